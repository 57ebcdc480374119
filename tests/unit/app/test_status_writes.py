"""The daemon's status file writes (the status loop's and the lifecycle's) happen one at a time, each with
the state of its turn, so the file never ends on an older state than the daemon's."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest

from tenex_daemon.app import daemon as daemon_module
from tenex_daemon.app.daemon import Daemon
from tenex_daemon.app.home import init_home
from tenex_daemon.app.settings import load_settings
from tenex_daemon.app.status import StatusData, write_status


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
