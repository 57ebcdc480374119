"""A bounded number of places shared fairly between parties (the runs' places, shared between people).

A semaphore hands a freed place to whoever asked first. For the runs that meant one person's flood (two
dozen conversations opened at once, each a slow run) took every place and then every place that came
free, and the owner's message waited behind all of them (59 s in an audit's probe, with 24 slow runs).
Here a freed place goes to the party holding the fewest places, among equals the one served longest ago
(never before counts as longest), then the one that asked first: the owner's run takes the next place
that comes free, and parties take turns, while the flood still uses every place nobody else asks for.
Nobody is capped, and within one party places go first come, first served.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter, deque
from types import TracebackType


class FairSlots:
    """At most ``size`` holders at once; a freed place goes to the waiting party that holds the fewest,
    among equals the one served longest ago, then the longest waiting."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"size must be at least 1, not {size}")
        self._size = size
        self._in_use = 0
        self._held: Counter[str] = Counter()
        self._waiting: dict[str, deque[tuple[int, asyncio.Future[None]]]] = {}
        self._order = itertools.count()
        self._served: dict[str, int] = {}
        """When each party holding or waiting for a place was last given one (by :attr:`_order`)."""

    @property
    def in_use(self) -> int:
        """The places held now."""
        return self._in_use

    def held_by(self, party: str) -> int:
        """The places ``party`` holds now."""
        return self._held[party]

    def hold(self, party: str) -> _Held:
        """Hold a place for the block, as ``party`` (waiting for one when all are held)."""
        return _Held(self, party)

    async def _acquire(self, party: str) -> None:
        if self._in_use < self._size and not self._waiting:
            self._take(party)
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(party, deque()).append((next(self._order), granted))
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():  # given a place as it was cancelled: pass it on
                self._release(party)
            else:
                self._forget(party, granted)
            raise

    def _take(self, party: str) -> None:
        self._in_use += 1
        self._held[party] += 1
        self._served[party] = next(self._order)

    def _release(self, party: str) -> None:
        self._in_use -= 1
        self._held[party] -= 1
        if not self._held[party]:
            del self._held[party]
        self._hand_on()
        self._forget_idle(party)

    def _forget_idle(self, party: str) -> None:
        """Forget when ``party`` was served once it neither holds nor waits (the map stays small)."""
        if party not in self._held and party not in self._waiting:
            self._served.pop(party, None)

    def _forget(self, party: str, granted: asyncio.Future[None]) -> None:
        queue = self._waiting.get(party)
        if queue is None:
            return
        for entry in queue:
            if entry[1] is granted:
                queue.remove(entry)
                break
        if not queue:
            del self._waiting[party]
        self._hand_on()  # a place may have been free while only this waiter's party was ahead
        self._forget_idle(party)

    def _hand_on(self) -> None:
        """Give free places to waiters: fewest held first, then served longest ago, then longest waiting."""
        while self._in_use < self._size and self._waiting:
            party = min(
                self._waiting, key=lambda p: (self._held[p], self._served.get(p, -1), self._waiting[p][0][0])
            )
            queue = self._waiting[party]
            _, granted = queue.popleft()
            if not queue:
                del self._waiting[party]
            if granted.done():  # cancelled, its task not yet resumed to forget it
                self._forget_idle(party)
                continue
            self._take(party)
            granted.set_result(None)


class _Held:
    """A place held for an ``async with`` block (a plain context manager: one is taken per agent run)."""

    __slots__ = ("_party", "_slots")

    def __init__(self, slots: FairSlots, party: str) -> None:
        self._slots = slots
        self._party = party

    async def __aenter__(self) -> None:
        slots = self._slots
        if slots._in_use < slots._size and not slots._waiting:
            slots._take(self._party)
        else:
            await slots._acquire(self._party)

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._slots._release(self._party)
