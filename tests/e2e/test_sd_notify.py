"""tenexd under a systemd-like supervisor: READY=1, STATUS=, WATCHDOG=1 and STOPPING=1 on NOTIFY_SOCKET."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from tests.e2e.harness import DaemonProcess, Home
from tests.integration.nostr.harness import LocalRelayServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def drain(sock: socket.socket) -> list[str]:
    """Every datagram waiting on the socket, decoded."""
    received: list[str] = []
    while True:
        try:
            received.append(sock.recv(4096).decode())
        except BlockingIOError:
            return received


async def test_daemon_notifies_ready_watchdog_and_stopping(
    tmp_path: Path, relay: LocalRelayServer, home: Home
) -> None:
    """The daemon sends READY=1 once subscribed, WATCHDOG=1 within WatchdogSec/2, STOPPING=1 on SIGTERM."""
    path = str(tmp_path / "notify.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(path)
    listener.setblocking(False)
    process = DaemonProcess(home, env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000"})
    try:
        await process.start()
        running: list[str] = []
        for _ in range(150):  # WatchdogSec=1: two pings are due within 1.5 s, later on a loaded machine
            await asyncio.sleep(0.1)
            running += drain(listener)
            if sum(datagram.splitlines().count("WATCHDOG=1") for datagram in running) >= 2:
                break
        assert await process.stop() == 0
        stopping = drain(listener)
    finally:
        process.kill()
        listener.close()

    lines = [line for datagram in running for line in datagram.splitlines()]
    assert "READY=1" in lines, process.log_tail()
    assert any(line.startswith("STATUS=") for line in lines)
    assert lines.count("WATCHDOG=1") >= 2
    assert "STOPPING=1" in [line for datagram in stopping for line in datagram.splitlines()]
