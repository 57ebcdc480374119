"""One relay's connection: its socket and reader, NIP-42 auth, reconnects with backoff, publishes
and one-off fetches.

A connection is given what it needs explicitly: the pool's settings, the live subscriptions
(with their cursors), where to hand events (an :class:`EventSink`), the key cache, the auth
signer and a way to run background tasks. Its reader never awaits an ``OK``: ``OK`` frames
resolve futures that publishers wait on.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import structlog
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, WebSocketException

from tenex_daemon.core.events import NostrEvent

from ..codec import (
    AuthMessage,
    ClosedMessage,
    EoseMessage,
    EventMessage,
    KnownEventMessage,
    NoticeMessage,
    OkMessage,
    PublicKeyCache,
    Rejection,
    RejectReason,
    encode_auth,
    encode_close,
    encode_event,
    encode_req,
    parse_relay_frame,
    verify_event,
)
from ..signer import Signer
from .oks import RESEND, TOO_LARGE_FOR_RELAY, AwaitedOks, relay_closed_for_size, we_closed_for_size
from .outage import Outage, Renewals, backoff_delay
from .quick_ack import quick_ack
from .refused import ClosedSubscriptions
from .rejects import RejectLog
from .stored import CATCH_UP_PAGES, CatchUp, EventSink, Paged, StoredBatch, StoredEvents
from .subscriptions import Subscription, Subscriptions
from .types import ConnectHandler, Filter, PoolSettings, RelayHealth, RelaySpec, RelayState, Spawn

log = structlog.get_logger(__name__)


SEND_RETRY_WAIT = 1.0
"""Seconds a publish whose frame could not be sent waits for its connection's close before sending again."""

def _next_page(until: int | None, shift: int, dates: list[int], *, fresh: bool) -> tuple[int, bool] | None:
    """Where a catch-up's next page ends after a page of events dated ``dates`` (asked with ``until`` plus
    ``shift``; ``fresh``: it brought events the page before did not): (its ``until``, whether that is this
    page's oldest second), or None when the filter is done (nothing new, or a relay that does not keep to
    ``until``: it has nothing older to give). A page all dated one second: the relay may keep more of it than
    one answer holds, and ``until`` cannot go past it; the seconds before are asked next."""
    oldest = min(dates)
    if until is None or oldest < until:
        return (oldest, True) if fresh else None
    if max(dates) > until + shift:
        return None
    return until - 1, False


@dataclass
class _Fetch:
    """A one-off REQ in progress: what came so far, and its end (EOSE or CLOSED)."""

    events: list[NostrEvent] = field(default_factory=list)
    refused: list[tuple[str, int]] = field(default_factory=list)
    """(id, created_at) of each event that came but was refused: a catch-up pages past them too."""
    done: asyncio.Future[str] | None = None
    filters: list[Filter] = field(default_factory=list)
    auth_retried: bool = False


