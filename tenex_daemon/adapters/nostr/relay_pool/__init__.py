"""The relay pool: several Nostr relays over ``websockets``, one reader task per relay.

Its parts: :mod:`.connection` (one relay's socket, auth, backoff), :mod:`.stored` (a subscription's
stored events, held to be taken in oldest first), :mod:`.delivery` (the intake
queue, deduplication and delivery lanes), :mod:`.subscriptions` (live subscriptions and their
cursors), :mod:`.resolver` (finding referenced events), :mod:`.types` (settings and health data)
and :mod:`.pool` (the pool that ties them together).

What it guarantees:

- A reader task never awaits an ``OK``: ``OK`` frames resolve futures that
  publishers wait on, so a publish can never deadlock the socket loop.
- Each relay reconnects with capped, jittered exponential backoff; subscriptions
  are re-sent with ``since`` = the last accepted ``created_at`` from that relay
  minus a safety window (never later than now minus the window and
  ``slow_clock_allowance``: relays apply ``since`` to live events too). The cursor
  is kept in the store (``set_meta``), so a restarted daemon asks only for what it
  may have missed.
- Each event reaches the consumer once: an in-memory LRU drops copies from other
  relays while the first is in flight, and the store's processed set
  (``is_processed``) drops anything handled before a restart. After the consumer
  returns, the id is marked processed.
- A subscription's stored events (before its EOSE, and its catch-up's pages), which
  relays send newest first, are taken in oldest first; live events as they come.
- Delivery is in arrival order, one event at a time, unless ``delivery_lanes`` > 1
  and a ``lane_key`` is given: then events with different keys (a daemon uses the
  conversation) are delivered concurrently and events with the same key in order.
- NIP-42: a challenge is answered as soon as it arrives; a ``CLOSED`` or ``OK``
  with ``auth-required:`` makes the pool re-send that ``REQ`` or ``EVENT`` once,
  after authenticating.
- A publish goes to every writable relay and is done when one answers ``OK true``
  (``duplicate:`` counts as success); relays that never answer time out. An ``OK``
  with an empty id (nostr-relay's refusals) is attributed to its EVENT by deduction
  (:mod:`.oks`); one that cannot be is counted and logged (``ok_unmatched``).
- Health (state, connected since, reconnects, last event, rejects by reason) is
  plain data: :meth:`RelayPool.health`.
- Each frame read is acknowledged at once (Linux ``TCP_QUICKACK``). A relay that writes
  small frames without ``TCP_NODELAY`` (nostr-sdk's LocalRelay) holds its next frame until
  the last one is acknowledged; a delayed ACK would make that up to 40 ms per frame (an
  ``OK`` followed by an event, or two events in a row).
"""

from .connection import RelayConnection
from .delivery import SeenIds
from .outage import backoff_delay
from .pool import RelayPool
from .resolver import RelayEventResolver
from .types import (
    CURSOR_META_PREFIX,
    EventHandler,
    Filter,
    LaneKey,
    PoolHealth,
    PoolSettings,
    PoolStore,
    PublishError,
    PublishResult,
    ReceivedEvent,
    RelayHealth,
    RelaySpec,
    RelayState,
    Remember,
)

__all__ = [
    "CURSOR_META_PREFIX",
    "EventHandler",
    "Filter",
    "LaneKey",
    "PoolHealth",
    "PoolSettings",
    "PoolStore",
    "PublishError",
    "PublishResult",
    "ReceivedEvent",
    "RelayConnection",
    "RelayEventResolver",
    "RelayHealth",
    "RelayPool",
    "RelaySpec",
    "RelayState",
    "Remember",
    "SeenIds",
    "backoff_delay",
]
