"""systemd's watchdog: pinged while the store's writes go through, withheld once one has waited too long (a
commit thread hung on a dead disk, a database pool that never answers), so that systemd restarts the
daemon; a store that answers with errors is not stuck."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from tenex_daemon.adapters.nostr.relay_pool import RelayPool
from tenex_daemon.adapters.storage.filesystem.ops import commit_thread
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.app import daemon as daemon_module
from tenex_daemon.app import watchdog as watchdog_module
from tenex_daemon.app.daemon import Daemon
from tenex_daemon.app.home import init_home
from tenex_daemon.app.notify import SystemdNotifier
from tenex_daemon.app.settings import load_settings
from tenex_daemon.app.watchdog import WATCHDOG_KEY, Watchdog, store_probe


class Pings(SystemdNotifier):
    """A notifier that counts its watchdog pings."""

    def __init__(self) -> None:
        super().__init__({})
        self.count = 0

    def watchdog(self) -> bool:
        self.count += 1
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def turn() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def until(check: Callable[[], bool], within: float = 10.0) -> bool:
    """Poll ``check`` until it holds or ``within`` seconds passed; return whether it held."""
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def test_pings_stop_while_a_write_waits_too_long_and_go_on_once_it_ends() -> None:
    """A write that hangs: pinged until it waited longer than the bound, then not (logged once); once it
    ends the pings go on, and a new write is started at the next round."""
    notifier, clock = Pings(), Clock()
    writes: list[asyncio.Event] = []

    async def probe() -> None:
        done = asyncio.Event()
        writes.append(done)
        await done.wait()

    dog = Watchdog(notifier, probe, stuck_after_s=60.0, clock=clock)
    with capture_logs() as logs:
        assert dog.beat()
        await turn()
        assert len(writes) == 1
        clock.now += 60.0
        assert dog.beat()  # waited as long as the bound: still pinged
        clock.now += 1.0
        assert not dog.beat()
        assert not dog.beat()
        assert dog.waited_s() == 61.0
        assert len(writes) == 1  # no second write beside the one in flight
        writes[0].set()
        await turn()
        assert dog.beat()
        await turn()
        assert len(writes) == 2
    assert notifier.count == 3
    assert [entry["event"] for entry in logs] == ["watchdog_withheld", "watchdog_resumed"]
    writes[1].set()
    await turn()


async def test_a_write_that_fails_is_an_answer_and_the_pings_go_on() -> None:
    """A store that answers with an error (a full disk, a database refusing) is not stuck: restarting would
    not help, so the pings go on; the failure is logged once for a run of them."""
    notifier, clock = Pings(), Clock()

    async def probe() -> None:
        raise OSError(28, "No space left on device")

    dog = Watchdog(notifier, probe, stuck_after_s=1.0, clock=clock)
    with capture_logs() as logs:
        for _ in range(3):
            assert dog.beat()
            await turn()
            clock.now += 5.0
    assert notifier.count == 3
    assert [entry["event"] for entry in logs] == ["watchdog_write_failed"]


async def test_without_systemds_watchdog_the_store_is_probed_and_a_stuck_write_is_told_not_pinged() -> None:
    """No watchdog asked for: nothing is pinged, yet the store is probed all the same, and a write waiting past
    the bound is told (what the status shows as degraded) until it ends."""
    notifier, clock = Pings(), Clock()
    done = asyncio.Event()

    async def probe() -> None:
        await done.wait()

    dog = Watchdog(notifier, probe, stuck_after_s=60.0, clock=clock, ping=False)
    assert not dog.beat()
    await turn()
    assert dog.stuck_s() is None
    clock.now += 61.0
    assert dog.stuck_s() == 61.0
    done.set()
    await turn()
    assert dog.stuck_s() is None
    assert notifier.count == 0


def offline_daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Daemon:
    """A daemon on a new home whose relay never answers and that announces nothing (it starts at once)."""

    async def no_relay(self: RelayPool, count: int = 1, within: float = 10.0) -> bool:
        return False

    async def no_announcement(self: Daemon, signers: object) -> None:
        return None

    monkeypatch.setattr(RelayPool, "wait_connected", no_relay)
    monkeypatch.setattr(Daemon, "_announce", no_announcement)
    init_home(tmp_path / "h", relays=["ws://127.0.0.1:1"])
    return Daemon(load_settings(tmp_path / "h", {}))


async def test_a_stuck_store_shows_as_degraded_in_the_status_without_systemd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon not under systemd, its filesystem store's commit thread hung: its status says degraded,
    naming the store's waiting write, and no longer once the thread goes on."""
    monkeypatch.setattr(watchdog_module, "STORE_STUCK_AFTER_S", 0.5)
    monkeypatch.setattr(daemon_module, "PROBE_EVERY_S", 0.1)
    daemon = offline_daemon(tmp_path, monkeypatch)
    daemon.notifier = SystemdNotifier({})

    def store_named() -> bool:
        return "store: a write has waited" in (daemon.status()["degraded"] or "")

    dead_disk = threading.Event()
    running = asyncio.create_task(daemon.run())
    try:
        await asyncio.wait_for(daemon.wait_ready(), 30)
        commit_thread().submit(dead_disk.wait, 60)  # every commit waits behind it from now on
        assert await until(store_named)
        dead_disk.set()
        assert await until(lambda: not store_named())
    finally:
        dead_disk.set()
        daemon.request_stop()
        await asyncio.wait_for(running, 30)


