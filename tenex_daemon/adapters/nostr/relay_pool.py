"""The relay pool: several Nostr relays over ``websockets``, one reader task per relay.

What it guarantees:

- A reader task never awaits an ``OK``: ``OK`` frames resolve futures that
  publishers wait on, so a publish can never deadlock the socket loop.
- Each relay reconnects with capped, jittered exponential backoff; subscriptions
  are re-sent with ``since`` = the last accepted ``created_at`` from that relay
  minus a safety window. The cursor is kept in the store (``set_meta``), so a
  restarted daemon asks only for what it may have missed.
- Each event reaches the consumer once: an in-memory LRU drops copies from other
  relays while the first is in flight, and the store's processed set
  (``is_processed``) drops anything handled before a restart. After the consumer
  returns, the id is marked processed.
- Delivery is in arrival order, one event at a time, unless ``delivery_lanes`` > 1
  and a ``lane_key`` is given: then events with different keys (a daemon uses the
  conversation) are delivered concurrently and events with the same key in order.
- NIP-42: a challenge is answered as soon as it arrives; a ``CLOSED`` or ``OK``
  with ``auth-required:`` makes the pool re-send that ``REQ`` or ``EVENT`` once,
  after authenticating.
- A publish goes to every writable relay and is done when one answers ``OK true``
  (``duplicate:`` counts as success); relays that never answer, or answer with an
  empty id (nostr-relay), time out.
- Health (state, connected since, reconnects, last event, rejects by reason) is
  plain data: :meth:`RelayPool.health`.
- Each frame read is acknowledged at once (Linux ``TCP_QUICKACK``). A relay that writes
  small frames without ``TCP_NODELAY`` (nostr-sdk's LocalRelay) holds its next frame until
  the last one is acknowledged; a delayed ACK would make that up to 40 ms per frame (an
  ``OK`` followed by an event, or two events in a row).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import random
import socket
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final, Protocol

import structlog
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, WebSocketException

from tenex_daemon.core.errors import TenexError
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.nip19 import Entity
from tenex_daemon.core.vocabulary import TAG_IDENTIFIER

from .codec import (
    DEFAULT_LIMITS,
    AuthMessage,
    ClosedMessage,
    EoseMessage,
    EventMessage,
    KnownEventMessage,
    Limits,
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
from .signer import Signer

log = structlog.get_logger(__name__)

CURSOR_META_PREFIX: Final = "nostr.cursor"
"""Store meta keys ``nostr.cursor:<subscription id>:<relay url>`` hold the last accepted created_at."""

Filter = dict[str, Any]


class PoolStore(Protocol):
    """What the pool needs from a store: the processed-id set and small metadata.

    :class:`~tenex_daemon.core.ports.ConversationStore` satisfies it.
    """

    async def is_processed(self, event_id: str) -> bool:
        """Return whether the event id was handled before (in this or an earlier run)."""

    async def mark_processed(self, event_id: str) -> None:
        """Remember a handled event id durably."""

    async def get_meta(self, key: str) -> str | None:
        """Return a stored small value."""

    async def set_meta(self, key: str, value: str) -> None:
        """Durably store a small value."""


class RelayState(StrEnum):
    """Where one relay connection stands."""

    IDLE = "idle"
    CONNECTING = "connecting"
    CONNECTED = "connected"
    BACKOFF = "backoff"
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class RelaySpec:
    """One relay and what it is used for."""

    url: str
    read: bool = True
    write: bool = True


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """Tunables of the pool; the defaults suit a daemon, tests shorten the delays."""

    limits: Limits = DEFAULT_LIMITS
    max_message_bytes: int = 4 * 1024 * 1024
    """Hard websocket frame limit (``max_size``): a larger frame closes the connection."""
    open_timeout: float = 10.0
    ping_interval: float | None = 20.0
    backoff_base: float = 0.5
    backoff_cap: float = 30.0
    stable_after: float = 10.0
    """A connection that stayed up this long resets the backoff."""
    since_window: int = 120
    """Seconds subtracted from the cursor when (re)subscribing; dedupe absorbs the overlap."""
    publish_timeout: float = 10.0
    fetch_timeout: float = 5.0
    auth_timeout: float = 5.0
    seen_cache_size: int = 100_000
    intake_queue_size: int = 10_000
    delivery_lanes: int = 1
    """Keys delivered at once when the pool has a ``lane_key``; one key's events always go in order."""
    cursor_flush_interval: float = 1.0
    drain_timeout: float = 5.0


