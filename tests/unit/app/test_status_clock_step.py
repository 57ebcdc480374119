"""The daemon's status across a wall clock stepped back (an NTP correction, a clock fixed by hand): its
uptime and how long no relay has been connected are counted on a monotonic clock."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tenex_daemon.adapters.nostr.relay_pool import RelayPool
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.app import status as status_module
from tenex_daemon.app.daemon import Daemon
from tenex_daemon.app.home import init_home
from tenex_daemon.app.settings import load_settings


async def test_a_clock_stepped_back_leaves_uptime_positive_and_a_relay_outage_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no relay connected for longer than the degraded threshold, a wall clock stepped back an hour
    leaves the status degraded for the relays (before: the outage read as just begun) and its uptime
    positive (before: about -3600 s)."""
    monkeypatch.setattr(status_module, "RELAYS_DOWN_DEGRADED_S", 0.05)
    init_home(tmp_path / "h", relays=["ws://127.0.0.1:9"])
    daemon = Daemon(load_settings(tmp_path / "h"))
    daemon.pool = RelayPool(["ws://127.0.0.1:9"], on_event=daemon._on_event, store=MemoryStore())
    assert daemon.status()["degraded"] is None  # the outage begins now
    real = time.time
    await asyncio.sleep(0.1)
    monkeypatch.setattr(time, "time", lambda: real() - 3_600)

    after = daemon.status()

    assert after["uptime_s"] >= 0.1
    assert "relays: none connected" in (after["degraded"] or "")
