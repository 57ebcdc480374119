"""A person's client for the daemon benchmark, kept lean so that its own costs stay out of the figures.

At 100 events at once, a client built on tenexd's relay pool spends about 0.35 ms of Python per
event (signing, then parsing and verifying what comes back): the "relay round trip" it measured
was mostly itself, and since the overhead subtracts two of those round trips from a reply, the
client's cost was taken off tenexd's twice while a reply pays it once. So here events are
signed before the clock starts and sent as ready frame text, and an arrival is stamped when its
frame is read (one JSON parse, no signature check: the relay already checked it). Every frame
read is acknowledged at once (``TCP_QUICKACK``), as tenexd's relay connections do: LocalRelay
writes without ``TCP_NODELAY``, and a delayed ACK would hold an ``OK`` and the event behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Callable
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

from tenex_daemon.adapters.nostr.signer import Signer

TIMEOUT_S = 30.0


class Prepared:
    """A signed event as frame text, and the id its answer is matched by."""

    def __init__(self, event_id: str, frame: str) -> None:
        self.event_id = event_id
        self.frame = frame


class BenchClient:
    """One websocket to the relay with one subscription; answers are matched by event id."""

    def __init__(self, url: str, signer: Signer) -> None:
        self.url = url
        self.signer = signer
        self.waiters: dict[str, asyncio.Future[float]] = {}
        self._sent = 0
        self._ws: ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()

    async def start(self, filters: list[dict[str, Any]]) -> None:
        """Connect, subscribe with ``filters`` and return once the relay sent its stored events (EOSE)."""
        self._ws = await connect(self.url, max_size=None, compression=None)
        self._reader = asyncio.create_task(self._read(self._ws))
        await self._ws.send(json.dumps(["REQ", "bench", *filters]))
        await asyncio.wait_for(self._subscribed.wait(), TIMEOUT_S)

    async def stop(self) -> None:
        """Close the connection and its reader."""
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._ws is not None:
            await self._ws.close()

    def prepare(self, kind: int, content: str, tags: list[list[str]]) -> Prepared:
        """Sign an event now (outside any timing) and keep its frame text."""
        self._sent += 1  # identical events in one second would share an id
        event = self.signer.sign(kind, f"{content} #{self._sent}", tags)
        return Prepared(event.id, json.dumps(["EVENT", event.to_dict()], separators=(",", ":")))

    async def round_trip(self, prepared: Prepared, *, listener: BenchClient | None = None) -> float:
        """Send a prepared event; return seconds until its answer arrives: the event itself on
        this subscription (or on ``listener``'s), or a kind-1111 reply whose ``E`` is its id."""
        assert self._ws is not None, "start the client first"
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        waiters = (listener or self).waiters
        waiters[prepared.event_id] = future
        started = time.perf_counter()
        await self._ws.send(prepared.frame)
        try:
            answered = await asyncio.wait_for(future, TIMEOUT_S)
        finally:
            del waiters[prepared.event_id]
        return answered - started

    async def _read(self, ws: ClientConnection) -> None:
        ack = _quick_ack(ws)
        async for message in ws:
            arrived = time.perf_counter()
            ack()
            frame = json.loads(message)
            if frame[0] == "EVENT":
                event = frame[2]
                key = event["id"]
                if event["kind"] == 1111:
                    key = next((tag[1] for tag in event["tags"] if tag[:1] == ["E"] and len(tag) > 1), "")
                self._answer(key, arrived)
            elif frame[0] == "EOSE":
                self._subscribed.set()
            elif frame[0] == "OK" and not frame[2]:
                self._refused(frame[1], str(frame[3]))

    def _answer(self, key: str, arrived: float) -> None:
        future = self.waiters.get(key)
        if future is not None and not future.done():
            future.set_result(arrived)

    def _refused(self, event_id: str, reason: str) -> None:
        future = self.waiters.get(event_id)
        if future is not None and not future.done():
            future.set_exception(RuntimeError(f"the relay refused {event_id}: {reason}"))


def _quick_ack(ws: ClientConnection) -> Callable[[], None]:
    """A call that acknowledges at once what the socket received (Linux; elsewhere a no-op)."""
    option = getattr(socket, "TCP_QUICKACK", None)
    sock = ws.transport.get_extra_info("socket") if ws.transport is not None else None
    if option is None or sock is None:
        return _no_ack

    def ack() -> None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, option, 1)

    return ack


def _no_ack() -> None:
    return None
