"""Transport hardening: a relay that replays an oversized EVENT frame on every subscription must not
make the pool reconnect forever (docs/PROTOCOL.md, "Relays")."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from tenex_daemon.adapters.nostr.codec import Limits, RejectReason
from tenex_daemon.adapters.nostr.relay_pool import PoolSettings, ReceivedEvent, RelayPool
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.core.vocabulary import KIND_COMMENT

AUTHOR = Signer.generate(label="author")
FAST = PoolSettings(backoff_base=0.02, backoff_cap=0.1, stable_after=5.0, cursor_flush_interval=0.1)


class ReplayingRelay:
    """A relay that, on every REQ, sends one good event and then one huge EVENT frame (honouring ``since``)."""

    def __init__(self, huge_chars: int) -> None:
        self.created_at = int(time.time()) - 10
        self.good = AUTHOR.sign(KIND_COMMENT, "small and fine", created_at=self.created_at)
        self.huge = AUTHOR.sign(KIND_COMMENT, "x" * huge_chars, created_at=self.created_at)
        self.connections = 0
        self.reqs: list[list[Any]] = []
        self.url = ""

    async def serve(self, ws: ServerConnection) -> None:
        """Answer each REQ: the good event, the huge one if ``since`` allows it, then EOSE."""
        self.connections += 1
        with contextlib.suppress(ConnectionClosed):
            async for raw in ws:
                frame = json.loads(raw)
                if frame[0] != "REQ":
                    continue
                self.reqs.append(frame)
                sub_id, filters = frame[1], frame[2:]
                since = min((int(f.get("since", 0)) for f in filters), default=0)
                await ws.send(json.dumps(["EVENT", sub_id, self.good.to_dict()]))
                if since <= self.created_at:
                    await ws.send(json.dumps(["EVENT", sub_id, self.huge.to_dict()]))
                await ws.send(json.dumps(["EOSE", sub_id]))


@contextlib.asynccontextmanager
async def running(relay: ReplayingRelay) -> AsyncIterator[ReplayingRelay]:
    """Serve ``relay`` on a free local port for the block."""
    async with serve(relay.serve, "127.0.0.1", 0, max_size=None) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        relay.url = f"ws://127.0.0.1:{port}"
        yield relay


async def _collect(pool: RelayPool, received: list[ReceivedEvent], within: float) -> None:
    deadline = time.monotonic() + within
    while not received and time.monotonic() < deadline:  # noqa: ASYNC110 - polling a test list
        await asyncio.sleep(0.02)
    await asyncio.sleep(1.0)  # time for any reconnect loop to show


async def test_a_5_mib_event_frame_is_rejected_by_the_codec_without_closing_the_connection() -> None:
    """A 5 MiB EVENT frame (over the old 4 MiB websocket limit) is counted ``oversized_frame`` and the
    connection stays up: one connection, one REQ, the good event delivered."""
    received: list[ReceivedEvent] = []

    async def on_event(event: ReceivedEvent) -> None:
        received.append(event)

    async with (
        running(ReplayingRelay(5 * 1024 * 1024)) as relay,
        RelayPool([relay.url], on_event=on_event, settings=FAST) as pool,
    ):
        await pool.subscribe("s", [{"kinds": [KIND_COMMENT]}])
        await _collect(pool, received, within=10)
        health = pool.health()
    assert [r.event.id for r in received] == [relay.good.id]
    assert relay.connections == 1
    assert len(relay.reqs) == 1
    assert health.rejects == {RejectReason.OVERSIZED_FRAME.value: 1}
    assert health.relays[0].reconnects == 0


async def test_a_frame_over_the_transport_limit_is_skipped_past_instead_of_replayed_forever() -> None:
    """A frame over the websocket limit closes the connection once; the next REQ asks ``since`` past
    the moment of the close, so the relay does not replay it and the pool stops reconnecting."""
    received: list[ReceivedEvent] = []

    async def on_event(event: ReceivedEvent) -> None:
        received.append(event)

    settings = PoolSettings(
        backoff_base=0.02, backoff_cap=0.1, stable_after=5.0, cursor_flush_interval=0.1,
        max_message_bytes=64 * 1024, limits=Limits(max_frame_chars=16 * 1024),
    )
    async with (
        running(ReplayingRelay(100 * 1024)) as relay,
        RelayPool([relay.url], on_event=on_event, settings=settings) as pool,
    ):
        await pool.subscribe("s", [{"kinds": [KIND_COMMENT]}])
        await _collect(pool, received, within=10)
        health = pool.health()
    assert [r.event.id for r in received] == [relay.good.id]
    assert relay.connections == 2, f"{relay.connections} connections: the pool reconnect-loops"
    assert int(relay.reqs[-1][2]["since"]) > relay.created_at
    assert health.rejects == {RejectReason.OVERSIZED_FRAME.value: 1}
