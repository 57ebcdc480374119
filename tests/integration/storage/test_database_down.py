"""A PostgreSQL store whose database has stopped says so as StoreUnavailableError (the control API's 503)
for every call, a conversation's lease and a run's or a name's lease included."""

from __future__ import annotations

import asyncio

import pytest

from tenex_daemon.adapters.storage.postgres import PostgresStore
from tenex_daemon.core.errors import StoreUnavailableError
from tests.contract.postgres_server import PostgresServer, find_bin_dir

pytestmark = pytest.mark.integration


async def test_a_lease_and_a_name_asked_of_a_stopped_database_are_store_unavailable_errors() -> None:
    """With the database stopped, ``lease``, ``try_take`` (with and without a keeper) and a query each
    raise StoreUnavailableError: before, the leases raised the driver's ConnectionRefusedError (a 500)."""
    if find_bin_dir() is None:
        pytest.skip("PostgreSQL is not installed; scripts/setup.d/20-postgres.sh installs it")
    server = await asyncio.to_thread(PostgresServer.start)  # its own server: this test stops it
    try:
        store = PostgresStore(await server.create_database())
        await store.open()
        async with store.lease("conversation"):
            pass
    finally:
        await asyncio.to_thread(server.stop)
    try:
        with pytest.raises(StoreUnavailableError, match="the PostgreSQL store does not answer"):
            async with store.lease("conversation"):
                pass
        for on_lost in (None, lambda: None):
            with pytest.raises(StoreUnavailableError, match="the PostgreSQL store does not answer"):
                async with store.try_take("daemon name", on_lost):
                    pass
        with pytest.raises(StoreUnavailableError, match="the PostgreSQL store does not answer"):
            await store.get_meta("relay-cursor")
    finally:
        await store.close()
