"""Refused events, logged without letting a flood of them flood the log."""

from __future__ import annotations

import time
from collections import OrderedDict

import structlog

log = structlog.get_logger(__name__)


class RefusalLog:
    """Logs refused events at most once per author (or per key the caller gives) per ``every_s``
    seconds, with the count suppressed in between (a stranger's flood costs one line a minute);
    remembers the newest ``memory`` keys. At most ``lines`` lines per ``every_s`` in all: a flood from
    fresh keys, one event each, costs that many, the next line counting the others (``others``)."""

    def __init__(self, every_s: float = 60.0, memory: int = 1_000, lines: int = 20) -> None:
        self.every_s = every_s
        self.memory = memory
        self.lines = lines
        self.clock = time.monotonic
        self._last: OrderedDict[str, tuple[float, int]] = OrderedDict()
        """Key (the author, unless the caller names another) -> (when last logged, lines suppressed since)."""
        self._window: tuple[float, int] = (float("-inf"), 0)
        """(when the current window of ``every_s`` began, lines logged in it)."""
        self._others = 0
        """Refusals of keys not logged because the window's lines were spent."""

    def refused(self, event_id: str, author: str, kind: int, reason: str, *, key: str | None = None) -> None:
        """Log one refused event, unless one of the same ``key`` (default: the author) was logged less
        than ``every_s`` ago."""
        key = author if key is None else key
        now = self.clock()
        last = self._last.pop(key, None)
        if last is not None and now - last[0] < self.every_s:
            self._last[key] = (last[0], last[1] + 1)
            return
        started, logged = self._window
        if now - started >= self.every_s:
            started, logged = now, 0
        if logged >= self.lines:
            self._others += 1
            return
        self._window = (started, logged + 1)
        self._last[key] = (now, 0)
        if len(self._last) > self.memory:
            self._last.popitem(last=False)
        others, self._others = self._others, 0
        log.info("event_refused", reason=reason, author=author, event_id=event_id, kind=kind,
                 suppressed=0 if last is None else last[1], others=others)
