"""Delivery: the pool's intake queue and the consumer calls, each event once, in order per lane.

Events from every relay go through one queue. Copies of an event in flight are dropped (an
LRU of ids), and so are events the store marked processed before; after the consumer returns
an event is marked processed and its relay's cursor moves. With ``delivery_lanes`` > 1 and a
lane key, events with different keys are delivered concurrently and events with the same key
in arrival order.

An event whose consumer call raised (a store that cannot write: a full disk, a read-only file
system) is kept in memory, bounded, and handed to the consumer again with capped exponential
backoff until it goes through: it does not wait for a relay to send it again or for a restart (while it
waits, the cursor it came through does not pass it, so a restart meanwhile asks for it again). It
goes to the consumer even when the store marked it processed meanwhile: the failed call may have
stored it without being told so (a commit whose answer a broken connection lost).
A consumer that answers :attr:`Remember.IN_MEMORY` (a stranger's event) leaves the store alone:
the bounded seen-id set dedupes it.

Once the consumer stops taking events (:meth:`Delivery.leave_to_relays`: the daemon is stopping),
those still queued, in a lane or waiting for a retry are not handed over, retried or logged one by one:
they are left to the relays (not marked processed, their cursors not moved, so a relay sends them again
after the next start), counted and logged once when delivery stops.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import structlog

from tenex_daemon.core.events import NostrEvent
from tenex_daemon.runtime.background import BackgroundTasks
from tenex_daemon.runtime.lanes import lend_with
from tenex_daemon.runtime.log_budget import LineBudget

from .types import EventHandler, LaneKey, PoolSettings, PoolStore, ReceivedEvent, Remember

log = structlog.get_logger(__name__)

FAILURE_LINES = 20
"""Handler failures logged (with their traceback) per error type per :data:`FAILURE_EVERY_S`; the next line
after a window that ran out says how many were not logged (``not_logged``); every one is counted
(``consumer_errors``: ``tenexd_intake_handler_errors_total``)."""
FAILURE_EVERY_S = 60.0

_Intake = tuple[NostrEvent, str, str, float]
"""An event waiting for the consumer: the event, its relay, its subscription, when it was taken in."""
AdvanceCursor = Callable[[str, str, int], None]
"""Moves the cursor of (subscription id, relay url) up to an accepted ``created_at``."""


class CursorPins(Protocol):
    """Keeps a cursor from passing the events taken in through it that wait for a retry
    (:class:`~.subscriptions.Subscriptions`)."""

    def pin(self, sub_id: str, url: str, event_id: str, created_at: int) -> None:
        """The event waits for a retry: the cursor of (``sub_id``, ``url``) does not pass it."""

    def unpin(self, sub_id: str, url: str, event_id: str, *, left: bool = False) -> None:
        """The event no longer waits for a retry (``left``: given up on; the cursor still stops at it)."""

    def handed_over(self, event_id: str) -> None:
        """The event was handed over for good (a relay's copy of one given up on, the cursor moves on)."""


class SeenIds:
    """An LRU set of event ids (in-flight dedupe across relays)."""

    def __init__(self, maxsize: int) -> None:
        self._maxsize = maxsize
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add_if_new(self, event_id: str) -> bool:
        """Add the id; return False when it was already there."""
        if event_id in self._ids:
            self._ids.move_to_end(event_id)
            return False
        self._ids[event_id] = None
        if len(self._ids) > self._maxsize:
            self._ids.popitem(last=False)
        return True

    def __contains__(self, event_id: object) -> bool:
        return event_id in self._ids

    def discard(self, event_id: str) -> None:
        """Forget an id (its delivery failed, so a copy may be tried again)."""
        self._ids.pop(event_id, None)


class Delivery:
    """Takes validated events in from the relay connections and hands each new one to the consumer."""

    def __init__(
        self,
        settings: PoolSettings,
        advance_cursor: AdvanceCursor,
        *,
        on_event: EventHandler | None,
        store: PoolStore | None,
        lane_key: LaneKey | None,
        cursor_pins: CursorPins | None = None,
    ) -> None:
        """Deliver to ``on_event``; ``store`` keeps the processed ids; ``advance_cursor`` moves cursors, and
        ``cursor_pins`` keeps each from passing an event waiting for a retry."""
        self._settings = settings
        self._advance_cursor = advance_cursor
        self._cursor_pins = cursor_pins
        self._on_event = on_event
        self._store = store
        self._lane_key = lane_key
        self.seen = SeenIds(settings.seen_cache_size)
        self.delivered = 0
        self.duplicates = 0
        self.consumer_errors = 0
        self.retries = 0
        """Consumer calls made again for events whose earlier call raised."""
        self.retry_dropped = 0
        self._failure_lines = LineBudget(FAILURE_LINES, FAILURE_EVERY_S)
        """Handler failures logged with their traceback, per error type: a store failing for every event (a
        full disk) costs that many lines a minute, not one per event and retry."""
        self.left = 0
        """Events left to the relays after :meth:`leave_to_relays` (not handed over, marked or retried)."""
        self._leaving = False
        self._on_their_way: set[str] = set()
        """Events taken in (or back from the retry set) whose delivery has not ended: queued, waiting in a
        lane, or being handed over."""
        self.last_error: str | None = None
        """The newest consumer error (``Type: message``), kept while events wait for a retry."""
        self._retry: OrderedDict[str, tuple[_Intake, int, float]] = OrderedDict()
        """Event id -> (the event as taken in, failed attempts, loop time it is due again)."""
        self._retry_wake = asyncio.Event()
        self._retry_task: asyncio.Task[None] | None = None
        self._queue: asyncio.Queue[_Intake] | None = None
        self._task: asyncio.Task[None] | None = None
        self._lanes = BackgroundTasks("nostr delivery")

    @property
    def retrying(self) -> int:
        """Events whose consumer call raised, waiting to be handed over again."""
        return len(self._retry)

    @property
    def queued(self) -> int:
        """Events taken in and not yet handed to a lane."""
        return self._queue.qsize() if self._queue is not None else 0

    def start(self) -> None:
        """Open the intake queue and start the delivery task."""
        self._queue = asyncio.Queue(self._settings.intake_queue_size)
        self._task = asyncio.create_task(self._deliver_loop(), name="nostr delivery")
        self._retry_task = asyncio.create_task(self._retry_loop(), name="nostr delivery retry")

    async def settled(self) -> bool:
        """Wait until every event taken in so far has reached the consumer; return whether each was handed
        over for good: none left to the relays (:meth:`leave_to_relays`), none waiting for a retry."""
        if self._queue is not None:
            await self._queue.join()
        return not self._leaving and not self._retry

    async def drain(self) -> None:
        """Wait (up to ``drain_timeout``) until every event taken in has reached the consumer.

        Failed events waiting for a retry are not waited for (they are left to the relays and
        the next start): their retries stop here.
        """
        if self._retry_task is not None:
            self._retry_task.cancel()
            await asyncio.gather(self._retry_task, return_exceptions=True)
        if self._queue is not None and self._task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._queue.join(), self._settings.drain_timeout)

    async def stop(self) -> None:
        """Cancel the delivery task and the lane workers, and wait for them; log how many events were left
        to the relays (refused by the consumer as it stopped, waiting for a retry, or still on their way
        when ``drain_timeout`` ran out)."""
        on_their_way = set(self._on_their_way)  # cancelled below: not handed over, not marked
        tasks = [t for t in (self._task, self._retry_task) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._lanes.cancel_all()
        left = self.left + len(on_their_way | self._retry.keys()) if self._leaving else 0
        if left:
            note = "the relays send them again after the next start"
            log.info("events_left_to_relays", count=left, note=note)

    def leave_to_relays(self) -> None:
        """The consumer takes no more events (the daemon is stopping): from now on those taken in are left
        to the relays, quietly; one being handed over now that fails is left too, without a retry."""
        self._leaving = True
        self._retry_wake.set()

    def _leave(self, event: NostrEvent) -> None:
        self.left += 1
        self.seen.discard(event.id)
        self._retry.pop(event.id, None)  # its cursor stays pinned: the next start asks for it again

    # -- intake ----------------------------------------------------------------------------

    def count_known_copy(self, event: NostrEvent, url: str, sub_id: str) -> None:
        """Count a relay's copy of an event already taken in (and move that relay's cursor)."""
        self.duplicates += 1
        self._advance_cursor(sub_id, url, event.created_at)

    async def intake(self, event: NostrEvent, url: str, sub_id: str) -> None:
        """Take a validated event from a relay reader; drop copies already in flight."""
        if not self.seen.add_if_new(event.id):
            self.count_known_copy(event, url, sub_id)
            return
        assert self._queue is not None
        self._on_their_way.add(event.id)
        await self._queue.put((event, url, sub_id, time.time()))

    # -- delivery --------------------------------------------------------------------------

    async def _deliver_loop(self) -> None:
        assert self._queue is not None
        queue = self._queue
        lanes = self._settings.delivery_lanes
        if lanes > 1 and self._lane_key is not None:
            await self._deliver_in_lanes(queue, lanes, self._lane_key)
            return
        while True:
            await self._deliver_one(queue, await queue.get())

    async def _deliver_one(self, queue: asyncio.Queue[_Intake], item: _Intake) -> None:
        try:
            await self._deliver(*item)
        except Exception:
            log.exception("delivery failed", event_id=item[0].id)
        finally:
            queue.task_done()  # counted on the intake queue, so stop() waits for every lane
            self._on_their_way.discard(item[0].id)

    async def _deliver_in_lanes(
        self, queue: asyncio.Queue[_Intake], lanes: int, lane_key: LaneKey
    ) -> None:
        """Deliver up to ``lanes`` keys at once; a key's events go one at a time, in arrival order.

        A key being delivered collects its later events in a backlog that its own worker
        drains, so a slow key never holds up another while a lane is free.
        """
        backlogs: dict[str, collections.deque[_Intake]] = {}
        free_lanes = asyncio.Semaphore(lanes)
        overdrawn = [0]  # slots lenders took back beyond ``lanes`` (none free): the next lanes to end repay
        held = asyncio.Semaphore(self._settings.intake_queue_size)  # bounds the backlogs

        @contextlib.asynccontextmanager
        async def lent(holding: list[bool]) -> AsyncIterator[None]:
            """A lane's slot (``holding[0]``: whether the lane has it), given back while its event waits on a
            model or the relays. Taken back at once, beyond the bound when none is free: the lender may hold
            a lock (its conversation's routing) that the events now in every lane wait for, and waiting for
            one of their slots froze intake for good."""
            free_lanes.release()
            holding[0] = False
            try:
                yield
            finally:
                if free_lanes.locked():
                    overdrawn[0] += 1
                else:
                    await free_lanes.acquire()  # free: returns at once
                holding[0] = True

        async def drain_key(key: str) -> None:
            backlog = backlogs[key]
            holding = [True]
            lend_with(functools.partial(lent, holding))  # defined once, not per lane: lanes come per event
            try:
                while backlog:
                    try:
                        await self._deliver_one(queue, backlog.popleft())
                    finally:
                        held.release()
            finally:
                del backlogs[key]
                if holding[0] and overdrawn[0]:
                    overdrawn[0] -= 1
                elif holding[0]:
                    free_lanes.release()

        while True:
            item = await queue.get()
            try:
                key = lane_key(item[0])
            except Exception:
                log.exception("lane key failed", event_id=item[0].id)
                key = ""
            await held.acquire()
            backlog = backlogs.get(key)
            if backlog is not None:
                backlog.append(item)
                continue
            await free_lanes.acquire()
            backlog = backlogs.get(key)  # its worker may have started and finished meanwhile
            if backlog is not None:
                free_lanes.release()
                backlog.append(item)
                continue
            backlogs[key] = collections.deque([item])
            self._lanes.spawn(drain_key(key), f"lane {key[:16]}")

    async def _deliver(self, event: NostrEvent, url: str, sub_id: str, received_at: float) -> None:
        if self._leaving:
            self._leave(event)
            return
        try:
            # An event handed over again after its handler failed goes to the handler even when the store has
            # it now: the failed try may have stored it without being told (a commit whose answer a broken
            # connection lost), and only the handler can tell whether anyone dispatched it.
            retried = event.id in self._retry
            if self._store is not None and not retried and await self._store.is_processed(event.id):
                self.duplicates += 1
                self._unretry(event.id)
                self._advance_cursor(sub_id, url, event.created_at)
                return
            remember = None
            if self._on_event is not None:
                remember = await self._on_event(ReceivedEvent(event, url, sub_id, received_at))
            if self._store is not None and remember is not Remember.IN_MEMORY:
                await self._store.mark_processed(event.id)
        except Exception as exc:
            if self._leaving:  # refused because the consumer stopped meanwhile: no error, no retry
                self._leave(event)
                return
            self.consumer_errors += 1
            self.seen.discard(event.id)  # a copy from another relay may go through before the retry
            self._keep_for_retry((event, url, sub_id, received_at), exc)
            not_logged = self._failure_lines.take(type(exc).__name__)
            if not_logged is not None:
                more = {"not_logged": not_logged} if not_logged else {}
                log.exception(
                    "event handler failed", event_id=event.id, kind=event.kind, retrying=self.retrying, **more
                )
            return
        self._unretry(event.id)
        self.delivered += 1
        self._advance_cursor(sub_id, url, event.created_at)

    # -- retry -----------------------------------------------------------------------------

    def _keep_for_retry(self, item: _Intake, exc: Exception) -> None:
        """Keep a failed event to hand over again later (backoff doubles per failure, capped)."""
        self.last_error = f"{type(exc).__name__}: {exc}"[:300]
        event, url, sub_id, _ = item
        earlier, failures, _ = self._retry.pop(event.id, (item, 0, 0.0))
        if self._cursor_pins is not None:
            self._cursor_pins.pin(sub_id, url, event.id, event.created_at)
            if earlier[1:3] != (url, sub_id):  # it failed before as another relay's copy
                self._cursor_pins.unpin(earlier[2], earlier[1], event.id)
        settings = self._settings
        wait = min(settings.retry_cap, settings.retry_base * 2 ** min(failures, 30))
        self._retry[event.id] = (item, failures + 1, asyncio.get_running_loop().time() + wait)
        if len(self._retry) > settings.retry_capacity:
            dropped = next(iter(self._retry))
            self._unretry(dropped, left=True)
            self.retry_dropped += 1
            not_logged = self._failure_lines.take("retry_set_full")
            if not_logged is not None:
                log.warning("event dropped from the retry set", event_id=dropped, reason="retry_set_full",
                            note="left to the relays and the next start", not_logged=not_logged)
        self._retry_wake.set()

    def _unretry(self, event_id: str, *, left: bool = False) -> None:
        """The event leaves the retry set: handed over, its cursor is no longer pinned by it (nor stopped, if
        it was left before: a relay sent it again); ``left`` (dropped from a full set), its cursor still stops
        at it until a relay's copy is handed over (or, past ``MAX_LEFT``, for the rest of the run: the next
        start asks)."""
        entry = self._retry.pop(event_id, None)
        if self._cursor_pins is None:
            return
        if entry is not None:
            _, url, sub_id, _ = entry[0]
            self._cursor_pins.unpin(sub_id, url, event_id, left=left)
        if not left:
            self._cursor_pins.handed_over(event_id)

    async def _retry_loop(self) -> None:
        """Hand every failed event whose wait is over to the delivery queue again."""
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while not self._leaving:
            self._retry_wake.clear()
            now = loop.time()
            due = [(event_id, entry[0]) for event_id, entry in self._retry.items() if entry[2] <= now]
            for event_id, item in due:
                entry = self._retry.get(event_id)
                if entry is None:
                    continue
                self._retry[event_id] = (entry[0], entry[1], math.inf)  # in the queue: not due again
                self.retries += 1
                self.seen.add_if_new(event_id)
                self._on_their_way.add(event_id)
                await self._queue.put(item)
            if not self._retry:
                self.last_error = None
            wait = min((entry[2] for entry in self._retry.values()), default=math.inf) - loop.time()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._retry_wake.wait(), None if wait == math.inf else max(0.0, wait))
