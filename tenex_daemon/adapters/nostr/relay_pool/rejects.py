"""A relay connection's refused frames, logged without letting a flood of them flood the log: a relay may
send anything, as fast as it likes (20,000 forged events wrote 7 MB of warnings in 12 s, one line each)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tenex_daemon.runtime.log_budget import LineBudget

REJECT_LINES = 200
"""Lines logged per reason per :data:`REJECT_EVERY_S` on one connection: each refusal of a small attack
is still logged with its event id; a flood's rest is counted."""
REJECT_EVERY_S = 60.0


class RejectLog:
    """Logs a connection's refused frames (``frame rejected``, a warning with the reason, the detail and the
    event id): at most :data:`REJECT_LINES` per reason per :data:`REJECT_EVERY_S`. The first line after a
    window that ran out says how many were not logged (``not_logged``); the connection counts every refusal
    all the same (its ``rejects``, in ``tenexd status`` and ``/metrics``)."""

    def __init__(
        self,
        log: Any,
        lines: int = REJECT_LINES,
        every_s: float = REJECT_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = log
        self._budget = LineBudget(lines, every_s, clock)

    def said(self, reason: str, detail: str, event_id: str | None) -> None:
        """Log one refused frame, unless its reason's lines for this window are spent."""
        unlogged = self._budget.take(reason)
        if unlogged is None:
            return
        more = {"not_logged": unlogged} if unlogged else {}
        self._log.warning("frame rejected", reason=reason, detail=detail[:200], event_id=event_id, **more)