@dataclass(frozen=True, slots=True)
class ReceivedEvent:
    """An accepted event handed to the consumer, with where it came from."""

    event: NostrEvent
    relay_url: str
    subscription_id: str
    received_at: float
    """Epoch seconds when the pool took the event in from the relay (before any queueing)."""


@dataclass(frozen=True, slots=True)
class RelayHealth:
    """A snapshot of one relay connection, for ``tenexd status``."""

    url: str
    state: RelayState
    read: bool
    write: bool
    connected_since: float | None
    reconnects: int
    last_event_at: float | None
    events_received: int
    rejects: dict[str, int]
    notices: int
    authenticated: bool
    last_error: str | None

    def to_dict(self) -> dict[str, Any]:
        """Return the snapshot as JSON-ready data."""
        return {
            "url": self.url, "state": self.state.value, "read": self.read, "write": self.write,
            "connected_since": self.connected_since, "reconnects": self.reconnects,
            "last_event_at": self.last_event_at, "events_received": self.events_received,
            "rejects": dict(self.rejects), "notices": self.notices,
            "authenticated": self.authenticated, "last_error": self.last_error,
        }


@dataclass(frozen=True, slots=True)
class PoolHealth:
    """A snapshot of the whole pool: every relay plus delivery counters."""

    relays: tuple[RelayHealth, ...]
    delivered: int
    duplicates: int
    consumer_errors: int
    queued: int
    rejects: dict[str, int]

    @property
    def connected(self) -> int:
        """How many relays are connected now."""
        return sum(1 for r in self.relays if r.state is RelayState.CONNECTED)

    def to_dict(self) -> dict[str, Any]:
        """Return the snapshot as JSON-ready data."""
        return {
            "relays": [r.to_dict() for r in self.relays], "connected": self.connected,
            "delivered": self.delivered, "duplicates": self.duplicates,
            "consumer_errors": self.consumer_errors, "queued": self.queued, "rejects": dict(self.rejects),
        }


@dataclass(frozen=True, slots=True)
class PublishResult:
    """How the relays answered one publish (as known when it returned)."""

    event_id: str
    accepted_by: tuple[str, ...] = ()
    rejected: Mapping[str, str] = field(default_factory=dict)
    timed_out: tuple[str, ...] = ()
    pending: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """Whether at least one relay has the event."""
        return bool(self.accepted_by)


class PublishError(TenexError):
    """No relay accepted an event before the timeout."""

    def __init__(self, result: PublishResult) -> None:
        parts = [f"{url}: {msg}" for url, msg in result.rejected.items()]
        parts += [f"{url}: no answer" for url in result.timed_out]
        super().__init__(f"no relay accepted event {result.event_id} ({'; '.join(parts) or 'no relay'})")
        self.result = result


def _quick_ack(ws: ClientConnection) -> Callable[[], None]:
    """Return a call that acknowledges what the connection's socket received so far, at once.

    Linux only (``TCP_QUICKACK``; elsewhere, or for a socket that refuses it, a no-op). Made
    per connection: the option is not sticky, so it is set again after every frame read.
    """
    option = getattr(socket, "TCP_QUICKACK", None)
    sock = ws.transport.get_extra_info("socket") if ws.transport is not None else None
    if option is None or sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return _no_ack

    def ack() -> None:
        with contextlib.suppress(OSError):  # closed meanwhile: the read loop sees it next
            sock.setsockopt(socket.IPPROTO_TCP, option, 1)

    return ack


def _no_ack() -> None:
    return None


def backoff_delay(
    attempt: int, base: float, cap: float, rng: Callable[[float, float], float] = random.uniform
) -> float:
    """Return the wait before reconnect ``attempt`` (0-based): ``base * 2**attempt`` capped, jittered.

    The jitter draws from the upper half (``[d/2, d]``) so relays that dropped
    together do not reconnect in lockstep, while the wait still grows.
    """
    delay = min(cap, base * (2 ** min(attempt, 60)))
    return rng(delay / 2, delay)


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


@dataclass
class _Subscription:
    sub_id: str
    filters: list[Filter]


@dataclass
class _Fetch:
    events: list[NostrEvent] = field(default_factory=list)
    done: asyncio.Future[str] | None = None
    filters: list[Filter] = field(default_factory=list)
    auth_retried: bool = False


