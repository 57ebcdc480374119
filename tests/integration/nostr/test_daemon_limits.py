"""The daemon's relay pool applies the home's size limits (``daemon.max_content_bytes``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path

import pytest
from websockets.asyncio.server import ServerConnection

from tenex_daemon.adapters.nostr.codec import RejectReason
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.app.daemon import Daemon
from tenex_daemon.app.home import init_home
from tenex_daemon.app.settings import load_settings
from tenex_daemon.core.vocabulary import KIND_COMMENT

from .harness import FakeRelay

pytestmark = [pytest.mark.integration]

STRANGER = Signer.generate(label="stranger")
LIMIT = 1000


async def test_an_event_over_the_configured_content_size_is_rejected_and_counted(tmp_path: Path) -> None:
    """With ``daemon.max_content_bytes`` = 1000, the daemon's pool rejects a 2,000-byte event as
    oversized (counted in its health) and still takes in a 900-byte one."""
    big = STRANGER.sign(KIND_COMMENT, "x" * (2 * LIMIT))
    small = STRANGER.sign(KIND_COMMENT, "y" * (LIMIT - 100))
    served: list[str] = []

    async def relay_script(relay: FakeRelay, ws: ServerConnection) -> None:
        while True:
            frame = await relay.recv(ws)
            if frame[0] == "REQ":
                if not served:
                    served.append(frame[1])
                    for event in (big, small):
                        await ws.send(json.dumps(["EVENT", frame[1], event.to_dict()]))
                await ws.send(json.dumps(["EOSE", frame[1]]))
            elif frame[0] == "EVENT":
                await ws.send(json.dumps(["OK", frame[1]["id"], True, ""]))

    async with FakeRelay(relay_script) as relay:
        init_home(tmp_path / "h", relays=[relay.url])
        settings = load_settings(tmp_path / "h", {"TENEX_DAEMON__MAX_CONTENT_BYTES": str(LIMIT)})
        daemon = Daemon(settings)
        running = asyncio.create_task(daemon.run())
        try:
            await asyncio.wait_for(daemon.wait_ready(), 30)
            assert daemon.pool is not None
            deadline = time.monotonic() + 10
            while daemon.pool.health().delivered < 1 and time.monotonic() < deadline:  # noqa: ASYNC110 - the pool has no event for it
                await asyncio.sleep(0.05)
            health = daemon.pool.health()
        finally:
            daemon.request_stop()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(running, 30)

    assert health.rejects == {RejectReason.OVERSIZED.value: 1}
    assert health.delivered == 1
    assert [r.events_received for r in health.relays] == [1]
    assert daemon.status()["events"]["rejected"].get(RejectReason.OVERSIZED.value) == 1
