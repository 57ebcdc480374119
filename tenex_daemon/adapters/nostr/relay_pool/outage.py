"""A relay connection's pacing of its reconnects: the backoff after a failure, its failures since it was
last up (logged sparingly: a relay down for months writes a warning every :data:`DOWN_LOG_EVERY_S`, not a
line at each reconnect try), and the pause before a connection closed on purpose is opened again."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from typing import Any

from .types import PoolSettings


def backoff_delay(
    attempt: int, base: float, cap: float, rng: Callable[[float, float], float] = random.uniform
) -> float:
    """Return the wait before reconnect ``attempt`` (0-based): ``base * 2**attempt`` capped, jittered.

    The jitter draws from the upper half (``[d/2, d]``) so relays that dropped
    together do not reconnect in lockstep, while the wait still grows.
    """
    delay = min(cap, base * (2 ** min(attempt, 60)))
    return rng(delay / 2, delay)


DOWN_LOG_EVERY_S = 600.0
"""How often a relay that stays down is logged again (``relay still unreachable``, a warning)."""


class Outage:
    """The tries that failed since the relay was last up (``log``: the connection's bound logger)."""

    def __init__(self, log: Any) -> None:
        self._log = log
        self.since: float | None = None
        """When (monotonic) a connection first failed since the relay was last up; None while up."""
        self.tries = 0
        self._logged = 0.0

    def failed(self, error: str | None, retry_in: float) -> None:
        """A connection failed or dropped: the first since the relay was up is logged at info, the next ones
        at debug, and while it stays down a warning every :data:`DOWN_LOG_EVERY_S`."""
        now = time.monotonic()
        self.tries += 1
        if self.since is None:
            self.since = self._logged = now
            self._log.info("relay disconnected", error=error, retry_in=round(retry_in, 2))
        elif now - self._logged >= DOWN_LOG_EVERY_S:
            self._logged = now
            self._log.warning(
                "relay still unreachable", down_s=round(now - self.since), tries=self.tries, error=error
            )
        else:
            self._log.debug("relay disconnected", error=error, retry_in=round(retry_in, 2))

    def ended(self) -> dict[str, Any]:
        """The relay is up again: how long it was down and the tries that failed (for its log line)."""
        down_s = None if self.since is None else round(time.monotonic() - self.since, 1)
        ended = {"down_s": down_s, "failed_tries": self.tries}
        self.since, self.tries = None, 0
        return ended


class Renewals:
    """Connections closed on purpose to be opened again at once (a refusal that slows the connection it
    came on): the first is opened again at once, but each within ``stable_after`` seconds of the one before
    waits a backoff that grows, so a relay that refuses all we send is not reconnected to (and subscribed
    to again) per event."""

    def __init__(self, settings: PoolSettings) -> None:
        self._settings = settings
        self._streak = 0
        self._last = -math.inf

    def pause(self) -> float:
        """A connection is renewed now: the seconds to wait before opening the next. The streak ends only
        once a connection stayed ``stable_after`` seconds after its pause without being renewed."""
        settings, now = self._settings, time.monotonic()
        self._streak = self._streak + 1 if now - self._last < settings.stable_after else 0
        pause = 0.0
        if self._streak:
            pause = backoff_delay(self._streak - 1, settings.backoff_base, settings.backoff_cap)
        self._last = now + pause  # when the next connection opens: a long pause is no stable connection
        return pause
