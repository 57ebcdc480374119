"""A live subscription's stored events, held to be taken in oldest first, and its catch-up's state.

A relay sends the stored events a REQ matches newest first, and a catch-up pages back from the newest: taken
in as they came, the messages a person wrote while the daemon was down (or a relay disconnected) reached the
consumer in reverse, the last one answered alone first and the earlier ones then as a burst whose newest
was the first written. So the events a live REQ brings before its EOSE, and those of its catch-up's pages,
are held in a :class:`StoredBatch` and handed over sorted by ``(created_at, id)`` once the batch is whole:
at EOSE, or for a catch-up once its last page came. Events that come after EOSE (live) go in at once.
A connection keeps its batches in a :class:`StoredEvents`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Any, Protocol

from tenex_daemon.core.events import NostrEvent

from .subscriptions import Subscriptions
from .types import Filter, PoolSettings, Spawn

CATCH_UP_PAGES = 10_000
"""Pages one filter of a catch-up asks for at most (a relay that ignores ``since``): past it, the catch-up
counts as cut short."""


class EventSink(Protocol):
    """Where a connection hands the events of live subscriptions (the pool's delivery)."""

    @property
    def seen(self) -> Container[str]:
        """Ids of events already verified and taken in: their copies skip the signature check."""

    async def intake(self, event: NostrEvent, url: str, sub_id: str) -> None:
        """Take a validated event in."""

    def count_known_copy(self, event: NostrEvent, url: str, sub_id: str) -> None:
        """Count a relay's copy of an event already taken in."""

    async def settled(self) -> bool:
        """Wait until every event taken in so far has reached the consumer; return whether each was handed
        over for good (none left to the relays, none waiting to be tried again)."""


class StoredBatch:
    """The stored events of one live subscription not taken in yet, by id (a page repeats part of the one
    before, and the first page of a catch-up its REQ's first answer).

    At most ``cap`` (the pool's ``intake_queue_size``: as many as its intake queue may hold already): a relay
    sends a capped number per REQ (nostr-sdk's relays 500), but a catch-up pages through everything since its
    cursor (up to :data:`CATCH_UP_PAGES` pages a filter), so a batch that fills is taken in at once and the
    next one begins; each is in order, the first of them the newest (logged ``stored_events_batch_full``).
    """

    def __init__(self, cap: int) -> None:
        """Hold at most ``cap`` events (at least one)."""
        self.cap = max(1, cap)
        self._events: dict[str, tuple[NostrEvent, bool]] = {}
        self._deadline: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self._events)

    def __contains__(self, event_id: object) -> bool:
        return event_id in self._events

    def add(self, event: NostrEvent, *, known: bool = False) -> bool:
        """Hold an event (``known``: a copy of one taken in before, its signature not checked); return whether
        the batch is full now."""
        held = self._events.get(event.id)
        if held is None or held[1]:  # a checked copy stands in for an unchecked one
            self._events[event.id] = (event, known)
        return len(self._events) >= self.cap

    def take(self) -> list[tuple[NostrEvent, bool]]:
        """Empty the batch; return its events (each with ``known``) oldest first, a second's by id."""
        events = sorted(self._events.values(), key=lambda held: (held[0].created_at, held[0].id))
        self._events = {}
        return events

    def arm(self, seconds: float | None, call: Callable[[], None] = lambda: None) -> None:
        """Call ``call`` in ``seconds`` (replacing the call armed before); None: call nothing."""
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = None if seconds is None else asyncio.get_running_loop().call_later(seconds, call)

    async def hand_over(self, sink: EventSink, url: str, sub_id: str) -> None:
        """Empty the batch into ``sink`` as ``url``'s events of ``sub_id``, oldest first; a copy of an event
        taken in before is counted as such, as it would have been when it came."""
        for event, known in self.take():
            if known:
                sink.count_known_copy(event, url, sub_id)
            else:
                await sink.intake(event, url, sub_id)


@dataclass
class CatchUp:
    """A live subscription asked of a relay from its cursor: when the relay sent any stored event before
    EOSE, each filter is then asked again a page at a time (``until``), since a relay sends a capped number
    per REQ, newest first."""

    filters: list[Filter]
    got_events: bool = False


@dataclass
class Paged:
    """A catch-up's paging: its number (its fetch ids are told apart by it), the connection it started on,
    and the pages asked and events handed over so far."""

    number: int
    generation: int
    pages: int = 0
    taken: int = 0


