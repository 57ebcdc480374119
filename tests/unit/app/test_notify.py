"""sd_notify: datagrams on NOTIFY_SOCKET, abstract sockets, watchdog interval, and a no-op without systemd."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tenex_daemon.app.notify import SystemdNotifier


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
