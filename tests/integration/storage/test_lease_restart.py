"""A conversation's lease on PostgreSQL across a database restart: the lease goes with its connection, so
the holder's later writes to that conversation fail rather than overwrite what the next holder saved."""

from __future__ import annotations

import asyncio

import pytest

from tenex_daemon.adapters.storage.postgres import PostgresStore
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.errors import StoreUnavailableError
from tests.conftest import Cast
from tests.contract.postgres_server import PostgresServer, find_bin_dir

pytestmark = pytest.mark.integration


async def test_a_write_under_a_lease_lost_to_a_restart_fails_and_the_next_holders_change_stays(
    cast: Cast,
) -> None:
    """Daemon A holds a conversation's lease and has loaded it when PostgreSQL restarts; daemon B then takes
    the lease and saves a change. A's save of what it loaded fails (its lease's connection is gone), so B's
    change stays; before, A's save went through a pool connection and wiped B's change out."""
    if find_bin_dir() is None:
        pytest.skip("PostgreSQL is not installed; scripts/setup.d/20-postgres.sh installs it")
    server = await asyncio.to_thread(PostgresServer.start)  # its own server: this test restarts it
    try:
        dsn = await server.create_database()
        a, b = PostgresStore(dsn), PostgresStore(dsn)
        await a.open()
        await b.open()
        root = cast.user_says("a conversation two daemons share", kind=11)
        conversation = Conversation(id=root.id, title="shared", created_at=1, updated_at=1)
        conversation.append(root)
        await a.create(conversation)

        async with a.lease(root.id):
            loaded = await a.load(root.id)
            assert loaded is not None
            await asyncio.to_thread(server.restart, crash=True)
            async with b.lease(root.id):  # free: the restart dropped A's lock with its connection
                theirs = await b.load(root.id)
                assert theirs is not None
                theirs.title = "saved by B"
                await b.save_state(theirs)
            loaded.title = "saved by A"
            with pytest.raises(StoreUnavailableError):
                await a.save_state(loaded)

        kept = await b.load(root.id)
        assert kept is not None
        assert kept.title == "saved by B"
        await a.close()
        await b.close()
    finally:
        await asyncio.to_thread(server.stop)
