"""A PostgreSQL database that refuses statements for now (read-only after a failover to a standby, a
statement cancelled by ``statement_timeout``, ``lock_timeout`` or an administrator) is an outage of the
store, StoreUnavailableError saying which (the control API's 503, one line in the log), not a defect; the
transaction is rolled back whole, and the call made again once the database accepts it is stored."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest

from tenex_daemon.adapters.storage.postgres import PostgresStore
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.errors import StoreUnavailableError
from tenex_daemon.core.events import NostrEvent
from tests.conftest import Cast
from tests.contract.postgres_server import PostgresServer

pytestmark = pytest.mark.integration


@pytest.fixture
async def admin_store(
    postgres_server: PostgresServer, cast: Cast
) -> AsyncIterator[tuple[PostgresStore, asyncpg.Connection, str, Conversation]]:
    """An open store on a fresh database holding one conversation, an administrator's connection to that
    database, the database's name and the conversation."""
    dsn = await postgres_server.create_database()
    store = PostgresStore(dsn)
    await store.open()
    admin = await asyncpg.connect(dsn)
    root = cast.user_says("a conversation", kind=11)
    conversation = Conversation(id=root.id, title="refused", created_at=1, updated_at=1)
    conversation.append(root)
    await store.create(conversation)
    try:
        yield store, admin, dsn.rpartition("/")[2], conversation
    finally:
        await admin.close()
        await store.close()


async def _database_set(store: PostgresStore, admin: asyncpg.Connection, database: str, setting: str) -> None:
    """``ALTER DATABASE ... SET setting`` (or ``RESET``), and the store's query connections replaced so the
    next call's session has it."""
    await admin.execute(f'ALTER DATABASE "{database}" {setting}')
    await store.pool.expire_connections()


async def _stored(admin: asyncpg.Connection, conversation_id: str, event: NostrEvent) -> tuple[object, ...]:
    """What the database holds of ``event`` and its conversation: whether its id is processed, its rows,
    and the conversation's event count."""
    return (
        await admin.fetchval("SELECT count(*) FROM processed_events WHERE event_id = $1", event.id),
        await admin.fetchval("SELECT count(*) FROM events WHERE event_id = $1", event.id),
        await admin.fetchval("SELECT event_count FROM conversations WHERE id = $1", conversation_id),
    )


async def test_a_write_to_a_read_only_database_is_store_unavailable_and_stores_nothing(
    admin_store: tuple[PostgresStore, asyncpg.Connection, str, Conversation], cast: Cast
) -> None:
    """With the database read-only (default_transaction_read_only, as a standby is), append_event raises
    StoreUnavailableError saying the store is read-only (before: asyncpg's ReadOnlySQLTransactionError, a
    500) and stores nothing; once writable again, the same append is stored."""
    store, admin, database, conversation = admin_store
    reply = cast.alice_says("a reply", tags=[["e", conversation.id]])
    await _database_set(store, admin, database, "SET default_transaction_read_only = on")

    with pytest.raises(StoreUnavailableError) as caught:
        await store.append_event(conversation.id, reply)

    assert str(caught.value) == (
        "the PostgreSQL store is read-only (a standby, or default_transaction_read_only on): "
        "cannot execute INSERT in a read-only transaction"
    )
    assert isinstance(caught.value.__cause__, asyncpg.ReadOnlySQLTransactionError)
    assert await _stored(admin, conversation.id, reply) == (0, 0, 1)
    await _database_set(store, admin, database, "RESET default_transaction_read_only")
    assert await store.append_event(conversation.id, reply) is True
    assert await _stored(admin, conversation.id, reply) == (1, 1, 2)


