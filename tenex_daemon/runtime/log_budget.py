"""Log lines rationed per key: a flood (a relay's forged frames, refused requests, a handler failing on every
event of a full disk) costs a bounded number of lines, and the next line says how many were left out."""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class LineBudget:
    """At most ``lines`` log lines per key in each window of ``every_s`` seconds (a window begins with the
    first line asked for after the last one ended); what is left out is counted for the key's next line."""

    def __init__(self, lines: int, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lines = lines
        self.every_s = every_s
        self.clock = clock
        self._windows: dict[str, tuple[float, int, int]] = {}
        """Key (a bounded set: reasons, error types) -> (when its window began, lines logged in it, lines
        left out since the key's last line)."""

    def take(self, key: str) -> int | None:
        """Whether to log a line for ``key``: None when this window's lines are spent (the line is counted),
        else how many of the key's lines were left out since its last line."""
        now = self.clock()
        started, logged, left_out = self._windows.get(key, (-math.inf, 0, 0))
        if now - started >= self.every_s:
            started, logged = now, 0
        if logged >= self.lines:
            self._windows[key] = (started, logged, left_out + 1)
            return None
        self._windows[key] = (started, logged + 1, 0)
        return left_out