async def test_the_probe_is_one_write_of_a_small_value() -> None:
    """What the watchdog writes: the time, under its own key, through the store's durable writes; a daemon
    sharing its database writes under a key of its own (none waits behind another's row)."""
    store = MemoryStore()
    await store.open()
    await store_probe(store)()
    await store_probe(store, "east")()
    assert (await store.get_meta(WATCHDOG_KEY) or "").isdigit()
    assert (await store.get_meta(f"{WATCHDOG_KEY}:east") or "").isdigit()


def pings(sock: socket.socket) -> int:
    """WATCHDOG=1 lines among the datagrams waiting on ``sock``."""
    count = 0
    while True:
        try:
            count += sock.recv(4096).decode().splitlines().count("WATCHDOG=1")
        except BlockingIOError:
            return count


async def test_the_daemon_stops_pinging_while_its_store_commit_hangs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon under systemd's watchdog, its filesystem store's commit thread hung (an fsync on a dead
    disk): the event loop turns, yet the pings stop once the watchdog's write waited past the bound (no ping
    in the rounds after its status says so), and go on when the thread does."""
    monkeypatch.setattr(watchdog_module, "STORE_STUCK_AFTER_S", 0.5)
    rounds = 0
    beat = Watchdog.beat

    def counted_beat(self: Watchdog) -> bool:
        nonlocal rounds
        rounds += 1
        return beat(self)

    monkeypatch.setattr(Watchdog, "beat", counted_beat)
    daemon = offline_daemon(tmp_path, monkeypatch)
    path = str(tmp_path / "notify.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(path)
    listener.setblocking(False)
    daemon.notifier = SystemdNotifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"})  # a ping each 0.1 s
    received = 0

    def pinged(count: int) -> bool:
        nonlocal received
        received += pings(listener)
        return received >= count

    dead_disk = threading.Event()
    running = asyncio.create_task(daemon.run())
    try:
        await asyncio.wait_for(daemon.wait_ready(), 30)
        assert await until(lambda: pinged(2))
        commit_thread().submit(dead_disk.wait, 60)  # every commit waits behind it from now on
        assert await until(lambda: "store: a write has waited" in (daemon.status()["degraded"] or ""))
        pings(listener)  # those sent before the bound passed
        since = rounds
        assert await until(lambda: rounds >= since + 3)  # three rounds of the watchdog after it
        assert pings(listener) == 0
        dead_disk.set()
        received = 0
        assert await until(lambda: pinged(2))
        assert daemon.store is not None
        assert (await daemon.store.get_meta(WATCHDOG_KEY) or "").isdigit()  # what it writes
    finally:
        dead_disk.set()
        daemon.request_stop()
        await asyncio.wait_for(running, 30)
        listener.close()
