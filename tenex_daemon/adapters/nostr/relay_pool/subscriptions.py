"""The pool's live subscriptions and their cursors: per subscription and relay, the last accepted
``created_at``, kept in the store so a restarted daemon asks only for what it may have missed."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from .types import CURSOR_META_PREFIX, Filter, PoolStore

MAX_LEFT = 1_000
"""Events given up on (dropped from a full retry set) whose relay copy, handed over later, lets their cursor
move on; past it the oldest stops its cursor for the rest of the run (the next start asks for it again)."""

@dataclass
class Subscription:
    """A live subscription: its id and the filters it was made with."""

    sub_id: str
    filters: list[Filter]
    lookback_s: int = 0
    """Seconds asked for before the cursor beyond the window (events dated in the past)."""


def cursor_key(sub_id: str, url: str) -> str:
    """The store meta key of a subscription's cursor on a relay (:data:`ANY_RELAY`: on the relays it had)."""
    return f"{CURSOR_META_PREFIX}:{sub_id}:{url}"


ANY_RELAY = "*"
"""The "url" of a subscription's cursor that no relay is named by: the oldest of its relays' cursors, kept
at each flush, where the subscription starts from when none of the relays it is asked of now has a cursor
(every relay of the settings replaced): not from their whole history, whose old messages would be answered
as new."""


