"""Fixtures for storage integration tests: the session's real PostgreSQL server, a store on a fresh database."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tenex_daemon.adapters.storage.postgres import PostgresStore
from tests.contract.postgres_server import PostgresServer, find_bin_dir, shared_server


@pytest.fixture(scope="session")
def postgres_server() -> PostgresServer:
    """A real PostgreSQL server for the whole session (shared with the contract suite)."""
    if find_bin_dir() is None:
        pytest.skip("PostgreSQL is not installed; scripts/setup.d/20-postgres.sh installs it")
    return shared_server()


@pytest.fixture
async def store_and_dsn(postgres_server: PostgresServer) -> AsyncIterator[tuple[PostgresStore, str]]:
    """An open store on a fresh database, and the database's dsn."""
    dsn = await postgres_server.create_database()
    store = PostgresStore(dsn)
    await store.open()
    try:
        yield store, dsn
    finally:
        await store.close()
