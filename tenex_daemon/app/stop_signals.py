"""SIGTERM, SIGINT and SIGHUP: the first asks the daemon for its graceful stop, a second one forces the exit.

A graceful stop can take long or hang (runs given their grace period, a relay or a database that does
not answer): whoever sends a second signal (Ctrl-C again in a terminal, ``kill`` again) wants the
process gone now. The second signal logs ``stop_forced`` and ends the process at once
(``os._exit``, exit status 128 + the signal's number: 143 for SIGTERM, 130 for SIGINT), without
waiting for the stop's steps. Nothing depends on those steps for safety: a crash at any instant loses
nothing accepted (docs/ARCHITECTURE.md, "Durability contract"), the run journal redoes the runs not
finished and the outbox publishes what was not sent at the next start, the store's lock goes with the
process, and the embedded relay stops when its standard input closes. The ``claude`` calls under way,
in process groups of their own, are killed with their tools first. SIGHUP (the terminal closed) stops the
daemon as the others do.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable

import structlog

from tenex_daemon.adapters.llm.claude_code import kill_running

log = structlog.get_logger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""SIGHUP too: the terminal the daemon ran in was closed (the daemon has nothing to reload)."""


def forced_exit_code(signum: int) -> int:
    """The exit status of an exit forced by signal ``signum`` (the shell's 128 + its number)."""
    return 128 + signum


class StopSignals:
    """The daemon's handlers of SIGTERM, SIGINT and SIGHUP on its event loop."""

    def __init__(
        self, request_stop: Callable[[], None], exit_now: Callable[[int], object] = os._exit
    ) -> None:
        self.request_stop = request_stop
        self.exit_now = exit_now
        """Ends the process with the given status without any cleanup (replaced in tests)."""
        self.before_exit: Callable[[], None] = kill_running
        """Ends what a forced exit would leave running: the ``claude`` calls under way and their tools,
        which live in process groups of their own (replaced in tests)."""
        self.received = 0
        """Stop signals received so far."""

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        """Handle the stop signals on ``loop`` (nothing where the loop cannot: not the main thread)."""
        self.received = 0
        for signum in STOP_SIGNALS:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(signum, self.handle, signum)

    def remove(self, loop: asyncio.AbstractEventLoop) -> None:
        """Give the stop signals back to their default handling."""
        for signum in STOP_SIGNALS:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(signum)

    def handle(self, signum: int) -> None:
        """A stop signal came: the first asks for the graceful stop, any later one forces the exit."""
        self.received += 1
        name = signal.Signals(signum).name
        if self.received == 1:
            log.info("stop_signal", signal=name, note="stopping gracefully; a second signal forces the exit")
            self.request_stop()
            return
        code = forced_exit_code(signum)
        log.warning(
            "stop_forced", signal=name, exit_code=code,
            note="a second stop signal: exiting now, without finishing the stop (accepted events are "
            "kept; unfinished runs are redone and unsent replies published at the next start)",
        )
        with contextlib.suppress(Exception):
            self.before_exit()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        self.exit_now(code)
