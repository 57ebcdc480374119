"""The relay pool: several relay connections, one stream of deduplicated, validated events."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Coroutine, Iterable, Sequence
from typing import Any

import structlog

from tenex_daemon.core.events import NostrEvent
from tenex_daemon.runtime.background import BackgroundTasks

from ..codec import OkMessage, PublicKeyCache, encode_close
from ..signer import Signer
from .connection import RelayConnection
from .delivery import Delivery
from .subscriptions import Subscription, Subscriptions
from .types import (
    ConnectHandler,
    EventHandler,
    Filter,
    LaneKey,
    PoolHealth,
    PoolSettings,
    PoolStore,
    PublishError,
    PublishResult,
    RelayHealth,
    RelaySpec,
    RelayState,
)

log = structlog.get_logger(__name__)


class RelayPool:
    """Connections to several relays, one stream of deduplicated, validated events.

    Use it as an async context manager (or call :meth:`start` / :meth:`stop`)::

        async with RelayPool(["wss://relay.example"], on_event=handle, store=store) as pool:
            await pool.subscribe("mentions", [{"kinds": [11, 1111], "#p": [agent_pubkey]}])
            await pool.publish(signed_reply)

    ``on_event`` is awaited once per new event, one at a time, in arrival order; a
    slow handler should hand work to its own tasks. When it returns, the event id
    is marked processed in the store (unless it returns :attr:`Remember.IN_MEMORY`); when it
    raises, the error is logged and the event is handed over again with backoff (or by a
    later copy).
    """

    def __init__(
        self,
        relays: Iterable[str | RelaySpec],
        *,
        on_event: EventHandler | None = None,
        store: PoolStore | None = None,
        auth_signer: Signer | None = None,
        settings: PoolSettings | None = None,
        lane_key: LaneKey | None = None,
        on_connect: ConnectHandler | None = None,
    ) -> None:
        """Describe the pool; nothing connects until :meth:`start`.

        ``on_connect`` is told each relay's URL whenever it (re)connects and its subscriptions are
        sent again (the daemon's outbox publishes what waits, at once).

        ``lane_key`` maps an event to the key whose events must reach ``on_event`` in
        order (with ``settings.delivery_lanes`` > 1, different keys are delivered concurrently).
        """
        self.specs = [r if isinstance(r, RelaySpec) else RelaySpec(r) for r in relays]
        urls = [s.url for s in self.specs]
        if len(set(urls)) != len(urls):
            raise ValueError("a relay url is listed twice")
        self.store = store
        self._on_connect = on_connect
        self.auth_signer = auth_signer
        self.settings = settings or PoolSettings()
        if self.settings.delivery_lanes < 1:
            raise ValueError("delivery_lanes must be at least 1")
        self.key_cache = PublicKeyCache()
        self._subscriptions = Subscriptions(
            self.settings.since_window, slow_clock_allowance=self.settings.slow_clock_allowance
        )
        self._delivery = Delivery(
            self.settings, self._subscriptions.advance, on_event=on_event, store=store, lane_key=lane_key,
            cursor_pins=self._subscriptions,
        )
        self._relays: dict[str, RelayConnection] = {}
        self._tasks = BackgroundTasks("relay pool")
        self._flush_task: asyncio.Task[None] | None = None
        self._fetch_ids = itertools.count(1)
        self._started = False

    @property
    def delivered(self) -> int:
        """Events handed to the consumer (that returned)."""
        return self._delivery.delivered

    @property
    def duplicates(self) -> int:
        """Copies dropped: in flight from another relay, or processed before."""
        return self._delivery.duplicates

    @property
    def consumer_errors(self) -> int:
        """Events whose consumer call raised."""
        return self._delivery.consumer_errors

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> RelayPool:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Open a connection task per relay and the delivery task."""
        if self._started:
            return
        self._started = True
        self._delivery.start()
        for spec in self.specs:
            relay = RelayConnection(
                spec,
                self.settings,
                subscriptions=self._subscriptions,
                sink=self._delivery,
                key_cache=self.key_cache,
                auth_signer=self.auth_signer,
                spawn=self.spawn,
                on_connect=self._on_connect,
            )
            self._relays[spec.url] = relay
            relay.task = asyncio.create_task(relay.run(), name=f"relay {spec.url}")
        self._flush_task = asyncio.create_task(self._flush_loop(), name="nostr cursor flush")

    def retry_now(self, url: str) -> None:
        """The relay at ``url`` is known to be back (the embedded relay restarted): connect to it now rather
        than at the end of its reconnect backoff."""
        relay = self._relays.get(url)
        if relay is not None:
            relay.retry_now()

    def leave_to_relays(self) -> None:
        """The consumer takes no more events (its owner is stopping): those taken in from now on, queued or
        waiting for a retry are left to the relays, which send them again after the next start
        (:meth:`Delivery.leave_to_relays`)."""
        self._delivery.leave_to_relays()

    async def stop(self) -> None:
        """Close connections, let queued events reach the consumer (bounded), flush cursors."""
        if not self._started:
            return
        self._started = False
        for relay in self._relays.values():
            if relay.task is not None:
                relay.task.cancel()
        await asyncio.gather(*(r.task for r in self._relays.values() if r.task), return_exceptions=True)
        for relay in self._relays.values():
            relay.state = RelayState.STOPPED
        await self._delivery.drain()
        if self._flush_task is not None:
            self._flush_task.cancel()
        await asyncio.gather(
            self._delivery.stop(), self._tasks.cancel_all(), *filter(None, [self._flush_task]),
            return_exceptions=True,
        )
        await self._subscriptions.flush(self.store)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        """Run a tracked background task; its exception is logged, it is cancelled on stop."""
        self._tasks.spawn(coro, name)

    # -- subscriptions ---------------------------------------------------------------------

    async def subscribe(self, sub_id: str, filters: Sequence[Filter], *, lookback_s: int = 0) -> None:
        """Add (or replace) a live subscription on every readable relay.

        Its cursor is loaded from the store, so after a restart only what may have
        been missed is asked for. ``lookback_s``: seconds a re-subscription asks further back than
        the cursor, for events dated in the past (NIP-59 gift wraps: up to two days).
        """
        if not 0 < len(sub_id) <= 64:
            raise ValueError("a subscription id must be 1 to 64 characters")
        if sub_id.startswith("fetch-"):
            raise ValueError("subscription ids starting with 'fetch-' are reserved")
        sub = Subscription(sub_id, [dict(f) for f in filters], lookback_s)
        await self._subscriptions.add(sub, [spec.url for spec in self.specs], self.store)
        for relay in self._relays.values():
            if relay.spec.read:
                await relay.send_req(sub)

    async def unsubscribe(self, sub_id: str) -> None:
        """Close a subscription on every relay."""
        if not self._subscriptions.remove(sub_id):
            return
        for relay in self._relays.values():
            await relay.send(encode_close(sub_id))

    def cursor(self, sub_id: str, url: str) -> int | None:
        """Return the last accepted ``created_at`` for a subscription on a relay."""
        return self._subscriptions.cursor(sub_id, url)

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.cursor_flush_interval)
            try:
                await self._subscriptions.flush(self.store)
            except Exception:
                log.exception("cursor flush failed")

    # -- intake ----------------------------------------------------------------------------

    async def intake(self, event: NostrEvent, url: str, sub_id: str) -> None:
        """Take a validated event in as if a relay sent it on ``sub_id`` (copies in flight are dropped)."""
        await self._delivery.intake(event, url, sub_id)

    # -- publishing ------------------------------------------------------------------------

    async def publish(
        self,
        event: NostrEvent,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - per-relay deadlines inside; asyncio.timeout would cut the cleanup
        raise_on_failure: bool = True,
    ) -> PublishResult:
        """Send ``event`` to every writable relay; return once one has it.

        Done at the first ``OK true`` (or ``duplicate:``); relays still pending keep
        trying in the background until the timeout. Raises :class:`PublishError` when
        none accepted (unless ``raise_on_failure`` is False).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.settings.publish_timeout if timeout is None else timeout)
        writers = [r for r in self._relays.values() if r.spec.write]
        accepted: list[str] = []
        rejected: dict[str, str] = {}
        timed_out: list[str] = []
        pending: set[asyncio.Task[OkMessage | None]] = set()
        tasks: dict[asyncio.Task[OkMessage | None], str] = {}
        if len(writers) == 1:
            # one relay (the usual home): awaited here, without a task and a wait around it;
            # there is no tail to leave behind
            relay = writers[0]
            try:
                answer: OkMessage | BaseException | None = await relay.publish(event, deadline)
            except Exception as exc:
                answer = exc
            _tally(relay.url, answer, accepted, rejected, timed_out)
        else:
            tasks = {asyncio.create_task(r.publish(event, deadline), name=f"publish {r.url}"): r.url
                     for r in writers}
            pending = set(tasks)
            while pending and not accepted:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    _tally(tasks[task], task.exception() or task.result(), accepted, rejected, timed_out)
            for task in pending:
                self.spawn(self._finish_publish(event.id, tasks[task], task), f"publish tail {tasks[task]}")
        result = PublishResult(
            event.id, tuple(accepted), rejected, tuple(timed_out), tuple(tasks[t] for t in pending)
        )
        if accepted:
            log.debug("published", event_id=event.id, kind=event.kind, accepted_by=accepted)
        elif raise_on_failure:  # the caller is told, and says so itself
            log.debug("publish failed", event_id=event.id, rejected=rejected, timed_out=timed_out)
            raise PublishError.of(result)
        else:
            log.warning("publish failed", event_id=event.id, rejected=rejected, timed_out=timed_out)
        return result

    async def _finish_publish(self, event_id: str, url: str, task: asyncio.Task[OkMessage | None]) -> None:
        try:
            answer = await task
        except asyncio.CancelledError:
            task.cancel()
            raise
        if answer is None:
            relay = self._relays.get(url)
            down = relay is not None and relay.state is not RelayState.CONNECTED
            # a relay that is down says so itself (``relay disconnected``, ``relay still unreachable``): not
            # one more line for each publish it misses, every 15 s for as long as it is down
            (log.debug if down else log.info)("relay did not answer a publish", relay=url, event_id=event_id)
        elif not answer.is_success:
            log.info("relay refused a publish", relay=url, event_id=event_id, message=answer.message)

    # -- fetching --------------------------------------------------------------------------

    async def fetch(
        self,
        filters: Sequence[Filter],
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - per-relay deadlines inside; asyncio.timeout would cut the cleanup
    ) -> list[NostrEvent]:
        """Ask every readable relay once; return the validated events (deduplicated, newest first).

        Each relay is read until its EOSE, a CLOSED, or the timeout. Fetched events
        bypass the consumer and the processed set.
        """
        by_id: dict[str, NostrEvent] = {}
        for answer in await self.fetch_each(filters, timeout=timeout):
            for event in answer:
                by_id.setdefault(event.id, event)
        return sorted(by_id.values(), key=lambda e: (-e.created_at, e.id))

    async def fetch_each(
        self,
        filters: Sequence[Filter],
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - per-relay deadlines inside; asyncio.timeout would cut the cleanup
    ) -> list[list[NostrEvent]]:
        """Ask every readable relay once; return each one's answer apart (a relay that failed: none), for a
        caller that pages each relay by its own answer (each relay caps its answers its own way)."""
        wait = self.settings.fetch_timeout if timeout is None else timeout
        readers = [r for r in self._relays.values() if r.spec.read]
        fetch_id = f"fetch-{next(self._fetch_ids)}"
        results = await asyncio.gather(
            *(r.fetch(fetch_id, [dict(f) for f in filters], wait) for r in readers),
            return_exceptions=True,
        )
        answers: list[list[NostrEvent]] = []
        for result in results:
            if isinstance(result, BaseException):
                log.warning("fetch failed", error=repr(result))
                continue
            answers.append(result)
        return answers

    async def fetch_event(
        self,
        event_id: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - per-relay deadlines inside; asyncio.timeout would cut the cleanup
    ) -> NostrEvent | None:
        """Return the event with this id from any relay, or None."""
        for event in await self.fetch([{"ids": [event_id]}], timeout=timeout):
            if event.id == event_id:
                return event
        return None

    # -- health ----------------------------------------------------------------------------

    def health(self) -> PoolHealth:
        """Snapshot every relay and the delivery counters."""
        relays = tuple(
            self._relays[s.url].health() if s.url in self._relays else RelayHealth(
                s.url, RelayState.IDLE, s.read, s.write, None, 0, None, 0, {}, 0, False, None
            )
            for s in self.specs
        )
        rejects: Counter[str] = Counter()
        for relay in relays:
            rejects.update(relay.rejects)
        delivery = self._delivery
        return PoolHealth(
            relays, self.delivered, self.duplicates, self.consumer_errors, delivery.queued,
            dict(rejects), retrying=delivery.retrying, retries=delivery.retries,
            retry_dropped=delivery.retry_dropped,
            last_consumer_error=delivery.last_error if delivery.retrying else None,
        )

    def rejects_by_reason(self) -> dict[str, int]:
        """Return how many frames every relay together refused, by reason code."""
        return self.health().rejects

    async def wait_connected(
        self,
        count: int | None = None,
        within: float = 10.0,
    ) -> bool:
        """Wait up to ``within`` seconds until ``count`` relays (default: all) are connected."""
        want = len(self._relays) if count is None else count
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while sum(1 for r in self._relays.values() if r.connected.is_set()) < want:
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True


def _tally(
    url: str,
    answer: OkMessage | BaseException | None,
    accepted: list[str],
    rejected: dict[str, str],
    timed_out: list[str],
) -> None:
    """Count one relay's answer to a publish: accepted, refused (its message, or the error its
    publish raised) or unanswered before the deadline."""
    if isinstance(answer, BaseException):
        rejected[url] = f"error: {type(answer).__name__}"
    elif answer is None:
        timed_out.append(url)
    elif answer.is_success:
        accepted.append(url)
    else:
        rejected[url] = answer.message
