"""The relay pool's values: settings, relay descriptions, received events, health snapshots, results."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final, Protocol

from tenex_daemon.core.errors import EventRefusedError, TenexError
from tenex_daemon.core.events import NostrEvent

from ..codec import DEFAULT_LIMITS, Limits

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
    max_message_bytes: int = 16 * 1024 * 1024
    """Hard websocket frame limit (``max_size``): a larger frame closes the connection, and the relay's
    subscriptions then ask ``since`` past that moment so the relay does not replay it. Frames under it
    reach the codec, whose limits (``limits.max_frame_chars``) reject them without a reconnect."""
    open_timeout: float = 10.0
    ping_interval: float | None = 20.0
    backoff_base: float = 0.5
    backoff_cap: float = 30.0
    stable_after: float = 10.0
    """A connection that stayed up this long resets the backoff."""
    since_window: int = 120
    """Seconds subtracted from the cursor when (re)subscribing; dedupe absorbs the overlap."""
    slow_clock_allowance: int = 3_600
    """Seconds before ``since_window`` a (re)subscription's ``since`` is at most (before now): relays apply
    ``since`` to live events too, so a message from a clock running that slow, sent after the REQ, is
    still heard."""
    publish_timeout: float = 10.0
    fetch_timeout: float = 5.0
    auth_timeout: float = 5.0
    seen_cache_size: int = 100_000
    intake_queue_size: int = 10_000
    delivery_lanes: int = 1
    """Keys delivered at once when the pool has a ``lane_key``; one key's events always go in order."""
    cursor_flush_interval: float = 1.0
    drain_timeout: float = 5.0
    retry_base: float = 1.0
    """First wait before handing an event whose consumer call raised to the consumer again (doubles)."""
    retry_cap: float = 60.0
    retry_capacity: int = 1_000
    """Failed events kept in memory for retry; past it the oldest is dropped (left to the relays)."""


class Remember(StrEnum):
    """What the consumer asks the pool to do with an event it handled (``None`` means ``DURABLY``)."""

    DURABLY = "durably"
    """Mark it processed in the store: never handed over again, across restarts."""
    IN_MEMORY = "in_memory"
    """Dedupe it in memory only (the bounded seen-id set): nothing written, e.g. a stranger's event."""


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
    oks_attributed: int = 0
    """``OK`` answers without an event id attributed to the EVENT they answer, since start (``.oks``)."""
    oks_unmatched: int = 0
    """``OK`` answers without an event id that could not be attributed, since start."""
    subscriptions_closed: int = 0
    """Live subscriptions the relay ended (``CLOSED``) while connected, since start (each is sent again)."""
    unserved: dict[str, tuple[float, str]] = field(default_factory=dict)
    """Per live subscription the relay ended and has not served since (no EOSE, no event): for how many
    seconds, and the relay's message."""

    def to_dict(self) -> dict[str, Any]:
        """Return the snapshot as JSON-ready data."""
        return {
            "url": self.url, "state": self.state.value, "read": self.read, "write": self.write,
            "connected_since": self.connected_since, "reconnects": self.reconnects,
            "last_event_at": self.last_event_at, "events_received": self.events_received,
            "rejects": dict(self.rejects), "notices": self.notices,
            "authenticated": self.authenticated, "last_error": self.last_error,
            "oks_attributed": self.oks_attributed, "oks_unmatched": self.oks_unmatched,
            "subscriptions_closed": self.subscriptions_closed,
            "unserved": {sub: {"for_s": s, "message": why} for sub, (s, why) in self.unserved.items()},
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
    retrying: int = 0
    """Events whose consumer call raised, kept for another try."""
    retries: int = 0
    """Consumer calls made again for such events, since start."""
    retry_dropped: int = 0
    """Failed events dropped from the retry set when it was full."""
    last_consumer_error: str | None = None

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
            "retrying": self.retrying, "retries": self.retries, "retry_dropped": self.retry_dropped,
            "last_consumer_error": self.last_consumer_error,
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

    @property
    def refused_for_good(self) -> bool:
        """Whether every relay asked refused the event for its size (:func:`refused_for_its_size`), none of
        them still pending or silent: the same event is never accepted there."""
        return (
            not self.accepted_by and not self.timed_out and not self.pending and bool(self.rejected)
            and all(refused_for_its_size(message) for message in self.rejected.values())
        )


REFUSED_FOR_GOOD = ("blocked:", "invalid:")
"""The NIP-01 ``OK false`` prefixes of refusals the relay will not change its mind on for this event."""
SIZE_WORDS = (
    "size", "too large", "too long", "too big", "exceeds", "characters should be enough for anybody",
)
"""Words of a refusal for the event's size; the last is PyPI nostr-relay's (``validators.is_not_too_large``:
``invalid: 280 characters should be enough for anybody``, sent with an empty event id, :mod:`.oks`)."""


def refused_for_its_size(message: str) -> bool:
    """Whether a relay's ``OK false`` message refuses the event for its size (``blocked: event size (70998
    bytes) exceeds maximum allowed size``, nostr-relay's ``invalid: 280 characters should be enough for
    anybody``): signed once, it stays too large. Other ``blocked:`` and ``invalid:`` refusals may pass
    later (an author the relay's operator lets in again, a clock set right), as ``rate-limited:`` and
    ``error:`` do: those events are tried again."""
    lowered = message.lower()
    return lowered.startswith(REFUSED_FOR_GOOD) and any(word in lowered for word in SIZE_WORDS)


class PublishError(TenexError):
    """No relay accepted an event before the timeout."""

    def __init__(self, result: PublishResult) -> None:
        parts = [f"{url}: {msg}" for url, msg in result.rejected.items()]
        parts += [f"{url}: no answer" for url in result.timed_out]
        super().__init__(f"no relay accepted event {result.event_id} ({'; '.join(parts) or 'no relay'})")
        self.result = result

    @staticmethod
    def of(result: PublishResult) -> PublishError:
        """The error for ``result``: :class:`RefusedForGoodError` when every relay refused it for good."""
        return RefusedForGoodError(result) if result.refused_for_good else PublishError(result)


class RefusedForGoodError(PublishError, EventRefusedError):
    """Every relay refused the event for good (:attr:`PublishResult.refused_for_good`)."""

    def __init__(self, result: PublishResult) -> None:
        super().__init__(result)
        self.reasons = tuple(result.rejected.values())


EventHandler = Callable[[ReceivedEvent], Awaitable["Remember | None"]]
"""The pool's consumer: awaited once per new event; it may say how the event is remembered."""
LaneKey = Callable[[NostrEvent], str]
"""Maps an event to the key whose events must reach the consumer in order."""
ConnectHandler = Callable[[str], None]
"""Told a relay's URL each time it (re)connects."""
Spawn = Callable[[Coroutine[Any, Any, Any], str], None]
"""Runs a named, tracked background task (the pool's :meth:`~RelayPool.spawn`)."""