class Subscriptions:
    """Live subscriptions by id, and their cursors per relay (moved up as events are accepted)."""

    def __init__(self, since_window: int, *, slow_clock_allowance: int = 0) -> None:
        """``since_window``: seconds subtracted from a cursor when (re)subscribing; ``slow_clock_allowance``:
        seconds further back that a (re)subscription's ``since`` is at most from now (:meth:`filters_for`)."""
        self._since_window = since_window
        self._slow_clock_allowance = slow_clock_allowance
        self._subs: dict[str, Subscription] = {}
        self._closed: set[str] = set()
        """Ids of subscriptions closed by this pool (the daemon's few, named by it: not a growing set)."""
        self._cursors: dict[tuple[str, str], int] = {}
        self._dirty: set[tuple[str, str]] = set()
        self._held_at: dict[tuple[str, str], int] = {}
        """Cursors held until a catch-up is complete -> the newest ``created_at`` accepted meanwhile (-1:
        none yet), where each moves once released."""
        self._pins: dict[tuple[str, str], dict[str, int]] = {}
        """Cursors pinned by events taken in through them that wait for a retry: event id -> ``created_at``.
        A pinned cursor does not pass the oldest (a restart asks for it again); the newest ``created_at``
        accepted meanwhile is in ``_pinned_newest``, where it moves once the last pin goes."""
        self._pinned_newest: dict[tuple[str, str], int] = {}
        self._left: dict[tuple[str, str], dict[str, int]] = {}
        """Cursors that pass no event given up on (left to the relays and the next start) until a relay's
        copy of it is handed over (:meth:`handed_over`): event id -> ``created_at``."""
        self._left_key: dict[str, set[tuple[str, str]]] = {}
        """The cursors each event in ``_left`` stops (its copies from several relays may each have been left;
        at most :data:`MAX_LEFT` events)."""
        self._left_at: dict[tuple[str, str], int] = {}
        """Cursors that pass, for the rest of this run, no event left past :data:`MAX_LEFT`: the oldest's
        date (the next start asks for it again)."""
        self._floors: dict[str, int] = {}
        """Per relay url: a ``since`` no REQ to it goes below (set past a frame too big to read)."""
        self._formerly: dict[str, int] = {}
        """Per subscription none of whose relays has a cursor: the one it had on its relays before
        (:data:`ANY_RELAY`)."""

    def get(self, sub_id: str) -> Subscription | None:
        """The live subscription with this id, or None."""
        return self._subs.get(sub_id)

    def live(self) -> list[Subscription]:
        """Every live subscription (a copy: safe to iterate while subscribing)."""
        return list(self._subs.values())

    async def add(self, sub: Subscription, urls: Iterable[str], store: PoolStore | None) -> None:
        """Add (or replace) a subscription, first loading its stored cursor for each relay url."""
        if store is not None:
            for url in urls:
                stored = await store.get_meta(cursor_key(sub.sub_id, url))
                if stored is not None and stored.isdigit():
                    key = (sub.sub_id, url)
                    self._cursors[key] = max(self._cursors.get(key, 0), int(stored))
            loaded = [at for (sub_id, _), at in self._cursors.items() if sub_id == sub.sub_id]
            formerly = await store.get_meta(cursor_key(sub.sub_id, ANY_RELAY))
            if not loaded and formerly is not None and formerly.isdigit():
                self._formerly[sub.sub_id] = int(formerly)
            elif loaded and formerly is None:  # a home from before the key: kept now, not at a first event
                await store.set_meta(cursor_key(sub.sub_id, ANY_RELAY), str(min(loaded)))
        self._subs[sub.sub_id] = sub

    def remove(self, sub_id: str) -> bool:
        """Drop a subscription; return whether it was live. Its id is remembered as closed: a relay's events
        for it sent before it read the CLOSE are expected, not refused (:meth:`was_closed`)."""
        self._closed.add(sub_id)
        return self._subs.pop(sub_id, None) is not None

    def was_closed(self, sub_id: str) -> bool:
        """Whether this id was a live subscription of this pool, closed since (by the pool itself)."""
        return sub_id in self._closed and sub_id not in self._subs

    def filters_for(self, sub: Subscription, url: str) -> list[Filter]:
        """Return the filters with ``since`` moved up to this relay's cursor minus the window. A relay
        without a cursor of its own (one added to the settings) starts from the oldest cursor the
        subscription has on the others: not from its whole history, whose old messages would be answered
        as new. No ``since`` counts past now, neither a cursor, a floor nor a filter's own: one dated ahead
        (set while the clock ran fast, then stepped back) would leave every message until then unasked.

        Nor does one from a cursor come closer to now than the window and the slow-clock allowance: relays
        apply ``since`` to live events too, so a message dated before it (its sender's clock running more
        than the window slow), sent after the REQ, was never heard: the relay dropped it, and the REQs after
        it ask from newer cursors. The stored events of that allowance are asked again each time (the
        dedupe of stored ids drops them)."""
        now = int(time.time())
        cursor = self.starts_from(sub.sub_id, url)
        floor = self._floors.get(url)
        since = 0
        if cursor is not None:
            since = max(0, min(cursor, now) - self._since_window - sub.lookback_s)
            since = min(since, max(0, now - self._since_window - self._slow_clock_allowance))
        since = max(since, min(floor or 0, now))
        asked: list[Filter] = []
        for flt in sub.filters:
            own = flt.get("since")
            if cursor is None and floor is None and own is None:
                asked.append(flt)
            else:
                asked.append({**flt, "since": max(min(int(own or 0), now), since)})
        return asked

    def starts_from(self, sub_id: str, url: str) -> int | None:
        """The cursor a REQ to ``url`` is asked from: the relay's own, else the oldest the subscription has on
        the others (a relay added to the settings), else the one it had on the relays it was asked of before
        (every relay replaced, :data:`ANY_RELAY`); None for a new home's first subscription."""
        cursor = self._cursors.get((sub_id, url))
        if cursor is None:
            others = [at for (sub, _), at in self._cursors.items() if sub == sub_id]
            formerly = self._formerly.get(sub_id)  # a new relay that has a cursor now must not hide it
            cursor = min([*others, *(() if formerly is None else (formerly,))], default=None)
        return cursor

    def skip_past(self, url: str, moment: float) -> int:
        """Make every later REQ to ``url`` ask ``since`` after ``moment`` (for this run); return it.

        What that relay dated earlier and has not sent yet is then not asked of it again: other
        relays still deliver it. Used when the relay sent a frame over the websocket limit, which
        it would otherwise replay on every resubscription (docs/PROTOCOL.md, "Relays").
        """
        floor = int(moment) + 1
        self._floors[url] = max(self._floors.get(url, 0), floor)
        return self._floors[url]

    def cursor(self, sub_id: str, url: str) -> int | None:
        """Return the last accepted ``created_at`` for a subscription on a relay."""
        return self._cursors.get((sub_id, url))

    def hold(self, sub_id: str, url: str) -> None:
        """Keep a cursor where it is (events accepted meanwhile are remembered) until :meth:`release`."""
        self._held_at.setdefault((sub_id, url), -1)

    def release(self, sub_id: str, url: str) -> None:
        """A catch-up is complete: the cursor moves to the newest event accepted while it was held."""
        newest = self._held_at.pop((sub_id, url), -1)
        if newest >= 0:
            self.advance(sub_id, url, newest)

    def is_held(self, sub_id: str, url: str) -> bool:
        """Whether the cursor waits for a catch-up to complete."""
        return (sub_id, url) in self._held_at

    def pin(self, sub_id: str, url: str, event_id: str, created_at: int) -> None:
        """An event taken in through this cursor waits for a retry: the cursor does not pass its
        ``created_at`` until :meth:`unpin`, so a restart meanwhile asks the relay for it again."""
        self._pins.setdefault((sub_id, url), {})[event_id] = created_at

    def unpin(self, sub_id: str, url: str, event_id: str, *, left: bool = False) -> None:
        """The event no longer waits for a retry: the cursor moves toward the newest event accepted meanwhile,
        up to the oldest pin left (all the way once none is). ``left``: it was given up on (left to the
        relays and the next start), so for the rest of this run the cursor does not pass it either."""
        key = (sub_id, url)
        pins = self._pins.get(key)
        created_at = None if pins is None else pins.pop(event_id, None)
        if pins is None or created_at is None:
            return
        if left:
            self._leave(key, event_id, created_at)
        if pins:
            newest = self._pinned_newest.get(key, -1)
        else:
            del self._pins[key]
            newest = self._pinned_newest.pop(key, -1)
        if newest >= 0:
            self.advance(sub_id, url, newest)

    def _leave(self, key: tuple[str, str], event_id: str, created_at: int) -> None:
        self._left.setdefault(key, {})[event_id] = created_at
        self._left_key.setdefault(event_id, set()).add(key)
        if len(self._left_key) > MAX_LEFT:  # the oldest left stops its cursors for the rest of the run
            oldest = next(iter(self._left_key))
            for oldest_key in self._left_key.pop(oldest):
                at = self._unleave(oldest_key, oldest)
                self._left_at[oldest_key] = min(at, self._left_at.get(oldest_key, at))

    def _unleave(self, key: tuple[str, str], event_id: str) -> int:
        """Take ``event_id`` out of ``key``'s left events; return its ``created_at``."""
        left = self._left[key]
        at = left.pop(event_id)
        if not left:
            del self._left[key]
        return at

    def handed_over(self, event_id: str) -> None:
        """An event was handed over for good: if it was left (:meth:`unpin`), a relay sent it again and each
        cursor it stopped moves on (to the newest event accepted meanwhile, up to what still stops it)."""
        for key in self._left_key.pop(event_id, ()):
            self._unleave(key, event_id)
            if self._pins.get(key) or key in self._left or key in self._left_at:
                newest = self._pinned_newest.get(key, -1)
            else:
                newest = self._pinned_newest.pop(key, -1)
            if newest >= 0:
                self.advance(*key, newest)

    def advance(self, sub_id: str, url: str, created_at: int) -> None:
        """Move a cursor up to an accepted event's ``created_at`` (never past now; a held one later; a pinned
        one no further than its oldest pin). One left ahead of now (the clock stepped back) comes back to
        now."""
        # An event dated in the future must not push the cursor past now.
        now = int(time.time())
        created_at = min(created_at, now)
        key = (sub_id, url)
        if self._cursors.get(key, -1) > now:
            self._cursors[key] = now
            self._dirty.add(key)
        if key in self._held_at:
            self._held_at[key] = max(created_at, self._held_at[key])
            return
        pins, left, left_at = self._pins.get(key), self._left.get(key), self._left_at.get(key)
        if pins or left or left_at is not None:  # most cursors have none: nothing is built for them
            stops = (*(pins.values() if pins else ()), *(left.values() if left else ()))
            ceiling = min([*stops, *(() if left_at is None else (left_at,))])
            self._pinned_newest[key] = max(created_at, self._pinned_newest.get(key, -1))
            created_at = min(created_at, ceiling)
        if created_at > self._cursors.get(key, -1):
            self._cursors[key] = created_at
            self._dirty.add(key)

    async def flush(self, store: PoolStore | None) -> None:
        """Write the cursors moved since the last flush to the store."""
        if store is None:
            self._dirty.clear()
            return
        dirty, self._dirty = self._dirty, set()
        for sub_id, url in dirty:
            await store.set_meta(cursor_key(sub_id, url), str(self._cursors[(sub_id, url)]))
        for sub_id in {sub_id for sub_id, _ in dirty}:  # where it starts should its relays all be replaced
            oldest = min(at for (sub, _), at in self._cursors.items() if sub == sub_id)
            await store.set_meta(cursor_key(sub_id, ANY_RELAY), str(oldest))
