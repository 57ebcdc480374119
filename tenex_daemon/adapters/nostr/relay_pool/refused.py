"""The live subscriptions a relay ended with ``CLOSED`` while its connection stayed up: each REQ sent again
after a backoff, and since when each has gone unserved, so that ``tenexd status`` can say that a connected
relay hears nothing for the daemon (a relay that refuses its subscriptions is as deaf as one down)."""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from typing import Any

from .outage import backoff_delay
from .types import PoolSettings, Spawn

CLOSED_FOR_GOOD = ("blocked", "invalid", "restricted", "unsupported")
"""``CLOSED`` prefixes a relay is unlikely to change its mind on soon: the REQ is sent again after a longer
wait (:data:`CLOSED_FOR_GOOD_FACTOR` times the reconnect backoff)."""
CLOSED_FOR_GOOD_FACTOR = 10

Resend = Callable[[str, int, float], Coroutine[Any, Any, None]]
"""Sends a subscription's REQ again: (its id, the connection number it was ended on, after how long)."""


class ClosedSubscriptions:
    """One connection's subscriptions the relay ended: their REQs' backoff, and which still go unserved."""

    def __init__(
        self, settings: PoolSettings, log: Any, spawn: Spawn, url: str, resend: Resend,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._log = log
        self._spawn = spawn
        self._url = url
        self._resend_req = resend
        self._clock = clock
        self.resubscribes: dict[str, tuple[int, float]] = {}
        """Per live subscription the relay ended with ``CLOSED`` on this connection: its REQs sent again
        since, and when the last was (monotonic): the backoff grows unless the subscription stays up."""
        self.resubscribing: set[tuple[str, int]] = set()
        """(subscription id, connection number) of each REQ waiting out its backoff to be sent again."""
        self.unserved: dict[str, tuple[float, str]] = {}
        """Per subscription ended by the relay and neither answered (EOSE) nor sent an event since: since when
        (monotonic), and the relay's message."""
        self.total = 0
        """``CLOSED`` answers to live subscriptions, since start."""

    def reconnected(self) -> None:
        """A new connection: the backoff of REQs sent again starts over."""
        self.resubscribes.clear()

    def closed(self, sub_id: str, prefix: str, reason: str, connection: int) -> None:
        """The relay ended a live subscription while the connection stays up: send its REQ again (from its
        cursor, as a reconnect does) after a backoff that grows with each ``CLOSED`` on this connection,
        unless the subscription stayed up ``stable_after`` seconds; longer for refusals unlikely to change
        soon (:data:`CLOSED_FOR_GOOD`)."""
        self.total += 1
        now = self._clock()
        since, _ = self.unserved.get(sub_id, (now, ""))
        self.unserved[sub_id] = (since, reason[:300])
        waiting = (sub_id, connection)
        if waiting in self.resubscribing:
            return
        settings = self._settings
        attempt, last = self.resubscribes.get(sub_id, (0, 0.0))
        if now - last >= settings.stable_after:
            attempt = 0
        self.resubscribes[sub_id] = (attempt + 1, now)
        base, cap = settings.backoff_base, settings.backoff_cap
        if prefix in CLOSED_FOR_GOOD:
            base, cap = base * CLOSED_FOR_GOOD_FACTOR, cap * CLOSED_FOR_GOOD_FACTOR
        delay = backoff_delay(attempt, base, cap)
        self._log.warning("subscription closed by relay; re-sending it later", subscription=sub_id,
                          message=reason[:300], retry_in=round(delay, 2))
        self.resubscribing.add(waiting)
        self._spawn(self._resend(waiting, delay), f"resubscribe {self._url}")

    async def _resend(self, waiting: tuple[str, int], delay: float) -> None:
        try:
            await self._resend_req(*waiting, delay)
        finally:
            self.resubscribing.discard(waiting)

    def served(self, sub_id: str) -> None:
        """The relay answered the subscription (EOSE) or sent an event on it: it serves it again."""
        if self.unserved:
            self.unserved.pop(sub_id, None)

    def unserved_s(self) -> dict[str, tuple[float, str]]:
        """Per subscription the relay ended and has not served since: for how many seconds, and why."""
        now = self._clock()
        return {sub_id: (round(now - since, 3), why) for sub_id, (since, why) in self.unserved.items()}
