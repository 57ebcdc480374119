"""Fixtures for the store contract suite: every store kind, opened and reopened on the same data."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tenex_daemon.adapters.storage.filesystem import FileSystemStore, FsyncPolicy
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.adapters.storage.postgres import PostgresStore
from tenex_daemon.core.ports import Store
from tests.contract.postgres_server import PostgresServer, find_bin_dir, shared_server

STORE_KINDS = ["memory", "fs-always", "fs-batch", "postgres"]


@pytest.fixture(scope="session")
def postgres_server() -> PostgresServer:
    """A real PostgreSQL server for the whole session (skipped only where PostgreSQL is absent)."""
    if find_bin_dir() is None:
        pytest.skip("PostgreSQL is not installed; scripts/setup.d/20-postgres.sh installs it")
    return shared_server()


@pytest.fixture
async def postgres_dsn(postgres_server: PostgresServer) -> str:
    """A fresh, empty database on the session's server."""
    return await postgres_server.create_database()


@dataclass
class StoreHarness:
    """Opens stores of one kind over the same data, so a test can close and reopen."""

    kind: str
    make_store: Callable[[], Store]
    durable: bool
    opened: list[Store] = field(default_factory=list)

    async def open(self) -> Store:
        """Open a new store instance over the harness's data."""
        store = self.make_store()
        await store.open()
        self.opened.append(store)
        return store

    async def reopen(self, store: Store) -> Store:
        """Close ``store`` and open a fresh instance (the same one for a memory store)."""
        if not self.durable:
            return store
        await store.close()
        return await self.open()


@pytest.fixture(params=STORE_KINDS)
async def harness(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StoreHarness]:
    """One harness per store kind."""
    kind: str = request.param
    maker: Callable[[], Store]
    if kind == "memory":
        memory = MemoryStore()
        maker = lambda: memory  # noqa: E731
    elif kind.startswith("fs-"):
        policy: FsyncPolicy = "always" if kind == "fs-always" else "batch"
        maker = lambda: FileSystemStore(tmp_path / "home", fsync=policy)  # noqa: E731
    else:
        server: PostgresServer = request.getfixturevalue("postgres_server")
        dsn = await server.create_database()
        maker = lambda: PostgresStore(dsn)  # noqa: E731
    harness = StoreHarness(kind, maker, durable=kind != "memory")
    yield harness
    for store in harness.opened:
        await store.close()


@pytest.fixture
async def store(harness: StoreHarness) -> Store:
    """An opened store of the harness's kind."""
    return await harness.open()


OpenStore = Callable[[], Awaitable[Store]]
