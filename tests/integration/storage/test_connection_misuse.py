"""How the PostgreSQL store tells a connection lost from a connection misused: two statements at once on
one connection (a programming error) pass as the driver's own error, never as an outage to retry, while a
connection the server ended is StoreUnavailableError and the call made again works."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

from tenex_daemon.adapters.storage.postgres import PostgresStore
from tenex_daemon.core.errors import StoreUnavailableError

pytestmark = pytest.mark.integration


async def _two_statements_at_once(store: PostgresStore) -> None:
    """Run two statements at once on one of the store's connections, in its connection block, and raise
    the first error either met once both are over."""
    async with store._connection() as conn:
        outcomes = await asyncio.gather(
            conn.fetchval("SELECT pg_sleep(0.2)"), conn.fetchval("SELECT 1"), return_exceptions=True
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome


async def test_two_statements_at_once_on_one_connection_are_the_drivers_error_not_an_outage(
    store_and_dsn: tuple[PostgresStore, str],
) -> None:
    """Two coroutines using one of the store's connections at once raise asyncpg's InterfaceError ("another
    operation is in progress") out of the store's connection block, not StoreUnavailableError, and the
    store answers the next call."""
    store, _ = store_and_dsn

    with pytest.raises(asyncpg.InterfaceError, match="another operation is in progress") as caught:
        await _two_statements_at_once(store)

    assert not isinstance(caught.value, StoreUnavailableError)
    assert await store.get_meta("relay-cursor") is None


async def _write_under_a_lease_the_server_ended(store: PostgresStore, admin: Any, key: str) -> None:
    """Take ``key``'s lease, have the server end the session holding it (``admin``), then write ``key``
    through it."""
    async with store.lease(key):
        held = store._leased[(asyncio.current_task(), key)]
        assert await admin.fetchval("SELECT pg_terminate_backend($1, 5000)", held.get_server_pid())
        await store.set_meta(key, "first")


async def test_a_write_on_a_lease_whose_session_the_server_ended_is_an_outage_and_the_next_lease_works(
    store_and_dsn: tuple[PostgresStore, str],
) -> None:
    """A write through a lease whose connection the server ended (pg_terminate_backend) raises
    StoreUnavailableError out of the lease, and the write made again under a new lease is stored."""
    store, dsn = store_and_dsn
    admin = await asyncpg.connect(dsn)
    try:
        with pytest.raises(StoreUnavailableError, match="the PostgreSQL store does not answer"):
            await _write_under_a_lease_the_server_ended(store, admin, "channel.x")
    finally:
        await admin.close()

    async with store.lease("channel.x"):
        await store.set_meta("channel.x", "again")

    assert await store.get_meta("channel.x") == "again"
