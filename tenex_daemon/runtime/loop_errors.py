"""The event loop's exception handler: what asyncio reports of its own (a failed ``accept`` of the control
socket, a transport's error) goes to the log as before, but an ``OSError`` repeating the same message is
written at most once a minute, the repeats counted in the next line. Out of file descriptors, asyncio's
accept loop reports ``socket.accept() out of system resource`` for each try, over a thousand a second:
about a megabyte of log in four seconds, enough to fill a small disk."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import structlog

log = structlog.get_logger(__name__)

REPEAT_EVERY_S = 60.0
"""How often one repeating ``OSError`` message of the loop is written."""
KEPT_MESSAGES = 64
"""How many messages' last writes are remembered (the oldest forgotten first)."""


class LoopErrors:
    """Set as ``loop.set_exception_handler(LoopErrors())``; ``clock``: a test may give its own."""

    def __init__(self, every_s: float = REPEAT_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._every_s = every_s
        self._clock = clock
        self._written: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if not isinstance(context.get("exception"), OSError):
            loop.default_exception_handler(context)
            return
        message = str(context.get("message", ""))
        now = self._clock()
        written = self._written.get(message)
        if written is not None and now - written < self._every_s:
            self._held[message] = self._held.get(message, 0) + 1
            return
        repeats = self._held.pop(message, 0)
        self._written.pop(message, None)
        self._written[message] = now
        while len(self._written) > KEPT_MESSAGES:
            oldest = next(iter(self._written))
            del self._written[oldest]
            self._held.pop(oldest, None)
        if repeats:
            log.warning("event_loop_error_repeated", message=message, times=repeats, within_s=self._every_s)
        loop.default_exception_handler(context)
