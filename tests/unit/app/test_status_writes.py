"""The daemon's status file writes (the status loop's and the lifecycle's) happen one at a time, each with
the state of its turn, so the file never ends on an older state than the daemon's."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from pathlib import Path

import pytest

from tenex_daemon.adapters.nostr.relay_pool import RelayPool
from tenex_daemon.app import daemon as daemon_module
from tenex_daemon.app.daemon import Daemon
from tenex_daemon.app.home import init_home
from tenex_daemon.app.settings import load_settings
from tenex_daemon.app.status import StatusData, new_status, write_status


async def test_a_slow_starting_write_does_not_overwrite_the_running_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the status loop's "starting" write is slow and the daemon becomes ready meanwhile, the file ends saying "running"."""
    init_home(tmp_path / "h", relays=["ws://127.0.0.1:9"])
    daemon = Daemon(load_settings(tmp_path / "h", {}))
    writing_starting, release = threading.Event(), threading.Event()

    def slow_starting(path: Path, data: StatusData) -> None:
        if data["state"] == "starting":
            writing_starting.set()
            release.wait(10)
        write_status(path, data)

    monkeypatch.setattr(daemon_module, "write_status", slow_starting)
    starting = asyncio.create_task(daemon._write_status())
    assert await asyncio.to_thread(writing_starting.wait, 10)
    daemon.state = "running"
    running = asyncio.create_task(daemon._write_status())
    await asyncio.wait({running}, timeout=1.0)  # unserialized, the "running" write is done by now
    release.set()
    await asyncio.gather(starting, running)
    assert json.loads(daemon.settings.status_path.read_text())["state"] == "running"


def relays_held_at_start(monkeypatch: pytest.MonkeyPatch) -> tuple[asyncio.Event, asyncio.Event]:
    """Make a starting daemon wait for its relays until told to go on (none connects then); return the
    event set once it waits and the one that lets it go on."""
    waiting, go_on = asyncio.Event(), asyncio.Event()

    async def wait_connected(self: RelayPool, count: int = 1, within: float = 10.0) -> bool:
        waiting.set()
        await go_on.wait()
        return False

    monkeypatch.setattr(RelayPool, "wait_connected", wait_connected)
    return waiting, go_on


async def test_a_starting_daemon_says_so_before_its_relays_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As soon as a daemon holds its home's store, the status file says "starting" with its pid, while it
    still waits for its relays: `tenexd status` no longer reports the last run (stopped cleanly) for the
    seconds a start takes."""
    init_home(tmp_path / "h", relays=["ws://127.0.0.1:9"])
    settings = load_settings(tmp_path / "h", {})
    last_run = new_status("0.1.0")
    last_run["pid"], last_run["state"] = 1, "stopped"
    write_status(settings.status_path, last_run)
    waiting, go_on = relays_held_at_start(monkeypatch)
    daemon = Daemon(settings)
    running = asyncio.create_task(daemon.run())
    try:
        await asyncio.wait_for(waiting.wait(), 10)
        found = json.loads(settings.status_path.read_text())
        assert (found["state"], found["pid"]) == ("starting", os.getpid())
    finally:
        go_on.set()
        daemon.request_stop()
        await asyncio.wait_for(running, 30)


async def test_a_stop_asked_while_starting_never_says_ready(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM while the daemon waits for its relays at start: once the start is over it stops at once,
    without telling systemd it is ready (READY=1), serving, or writing 'running'; the file says stopped."""
    init_home(tmp_path / "h", relays=["ws://127.0.0.1:1"])
    settings = load_settings(tmp_path / "h", {})
    waiting, go_on = relays_held_at_start(monkeypatch)
    daemon = Daemon(settings)
    readies: list[str | None] = []

    def ready(status: str | None = None) -> bool:
        readies.append(status)
        return True

    monkeypatch.setattr(daemon.notifier, "ready", ready)
    running = asyncio.create_task(daemon.run())
    await asyncio.wait_for(waiting.wait(), 10)
    daemon.request_stop()
    go_on.set()
    await asyncio.wait_for(running, 30)

    assert readies == []
    assert not daemon._ready.is_set()
    assert json.loads(settings.status_path.read_text())["state"] == "stopped"


