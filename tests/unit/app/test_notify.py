"""sd_notify: datagrams on NOTIFY_SOCKET, abstract sockets, watchdog interval, and a no-op without systemd."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tenex_daemon.adapters.nostr.relay_pool import RelayPool
from tenex_daemon.app import notify as notify_module
from tenex_daemon.app.daemon import Daemon
from tenex_daemon.app.home import init_home
from tenex_daemon.app.notify import SystemdNotifier, keep_starting
from tenex_daemon.app.settings import load_settings


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket bound where systemd's notify socket would be."""
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2)
    yield sock, path
    sock.close()


def receive(sock: socket.socket) -> str:
    """Return the next datagram as text."""
    return sock.recv(4096).decode()


def test_sends_ready_status_watchdog_and_stopping(
    listener: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With NOTIFY_SOCKET set (from os.environ) the listener receives READY=1, STATUS=, WATCHDOG=1, STOPPING=1."""
    sock, path = listener
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    notifier = SystemdNotifier()
    assert notifier.enabled
    assert notifier.ready()
    assert receive(sock) == "READY=1"
    assert notifier.status("serving 3 agents\non 1 relay")
    assert receive(sock) == "STATUS=serving 3 agents on 1 relay"
    assert notifier.watchdog()
    assert receive(sock) == "WATCHDOG=1"
    assert notifier.stopping("draining")
    assert receive(sock) == "STOPPING=1\nSTATUS=draining"
    assert notifier.extend_timeout(2.5)
    assert receive(sock) == "EXTEND_TIMEOUT_USEC=2500000"
    notifier.close()


def test_abstract_socket_names_start_with_at() -> None:
    """An '@name' NOTIFY_SOCKET is the abstract socket '\\0name'."""
    name = f"tenexd-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(2)
    try:
        notifier = SystemdNotifier({"NOTIFY_SOCKET": "@" + name})
        assert notifier.ready("up")
        assert receive(sock) == "READY=1\nSTATUS=up"
        notifier.close()
    finally:
        sock.close()


def test_without_notify_socket_everything_is_a_no_op() -> None:
    """Outside systemd the notifier sends nothing and reports no watchdog."""
    notifier = SystemdNotifier({})
    assert not notifier.enabled
    assert not notifier.ready()
    assert not notifier.watchdog()
    assert notifier.watchdog_interval_s() is None


def test_watchdog_interval_comes_from_watchdog_usec(listener: tuple[socket.socket, str]) -> None:
    """WATCHDOG_USEC gives the interval in seconds; a WATCHDOG_PID of another process disables it."""
    _, path = listener
    assert SystemdNotifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "30000000"}).watchdog_interval_s() == 30.0
    mine = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "5000000", "WATCHDOG_PID": str(os.getpid())}
    assert SystemdNotifier(mine).watchdog_interval_s() == 5.0
    other = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "5000000", "WATCHDOG_PID": "1"}
    assert SystemdNotifier(other).watchdog_interval_s() is None
    assert SystemdNotifier({"NOTIFY_SOCKET": path}).watchdog_interval_s() is None


def test_a_missing_socket_is_logged_not_raised(tmp_path: Path) -> None:
    """Sending to a socket that does not exist returns False instead of raising."""
    notifier = SystemdNotifier({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
    assert not notifier.watchdog()


def test_a_receiver_that_stops_reading_never_blocks_a_notification(listener: tuple[socket.socket, str]) -> None:
    """With the receiver's queue full (it stopped reading), a notification is lost and logged at once, never
    waited on: it is sent from the event loop, and a blocking send froze the whole daemon, its stop too."""
    _, path = listener
    notifier = SystemdNotifier({"NOTIFY_SOCKET": path})
    started = time.monotonic()

    sent = [notifier.watchdog() for _ in range(200)]

    assert time.monotonic() - started < 1
    assert sent[0]
    assert not sent[-1]


async def test_ready_is_sent_again_until_the_receiver_has_room(listener: tuple[socket.socket, str]) -> None:
    """READY=1 (systemd kills a start it never hears of) is sent again while the receiver's queue is full,
    without blocking the event loop, and arrives once the receiver reads; given up on only after its time."""
    sock, path = listener
    notifier = SystemdNotifier({"NOTIFY_SOCKET": path})
    while notifier.watchdog():  # the receiver stopped reading: its queue fills
        pass
    task = asyncio.create_task(notifier.heard("READY=1", within_s=5))
    await asyncio.sleep(0.3)
    assert not task.done()

    received = [receive(sock)]  # room for one
    assert await asyncio.wait_for(task, 2)
    sock.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        while True:
            received.append(receive(sock))
    assert received[-1] == "READY=1"
    while notifier.watchdog():
        pass
    assert not await notifier.heard("STOPPING=1", within_s=0.2)


async def test_a_start_asks_for_more_time_until_cancelled_or_its_bound(
    listener: tuple[socket.socket, str],
) -> None:
    """While a start lasts, systemd is asked again and again for more time (EXTEND_TIMEOUT_USEC), so a start
    longer than TimeoutStartSec is not killed; past the bound, asking stops; cancelled, it stops at once."""
    sock, path = listener
    notifier = SystemdNotifier({"NOTIFY_SOCKET": path})
    now = [0.0]

    async def bounded() -> None:
        await keep_starting(notifier, every_s=0.01, by_s=2.0, for_s=0.05, clock=lambda: now[0])

    task = asyncio.create_task(bounded())
    await asyncio.sleep(0.05)
    assert receive(sock) == "EXTEND_TIMEOUT_USEC=2000000"
    now[0] = 1.0  # the bound has passed
    await asyncio.wait_for(task, 1)
    sock.setblocking(False)
    while True:  # drain what came before the bound
        try:
            sock.recv(4096)
        except BlockingIOError:
            break
    await asyncio.sleep(0.05)
    with pytest.raises(BlockingIOError):
        sock.recv(4096)

    quiet = SystemdNotifier({})
    await asyncio.wait_for(keep_starting(quiet, every_s=0.01), 1)  # without systemd: returns at once


async def test_a_stop_asked_for_while_starting_ends_the_asking_for_more_time(
    listener: tuple[socket.socket, str],
) -> None:
    """A stop asked for while the daemon starts ends the asking at once: systemd applies an extension sent
    after SIGTERM to the stop's timeout, which would let a stuck stop outlast TimeoutStopSec."""
    sock, path = listener
    notifier = SystemdNotifier({"NOTIFY_SOCKET": path})
    stopping = asyncio.Event()
    task = asyncio.create_task(keep_starting(notifier, every_s=0.05, by_s=2.0, until=stopping))
    await asyncio.sleep(0.01)
    assert receive(sock) == "EXTEND_TIMEOUT_USEC=2000000"

    stopping.set()

    await asyncio.wait_for(task, 1)
    sock.setblocking(False)
    await asyncio.sleep(0.1)  # two more would have come by now
    with pytest.raises(BlockingIOError):
        sock.recv(4096)


async def test_the_daemon_asks_for_more_time_while_it_starts(
    listener: tuple[socket.socket, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon under systemd, its start held (its relays slow to connect): it sends EXTEND_TIMEOUT_USEC
    before READY=1, and none once ready."""
    monkeypatch.setattr(notify_module, "START_EXTEND_EVERY_S", 0.05)
    held = asyncio.Event()

    async def slow_relay(self: RelayPool, count: int = 1, within: float = 10.0) -> bool:
        await held.wait()
        return False

    async def no_announcement(self: Daemon, signers: object) -> None:
        return None

    monkeypatch.setattr(RelayPool, "wait_connected", slow_relay)
    monkeypatch.setattr(Daemon, "_announce", no_announcement)
    sock, path = listener
    init_home(tmp_path / "h", relays=["ws://127.0.0.1:1"])
    daemon = Daemon(load_settings(tmp_path / "h", {}))
    daemon.notifier = SystemdNotifier({"NOTIFY_SOCKET": path})
    running = asyncio.create_task(daemon.run())
    try:
        await asyncio.sleep(0.3)
        held.set()
        await asyncio.wait_for(daemon.wait_ready(), 30)
        await asyncio.sleep(0.2)
        sock.setblocking(False)
        lines: list[str] = []
        while True:
            try:
                lines += sock.recv(4096).decode().splitlines()
            except BlockingIOError:
                break
        ready = lines.index("READY=1")
        assert sum(line.startswith("EXTEND_TIMEOUT_USEC=") for line in lines[:ready]) >= 2
        assert not [line for line in lines[ready:] if line.startswith("EXTEND_TIMEOUT_USEC=")]
    finally:
        held.set()
        daemon.request_stop()
        await asyncio.wait_for(running, 30)
