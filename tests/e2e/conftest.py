"""Fixtures for the end-to-end tests: a real relay, a fresh home, a running daemon."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.e2e.harness import DaemonProcess, Home, make_home
from tests.integration.nostr.harness import LocalRelayServer


@pytest.fixture
async def relay(tmp_path: Path) -> AsyncIterator[LocalRelayServer]:
    """A real relay (nostr-sdk LocalRelay, LMDB) that outlives daemon restarts."""
    server = LocalRelayServer(tmp_path / "relay-lmdb")
    await server.start()
    yield server
    server.stop()


@pytest.fixture
def home(tmp_path: Path, relay: LocalRelayServer) -> Home:
    """A home made by tenexd init (owner key generated), pointed at the relay."""
    return make_home(tmp_path / "home", relay.url)


@pytest.fixture
async def daemon(home: Home) -> AsyncIterator[DaemonProcess]:
    """A running tenexd on the home; SIGTERM at the end (kill by pid if it hangs)."""
    process = DaemonProcess(home, env={"TENEX_DAEMON__HOP_LIMIT": "2"})
    await process.start()
    yield process
    try:
        await process.stop()
    finally:
        process.kill()
