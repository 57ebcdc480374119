"""The ``batch`` policy's group commit: which calls share a group, how a group reaches the commit
thread, and what a group that fails as a whole does to its callers and to the groups after it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from tenex_daemon.adapters.storage.filesystem import FileSystemStore, committer
from tenex_daemon.adapters.storage.filesystem.group_commit import apply_journaled
from tenex_daemon.adapters.storage.filesystem.journal import Journal
from tenex_daemon.adapters.storage.filesystem.ops import commit_thread


async def open_batch(home: Path, **options: Any) -> FileSystemStore:
    """An open store with the batch policy."""
    store = FileSystemStore(home, fsync="batch", **options)
    await store.open()
    return store


def count_journal_writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, each write of the commit journal (one per group) appends its number of frames."""
    writes: list[int] = []
    real_write = Journal.write

    def counted(journal: Journal, frames: list[bytes], *args: Any, **kwargs: Any) -> None:
        writes.append(len(frames))
        real_write(journal, frames, *args, **kwargs)

    monkeypatch.setattr(Journal, "write", counted)
    return writes


class RecordingThread:
    """The commit thread, with each piece of work handed to it recorded."""

    def __init__(self) -> None:
        self.submitted: list[Callable[..., Any]] = []
        self._thread = commit_thread()

    def submit(self, work: Callable[..., Any], *args: Any) -> Future[Any]:
        self.submitted.append(work)
        return self._thread.submit(work, *args)


async def test_a_commit_to_an_idle_committer_is_handed_to_the_thread_by_the_call_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The call that finds no group in flight gives its group to the commit thread before it first
    waits: no turn of another task stands between a reply's save and the disk."""
    store = await open_batch(tmp_path / "home")
    thread = RecordingThread()
    monkeypatch.setattr(committer, "commit_thread", lambda: thread)
    try:
        saving = asyncio.get_running_loop().create_task(store.set_meta("cursor", "one"))
        await asyncio.sleep(0)  # the task runs up to its first wait; nothing else has run
        assert len(thread.submitted) == 1
        await saving
        assert await store.get_meta("cursor") == "one"
    finally:
        monkeypatch.undo()
        await store.close()


async def test_calls_made_while_a_group_is_in_flight_share_the_next_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ten saves made while one group is being committed are committed together, by one journal write."""
    store = await open_batch(tmp_path / "home")
    writes = count_journal_writes(monkeypatch)
    try:
        first = asyncio.get_running_loop().create_task(store.set_meta("first", "1"))
        await asyncio.sleep(0)  # the first group is in flight
        await asyncio.gather(first, *(store.set_meta(f"key{i}", str(i)) for i in range(10)))
        assert writes == [1, 10]
        assert [await store.get_meta(f"key{i}") for i in range(10)] == [str(i) for i in range(10)]
    finally:
        monkeypatch.undo()
        await store.close()


async def test_callers_that_save_again_as_their_group_settles_share_one_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five writers whose saves settle together and who save again at once make one group of those
    five saves (one fsync), not one of the first writer's and another of the other four."""
    store = await open_batch(tmp_path / "home")
    writes = count_journal_writes(monkeypatch)

    async def twice(i: int) -> None:
        await store.set_meta(f"a{i}", "1")
        await store.set_meta(f"b{i}", "2")

    try:
        blocker = asyncio.get_running_loop().create_task(store.set_meta("blocker", "0"))
        await asyncio.sleep(0)  # a group in flight: the five first saves queue behind it together
        await asyncio.gather(blocker, *(twice(i) for i in range(5)))
        assert writes == [1, 5, 5]
    finally:
        monkeypatch.undo()
        await store.close()


async def test_a_group_that_fails_as_a_whole_fails_its_callers_and_the_next_group_is_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A defect in a commit stage fails every call of that group with its error (nothing is said saved
    that was not), and the saves after it are committed as usual."""
    store = await open_batch(tmp_path / "home")
    failures = iter([RuntimeError("a defect in a stage")])

    def failing_once(journal: Journal, ops: Any) -> None:
        failure = next(failures, None)
        if failure is not None:
            raise failure
        apply_journaled(journal, ops)

    monkeypatch.setattr(committer, "apply_journaled", failing_once)
    try:
        with pytest.raises(RuntimeError, match="a defect in a stage"):
            await store.set_meta("lost", "never saved")
        await store.set_meta("kept", "saved")
        assert await store.get_meta("kept") == "saved"
        assert await store.get_meta("lost") is None
    finally:
        monkeypatch.undo()
        await store.close()


async def test_a_batch_delay_gathers_the_calls_made_within_it_and_a_close_cuts_it_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``batch_delay`` a group waits that long before it goes to the thread, and saves made meanwhile
    join it (one journal write for both); a close does not wait the delay out but hands the group over."""
    store = await open_batch(tmp_path / "home", batch_delay=60.0)
    writes = count_journal_writes(monkeypatch)
    try:
        first = asyncio.get_running_loop().create_task(store.set_meta("first", "1"))
        await asyncio.sleep(0)  # queued: its group waits out the delay
        second = asyncio.get_running_loop().create_task(store.set_meta("second", "2"))
        await asyncio.sleep(0)
        assert writes == []  # nothing has gone to the thread
        async with asyncio.timeout(10):  # a sixth of the delay: the close did not wait it out
            await store.close()
        await asyncio.gather(first, second)
        assert writes[0] == 2  # then the final checkpoint's own frame
    finally:
        monkeypatch.undo()
        await store.close()


async def test_a_close_does_not_wait_for_writers_that_keep_saving(tmp_path: Path) -> None:
    """Two writers saving without pause do not hold a close back: it waits for the group in flight and
    the calls already queued, not for every save the writers go on to make."""
    store = await open_batch(tmp_path / "home")

    async def writer(name: str) -> int:
        made = 0
        for n in range(1000):
            try:
                await store.set_meta(name, str(n))
            except Exception:  # the store closed under it
                break
            made += 1
        return made

    writers = [asyncio.get_running_loop().create_task(writer(f"w{i}")) for i in range(2)]
    await asyncio.sleep(0.02)  # both are saving
    async with asyncio.timeout(10):
        await store.close()
    made = await asyncio.gather(*writers)
    assert sum(made) < 2000


async def test_closing_commits_every_call_already_queued(tmp_path: Path) -> None:
    """Saves queued when the store starts closing, in the same turn of the loop, are committed before
    the final checkpoint, close returns, and the values are there when the home is opened again (the
    committer's own task used to miss the close's wake-up and wait for ever)."""
    home = tmp_path / "home"
    store = await open_batch(home)
    saves = [asyncio.get_running_loop().create_task(store.set_meta(f"key{i}", str(i))) for i in range(5)]
    await asyncio.sleep(0)  # the saves are queued; the close starts in the same turn
    async with asyncio.timeout(10):  # in this task, not a task of its own: the turn matters
        await store.close()
    await asyncio.gather(*saves)
    reopened = await open_batch(home)
    try:
        assert [await reopened.get_meta(f"key{i}") for i in range(5)] == [str(i) for i in range(5)]
    finally:
        await reopened.close()
