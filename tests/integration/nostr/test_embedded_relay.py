"""The embedded relay (``tenexd run --embedded-relay``), a child process the daemon owns, and the
relay connections' quick ACKs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from websockets.asyncio.client import connect

from tenex_daemon.adapters.nostr.relay_pool import RelayPool
from tenex_daemon.adapters.nostr.relay_pool.quick_ack import no_ack, quick_ack
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.app.embedded_relay import EmbeddedRelay, EmbeddedRelayError, _last_lines, relay_url

from .conftest import FAST
from .harness import LocalRelayServer, free_port, wait_port_closed

pytestmark = pytest.mark.integration


async def test_embedded_relay_serves_stops_and_refuses_a_taken_port(tmp_path: Path) -> None:
    """A second relay on a taken port fails at once, in one line saying why and how to choose another port
    (no relay process started, no traceback of it); stop() ends the process and frees the port."""
    port = free_port()
    first = EmbeddedRelay(tmp_path / "first", port=port)
    await first.start()
    pid = first.pid
    assert pid is not None
    try:
        second = EmbeddedRelay(tmp_path / "second", port=port)
        with pytest.raises(EmbeddedRelayError, match="Address already in use") as refused:
            await second.start()
        assert second.pid is None
        assert str(refused.value) == (
            f"embedded relay on ws://127.0.0.1:{port} failed to start: port {port} is in use by another program "
            "(Address already in use); stop it, or give the relay another port (relays.embedded_port in "
            "config.toml, or TENEX_RELAYS__EMBEDDED_PORT)"
        )
    finally:
        first.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    await wait_port_closed(port, within=5)


async def test_relay_connections_acknowledge_each_frame_at_once(local_relay: LocalRelayServer) -> None:
    """On Linux a relay connection gets a hook that sets TCP_QUICKACK (re-set after every frame read)."""
    async with connect(local_relay.url) as ws:
        ack = quick_ack(ws)
        assert (ack is not no_ack) == hasattr(socket, "TCP_QUICKACK")
        ack()
        sock = ws.transport.get_extra_info("socket")
        if hasattr(socket, "TCP_QUICKACK"):
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK) == 1


async def killed_and_restarted(relay: EmbeddedRelay) -> int:
    """SIGKILL the relay's process and wait (at most 20 s) until its supervisor started it again; return the
    pid killed."""
    killed = relay.pid
    assert killed is not None
    os.kill(killed, signal.SIGKILL)
    async with asyncio.timeout(20):
        while relay.restarts == 0:  # noqa: ASYNC110 - the supervisor has no event to wait on
            await asyncio.sleep(0.05)
    return killed


async def test_a_relay_process_that_dies_is_started_again_with_its_events(tmp_path: Path) -> None:
    """supervise() starts a killed relay again on its port, and the events it stored are still served."""
    relay = EmbeddedRelay(tmp_path / "relay", port=free_port())
    await relay.start()
    supervisor = asyncio.create_task(relay.supervise(poll_s=0.05))
    try:
        event = Signer.generate().sign(1, "kept across the restart")
        async with connect(relay.url) as ws:
            await ws.send(json.dumps(["EVENT", event.to_dict()]))
            assert json.loads(await asyncio.wait_for(ws.recv(), 10))[:3] == ["OK", event.id, True]
        killed = await killed_and_restarted(relay)
        assert relay.pid not in (None, killed)
        async with connect(relay.url) as ws:
            await ws.send(json.dumps(["REQ", "again", {"ids": [event.id]}]))
            frame = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert frame[:2] == ["EVENT", "again"]
        assert frame[2]["id"] == event.id
    finally:
        supervisor.cancel()
        await asyncio.gather(supervisor, return_exceptions=True)
        await asyncio.to_thread(relay.stop)
    assert relay.pid is None


async def test_a_relay_whose_restart_failed_is_started_again_once_its_port_is_free(tmp_path: Path) -> None:
    """A restart that fails (its port taken meanwhile) is tried again with the backoff, and the relay runs
    again once the port is free; before, the first failed try ended the supervision for good."""
    relay = EmbeddedRelay(tmp_path / "relay", port=free_port())
    await relay.start()
    supervisor = asyncio.create_task(relay.supervise(poll_s=0.05))
    squatter = socket.socket()
    try:
        killed = relay.pid
        assert killed is not None
        os.kill(killed, signal.SIGKILL)
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        async with asyncio.timeout(10):
            while True:  # the port frees as the process dies; take it before the first try (0.5 s)
                try:
                    squatter.bind((relay.host, relay.port))
                    break
                except OSError:
                    await asyncio.sleep(0.01)
        squatter.listen()
        async with asyncio.timeout(20):
            while relay.failed_restarts < 2:  # noqa: ASYNC110 - the supervisor has no event to wait on
                await asyncio.sleep(0.05)
        squatter.close()
        async with asyncio.timeout(30):
            while relay.restarts == 0:  # noqa: ASYNC110 - the supervisor has no event to wait on
                await asyncio.sleep(0.05)
        assert not supervisor.done()
        assert relay.pid not in (None, killed)
        async with connect(relay.url) as ws:
            await ws.send(json.dumps(["REQ", "alive", {"limit": 1}]))
            assert json.loads(await asyncio.wait_for(ws.recv(), 10))[0] in ("EVENT", "EOSE")
    finally:
        squatter.close()
        supervisor.cancel()
        await asyncio.gather(supervisor, return_exceptions=True)
        await asyncio.to_thread(relay.stop)
    assert relay.pid is None


async def test_a_restarted_relay_is_told_so_the_pool_connects_without_waiting_out_its_backoff(
    tmp_path: Path,
) -> None:
    """When supervise() starts a killed relay again it tells ``on_restarted`` the relay's URL, and a pool
    told so (``retry_now``) connects at once, though its reconnect backoff had 30 s left to wait: before, the
    daemon stayed cut off from its own relay for up to that long."""
    relay = EmbeddedRelay(tmp_path / "relay", port=free_port())
    await relay.start()
    slow = replace(FAST, backoff_base=30.0, backoff_cap=30.0, stable_after=3600.0)
    told: list[str] = []

    async with RelayPool([relay.url], store=MemoryStore(), settings=slow) as pool:
        assert await pool.wait_connected(within=10)

        def restarted(url: str) -> None:
            told.append(url)
            pool.retry_now(url)

        supervisor = asyncio.create_task(relay.supervise(restarted, poll_s=0.05))
        try:
            await killed_and_restarted(relay)
            assert told == [relay.url]
            assert await pool.wait_connected(within=5)
        finally:
            supervisor.cancel()
            await asyncio.gather(supervisor, return_exceptions=True)
            await asyncio.to_thread(relay.stop)


async def test_the_relays_files_are_the_owners_only_and_its_errors_only_its_own(tmp_path: Path) -> None:
    """Under a umask that leaves files readable by others, the relay's folder is made 0700 and its error log
    0600; a relay that fails reports what it wrote itself, not an earlier run's lines left in the log."""
    folder = tmp_path / "relay"
    log_path = tmp_path / "relay.log"
    log_path.write_text("Traceback (most recent call last):\nKeyboardInterrupt\n")
    old = os.umask(0o022)
    try:
        relay = EmbeddedRelay(folder, port=free_port())
        await relay.start()
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert stat.S_IMODE(relay.log_path.stat().st_mode) == 0o600
        assert relay.log_path == log_path
        process = await asyncio.to_thread(subprocess.Popen, [sys.executable, "-c", "raise SystemExit(3)"])
        assert _last_lines(process, log_path, log_path.stat().st_size) == "exit status 3"
        assert "KeyboardInterrupt" in _last_lines(process, log_path, 0)
    finally:
        await asyncio.to_thread(relay.stop)


def test_an_ipv6_host_is_bracketed_in_the_relays_url() -> None:
    """An IPv6 address is written in brackets in the relay's URL (``ws://::1:7777`` is no URL)."""
    assert relay_url("::1", 7777) == "ws://[::1]:7777"
    assert relay_url("127.0.0.1", 7777) == "ws://127.0.0.1:7777"
    assert relay_url("[::1]", 7777) == "ws://[::1]:7777"


async def test_a_relay_process_the_system_refuses_is_one_line_naming_the_limits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of file descriptors (or processes), the relay's start says so in one EmbeddedRelayError naming the
    limits to check: it was a bare "[Errno 24] Too many open files"."""

    def refused(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(subprocess, "Popen", refused)
    relay = EmbeddedRelay(tmp_path / "relay", "127.0.0.1", free_port())

    with pytest.raises(EmbeddedRelayError, match=r"could not be made \(\[Errno 24\] Too many open files\): check the"):
        await relay.start()