class RelayConnection:
    """One relay connection: its reader task, pending OKs, fetches and counters."""

    def __init__(
        self,
        spec: RelaySpec,
        settings: PoolSettings,
        *,
        subscriptions: Subscriptions,
        sink: EventSink,
        key_cache: PublicKeyCache,
        auth_signer: Signer | None,
        spawn: Spawn,
        on_connect: ConnectHandler | None = None,
    ) -> None:
        """Connect to ``spec.url`` once :meth:`run` runs; hand live events to ``sink``."""
        self.spec = spec
        self.url = spec.url
        self.settings = settings
        self.subscriptions = subscriptions
        self.sink = sink
        self.key_cache = key_cache
        self.auth_signer = auth_signer
        self.spawn = spawn
        self.on_connect = on_connect
        self.log = log.bind(relay=spec.url)
        self.ws: ClientConnection | None = None
        self.state = RelayState.IDLE
        self.connected_since: float | None = None
        self.reconnects = 0
        self.connects = 0
        self.last_event_at: float | None = None
        self.events_received = 0
        self.rejects: Counter[str] = Counter()
        self.reject_log = RejectLog(self.log)
        self.notices = 0
        self.last_error: str | None = None
        self.connected = asyncio.Event()
        self.authenticated = asyncio.Event()
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.oks = AwaitedOks(spec.url)
        """The ``OK``\\ s awaited here, and which EVENT an answer without an event id is for."""
        self.pending_ok = self.oks.waiters
        self.fetches: dict[str, _Fetch] = {}
        self.catching_up: dict[str, CatchUp] = {}
        """Live subscriptions asked from their cursor whose EOSE has not come yet."""
        self.stored = StoredEvents(spec.url, settings, sink=sink, subscriptions=subscriptions, spawn=spawn,
                                   log=self.log)
        """Per live subscription whose REQ's EOSE has not come yet: its stored events so far (:mod:`.stored`:
        taken in oldest first)."""
        self.catch_ups = 0
        """Catch-ups paged so far (their fetch ids are told apart by it)."""
        self.auth_retried_subs: set[str] = set()
        self.ok_sizes = self.oks.sizes
        """Per event id a publish awaits an ``OK`` for (:attr:`pending_ok`): the size of its EVENT frame."""
        self.refused = ClosedSubscriptions(settings, self.log, spawn, spec.url, self._resubscribe)
        """The live subscriptions the relay ended (``CLOSED``): sent after a backoff again; those unserved."""
        self.challenge: str | None = None
        """The newest AUTH challenge not answered yet (answered one at a time)."""
        self.answering = False
        self.renew_for: str | None = None
        """Why this connection is to be closed after the frame being read and opened again at once."""
        self.task: asyncio.Task[None] | None = None
        self._retry_now = asyncio.Event()
        self.outage = Outage(self.log)
        """Set to end a reconnect's backoff at once (:meth:`retry_now`: the relay is known to be back)."""

    # -- lifecycle -------------------------------------------------------------------------

    async def run(self) -> None:
        """Connect, read, and reconnect with backoff until cancelled."""
        settings = self.settings
        attempt = 0
        renewals = Renewals(settings)
        while True:
            self.state = RelayState.CONNECTING
            opened_at: float | None = None
            renewed: str | None = None
            try:
                async with connect(
                    self.url,
                    max_size=settings.max_message_bytes,
                    open_timeout=settings.open_timeout,
                    ping_interval=settings.ping_interval,
                    close_timeout=1.0,
                    proxy=None,
                    compression=None,
                ) as ws:
                    opened_at = time.monotonic()
                    await self._on_open(ws)
                    ack_now = quick_ack(ws)
                    async for raw in ws:
                        ack_now()
                        await self._on_frame(raw)
                        if self.renew_for is not None and not self.oks.unnamed:  # each attributed first
                            renewed = self.renew_for
                            self._on_close(renewing=True)  # nothing more is sent on it
                            break
                if renewed is not None:  # closed on purpose: a fresh connection, at once the first time
                    pause = renewals.pause()
                    self.log.info("relay_connection_renewed", reason=renewed, pause_s=round(pause, 3))
                    if pause:  # renewing at every refusal would reconnect (and subscribe again) per event
                        self.state = RelayState.BACKOFF
                        await self._pause(pause)
                    continue
                self.last_error = "closed by relay"
            except asyncio.CancelledError:
                self._on_close(stopping=True)
                self.state = RelayState.STOPPED
                raise
            except (OSError, WebSocketException, TimeoutError) as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"[:300]
                if isinstance(exc, ConnectionClosed):
                    self._closed_for_size(exc)
            except Exception as exc:  # a bug, or a library that changed: said, and the relay tried again
                self.last_error = f"{type(exc).__name__}: {exc}"[:300]
                self.log.exception("relay_connection_failed")
            self._on_close()
            if opened_at is not None and time.monotonic() - opened_at >= settings.stable_after:
                attempt = 0
            delay = backoff_delay(attempt, settings.backoff_base, settings.backoff_cap)
            attempt = min(attempt + 1, 30)
            self.state = RelayState.BACKOFF
            self.outage.failed(self.last_error, delay)
            await self._pause(delay)

    async def _pause(self, delay: float) -> None:
        """Wait ``delay`` seconds before connecting again, or less if :meth:`retry_now` is called."""
        self._retry_now.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._retry_now.wait(), delay)

    def retry_now(self) -> None:
        """A relay known to be back (the embedded relay restarted): a reconnect waiting out its backoff
        connects at once."""
        self._retry_now.set()

    def _closed_for_size(self, exc: ConnectionClosed) -> None:
        """Tell apart the two closes with 1009: websockets closing on a frame the relay sent over our
        ``max_message_bytes`` (skipped past), and the relay closing on a frame we sent over its own limit
        (our EVENT refused for its size)."""
        if we_closed_for_size(exc):
            self._skip_oversized()
        elif relay_closed_for_size(exc):
            self._refuse_too_large()

    def _refuse_too_large(self) -> None:
        """The relay closed the connection with 1009: a frame we sent was over its limit. The largest EVENT
        still awaiting its ``OK`` here is at least as large as that frame, so over the limit too: its publish
        is answered as refused for its size (:data:`TOO_LARGE_FOR_RELAY`, as an ``OK false`` would). Smaller
        ones are sent again on the next connection, as after any drop (one as large is refused then)."""
        refused = self.oks.refuse_largest(TOO_LARGE_FOR_RELAY)
        if refused is None:
            self.log.warning("relay closed the connection: a frame we sent was over its size limit")
            return
        event_id, size = refused
        self.log.warning("relay refused an event for its size", event_id=event_id, frame_bytes=size,
                         detail="it closed the connection with 1009 (message too big)")

    def _skip_oversized(self) -> None:
        """websockets closed the connection on a frame over ``max_message_bytes`` (unread, so its
        event is unknown): count it, and ask this relay only for what is dated after now, or it
        sends the frame again on every resubscription and the connection never stays up."""
        since = self.subscriptions.skip_past(self.url, time.time())
        self.reject(
            RejectReason.OVERSIZED_FRAME,
            f"frame over the websocket limit of {self.settings.max_message_bytes} bytes; "
            f"this relay is now asked only for events since {since}",
        )

    async def _on_open(self, ws: ClientConnection) -> None:
        self.ws = ws
        if self.connects:
            self.reconnects += 1
        self.connects += 1
        self.state = RelayState.CONNECTED
        self.connected_since = time.time()
        self.closed = asyncio.get_running_loop().create_future()
        self.auth_retried_subs.clear()
        self.refused.reconnected()
        self.log.info("relay connected", reconnects=self.reconnects, **self.outage.ended())
        if self.spec.read:
            for sub in self.subscriptions.live():
                await self.send_req(sub)
        for fetch_id, fetch in self.fetches.items():
            await self.send(encode_req(fetch_id, fetch.filters))
        self.connected.set()
        if self.on_connect is not None:
            try:
                self.on_connect(self.url)
            except Exception:
                self.log.exception("connect handler failed")

    def _on_close(self, *, renewing: bool = False, stopping: bool = False) -> None:
        self.stored.closed(self.catching_up, stopping=stopping)
        self.catching_up.clear()  # their cursors stay held: the reconnect's catch-up asks again from them
        # no OK comes for what was sent on this connection: each waiter also waits on `closed`, set below
        self.oks.closed(keep_pace=renewing)
        self.renew_for = None
        self.challenge = None
        self.ws = None
        self.connected.clear()
        self.authenticated.clear()
        self.connected_since = None
        if not self.closed.done():
            self.closed.set_result(None)

    async def send(self, text: str) -> bool:
        """Send a frame if connected; return whether it went out."""
        ws = self.ws
        if ws is None:
            return False
        try:
            await ws.send(text)
        except ConnectionClosed:
            return False
        return True

    async def send_req(self, sub: Subscription) -> None:
        """Send (or re-send) a subscription with ``since`` moved to this relay's cursor.

        Asked from a cursor (the relay's own, or the others' for a relay added to the settings), it is a
        catch-up: the cursor is held where it is until a catch-up has asked
        for every stored event the relay has since then (:meth:`_page_back`) and each was handed over for
        good; one cut short (a drop, a timeout, a stop, a crash) leaves it held, so the next catch-up (on
        reconnect, or at the next start) asks again from there."""
        filters = self.subscriptions.filters_for(sub, self.url)
        if self.subscriptions.starts_from(sub.sub_id, self.url) is not None and self.spec.read:
            self.subscriptions.hold(sub.sub_id, self.url)
            self.catching_up[sub.sub_id] = CatchUp(filters)
        self.stored.begin(sub.sub_id)  # before the REQ: its first events may be read before send returns
        if not await self.send(encode_req(sub.sub_id, filters)):
            self.stored.unfinished(sub.sub_id, held=sub.sub_id in self.catching_up)

    def _caught(self, sub_id: str) -> None:
        """Note a stored event of a catch-up under way."""
        catch_up = self.catching_up.get(sub_id)
        if catch_up is not None:
            catch_up.got_events = True

    async def _end_of_stored(self, sub_id: str) -> None:
        """EOSE of a live subscription: its stored events are taken in, oldest first. A catch-up that got
        events pages through each filter first (its first answer is taken in with its pages); one that got
        none is over (the cursor moves to the newest event handed over meanwhile)."""
        self.refused.served(sub_id)
        catch_up = self.catching_up.pop(sub_id, None)
        if catch_up is not None and catch_up.got_events:  # live events wait in the batch for the pages too
            self.catch_ups += 1
            batch = self.stored.keep(sub_id)
            self.spawn(self._page_back(sub_id, catch_up, self.catch_ups, batch), f"catch-up {self.url}")
            return
        batch = self.stored.end(sub_id) or self.stored.batch()
        await self.stored.take_in(sub_id, batch)
        if catch_up is not None:
            self.subscriptions.release(sub_id, self.url)

    async def _page_back(self, sub_id: str, catch_up: CatchUp, number: int, batch: StoredBatch) -> None:
        """:meth:`_page_all`; however it ends, what comes for the subscription is live again after it."""
        try:
            await self._page_all(sub_id, catch_up, number, batch)
        finally:
            if self.stored.get(sub_id) is batch:  # an end not foreseen: nothing is held for ever
                self.stored.release(sub_id, batch)
                self.spawn(self.stored.take_in(sub_id, batch), f"stored events {self.url}")

    async def _page_all(self, sub_id: str, catch_up: CatchUp, number: int, batch: StoredBatch) -> None:
        """Page each filter of a catch-up (:meth:`_page_filter`) into ``batch``, which holds its first answer,
        then take the batch in. Once every filter is done and every event was handed over for good, the
        cursor moves; a catch-up cut short (no EOSE, a reconnect meanwhile, the subscription closed, the page
        limit, events left or waiting for a retry) leaves it held."""
        paged = Paged(number, self.connects)
        done = True
        for flt in catch_up.filters:
            filter_done = await self._page_filter(sub_id, flt, paged, batch)
            if filter_done is None:  # its cursor stays held: the next catch-up asks again
                # a reconnect's catch-up asks for what came again, in order; on the same connection (a page
                # that timed out) none asks again soon: what came is taken in
                self.stored.release(sub_id, batch)
                if self.connects == paged.generation:
                    await self.stored.take_in(sub_id, batch)
                pages, taken = paged.pages, paged.taken
                self.log.info("catch_up_cut_short", subscription=sub_id, pages=pages, events=taken)
                return
            done = done and filter_done
        self.stored.release(sub_id, batch)  # from here what comes is live
        await self.stored.take_in(sub_id, batch)
        complete = await self.sink.settled() and done
        if complete:
            self.subscriptions.release(sub_id, self.url)
        pages, taken = paged.pages, paged.taken
        self.log.info("catch_up_paged", subscription=sub_id, pages=pages, events=taken, complete=complete)

    async def _page_filter(self, sub_id: str, flt: Filter, paged: Paged, batch: StoredBatch) -> bool | None:
        """Ask one filter for its stored events a page at a time, newest first (``until`` = the oldest second
        of the page before, or the second before it when a page is all of that second), until a page brings
        nothing new; hold those not taken in yet in ``batch``, as the live subscription's. True: done; False:
        the page limit (a relay that does not keep to ``since``); None: cut short (no EOSE, a reconnect
        meanwhile, the subscription closed)."""
        until: int | None = None
        from_page = False  # until is the page before's oldest second: its events there match it again
        shift = 0  # 1 once the relay reads until as "before" (nostr-relay; NIP-01's is "at or before")
        previous: set[str] = set()
        for _ in range(CATCH_UP_PAGES):
            if self.connects != paged.generation or self.subscriptions.get(sub_id) is None:
                return None  # the reconnect's own catch-up asks again; a closed subscription wants nothing
            paged.pages += 1
            asked = {**flt, "until": until + shift} if until is not None else flt
            fetch_id = f"fetch-catch-up-{paged.number}-{paged.pages}"
            page = await self._fetch(fetch_id, [asked], self.settings.fetch_timeout)
            if page.done is None or not page.done.done() or page.done.result() != "eose":
                return None  # a drop, a timeout or CLOSED
            if self.subscriptions.get(sub_id) is None:
                return None  # closed while the page came
            # refused events count as the page's too: a page of nothing but them (a flood of events
            # dated far ahead, say) must not end the paging before the events behind it
            dated = [(event.id, event.created_at) for event in page.events] + page.refused
            if from_page and not shift and all(created_at != until for _, created_at in dated):
                shift = 1  # the rest of that second would be skipped: asked again, until read as "before"
                continue
            if not dated:
                return True
            fresh = any(event_id not in previous for event_id, _ in dated)
            for event in page.events:
                if event.id not in previous and event.id not in self.sink.seen and event.id not in batch:
                    self.events_received += 1  # seen: taken in already; in the batch: held already
                    paged.taken += 1
                    await self.stored.hold(sub_id, batch, event)
            previous = {event_id for event_id, _ in dated}
            step = _next_page(until, shift, [created_at for _, created_at in dated], fresh=fresh)
            if step is None:
                return True
            if not step[1] and fresh:  # the rest of that second, past what one answer holds, is lost
                self.log.warning("catch_up_stuck", subscription=sub_id, second=until, n=len(dated))
            until, from_page = step
        return False

    # -- reading ---------------------------------------------------------------------------

    async def _on_frame(self, raw: str | bytes) -> None:
        message = parse_relay_frame(
            raw, limits=self.settings.limits, key_cache=self.key_cache, known=self.sink.seen
        )
        try:
            await self._dispatch(message)
        except Exception:
            self.log.exception("relay frame handling failed")

    def reject(self, reason: RejectReason, detail: str, event_id: str | None = None) -> None:
        """Count a refused frame, and log it (a flood of them in part: :class:`RejectLog`)."""
        self.rejects[reason.value] += 1
        self.reject_log.said(reason.value, detail, event_id)

    async def _dispatch(self, message: EventMessage | Rejection | object) -> None:
        if isinstance(message, EventMessage):
            await self._on_event(message)
        elif isinstance(message, KnownEventMessage):
            await self._on_known_event(message)
        elif isinstance(message, OkMessage):
            self._on_ok(message)
        elif isinstance(message, EoseMessage):
            fetch = self.fetches.get(message.subscription_id)
            if fetch is not None and fetch.done is not None and not fetch.done.done():
                fetch.done.set_result("eose")
            elif fetch is None:
                await self._end_of_stored(message.subscription_id)
        elif isinstance(message, ClosedMessage):
            self._on_closed(message)
        elif isinstance(message, AuthMessage):
            self._challenged(message.challenge)
        elif isinstance(message, NoticeMessage):
            self.notices += 1
            self.log.info("relay notice", message=message.message[:300])
        elif isinstance(message, Rejection):
            self.reject(message.reason, message.detail, message.event_id)
            self._note_refused(message.subscription_id, message.event_id, message.created_at)

    def _note_refused(self, sub_id: str | None, event_id: str | None, created_at: int | None) -> None:
        """A refused event (already counted and logged) counts for a catch-up as any stored event does: a
        fetch notes it with its date, for the paging to go past it; a catch-up's first answer pages on."""
        if sub_id is None or event_id is None or created_at is None:
            return
        fetch = self.fetches.get(sub_id)
        if fetch is not None:
            fetch.refused.append((event_id, created_at))
        else:
            self._caught(sub_id)

    async def _on_event(self, message: EventMessage) -> None:
        fetch = self.fetches.get(message.subscription_id)
        if fetch is not None:
            fetch.events.append(message.event)
            return
        sub = self._live_subscription(message.subscription_id, message.event.id)
        if sub is not None:
            self._caught(sub.sub_id)
            batch = self.stored.get(sub.sub_id)
            if batch is None:  # live: after EOSE
                await self.sink.intake(message.event, self.url, sub.sub_id)
            else:
                await self.stored.hold(sub.sub_id, batch, message.event)

    def _live_subscription(self, sub_id: str, event_id: str) -> Subscription | None:
        """The live subscription an event came on (counted as received), or None (rejected as unknown)."""
        sub = self.subscriptions.get(sub_id)
        if sub is None:
            if not self.subscriptions.was_closed(sub_id):  # else sent before the relay read our CLOSE
                self.reject(RejectReason.UNKNOWN_SUBSCRIPTION, sub_id[:64], event_id)
            return None
        self.events_received += 1
        self.last_event_at = time.time()
        self.refused.served(sub_id)
        return sub

    async def _on_known_event(self, message: KnownEventMessage) -> None:
        # A copy of an event this pool already verified: its id hashes every signed field.
        if message.subscription_id in self.fetches:
            if verify_event(message.event, key_cache=self.key_cache):
                await self._on_event(EventMessage(message.subscription_id, message.event))
            else:
                self.reject(RejectReason.BAD_SIGNATURE, "copy of a known event", message.event.id)
                self._note_refused(message.subscription_id, message.event.id, message.event.created_at)
            return
        sub = self._live_subscription(message.subscription_id, message.event.id)
        if sub is not None:
            self._caught(sub.sub_id)
            batch = self.stored.get(sub.sub_id)
            if batch is None:
                self.sink.count_known_copy(message.event, self.url, sub.sub_id)
            else:  # counted with the batch: its cursor does not pass the events held before it
                await self.stored.hold(sub.sub_id, batch, message.event, known=True)

    def _on_ok(self, message: OkMessage) -> None:
        # one without an event id (nostr-relay's refusals) is attributed when that can be told (.oks)
        self.oks.answer(message)
        if not message.event_id and not message.accepted and message.prefix != "auth-required":
            # nostr-relay then sleeps before every later frame of this connection (2 s, doubling at each
            # refusal): three refusals and its answers come after a publish's time; a fresh one is not slowed
            self.renew_for = "a refusal without an event id (nostr-relay slows the connection after it)"

    def _on_closed(self, message: ClosedMessage) -> None:
        sub_id = message.subscription_id
        fetch = self.fetches.get(sub_id)
        auth_required = message.prefix == "auth-required"
        if fetch is not None:
            if auth_required and not fetch.auth_retried:
                fetch.auth_retried = True
                self.spawn(self._resend_after_auth(encode_req(sub_id, fetch.filters)), "fetch auth")
            elif fetch.done is not None and not fetch.done.done():
                fetch.done.set_result(f"closed: {message.message}")
            return
        sub = self.subscriptions.get(sub_id)
        if sub is None:
            return
        held = self.catching_up.pop(sub_id, None) is not None  # its cursor stays held: the REQ sent again
        self.stored.unfinished(sub_id, held=held)  # catches up from it
        if auth_required and sub_id not in self.auth_retried_subs:
            self.auth_retried_subs.add(sub_id)
            self.log.info("subscription needs auth; re-sending after AUTH", subscription=sub_id)
            self.spawn(self._resend_req_after_auth(sub), f"resubscribe {self.url}")
        else:
            self.refused.closed(sub_id, message.prefix, message.message, self.connects)

    async def _resubscribe(self, sub_id: str, generation: int, delay: float) -> None:
        """Send a live subscription's REQ again after ``delay``, unless a reconnect sent it meanwhile (or it
        was closed); ``generation``: the connection number it was ended on."""
        await asyncio.sleep(delay)
        sub = self.subscriptions.get(sub_id)
        if sub is not None and self.connects == generation and self.ws is not None:
            await self.send_req(sub)

    # -- auth ------------------------------------------------------------------------------

    def _challenged(self, challenge: str) -> None:
        """An AUTH challenge: answered at once, or, while another is being answered, after it (only the
        newest of those that came meanwhile)."""
        self.challenge = challenge
        if not self.answering:
            self.answering = True
            self.spawn(self._answer_challenges(), f"auth {self.url}")

    async def _answer_challenges(self) -> None:
        """Answer the challenges one at a time until none waits."""
        try:
            while self.challenge is not None:
                challenge, self.challenge = self.challenge, None
                await self._authenticate(challenge)
        finally:
            self.answering = False

    async def _authenticate(self, challenge: str) -> None:
        signer = self.auth_signer
        if signer is None:
            self.log.warning("relay asked for AUTH but the pool has no auth signer")
            return
        event = signer.sign_auth(self.url, challenge)
        closed = self.closed
        future = self.expect_ok(event.id)
        try:
            # not owed for an answer without an id (.oks): nostr-relay never answers AUTH, and counted as a
            # candidate of such answers an AUTH would stop every later one on this connection being told
            if not await self.send(encode_auth(event)):
                return
            waiters: set[asyncio.Future[Any]] = {future, closed}
            await asyncio.wait(waiters, timeout=self.settings.auth_timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._forget_ok(event.id, future)
        if not future.done():
            if not closed.done():
                # nostr-relay never answers AUTH with OK: go on as authenticated; a later
                # auth-required answer shows if it was not.
                self.log.info("no OK for AUTH; assuming accepted")
                self.authenticated.set()
            return
        answer = future.result()
        if answer.accepted:
            self.log.info("authenticated", pubkey=signer.pubkey)
            self.authenticated.set()
        else:
            self.log.warning("AUTH refused", message=answer.message)

    async def wait_authenticated(self, wait_s: float) -> bool:
        """Wait up to ``wait_s`` seconds until this connection has authenticated."""
        try:
            await asyncio.wait_for(self.authenticated.wait(), wait_s)
        except TimeoutError:
            return False
        return True

    async def _resend_req_after_auth(self, sub: Subscription) -> None:
        if await self.wait_authenticated(self.settings.auth_timeout):
            await self.send_req(sub)
        else:
            unheard = "auth-required: not authenticated"
            self.refused.closed(sub.sub_id, "auth-required", unheard, self.connects)

    async def _resend_after_auth(self, frame: str) -> None:
        if await self.wait_authenticated(self.settings.auth_timeout):
            await self.send(frame)

    # -- publishing and fetching -----------------------------------------------------------

    def expect_ok(self, event_id: str, frame_size: int | None = None) -> asyncio.Future[OkMessage]:
        """Register interest in the relay's ``OK`` for an event id (``frame_size``: its EVENT frame's, for a
        publish). Whoever calls it forgets the future when done waiting (:meth:`_forget_ok`)."""
        return self.oks.expect(event_id, frame_size)

    def _forget_ok(self, event_id: str, future: asyncio.Future[OkMessage]) -> None:
        self.oks.forget(event_id, future)

    async def wait_connected(self, deadline: float) -> bool:
        """Wait for a connection until the loop-time ``deadline``."""
        if self.connected.is_set():  # the common case: no waiting task and timer per publish
            return True
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            return self.connected.is_set()
        try:
            await asyncio.wait_for(self.connected.wait(), remaining)
        except TimeoutError:
            return False
        return True

    async def publish(self, event: NostrEvent, deadline: float) -> OkMessage | None:
        """Send the event until this relay answers or the deadline passes (None: no answer).

        A dropped connection means sending again on the next one; an
        ``auth-required:`` answer means one more try after authenticating.
        """
        loop = asyncio.get_running_loop()
        frame = encode_event(event)
        auth_retry_used = False
        while await self.wait_connected(deadline):
            answer = await self._send_event(event.id, frame, deadline)
            if answer is RESEND:  # its answer could not be told from another's: sent again, one at a time
                continue
            if isinstance(answer, OkMessage):
                if (not answer.accepted and answer.prefix == "auth-required" and not auth_retry_used
                        and self.auth_signer is not None):
                    auth_retry_used = True
                    remaining = deadline - loop.time()
                    if await self.wait_authenticated(max(0.0, remaining)):
                        continue
                return answer
            if answer is None:
                return None
            # unsent, or the connection dropped before an answer: wait for the next one and send again
        return None

    async def _send_event(self, event_id: str, frame: str, deadline: float) -> OkMessage | bool | None:
        """Send an EVENT frame once (holding :attr:`.oks.AwaitedOks.turn` when this connection sends one
        at a time) and wait for its answer: the answer; None: none before the deadline; False: unsent,
        or the connection closed first."""
        loop = asyncio.get_running_loop()
        turn = self.oks.turn if self.oks.one_at_a_time else None
        if turn is not None:
            try:
                async with asyncio.timeout(max(0.0, deadline - loop.time())):
                    await turn.acquire()
            except TimeoutError:
                return None
        future = self.expect_ok(event_id, len(frame))
        closed = self.closed
        try:
            sent = await self._send_owed(event_id, frame)
            remaining = deadline - loop.time()
            if sent and remaining <= 0:
                return None
            # unsent: the connection is closing; its close may still answer (a relay's 1009 refuses
            # the frame), so wait for it before sending again
            waiters: set[asyncio.Future[Any]] = {future, closed}
            wait = remaining if sent else min(max(0.0, remaining), SEND_RETRY_WAIT)
            done, _ = await asyncio.wait(waiters, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._forget_ok(event_id, future)
            if turn is not None:
                turn.release()
        if future.done():
            return future.result()
        if not sent:
            await asyncio.sleep(0.05)
            return False
        return False if done else None

    async def _send_owed(self, event_id: str, frame: str) -> bool:
        """Send an EVENT or AUTH frame, counted as owed an ``OK`` on this connection (:mod:`.oks`); return
        whether it went out."""
        connection = self.connects
        self.oks.sending(event_id)
        sent = await self.send(frame)
        if not sent and self.connects == connection:
            self.oks.not_sent(event_id)
        return sent

    async def fetch(self, fetch_id: str, filters: list[Filter], wait_s: float) -> list[NostrEvent]:
        """Run a one-off REQ until EOSE (or CLOSED, or ``wait_s`` seconds); return what came."""
        return (await self._fetch(fetch_id, filters, wait_s)).events

    async def _fetch(self, fetch_id: str, filters: list[Filter], wait_s: float) -> _Fetch:
        """:meth:`fetch`, returning the fetch itself (its ``done`` tells whether it came to EOSE)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        fetch = _Fetch(done=loop.create_future(), filters=filters)
        self.fetches[fetch_id] = fetch
        try:
            if not await self.wait_connected(deadline):
                return fetch
            await self.send(encode_req(fetch_id, filters))
            assert fetch.done is not None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(fetch.done), max(0.0, deadline - loop.time()))
            await self.send(encode_close(fetch_id))
            return fetch
        finally:
            self.fetches.pop(fetch_id, None)

    def health(self) -> RelayHealth:
        """Snapshot this connection's health."""
        return RelayHealth(
            url=self.url, state=self.state, read=self.spec.read, write=self.spec.write,
            connected_since=self.connected_since, reconnects=self.reconnects,
            last_event_at=self.last_event_at, events_received=self.events_received,
            rejects=dict(self.rejects), notices=self.notices,
            authenticated=self.authenticated.is_set(), last_error=self.last_error,
            oks_attributed=self.oks.attributed, oks_unmatched=self.oks.unmatched,
            subscriptions_closed=self.refused.total, unserved=self.refused.unserved_s(),
        )

