"""SIGTERM and SIGINT: the first starts the daemon's graceful stop, a second one during it forces the exit
at once (a stop that hangs: Ctrl-C twice in a terminal ends `tenexd run`)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from tenex_daemon.adapters.llm import claude_code
from tenex_daemon.adapters.nostr.relay_pool import RelayPool
from tenex_daemon.app.daemon import Daemon
from tenex_daemon.app.home import init_home
from tenex_daemon.app.settings import load_settings
from tenex_daemon.app.stop_signals import StopSignals, forced_exit_code

REPO = Path(__file__).resolve().parents[3]


async def no_announcement(self: Daemon, signers: object) -> None:
    """No profiles published: no relay answers (each would wait 5 s)."""

HANGING_STOP = """
import asyncio, sys
from pathlib import Path
from tenex_daemon.adapters.nostr.relay_pool import RelayPool
from tenex_daemon.app.daemon import Daemon
from tenex_daemon.app.home import init_home
from tenex_daemon.app.logging import configure_logging
from tenex_daemon.app.settings import load_settings

async def no_relay(self, count=1, within=10.0):
    return False

async def hanging_stop(self):  # the relays' stop never ends (a step of the graceful stop that hangs)
    print("STOP HANGS", flush=True)
    await asyncio.sleep(3600)

async def no_announcement(self, signers):  # nobody to announce to: no relay (it would wait 5 s)
    return None

RelayPool.wait_connected = no_relay
RelayPool.stop = hanging_stop
Daemon._announce = no_announcement
home = Path(sys.argv[1])
init_home(home, relays=["ws://127.0.0.1:1"])
configure_logging("json", "info", stream=sys.stdout)
daemon = Daemon(load_settings(home, {}))

async def main():
    running = asyncio.create_task(daemon.run())
    await daemon.wait_ready()
    print("READY", flush=True)
    await running

asyncio.run(main())
"""


def wait_for_line(process: subprocess.Popen[str], text: str, within: float) -> list[str]:
    """The process's output lines up to the first holding ``text`` (failing after ``within`` seconds)."""
    assert process.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"no {text!r} in the daemon's output: {''.join(lines)[-2000:]}")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_a_second_stop_signal_ends_a_stop_that_hangs_at_once(tmp_path: Path, signum: signal.Signals) -> None:
    """A real `tenexd run` process whose graceful stop hangs: the first signal starts the stop and the
    process stays (the stop is waited for); a second one logs ``stop_forced`` and the process exits within
    seconds with 128 + the signal's number, the hanging step never finished."""
    process = subprocess.Popen(
        [sys.executable, "-c", HANGING_STOP, str(tmp_path / "h")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        wait_for_line(process, "READY", 60)
        process.send_signal(signum)
        wait_for_line(process, "STOP HANGS", 30)
        time.sleep(0.5)
        assert process.poll() is None  # the first signal stops gracefully: the hanging step is waited for
        process.send_signal(signum)
        code = process.wait(timeout=10)
        rest = process.stdout.read() if process.stdout is not None else ""
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert code == 128 + signum
    assert "stop_forced" in rest
    assert "daemon_stopped" not in rest


def test_the_first_signal_asks_for_the_stop_and_any_later_one_forces_the_exit() -> None:
    """StopSignals: the first signal calls request_stop only; the second (of either kind) exits with 128 +
    its number, saying so in the log."""
    stops: list[str] = []
    exits: list[int] = []
    signals = StopSignals(lambda: stops.append("stop"), exit_now=exits.append)
    with capture_logs() as logs:
        signals.handle(signal.SIGTERM)
        assert (stops, exits) == (["stop"], [])
        signals.handle(signal.SIGINT)
    assert (stops, exits) == (["stop"], [130])
    assert forced_exit_code(signal.SIGTERM) == 143
    forced = [entry for entry in logs if entry["event"] == "stop_forced"]
    assert [(entry["signal"], entry["exit_code"]) for entry in forced] == [("SIGINT", 130)]


def test_a_forced_exit_first_ends_the_claude_calls_under_way_with_their_tools() -> None:
    """A forced exit runs no cleanup, and a claude-code call lives in a process group of its own (a terminal's
    or a stop's signal does not reach it): the exit kills every such group first, claude and its tools."""
    tool = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    claude_code._RUNNING_GROUPS.add(tool.pid)
    exits: list[int] = []
    try:
        signals = StopSignals(lambda: None, exit_now=exits.append)
        signals.handle(signal.SIGHUP)
        signals.handle(signal.SIGHUP)
        assert tool.wait(timeout=5) == -signal.SIGKILL
    finally:
        claude_code._RUNNING_GROUPS.discard(tool.pid)
        if tool.poll() is None:
            tool.kill()
            tool.wait()
    assert exits == [128 + signal.SIGHUP]


async def test_the_daemon_forces_its_exit_on_a_second_signal_while_its_stop_hangs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In the daemon's own loop: SIGTERM starts the graceful stop (the relays' stop hangs here), a second
    SIGTERM asks for the forced exit at once, while the stop still waits; nothing of the stop is waited for."""
    init_home(tmp_path / "h", relays=["ws://127.0.0.1:1"])
    stop_reached, release = asyncio.Event(), asyncio.Event()

    async def no_relay(self: RelayPool, count: int = 1, within: float = 10.0) -> bool:
        return False

    async def hanging_stop(self: RelayPool) -> None:
        stop_reached.set()
        await release.wait()

    monkeypatch.setattr(RelayPool, "wait_connected", no_relay)
    monkeypatch.setattr(RelayPool, "stop", hanging_stop)
    monkeypatch.setattr(Daemon, "_announce", no_announcement)
    daemon = Daemon(load_settings(tmp_path / "h", {}))
    forced = asyncio.Event()
    exits: list[int] = []

    def exit_now(code: int) -> None:
        exits.append(code)
        forced.set()

    daemon.signals.exit_now = exit_now
    running = asyncio.create_task(daemon.run())
    try:
        await asyncio.wait_for(daemon.wait_ready(), 30)
        os.kill(os.getpid(), signal.SIGTERM)  # handled by the daemon's loop
        await asyncio.wait_for(stop_reached.wait(), 30)
        assert exits == []
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(forced.wait(), 5)
        assert exits == [143]
        assert not running.done()  # the stop still hangs: the exit did not wait for it
    finally:
        release.set()
        await asyncio.wait_for(running, 30)
