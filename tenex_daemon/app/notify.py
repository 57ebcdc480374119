"""sd_notify without a library: datagrams to ``$NOTIFY_SOCKET`` (systemd ``Type=notify``).

``READY=1`` once relays are subscribed, ``STATUS=`` lines for ``systemctl status``,
``WATCHDOG=1`` at least twice per ``WatchdogSec``, ``STOPPING=1`` when shutting down, and
``EXTEND_TIMEOUT_USEC=`` while a start lasts (:func:`keep_starting`).
Without ``NOTIFY_SOCKET`` (not under systemd) every call is a no-op. A path starting with
``@`` names an abstract socket. Sending never raises nor blocks: a lost notification is logged; the
two that must not be lost (``READY=1``, ``STOPPING=1``: :meth:`SystemdNotifier.heard`) are sent again
while the receiver's queue is full.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Callable, Mapping

import structlog

log = structlog.get_logger(__name__)

START_EXTEND_EVERY_S = 10.0
"""How often a start still under way asks systemd for more time."""
START_EXTEND_BY_S = 30.0
"""How much more time each ask is for: a start whose event loop stops turning is cut that long after."""
START_EXTEND_FOR_S = 1800.0
"""How long in all a start keeps asking; past it, ``TimeoutStartSec`` decides (a start stuck for good)."""
RESEND_EVERY_S = 0.1
"""How often a notification that must not be lost is sent again while the receiver's queue is full."""
READY_WITHIN_S = 30.0
"""How long ``READY=1`` is tried (``TimeoutStartSec`` is 60 s in the shipped unit)."""
STOPPING_WITHIN_S = 2.0
"""How long ``STOPPING=1`` is tried before the stop goes on without it."""


class SystemdNotifier:
    """Sends sd_notify messages to the socket named by ``NOTIFY_SOCKET`` (read once, at construction)."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        """Read ``NOTIFY_SOCKET``, ``WATCHDOG_USEC``, ``WATCHDOG_PID`` from ``env`` (default: os.environ)."""
        environment = os.environ if env is None else env
        raw = environment.get("NOTIFY_SOCKET") or None
        self._address: str | None = None
        if raw is not None:
            self._address = "\0" + raw[1:] if raw.startswith("@") else raw
        self._watchdog_usec = environment.get("WATCHDOG_USEC")
        self._watchdog_pid = environment.get("WATCHDOG_PID")
        self._socket: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        """Whether a notify socket is configured."""
        return self._address is not None

    def notify(self, *lines: str) -> bool:
        """Send ``KEY=VALUE`` lines in one datagram; return whether it was sent (a receiver whose queue is
        full: lost, and logged)."""
        if self._address is None:
            return False
        error = self._send(lines)
        if error is not None:
            log.warning("sd_notify_failed", error=f"{type(error).__name__}: {error}", message=lines[0][:40])
        return error is None

    async def heard(self, *lines: str, within_s: float) -> bool:
        """Send lines that must not be lost (``READY=1``: systemd would kill a start it never hears of; the
        daemon's ``STOPPING=1``), again every :data:`RESEND_EVERY_S` while the receiver's queue is full, for
        ``within_s`` at most; return whether they were sent."""
        if self._address is None:
            return False
        deadline = time.monotonic() + within_s
        # polled: nothing tells when an unconnected datagram socket's receiver has room again
        while isinstance(error := self._send(lines), BlockingIOError) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(RESEND_EVERY_S)
        if error is not None:
            log.warning("sd_notify_failed", error=f"{type(error).__name__}: {error}", message=lines[0][:40])
        return error is None

    def _send(self, lines: tuple[str, ...]) -> OSError | None:
        assert self._address is not None
        try:
            if self._socket is None:
                # never blocking: it is sent from the event loop, and a receiver that stops reading (its
                # queue full: max_dgram_qlen, 10 by default, 512 under systemd) would otherwise freeze the
                # whole daemon, its stop included
                kind = socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
                self._socket = socket.socket(socket.AF_UNIX, kind)
            self._socket.sendto("\n".join(lines).encode("utf-8"), self._address)
        except OSError as exc:
            return exc
        return None

    def ready(self, status: str | None = None) -> bool:
        """Tell systemd the daemon is ready (``READY=1``), optionally with a status line."""
        return self.notify(*ready_lines(status))

    def status(self, text: str) -> bool:
        """Set the one-line status shown by ``systemctl status`` (``STATUS=``)."""
        return self.notify(_status_line(text))

    def watchdog(self) -> bool:
        """Ping the watchdog (``WATCHDOG=1``)."""
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str | None = None) -> bool:
        """Tell systemd the daemon is shutting down (``STOPPING=1``)."""
        return self.notify(*stopping_lines(status))

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for more time to start or stop (``EXTEND_TIMEOUT_USEC=``)."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={max(0, int(seconds * 1_000_000))}")

    def watchdog_interval_s(self) -> float | None:
        """Return ``WatchdogSec`` in seconds (from ``WATCHDOG_USEC``), or None when no watchdog is asked for.

        None too when ``WATCHDOG_PID`` names another process. Ping at least every half of it.
        """
        if self._address is None or not self._watchdog_usec:
            return None
        if self._watchdog_pid and self._watchdog_pid.isdigit() and int(self._watchdog_pid) != os.getpid():
            return None
        try:
            usec = int(self._watchdog_usec)
        except ValueError:
            return None
        return usec / 1_000_000 if usec > 0 else None

    def close(self) -> None:
        """Close the socket (a later call opens a new one)."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _status_line(text: str) -> str:
    return "STATUS=" + " ".join(text.splitlines())


def ready_lines(status: str | None = None) -> tuple[str, ...]:
    """``READY=1``, with a status line when given."""
    return ("READY=1",) if status is None else ("READY=1", _status_line(status))


def stopping_lines(status: str | None = None) -> tuple[str, ...]:
    """``STOPPING=1``, with a status line when given."""
    return ("STOPPING=1",) if status is None else ("STOPPING=1", _status_line(status))


async def keep_starting(
    notifier: SystemdNotifier,
    *,
    every_s: float | None = None,
    by_s: float = START_EXTEND_BY_S,
    for_s: float = START_EXTEND_FOR_S,
    clock: Callable[[], float] = time.monotonic,
    until: asyncio.Event | None = None,
) -> None:
    """While the daemon starts, ask systemd for more time every ``every_s`` (``by_s`` each), for ``for_s`` in
    all: a start that takes longer than ``TimeoutStartSec`` (the store's recovery of a large home, a
    database's migrations) is not killed and restarted into the same long start again and again. Cancel
    it once the start is over; it ends by itself once ``until`` is set (a stop asked for while starting:
    systemd applies an extension sent then to the stop's timeout). Nothing without systemd. ``every_s``:
    :data:`START_EXTEND_EVERY_S` unless given."""
    if not notifier.enabled:
        return
    every = START_EXTEND_EVERY_S if every_s is None else every_s
    stopping = asyncio.Event() if until is None else until
    started = clock()
    while clock() - started < for_s and not stopping.is_set():
        notifier.extend_timeout(by_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), every)
    if stopping.is_set():
        return
    log.warning("start_not_extended", after_s=for_s, note="the start is left to systemd's TimeoutStartSec")
