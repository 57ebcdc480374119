"""Delivery: the pool's intake queue and the consumer calls, each event once, in order per lane.

Events from every relay go through one queue. Copies of an event in flight are dropped (an
LRU of ids), and so are events the store marked processed before; after the consumer returns
an event is marked processed and its relay's cursor moves. With ``delivery_lanes`` > 1 and a
lane key, events with different keys are delivered concurrently and events with the same key
in arrival order.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable

import structlog

from tenex_daemon.core.events import NostrEvent
from tenex_daemon.runtime.background import BackgroundTasks

from .types import EventHandler, LaneKey, PoolSettings, PoolStore, ReceivedEvent

log = structlog.get_logger(__name__)

_Intake = tuple[NostrEvent, str, str, float]
"""An event waiting for the consumer: the event, its relay, its subscription, when it was taken in."""
AdvanceCursor = Callable[[str, str, int], None]
"""Moves the cursor of (subscription id, relay url) up to an accepted ``created_at``."""


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
    ) -> None:
        """Deliver to ``on_event``; ``store`` keeps the processed ids; ``advance_cursor`` moves cursors."""
        self._settings = settings
        self._advance_cursor = advance_cursor
        self._on_event = on_event
        self._store = store
        self._lane_key = lane_key
        self.seen = SeenIds(settings.seen_cache_size)
        self.delivered = 0
        self.duplicates = 0
        self.consumer_errors = 0
        self._queue: asyncio.Queue[_Intake] | None = None
        self._task: asyncio.Task[None] | None = None
        self._lanes = BackgroundTasks("nostr delivery")

    @property
    def queued(self) -> int:
        """Events taken in and not yet handed to a lane."""
        return self._queue.qsize() if self._queue is not None else 0

    def start(self) -> None:
        """Open the intake queue and start the delivery task."""
        self._queue = asyncio.Queue(self._settings.intake_queue_size)
        self._task = asyncio.create_task(self._deliver_loop(), name="nostr delivery")

    async def drain(self) -> None:
        """Wait (up to ``drain_timeout``) until every event taken in has reached the consumer."""
        if self._queue is not None and self._task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._queue.join(), self._settings.drain_timeout)

    async def stop(self) -> None:
        """Cancel the delivery task and the lane workers, and wait for them."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._lanes.cancel_all()

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

    async def _deliver_in_lanes(
        self, queue: asyncio.Queue[_Intake], lanes: int, lane_key: LaneKey
    ) -> None:
        """Deliver up to ``lanes`` keys at once; a key's events go one at a time, in arrival order.

        A key being delivered collects its later events in a backlog that its own worker
        drains, so a slow key never holds up another while a lane is free.
        """
        backlogs: dict[str, collections.deque[_Intake]] = {}
        free_lanes = asyncio.Semaphore(lanes)
        held = asyncio.Semaphore(self._settings.intake_queue_size)  # bounds the backlogs

        async def drain_key(key: str) -> None:
            backlog = backlogs[key]
            try:
                while backlog:
                    try:
                        await self._deliver_one(queue, backlog.popleft())
                    finally:
                        held.release()
            finally:
                del backlogs[key]
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
        if self._store is not None and await self._store.is_processed(event.id):
            self.duplicates += 1
            self._advance_cursor(sub_id, url, event.created_at)
            return
        if self._on_event is not None:
            try:
                await self._on_event(ReceivedEvent(event, url, sub_id, received_at))
            except Exception:
                self.consumer_errors += 1
                self.seen.discard(event.id)
                log.exception("event handler failed", event_id=event.id, kind=event.kind)
                return
        if self._store is not None:
            await self._store.mark_processed(event.id)
        self.delivered += 1
        self._advance_cursor(sub_id, url, event.created_at)
