"""A lease or a run lease whose block is over gives its answer even when its connection cannot be given
back to the pool (the server ended its session meanwhile, as a restart does: the pool's reset of it
fails): the connection is cut and the failure logged, never raised over what the block did."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import MutableMapping
from typing import Any

import asyncpg
import pytest
from structlog.testing import capture_logs

from tenex_daemon.adapters.storage import postgres
from tenex_daemon.adapters.storage.postgres import PostgresStore
from tenex_daemon.adapters.storage.postgres_sessions import TRY_LEASE_SQL, unlock

pytestmark = pytest.mark.integration


def _end_unseen(dsn: str, pid: int) -> None:
    """End the session ``pid`` (``pg_terminate_backend``, waiting until it has exited) from a thread of its
    own while this event loop waits, so the loop has not yet read the end of that session's connection
    when it next uses it: as when the server ends a session (a restart) just as its block finishes."""

    async def end() -> None:
        admin = await asyncpg.connect(dsn)
        try:
            assert await admin.fetchval("SELECT pg_terminate_backend($1, 5000)", pid)
        finally:
            await admin.close()

    thread = threading.Thread(target=asyncio.run, args=(end(),))
    thread.start()
    thread.join()


def _release_failures(logs: list[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    """The warnings logged for a connection that could not be given back to its pool."""
    return [entry for entry in logs if entry["event"] == "postgres_release_failed"]


async def test_a_run_lease_found_taken_answers_so_though_its_connection_cannot_be_given_back(
    store_and_dsn: tuple[PostgresStore, str],
) -> None:
    """try_take() of a run lease another session holds yields False, and its block ends without error when
    the server ended the connection's session before it was given back (the pool's reset fails; before:
    asyncpg's ConnectionDoesNotExistError out of the block); a warning is logged and the lease is taken
    once free."""
    store, dsn = store_and_dsn
    holder = await asyncpg.connect(dsn)
    try:
        await holder.execute("SELECT pg_advisory_lock(hashtextextended($1, 0))", "run:1")
        with capture_logs() as logs:
            async with store.try_take("run:1") as taken:
                pid = await holder.fetchval("SELECT pid FROM pg_stat_activity WHERE query = $1", TRY_LEASE_SQL)
                _end_unseen(dsn, pid)
    finally:
        await holder.close()

    assert taken is False
    assert len(_release_failures(logs)) == 1
    assert _release_failures(logs)[0]["log_level"] == "warning"
    async with store.try_take("run:1") as taken_again:
        assert taken_again is True


async def test_a_lease_whose_write_committed_ends_without_error_though_its_connection_cannot_be_given_back(
    store_and_dsn: tuple[PostgresStore, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A conversation's lease whose block wrote a value ends without error when the server ends the lease's
    session right after its lock was let go, before the pool's reset (before: asyncpg's
    ConnectionDoesNotExistError, the committed write reported failed); the value is stored, a warning is
    logged, and the lease is taken again."""
    store, dsn = store_and_dsn

    async def unlock_then_session_ended(conn: Any, name: str) -> None:
        await unlock(conn, name)
        _end_unseen(dsn, conn.get_server_pid())

    monkeypatch.setattr(postgres, "unlock", unlock_then_session_ended)
    with capture_logs() as logs:
        async with store.lease("channel.x"):
            await store.set_meta("channel.x", "committed")
    monkeypatch.undo()

    assert await store.get_meta("channel.x") == "committed"
    assert [entry["log_level"] for entry in _release_failures(logs)] == ["warning"]
    async with store.lease("channel.x"):
        await store.set_meta("channel.x", "again")
    assert await store.get_meta("channel.x") == "again"
