"""Fixtures for storage integration tests: the session's real PostgreSQL server."""

from __future__ import annotations

import pytest

from tests.contract.postgres_server import PostgresServer, find_bin_dir, shared_server


@pytest.fixture(scope="session")
def postgres_server() -> PostgresServer:
    """A real PostgreSQL server for the whole session (shared with the contract suite)."""
    if find_bin_dir() is None:
        pytest.skip("PostgreSQL is not installed; scripts/setup.d/20-postgres.sh installs it")
    return shared_server()
