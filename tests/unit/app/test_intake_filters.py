"""What the daemon asks its relays for (docs/PROTOCOL.md): what p-tags its agents or project, what the
owner or a whitelisted person addresses to the project by its ``a`` tag from the daemon's first asking on,
and stop requests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.app.home import init_home
from tenex_daemon.app.intake_filters import ADDRESSED_SINCE_KEY, addressed_since, intake_filters
from tenex_daemon.app.settings import load_settings

OWNER = "11" * 32
FRIEND = "22" * 32


async def test_what_is_addressed_to_the_project_is_asked_for_from_the_first_asking_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ``a`` filter names the project's address, only the owner and whitelisted people as authors, and a
    ``since`` of when the daemon first asked for it, kept across starts: a home made for a project people
    wrote to for months does not answer every old message addressed to it as new."""
    result = init_home(tmp_path / "home", owner=OWNER, whitelist=[FRIEND], relays=["ws://127.0.0.1:1"])
    settings = load_settings(result.home)
    store = MemoryStore()
    monkeypatch.setattr("tenex_daemon.app.intake_filters.time.time", lambda: 1_800_000_000.5)
    first = await addressed_since(store)
    monkeypatch.setattr("tenex_daemon.app.intake_filters.time.time", lambda: 1_800_100_000.5)

    again = await addressed_since(store)
    filters = intake_filters(settings, ["aa" * 32], again)

    assert (first, again) == (1_800_000_000, 1_800_000_000)
    assert await store.get_meta(ADDRESSED_SINCE_KEY) == "1800000000"
    [addressed] = [f for f in filters if "#a" in f]
    assert addressed["#a"] == [f"31933:{OWNER}:{settings.project.d_tag}"]
    assert addressed["authors"] == sorted([OWNER, FRIEND])
    assert addressed["since"] == 1_800_000_000
    assert {"kinds": [1, 11, 1111, 1934], "#p": ["aa" * 32]} in filters


async def test_a_first_asking_dated_ahead_by_a_fast_clock_is_taken_back_to_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """The home's first start ran with the clock 30 days fast; the clock was set right: the next start asks
    from now, and keeps it (before, the value stayed 30 days ahead, and every REQ's ``since`` was now: messages
    addressed to the project during each downtime in those 30 days were never asked for)."""
    store = MemoryStore()
    monkeypatch.setattr("tenex_daemon.app.intake_filters.time.time", lambda: 1_800_000_000.5 + 30 * 86_400)
    await addressed_since(store)
    monkeypatch.setattr("tenex_daemon.app.intake_filters.time.time", lambda: 1_800_000_000.5)

    since = await addressed_since(store)

    assert since == 1_800_000_000
    assert await store.get_meta(ADDRESSED_SINCE_KEY) == "1800000000"
