"""A relay connection's failures since it was last up, logged sparingly: a relay down for months writes a
warning every :data:`DOWN_LOG_EVERY_S`, not a line at each reconnect try."""

from __future__ import annotations

import time
from typing import Any

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
