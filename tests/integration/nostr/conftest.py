"""Fixtures for the Nostr integration tests: real relays and a nostr-tools client, torn down here."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tenex_daemon.adapters.nostr.relay_pool import PoolSettings

from .harness import LocalRelayServer, NodeTool, NostrRelayProcess

FAST = PoolSettings(
    backoff_base=0.05, backoff_cap=0.5, stable_after=1.0, publish_timeout=8.0, fetch_timeout=5.0,
    auth_timeout=3.0, cursor_flush_interval=0.1, open_timeout=5.0, since_window=30,
)
"""Pool settings for tests: short backoff so a restarted relay is picked up at once."""


@pytest.fixture
async def local_relay(tmp_path: Path) -> AsyncIterator[LocalRelayServer]:
    """A plain nostr-sdk LocalRelay with LMDB storage."""
    relay = LocalRelayServer(tmp_path / "lmdb")
    await relay.start()
    yield relay
    relay.stop()


@pytest.fixture
async def auth_relay(tmp_path: Path) -> AsyncIterator[LocalRelayServer]:
    """A nostr-sdk LocalRelay that requires NIP-42 auth to read and to write."""
    relay = LocalRelayServer(tmp_path / "lmdb-auth", auth=True)
    await relay.start()
    yield relay
    relay.stop()


@pytest.fixture
async def nostr_relay(tmp_path: Path) -> AsyncIterator[NostrRelayProcess]:
    """PyPI nostr-relay as a subprocess (sqlite), killed by pid at the end."""
    relay = NostrRelayProcess(tmp_path / "nostr-relay")
    await relay.start()
    yield relay
    await relay.kill()


@pytest.fixture
def node() -> NodeTool:
    """The nostr-tools client (Node)."""
    return NodeTool()


@pytest.fixture(params=["local-relay", "nostr-relay"])
async def real_relay(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[LocalRelayServer | NostrRelayProcess]:
    """Each real relay in turn: nostr-sdk's LocalRelay, then the nostr-relay subprocess."""
    relay: LocalRelayServer | NostrRelayProcess
    if request.param == "local-relay":
        relay = LocalRelayServer(tmp_path / "lmdb-any")
        await relay.start()
        yield relay
        relay.stop()
    else:
        relay = NostrRelayProcess(tmp_path / "nostr-relay-any")
        await relay.start()
        yield relay
        await relay.kill()
