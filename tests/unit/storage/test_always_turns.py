"""The ``always`` policy: calls that write one file take turns in call order, so saves of one small value
made at once all succeed and the newest call's value is the one kept."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tenex_daemon.adapters.storage.filesystem import FileSystemStore


async def reopened_value(home: Path, key: str) -> str | None:
    """The value stored under ``key``, read by a store opened anew on ``home``."""
    store = FileSystemStore(home, fsync="always")
    await store.open()
    try:
        return await store.get_meta(key)
    finally:
        await store.close()


async def test_saves_of_one_value_at_once_all_succeed_and_the_last_call_wins(tmp_path: Path) -> None:
    """Sixteen saves of one key started together (values of different lengths) each succeed, and the
    value kept is the last call's: they shared the file's temp file, and all but one failed, before."""
    home = tmp_path / "home"
    store = FileSystemStore(home, fsync="always")
    await store.open()
    values = [f"{i}:" + "x" * (5000 * (i % 7)) for i in range(16)]
    try:
        outcomes = await asyncio.gather(*(store.set_meta("k", v) for v in values), return_exceptions=True)
        assert outcomes == [None] * len(values)
        assert await store.get_meta("k") == values[-1]
    finally:
        await store.close()
    assert await reopened_value(home, "k") == values[-1]


async def test_a_cancelled_save_still_goes_before_the_next_save_of_that_value(tmp_path: Path) -> None:
    """A caller cancelled while its save is being written stops waiting; the next save of the same value
    still waits for that write, so the newer value is the one kept."""
    home = tmp_path / "home"
    store = FileSystemStore(home, fsync="always")
    await store.open()
    try:
        first = asyncio.ensure_future(store.set_meta("k", "old" * 20_000))
        await asyncio.sleep(0)  # its write is under way
        second = asyncio.ensure_future(store.set_meta("k", "new"))
        first.cancel()
        await second
        assert first.cancelled()
        assert await store.get_meta("k") == "new"
    finally:
        await store.close()
    assert await reopened_value(home, "k") == "new"
