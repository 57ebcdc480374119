"""The embedded relay (``tenexd run --embedded-relay``), a child process the daemon owns, and the
relay connections' quick ACKs."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from websockets.asyncio.client import connect

from tenex_daemon.adapters.nostr.relay_pool import _no_ack, _quick_ack
from tenex_daemon.app.embedded_relay import EmbeddedRelay, EmbeddedRelayError

from .harness import LocalRelayServer, free_port, wait_port_closed

pytestmark = pytest.mark.integration


async def test_embedded_relay_serves_stops_and_refuses_a_taken_port(tmp_path: Path) -> None:
    """A second relay on a taken port fails saying why; stop() ends the process and frees the port."""
    port = free_port()
    first = EmbeddedRelay(tmp_path / "first", port=port)
    await first.start()
    pid = first.pid
    assert pid is not None
    try:
        second = EmbeddedRelay(tmp_path / "second", port=port)
        with pytest.raises(EmbeddedRelayError, match="Address already in use"):
            await second.start()
        assert second.pid is None
    finally:
        first.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    await wait_port_closed(port, within=5)


async def test_relay_connections_acknowledge_each_frame_at_once(local_relay: LocalRelayServer) -> None:
    """On Linux a relay connection gets a hook that sets TCP_QUICKACK (re-set after every frame read)."""
    async with connect(local_relay.url) as ws:
        ack = _quick_ack(ws)
        assert (ack is not _no_ack) == hasattr(socket, "TCP_QUICKACK")
        ack()
        sock = ws.transport.get_extra_info("socket")
        if hasattr(socket, "TCP_QUICKACK"):
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK) == 1
