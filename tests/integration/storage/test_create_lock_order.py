"""A conversation created with an event that another daemon appends to another conversation at that moment:
the two transactions wait for each other in one order (the processed id first), never in a circle. Before,
the create held the event's row in ``events`` while waiting for its processed id, which the append held
while waiting for that row: PostgreSQL ended one of them as a deadlock."""

from __future__ import annotations

import asyncio
import itertools

import asyncpg
import pytest

from tenex_daemon.adapters.storage.postgres import PostgresStore
from tenex_daemon.core.conversation import Conversation
from tests.conftest import Cast
from tests.contract.postgres_server import PostgresServer

pytestmark = pytest.mark.integration


async def waiting_for_a_lock(conn: asyncpg.Connection) -> None:
    """Return once some session of the database waits for a lock (asked every 10 ms)."""
    query = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
    for _ in itertools.count():
        if await conn.fetchval(query):
            return
        await asyncio.sleep(0.01)


async def test_a_create_and_an_append_of_one_event_wait_for_each_other_without_a_deadlock(
    postgres_server: PostgresServer, cast: Cast
) -> None:
    """Daemon B is appending event X to conversation A (its processed id inserted, not yet committed) when
    daemon A creates conversation C with X in its history: the create waits for B's append, B's append
    stores X and commits, then the create commits too, and both conversations hold X."""
    dsn = await postgres_server.create_database()
    store = PostgresStore(dsn)
    await store.open()
    appender = await asyncpg.connect(dsn)
    watcher = await asyncpg.connect(dsn)
    try:
        first_root = cast.user_says("first", kind=11)
        first = Conversation(id=first_root.id, title="first", created_at=1, updated_at=1)
        first.append(first_root)
        await store.create(first)
        shared = cast.alice_says("the event both take in", tags=[["e", first_root.id]])
        created_root = cast.user_says("created with it", kind=11)
        created = Conversation(id=created_root.id, title="created", created_at=1, updated_at=1)
        created.append(created_root)
        created.append(shared)

        async with asyncio.timeout(10):
            transaction = appender.transaction()
            await transaction.start()  # what append_event does, in its order
            await appender.execute("INSERT INTO processed_events (event_id) VALUES ($1)", shared.id)
            creating = asyncio.create_task(store.create(created))
            await waiting_for_a_lock(watcher)
            await appender.execute(
                "UPDATE conversations SET event_count = event_count + 1 WHERE id = $1", first_root.id
            )
            await appender.execute(
                "INSERT INTO events (event_id, conversation_id, seq, body) VALUES ($1, $2, 1, $3)",
                shared.id, first_root.id, shared.model_dump_json(),
            )
            await transaction.commit()
            await creating

        for conversation in (first, created):
            loaded = await store.load(conversation.id)
            assert loaded is not None
            assert loaded.history[-1] == shared
        assert await store.is_processed(shared.id)
    finally:
        await appender.close()
        await watcher.close()
        await store.close()