async def _append_stopped_midway(
    store: PostgresStore, admin: asyncpg.Connection, conversation_id: str, reply: NostrEvent, cancel: bool
) -> BaseException:
    """Append ``reply`` while the admin holds the conversation's row locked, so the append waits in its
    transaction after marking the id processed; cancel the waiting statement (``pg_cancel_backend``) when
    ``cancel``, else let the database's timeout end it; return what the append raised."""
    holding = admin.transaction()
    await holding.start()
    await admin.execute("SELECT 1 FROM conversations WHERE id = $1 FOR UPDATE", conversation_id)
    appending = asyncio.ensure_future(store.append_event(conversation_id, reply))
    async with asyncio.timeout(10):
        cancelled = not cancel
        while not cancelled:
            await asyncio.sleep(0.02)
            cancelled = bool(await admin.fetchval(
                """SELECT pg_cancel_backend(pid) FROM pg_stat_activity
                    WHERE datname = current_database() AND wait_event_type = 'Lock'
                      AND query LIKE '%UPDATE conversations%'"""
            ))
        outcome = await asyncio.gather(appending, return_exceptions=True)
    await holding.rollback()
    assert isinstance(outcome[0], BaseException), "the append stopped midway did not fail"
    return outcome[0]


@pytest.mark.parametrize(
    ("setting", "said"),
    [
        (None, "cancelled the statement: canceling statement due to user request"),
        ("SET statement_timeout = '300ms'", "cancelled the statement: canceling statement due to statement timeout"),
        ("SET lock_timeout = '300ms'", "gave up waiting for a lock: canceling statement due to lock timeout"),
    ],
)
async def test_a_write_cancelled_midway_is_store_unavailable_and_rolled_back_whole(
    admin_store: tuple[PostgresStore, asyncpg.Connection, str, Conversation],
    cast: Cast,
    setting: str | None,
    said: str,
) -> None:
    """An append whose statement is cancelled after it marked the id processed (pg_cancel_backend,
    statement_timeout, lock_timeout) raises StoreUnavailableError saying so (before: asyncpg's
    QueryCanceledError or LockNotAvailableError, a 500); nothing of it is stored, the processed id
    included, and the same append made again is stored."""
    store, admin, database, conversation = admin_store
    reply = cast.alice_says("a reply", tags=[["e", conversation.id]])
    if setting is not None:
        await _database_set(store, admin, database, setting)

    error = await _append_stopped_midway(store, admin, conversation.id, reply, cancel=setting is None)

    assert isinstance(error, StoreUnavailableError)
    assert str(error) == f"the PostgreSQL store {said}"
    assert await _stored(admin, conversation.id, reply) == (0, 0, 1)
    if setting is not None:
        await _database_set(store, admin, database, f"RESET {setting.split()[1]}")
    assert await store.append_event(conversation.id, reply) is True
    assert await _stored(admin, conversation.id, reply) == (1, 1, 2)


async def test_a_lease_waited_for_past_lock_timeout_is_store_unavailable_and_taken_once_free(
    admin_store: tuple[PostgresStore, asyncpg.Connection, str, Conversation],
) -> None:
    """With lock_timeout set, a lease another session holds past it raises StoreUnavailableError saying the
    store gave up waiting for a lock (before: asyncpg's LockNotAvailableError, a 500), and the lease is
    taken once its holder lets go."""
    store, admin, database, conversation = admin_store
    await admin.execute(f'ALTER DATABASE "{database}" SET lock_timeout = \'300ms\'')  # new lease connections
    await admin.execute("SELECT pg_advisory_lock(hashtextextended($1, 0))", conversation.id)

    with pytest.raises(StoreUnavailableError) as caught:
        async with store.lease(conversation.id):
            pass

    assert str(caught.value) == (
        "the PostgreSQL store gave up waiting for a lock: canceling statement due to lock timeout"
    )
    await admin.execute("SELECT pg_advisory_unlock(hashtextextended($1, 0))", conversation.id)
    async with store.lease(conversation.id):
        await store.set_meta(conversation.id, "leased")
    assert await store.get_meta(conversation.id) == "leased"