def _cursor_key(sub_id: str, url: str) -> str:
    return f"{CURSOR_META_PREFIX}:{sub_id}:{url}"


class _Relay:
    """One relay connection: its reader task, pending OKs, fetches and counters."""

    def __init__(self, spec: RelaySpec, pool: RelayPool) -> None:
        self.spec = spec
        self.url = spec.url
        self.pool = pool
        self.log = log.bind(relay=spec.url)
        self.ws: ClientConnection | None = None
        self.state = RelayState.IDLE
        self.connected_since: float | None = None
        self.reconnects = 0
        self.connects = 0
        self.last_event_at: float | None = None
        self.events_received = 0
        self.rejects: Counter[str] = Counter()
        self.notices = 0
        self.last_error: str | None = None
        self.connected = asyncio.Event()
        self.authenticated = asyncio.Event()
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.pending_ok: dict[str, list[asyncio.Future[OkMessage]]] = {}
        self.fetches: dict[str, _Fetch] = {}
        self.auth_retried_subs: set[str] = set()
        self.task: asyncio.Task[None] | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def run(self) -> None:
        """Connect, read, and reconnect with backoff until cancelled."""
        settings = self.pool.settings
        attempt = 0
        while True:
            self.state = RelayState.CONNECTING
            opened_at: float | None = None
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
                    ack_now = _quick_ack(ws)
                    async for raw in ws:
                        ack_now()
                        await self._on_frame(raw)
                self.last_error = "closed by relay"
            except asyncio.CancelledError:
                self._on_close()
                self.state = RelayState.STOPPED
                raise
            except (OSError, WebSocketException, TimeoutError) as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"[:300]
                if isinstance(exc, ConnectionClosed) and exc.sent is not None and exc.sent.code == 1009:
                    # websockets closed the connection on a frame over max_message_bytes
                    self.reject(RejectReason.OVERSIZED_FRAME, "frame over the websocket size limit")
            self._on_close()
            if opened_at is not None and time.monotonic() - opened_at >= settings.stable_after:
                attempt = 0
            delay = backoff_delay(attempt, settings.backoff_base, settings.backoff_cap)
            attempt = min(attempt + 1, 30)
            self.state = RelayState.BACKOFF
            self.log.info("relay disconnected", error=self.last_error, retry_in=round(delay, 2))
            await asyncio.sleep(delay)

    async def _on_open(self, ws: ClientConnection) -> None:
        self.ws = ws
        if self.connects:
            self.reconnects += 1
        self.connects += 1
        self.state = RelayState.CONNECTED
        self.connected_since = time.time()
        self.closed = asyncio.get_running_loop().create_future()
        self.auth_retried_subs.clear()
        self.log.info("relay connected", reconnects=self.reconnects)
        if self.spec.read:
            for sub in list(self.pool.subscriptions.values()):
                await self.send_req(sub)
        for fetch_id, fetch in self.fetches.items():
            await self.send(encode_req(fetch_id, fetch.filters))
        self.connected.set()

    def _on_close(self) -> None:
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

    async def send_req(self, sub: _Subscription) -> None:
        """Send (or re-send) a subscription with ``since`` moved to this relay's cursor."""
        await self.send(encode_req(sub.sub_id, self.pool.filters_with_cursor(sub, self.url)))

    # -- reading ---------------------------------------------------------------------------

    async def _on_frame(self, raw: str | bytes) -> None:
        message = parse_relay_frame(
            raw, limits=self.pool.settings.limits, key_cache=self.pool.key_cache, known=self.pool.seen
        )
        try:
            await self._dispatch(message)
        except Exception:
            self.log.exception("relay frame handling failed")

    def reject(self, reason: RejectReason, detail: str, event_id: str | None = None) -> None:
        """Count and log a refused frame."""
        self.rejects[reason.value] += 1
        self.log.warning("frame rejected", reason=reason.value, detail=detail[:200], event_id=event_id)

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
        elif isinstance(message, ClosedMessage):
            self._on_closed(message)
        elif isinstance(message, AuthMessage):
            self.pool.spawn(self._authenticate(message.challenge), f"auth {self.url}")
        elif isinstance(message, NoticeMessage):
            self.notices += 1
            self.log.info("relay notice", message=message.message[:300])
        elif isinstance(message, Rejection):
            self.reject(message.reason, message.detail, message.event_id)

    async def _on_event(self, message: EventMessage) -> None:
        fetch = self.fetches.get(message.subscription_id)
        if fetch is not None:
            fetch.events.append(message.event)
            return
        sub = self._live_subscription(message.subscription_id, message.event.id)
        if sub is not None:
            await self.pool.intake(message.event, self.url, sub.sub_id)

    def _live_subscription(self, sub_id: str, event_id: str) -> _Subscription | None:
        """The live subscription an event came on (counted as received), or None (rejected as unknown)."""
        sub = self.pool.subscriptions.get(sub_id)
        if sub is None:
            self.reject(RejectReason.UNKNOWN_SUBSCRIPTION, sub_id[:64], event_id)
            return None
        self.events_received += 1
        self.last_event_at = time.time()
        return sub

    async def _on_known_event(self, message: KnownEventMessage) -> None:
        # A copy of an event this pool already verified: its id hashes every signed field.
        if message.subscription_id in self.fetches:
            if verify_event(message.event, key_cache=self.pool.key_cache):
                await self._on_event(EventMessage(message.subscription_id, message.event))
            else:
                self.reject(RejectReason.BAD_SIGNATURE, "copy of a known event", message.event.id)
            return
        sub = self._live_subscription(message.subscription_id, message.event.id)
        if sub is not None:
            self.pool.count_known_copy(message.event, self.url, sub.sub_id)

    def _on_ok(self, message: OkMessage) -> None:
        if not message.event_id:
            # nostr-relay answers some rejections with an empty id: nothing to match, the
            # publisher's timeout covers it.
            self.log.warning("OK without event id", accepted=message.accepted, message=message.message)
            return
        for future in self.pending_ok.pop(message.event_id, []):
            if not future.done():
                future.set_result(message)

    def _on_closed(self, message: ClosedMessage) -> None:
        sub_id = message.subscription_id
        fetch = self.fetches.get(sub_id)
        auth_required = message.prefix == "auth-required"
        if fetch is not None:
            if auth_required and not fetch.auth_retried:
                fetch.auth_retried = True
                self.pool.spawn(self._resend_after_auth(encode_req(sub_id, fetch.filters)), "fetch auth")
            elif fetch.done is not None and not fetch.done.done():
                fetch.done.set_result(f"closed: {message.message}")
            return
        sub = self.pool.subscriptions.get(sub_id)
        if sub is None:
            return
        if auth_required and sub_id not in self.auth_retried_subs:
            self.auth_retried_subs.add(sub_id)
            self.log.info("subscription needs auth; re-sending after AUTH", subscription=sub_id)
            self.pool.spawn(self._resend_req_after_auth(sub), f"resubscribe {self.url}")
        else:
            self.log.warning("subscription closed by relay", subscription=sub_id, message=message.message)

    # -- auth ------------------------------------------------------------------------------

    async def _authenticate(self, challenge: str) -> None:
        signer = self.pool.auth_signer
        if signer is None:
            self.log.warning("relay asked for AUTH but the pool has no auth signer")
            return
        event = signer.sign_auth(self.url, challenge)
        future = self.expect_ok(event.id)
        if not await self.send(encode_auth(event)):
            return
        try:
            answer = await asyncio.wait_for(future, self.pool.settings.auth_timeout)
        except TimeoutError:
            # nostr-relay never answers AUTH with OK: go on as authenticated; a later
            # auth-required answer shows if it was not.
            self.log.info("no OK for AUTH; assuming accepted")
            self.authenticated.set()
            return
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

    async def _resend_req_after_auth(self, sub: _Subscription) -> None:
        if await self.wait_authenticated(self.pool.settings.auth_timeout):
            await self.send_req(sub)
        else:
            self.log.warning("subscription not re-sent: not authenticated", subscription=sub.sub_id)

    async def _resend_after_auth(self, frame: str) -> None:
        if await self.wait_authenticated(self.pool.settings.auth_timeout):
            await self.send(frame)

    # -- publishing and fetching -----------------------------------------------------------

    def expect_ok(self, event_id: str) -> asyncio.Future[OkMessage]:
        """Register interest in the relay's ``OK`` for an event id."""
        future: asyncio.Future[OkMessage] = asyncio.get_running_loop().create_future()
        self.pending_ok.setdefault(event_id, []).append(future)
        return future

    def _forget_ok(self, event_id: str, future: asyncio.Future[OkMessage]) -> None:
        waiting = self.pending_ok.get(event_id)
        if waiting and future in waiting:
            waiting.remove(future)
            if not waiting:
                del self.pending_ok[event_id]

    async def wait_connected(self, deadline: float) -> bool:
        """Wait for a connection until the loop-time ``deadline``."""
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
            future = self.expect_ok(event.id)
            closed = self.closed
            try:
                if not await self.send(frame):
                    await asyncio.sleep(0.05)
                    continue
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return None
                waiters: set[asyncio.Future[Any]] = {future, closed}
                done, _ = await asyncio.wait(waiters, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            finally:
                self._forget_ok(event.id, future)
            if future in done:
                answer = future.result()
                if (not answer.accepted and answer.prefix == "auth-required" and not auth_retry_used
                        and self.pool.auth_signer is not None):
                    auth_retry_used = True
                    remaining = deadline - loop.time()
                    if await self.wait_authenticated(max(0.0, remaining)):
                        continue
                return answer
            if not done:
                return None
            # the connection dropped before an answer: wait for the next one and send again
        return None

    async def fetch(self, fetch_id: str, filters: list[Filter], wait_s: float) -> list[NostrEvent]:
        """Run a one-off REQ until EOSE (or CLOSED, or ``wait_s`` seconds); return what came."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        fetch = _Fetch(done=loop.create_future(), filters=filters)
        self.fetches[fetch_id] = fetch
        try:
            if not await self.wait_connected(deadline):
                return fetch.events
            await self.send(encode_req(fetch_id, filters))
            assert fetch.done is not None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(fetch.done), max(0.0, deadline - loop.time()))
            await self.send(encode_close(fetch_id))
            return fetch.events
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
        )


EventHandler = Callable[[ReceivedEvent], Awaitable[None]]
_Intake = tuple[NostrEvent, str, str, float]
"""An event waiting for the consumer: the event, its relay, its subscription, when it was taken in."""
LaneKey = Callable[[NostrEvent], str]


class RelayPool:
    """Connections to several relays, one stream of deduplicated, validated events.

    Use it as an async context manager (or call :meth:`start` / :meth:`stop`)::

        async with RelayPool(["wss://relay.example"], on_event=handle, store=store) as pool:
            await pool.subscribe("mentions", [{"kinds": [11, 1111], "#p": [agent_pubkey]}])
            await pool.publish(signed_reply)

    ``on_event`` is awaited once per new event, one at a time, in arrival order; a
    slow handler should hand work to its own tasks. When it returns, the event id
    is marked processed in the store; when it raises, the error is logged and the
    event may be delivered again by a later copy.
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
    ) -> None:
        """Describe the pool; nothing connects until :meth:`start`.

        ``lane_key`` maps an event to the key whose events must reach ``on_event`` in
        order (with ``settings.delivery_lanes`` > 1, different keys are delivered concurrently).
        """
        self.specs = [r if isinstance(r, RelaySpec) else RelaySpec(r) for r in relays]
        urls = [s.url for s in self.specs]
        if len(set(urls)) != len(urls):
            raise ValueError("a relay url is listed twice")
        self.on_event = on_event
        self.store = store
        self.auth_signer = auth_signer
        self.settings = settings or PoolSettings()
        if self.settings.delivery_lanes < 1:
            raise ValueError("delivery_lanes must be at least 1")
        self.lane_key = lane_key
        self.key_cache = PublicKeyCache()
        self.subscriptions: dict[str, _Subscription] = {}
        self._relays: dict[str, _Relay] = {}
        self.seen = SeenIds(self.settings.seen_cache_size)
        self._queue: asyncio.Queue[_Intake] | None = None
        self._lane_tasks: set[asyncio.Task[None]] = set()
        self._cursors: dict[tuple[str, str], int] = {}
        self._dirty_cursors: set[tuple[str, str]] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._delivery_task: asyncio.Task[None] | None = None
        self._flush_task: asyncio.Task[None] | None = None
        self._fetch_ids = itertools.count(1)
        self._started = False
        self.delivered = 0
        self.duplicates = 0
        self.consumer_errors = 0

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
        self._queue = asyncio.Queue(self.settings.intake_queue_size)
        for spec in self.specs:
            relay = _Relay(spec, self)
            self._relays[spec.url] = relay
            relay.task = asyncio.create_task(relay.run(), name=f"relay {spec.url}")
        self._delivery_task = asyncio.create_task(self._deliver_loop(), name="nostr delivery")
        self._flush_task = asyncio.create_task(self._flush_loop(), name="nostr cursor flush")

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
        if self._queue is not None and self._delivery_task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._queue.join(), self.settings.drain_timeout)
        own = [t for t in (self._delivery_task, self._flush_task, *self._lane_tasks, *self._tasks) if t]
        for task in own:
            task.cancel()
        await asyncio.gather(*own, return_exceptions=True)
        self._tasks.clear()
        self._lane_tasks.clear()
        await self._flush_cursors()

    def spawn(self, coro: Awaitable[Any], name: str) -> None:
        """Run a tracked background task; its exception is logged, it is cancelled on stop."""

        async def guarded() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("background task failed", task=name)

        task = asyncio.create_task(guarded(), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- subscriptions ---------------------------------------------------------------------

    async def subscribe(self, sub_id: str, filters: Sequence[Filter]) -> None:
        """Add (or replace) a live subscription on every readable relay.

        Its cursor is loaded from the store, so after a restart only what may have
        been missed is asked for.
        """
        if not 0 < len(sub_id) <= 64:
            raise ValueError("a subscription id must be 1 to 64 characters")
        if sub_id.startswith("fetch-"):
            raise ValueError("subscription ids starting with 'fetch-' are reserved")
        sub = _Subscription(sub_id, [dict(f) for f in filters])
        if self.store is not None:
            for spec in self.specs:
                stored = await self.store.get_meta(_cursor_key(sub_id, spec.url))
                if stored is not None and stored.isdigit():
                    key = (sub_id, spec.url)
                    self._cursors[key] = max(self._cursors.get(key, 0), int(stored))
        self.subscriptions[sub_id] = sub
        for relay in self._relays.values():
            if relay.spec.read:
                await relay.send_req(sub)

    async def unsubscribe(self, sub_id: str) -> None:
        """Close a subscription on every relay."""
        if self.subscriptions.pop(sub_id, None) is None:
            return
        for relay in self._relays.values():
            await relay.send(encode_close(sub_id))

    def filters_with_cursor(self, sub: _Subscription, url: str) -> list[Filter]:
        """Return the filters with ``since`` moved up to this relay's cursor minus the window."""
        cursor = self._cursors.get((sub.sub_id, url))
        if cursor is None:
            return sub.filters
        since = max(0, cursor - self.settings.since_window)
        return [{**f, "since": max(int(f.get("since", 0)), since)} for f in sub.filters]

    def cursor(self, sub_id: str, url: str) -> int | None:
        """Return the last accepted ``created_at`` for a subscription on a relay."""
        return self._cursors.get((sub_id, url))

    def _advance_cursor(self, sub_id: str, url: str, created_at: int) -> None:
        # An event dated in the future must not push the cursor past now.
        created_at = min(created_at, int(time.time()))
        key = (sub_id, url)
        if created_at > self._cursors.get(key, -1):
            self._cursors[key] = created_at
            self._dirty_cursors.add(key)

    async def _flush_cursors(self) -> None:
        if self.store is None:
            self._dirty_cursors.clear()
            return
        dirty, self._dirty_cursors = self._dirty_cursors, set()
        for sub_id, url in dirty:
            await self.store.set_meta(_cursor_key(sub_id, url), str(self._cursors[(sub_id, url)]))

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.cursor_flush_interval)
            try:
                await self._flush_cursors()
            except Exception:
                log.exception("cursor flush failed")

    # -- intake and delivery ---------------------------------------------------------------

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

    async def _deliver_loop(self) -> None:
        assert self._queue is not None
        queue = self._queue
        lanes = self.settings.delivery_lanes
        if lanes > 1 and self.lane_key is not None:
            await self._deliver_in_lanes(queue, lanes, self.lane_key)
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
        held = asyncio.Semaphore(self.settings.intake_queue_size)  # bounds the backlogs

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
            task = asyncio.create_task(drain_key(key), name=f"nostr delivery {key[:16]}")
            self._lane_tasks.add(task)
            task.add_done_callback(self._lane_tasks.discard)

    async def _deliver(self, event: NostrEvent, url: str, sub_id: str, received_at: float) -> None:
        if self.store is not None and await self.store.is_processed(event.id):
            self.duplicates += 1
            self._advance_cursor(sub_id, url, event.created_at)
            return
        if self.on_event is not None:
            try:
                await self.on_event(ReceivedEvent(event, url, sub_id, received_at))
            except Exception:
                self.consumer_errors += 1
                self.seen.discard(event.id)
                log.exception("event handler failed", event_id=event.id, kind=event.kind)
                return
        if self.store is not None:
            await self.store.mark_processed(event.id)
        self.delivered += 1
        self._advance_cursor(sub_id, url, event.created_at)

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
        tasks = {asyncio.create_task(r.publish(event, deadline), name=f"publish {r.url}"): r.url
                 for r in writers}
        accepted: list[str] = []
        rejected: dict[str, str] = {}
        timed_out: list[str] = []
        pending = set(tasks)
        while pending and not accepted:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                url = tasks[task]
                try:
                    answer = task.result()
                except Exception as exc:
                    rejected[url] = f"error: {type(exc).__name__}"
                    continue
                if answer is None:
                    timed_out.append(url)
                elif answer.is_success:
                    accepted.append(url)
                else:
                    rejected[url] = answer.message
        for task in pending:
            self.spawn(self._finish_publish(event.id, tasks[task], task), f"publish tail {tasks[task]}")
        result = PublishResult(
            event.id, tuple(accepted), rejected, tuple(timed_out), tuple(tasks[t] for t in pending)
        )
        if accepted:
            log.debug("published", event_id=event.id, kind=event.kind, accepted_by=accepted)
        else:
            log.warning("publish failed", event_id=event.id, rejected=rejected, timed_out=timed_out)
            if raise_on_failure:
                raise PublishError(result)
        return result

    @staticmethod
    async def _finish_publish(event_id: str, url: str, task: asyncio.Task[OkMessage | None]) -> None:
        try:
            answer = await task
        except asyncio.CancelledError:
            task.cancel()
            raise
        if answer is None:
            log.info("relay did not answer a publish", relay=url, event_id=event_id)
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
        wait = self.settings.fetch_timeout if timeout is None else timeout
        readers = [r for r in self._relays.values() if r.spec.read]
        fetch_id = f"fetch-{next(self._fetch_ids)}"
        results = await asyncio.gather(
            *(r.fetch(fetch_id, [dict(f) for f in filters], wait) for r in readers),
            return_exceptions=True,
        )
        by_id: dict[str, NostrEvent] = {}
        for result in results:
            if isinstance(result, BaseException):
                log.warning("fetch failed", error=repr(result))
                continue
            for event in result:
                by_id.setdefault(event.id, event)
        return sorted(by_id.values(), key=lambda e: (-e.created_at, e.id))

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
        return PoolHealth(
            relays, self.delivered, self.duplicates, self.consumer_errors,
            self._queue.qsize() if self._queue is not None else 0, dict(rejects),
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


class RelayEventResolver:
    """Finds the event a ``note`` / ``nevent`` / ``naddr`` points at: the store first, then the relays.

    Implements :class:`~tenex_daemon.core.ports.EventResolver`.
    """

    def __init__(
        self, pool: RelayPool, *, store: _EventFinder | None = None, timeout: float = 5.0
    ) -> None:
        """Resolve through ``pool`` (and ``store.find_event`` first, when given)."""
        self.pool = pool
        self.store = store
        self.timeout = timeout

    async def resolve(self, entity: Entity) -> NostrEvent | None:
        """Return the referenced event, or None when it cannot be found in time."""
        if entity.kind_name in ("note", "nevent"):
            if self.store is not None:
                found = await self.store.find_event(entity.value)
                if found is not None:
                    return found[1]
            return await self.pool.fetch_event(entity.value, timeout=self.timeout)
        if entity.kind_name == "naddr" and entity.author is not None and entity.kind is not None:
            events = await self.pool.fetch(
                [{"kinds": [entity.kind], "authors": [entity.author], f"#{TAG_IDENTIFIER}": [entity.value]}],
                timeout=self.timeout,
            )
            matching = [e for e in events if e.tag_value(TAG_IDENTIFIER) == entity.value]
            return matching[0] if matching else None
        return None


class _EventFinder(Protocol):
    async def find_event(self, event_id: str) -> tuple[str, NostrEvent] | None:
        """Return (conversation id, event) for a stored event id."""


__all__ = [
    "CURSOR_META_PREFIX",
    "PoolHealth",
    "PoolSettings",
    "PoolStore",
    "PublishError",
    "PublishResult",
    "ReceivedEvent",
    "RelayEventResolver",
    "RelayHealth",
    "RelayPool",
    "RelaySpec",
    "RelayState",
    "SeenIds",
    "backoff_delay",
]