async def test_a_shutdown_step_that_fails_still_closes_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of the shutdown that raises (the relays' stop here; a database gone) does not skip the rest:
    the store is closed (its lock free for the next start) and the status file says stopped; the failure
    is raised after."""
    from tenex_daemon.app.wiring import build_store

    init_home(tmp_path / "h", relays=["ws://127.0.0.1:1"])
    settings = load_settings(tmp_path / "h", {})

    async def no_relay(self: RelayPool, count: int = 1, within: float = 10.0) -> bool:
        return False

    async def broken_stop(self: RelayPool) -> None:
        raise RuntimeError("the relays' stop failed")

    monkeypatch.setattr(RelayPool, "wait_connected", no_relay)
    monkeypatch.setattr(RelayPool, "stop", broken_stop)
    daemon = Daemon(settings)
    running = asyncio.create_task(daemon.run())
    await asyncio.wait_for(daemon.wait_ready(), 30)
    daemon.request_stop()
    with pytest.raises(RuntimeError, match="relays' stop failed"):
        await asyncio.wait_for(running, 30)

    assert json.loads(settings.status_path.read_text())["state"] == "stopped"
    store = build_store(settings)
    await store.open()  # the home's lock was released
    await store.close()


async def test_a_store_that_fails_to_close_still_lets_the_relay_child_stop_and_says_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's close failing at the stop (a full disk) still stops the embedded relay's process, writes
    the stopped status and gives the loop its exception handler back, then raises: all were skipped."""
    from tenex_daemon.adapters.storage.filesystem import FileSystemStore
    from tenex_daemon.app.embedded_relay import EmbeddedRelay

    init_home(tmp_path / "h", relays=["ws://127.0.0.1:1"])
    settings = load_settings(tmp_path / "h", {})
    stopped: list[str] = []
    close = FileSystemStore.close

    async def no_relay(self: RelayPool, count: int = 1, within: float = 10.0) -> bool:
        return False

    async def full_disk(self: FileSystemStore) -> None:
        await close(self)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(RelayPool, "wait_connected", no_relay)
    monkeypatch.setattr(FileSystemStore, "close", full_disk)
    monkeypatch.setattr(EmbeddedRelay, "stop", lambda self: stopped.append(self.url))
    loop = asyncio.get_running_loop()
    mine = loop.get_exception_handler()
    daemon = Daemon(settings)
    running = asyncio.create_task(daemon.run())
    await asyncio.wait_for(daemon.wait_ready(), 30)
    daemon.embedded_relay = EmbeddedRelay(tmp_path / "relay", "127.0.0.1", 9)  # as if it had started one
    daemon.request_stop()

    with pytest.raises(OSError, match="No space left"):
        await asyncio.wait_for(running, 30)

    assert stopped == ["ws://127.0.0.1:9"]
    assert json.loads(settings.status_path.read_text())["state"] == "stopped"
    assert loop.get_exception_handler() is mine  # the loop has its own handler back, the shutdown failing


async def test_a_start_longer_than_the_stale_limit_reads_as_starting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon held at start (its relays not answering: a long catch-up) for longer than
    ``daemon.stale_after_s``: `tenexd status`'s reading of its file says starting, not stale."""
    from tenex_daemon.app.status import Health, process_identity, read_status

    if process_identity(os.getpid()) is None:
        pytest.skip("process identities are read from /proc")
    init_home(tmp_path / "h", relays=["ws://127.0.0.1:1"])
    settings = load_settings(tmp_path / "h", {"TENEX_DAEMON__STALE_AFTER_S": "0.5"})
    waiting, go_on = relays_held_at_start(monkeypatch)
    daemon = Daemon(settings)
    running = asyncio.create_task(daemon.run())
    try:
        await asyncio.wait_for(waiting.wait(), 10)
        await asyncio.sleep(1.0)  # twice the stale limit, still starting
        report = read_status(settings.status_path, settings.daemon.stale_after_s)
        assert report.state is Health.RUNNING, report.reason
        assert report.reason.startswith(f"starting: pid {os.getpid()}")
        assert not report.healthy
    finally:
        go_on.set()
        daemon.request_stop()
        await asyncio.wait_for(running, 30)


async def test_a_status_write_failing_as_its_writer_is_cancelled_lets_the_cancellation_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The status writer cancelled (the daemon stopping) while its write is in flight, the write then failing
    (no file descriptor left, a full disk): the writer ends cancelled. Its failure took the cancellation's
    place, was counted as a failed write, and the writer went on: the stop waited for it for ever."""
    init_home(tmp_path / "h", relays=["ws://127.0.0.1:9"])
    daemon = Daemon(load_settings(tmp_path / "h", {}))
    writing, release = threading.Event(), threading.Event()

    def failing(path: Path, data: StatusData) -> None:
        writing.set()
        release.wait(10)
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(daemon_module, "write_status", failing)
    writer = asyncio.create_task(daemon._write_status_and_gauges())
    assert await asyncio.to_thread(writing.wait, 10)
    writer.cancel()
    await asyncio.sleep(0.05)
    release.set()

    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(writer, 5)
    assert writer.cancelled()