class StoredEvents:
    """A connection's batches: per live subscription whose REQ's EOSE has not come yet, its stored events
    so far; and where they go (:meth:`take_in`), or not, when the REQ ends without EOSE (:meth:`unfinished`).
    """

    def __init__(
        self,
        url: str,
        settings: PoolSettings,
        *,
        sink: EventSink,
        subscriptions: Subscriptions,
        spawn: Spawn,
        log: Any,
    ) -> None:
        """Batches of the relay at ``url``, taken in to ``sink``; ``log``: the connection's bound logger."""
        self._url = url
        self._settings = settings
        self._sink = sink
        self._subscriptions = subscriptions
        self._spawn = spawn
        self._log = log
        self._batches: dict[str, StoredBatch] = {}

    def batch(self) -> StoredBatch:
        """A new, empty batch (at most ``intake_queue_size`` events)."""
        return StoredBatch(self._settings.intake_queue_size)

    def begin(self, sub_id: str) -> None:
        """A live REQ is sent: its stored events are held until its EOSE (with those of a REQ before it whose
        EOSE has not come yet), for ``fetch_timeout`` seconds at most: then those held are taken in and the
        next ones go in as they come, as live events, so a relay that never sends EOSE is still heard."""
        batch = self._batches.setdefault(sub_id, self.batch())
        batch.arm(self._settings.fetch_timeout, lambda: self._no_eose(sub_id, batch))

    def get(self, sub_id: str) -> StoredBatch | None:
        """The batch of a subscription whose EOSE has not come yet; None: what comes for it is live."""
        return self._batches.get(sub_id)

    def end(self, sub_id: str) -> StoredBatch | None:
        """The subscription's EOSE came: its batch, if it had one (its events are live from now on)."""
        batch = self._batches.pop(sub_id, None)
        if batch is not None:
            batch.arm(None)
        return batch

    def keep(self, sub_id: str) -> StoredBatch:
        """The subscription's EOSE came, and its catch-up pages on: its batch stays (no deadline now), so
        what comes live meanwhile is held too, and taken in after the older pages, not before them."""
        batch = self._batches.setdefault(sub_id, self.batch())
        batch.arm(None)
        return batch

    def release(self, sub_id: str, batch: StoredBatch) -> None:
        """The catch-up that kept ``batch`` (:meth:`keep`) is over: what comes for ``sub_id`` is live now."""
        if self._batches.get(sub_id) is batch:
            del self._batches[sub_id]

    async def hold(self, sub_id: str, batch: StoredBatch, event: NostrEvent, *, known: bool = False) -> None:
        """Hold a stored event of ``sub_id`` in ``batch``; a full batch is taken in at once."""
        if batch.add(event, known=known):
            self._log.info("stored_events_batch_full", subscription=sub_id, events=len(batch))
            await self.take_in(sub_id, batch)

    async def take_in(self, sub_id: str, batch: StoredBatch) -> None:
        """Hand the events of ``batch`` over, oldest first; none once the subscription was closed (as its
        events that come after the CLOSE)."""
        if self._subscriptions.get(sub_id) is None:
            batch.take()
            return
        await batch.hand_over(self._sink, self._url, sub_id)

    def unfinished(self, sub_id: str, *, held: bool) -> None:
        """A live REQ ended before its EOSE (a drop, a CLOSED): a catch-up's stored events (``held``: its
        cursor is held) are dropped, since the next catch-up asks for them again, in order with the rest;
        those of a first subscription (no cursor to hold) are taken in."""
        batch = self.end(sub_id)
        if batch and not held:
            self._spawn(self.take_in(sub_id, batch), f"stored events {self._url}")

    def closed(self, catching_up: Container[str], *, stopping: bool) -> None:
        """The connection closed: each REQ ended (``catching_up``: the catch-ups among them); ``stopping``:
        the pool stops, and nothing is taken in (a cursor not held leaves them to the relay too)."""
        for sub_id in list(self._batches):
            if stopping:
                self.end(sub_id)
            else:
                self.unfinished(sub_id, held=sub_id in catching_up)

    def _no_eose(self, sub_id: str, batch: StoredBatch) -> None:
        if self._batches.get(sub_id) is batch:
            self.end(sub_id)
            self._log.warning("no_eose", subscription=sub_id, held=len(batch))
            self._spawn(self.take_in(sub_id, batch), f"stored events {self._url}")
