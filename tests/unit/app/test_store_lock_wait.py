"""A starting daemon waits a moment for a home's lock a tenexd command holds (docs/ARCHITECTURE.md,
"Durability contract"), and is refused when it stays held."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tenex_daemon.adapters.storage.filesystem import FileSystemStore, StoreLockedError
from tenex_daemon.adapters.storage.filesystem.lock import lock_home, unlock_home
from tenex_daemon.app.store_check import open_when_free


async def test_a_lock_given_back_within_the_wait_lets_the_store_open(tmp_path: Path) -> None:
    """The home's lock held by another reader for half a second: the store opens once it is given back."""
    held = lock_home(tmp_path / "conversations")
    asyncio.get_running_loop().call_later(0.5, unlock_home, held)
    store = FileSystemStore(tmp_path)

    await open_when_free(store, wait_s=5.0)

    await store.close()


async def test_a_lock_held_past_the_wait_is_refused_saying_by_whom(tmp_path: Path) -> None:
    """The home's lock held for good (a daemon): refused after the wait, naming the holder's process."""
    held = lock_home(tmp_path / "conversations")
    started = time.monotonic()
    try:
        with pytest.raises(StoreLockedError, match="in use by process"):
            await open_when_free(FileSystemStore(tmp_path), wait_s=0.5)
    finally:
        unlock_home(held)
    assert time.monotonic() - started >= 0.5
