"""The event loop's exception handler writes a repeating OSError of asyncio's own once a minute, counting the
repeats (out of file descriptors, one waiting client made asyncio log its accept failure over a thousand
times a second: 1.3 MB of log in 4 s), and passes anything else through as it was."""

from __future__ import annotations

import asyncio
import logging

import pytest
from structlog.testing import capture_logs

from tenex_daemon.runtime.loop_errors import LoopErrors


async def test_a_repeating_oserror_of_the_loop_is_written_once_a_minute_with_its_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """1,000 accept failures in one second are one asyncio record; the first after a minute is written again
    with a line counting the 999 held back; another error is written each time."""
    now = [100.0]
    handler = LoopErrors(clock=lambda: now[0])
    loop = asyncio.get_running_loop()
    accept = {"message": "socket.accept() out of system resource", "exception": OSError(24, "Too many open files")}
    other = {"message": "Task exception was never retrieved", "exception": ValueError("boom")}

    with caplog.at_level(logging.INFO), capture_logs() as logs:
        for _ in range(1000):
            handler(loop, dict(accept))
        handler(loop, dict(other))
        handler(loop, dict(other))
        now[0] += 61
        handler(loop, dict(accept))

    from_asyncio = [r.getMessage() for r in caplog.records if r.name == "asyncio"]
    assert from_asyncio.count("socket.accept() out of system resource") == 2
    assert from_asyncio.count("Task exception was never retrieved") == 2
    assert [(e["event"], e["times"]) for e in logs] == [("event_loop_error_repeated", 999)]
