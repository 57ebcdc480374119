"""Lines a full disk would not take, and what goes with them.

``batch``: the commit journal is fsynced before the logs get their lines; a log write that fails then
(ENOSPC) used to fail the call while the journal kept the line and the group's snapshot was already
replaced: the running store had the run's state without its event, the caller's retry stored a second
event, and a replay of the journal at the next open brought the first back (a duplicate). Such a line
now counts as stored and waits in the journal. ``always``: a snapshot saved with an event whose line
failed was written all the same. Both: a failed write to an event-id bucket, cut back, could cut a
line another thread had appended to it meanwhile.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import threading
from pathlib import Path

import pytest

from tenex_daemon.adapters.storage.atomic import write_all
from tenex_daemon.adapters.storage.filesystem import (
    LOG_NAME,
    STATE_NAME,
    FileSystemStore,
    FsyncPolicy,
    derived,
    direct,
    group_commit,
    journal,
)
from tenex_daemon.adapters.storage.filesystem.layout import JOURNAL_DIR
from tenex_daemon.adapters.storage.filesystem.processed import bucket_of
from tenex_daemon.core.conversation import Conversation
from tests.conftest import Cast


class FullDisk:
    """Writes to conversation logs fail with ENOSPC while :attr:`full` (the journal's still succeed)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.full = True
        monkeypatch.setattr(group_commit, "write_all", self.write)
        monkeypatch.setattr(journal, "write_all", self.write)

    def write(self, fd: int, data: bytes) -> None:
        if self.full and os.readlink(f"/proc/self/fd/{fd}").endswith(LOG_NAME):
            raise OSError(errno.ENOSPC, "No space left on device")
        write_all(fd, data)


async def history(home: Path, conversation_id: str) -> list[str]:
    """Open ``home`` (replaying any journal), return the conversation's event ids, close it."""
    store = FileSystemStore(home, fsync="batch")
    await store.open()
    try:
        loaded = await store.load(conversation_id)
        assert loaded is not None
        return [event.id for event in loaded.history]
    finally:
        await store.close()


def snapshot_title(home: Path, conversation_id: str) -> str:
    """The title in the conversation's ``state.json`` on disk."""
    data = json.loads((home / "conversations" / conversation_id / STATE_NAME).read_bytes())
    return str(data["state"]["title"])


def journal_files(home: Path) -> list[Path]:
    folder = home / "conversations" / JOURNAL_DIR
    return sorted(folder.iterdir()) if folder.exists() else []


async def started(home: Path, cast: Cast) -> tuple[FileSystemStore, Conversation]:
    store = FileSystemStore(home, fsync="batch")
    await store.open()
    root = cast.user_says("root", kind=11)
    conversation = Conversation(id=root.id, title="t", created_at=1, updated_at=1)
    conversation.append(root)
    await store.create(conversation)
    return store, conversation


async def test_a_journaled_line_its_log_could_not_take_counts_once_and_waits_for_room(
    tmp_path: Path, cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The event counts (True, processed, a second copy is a duplicate) with the state saved beside it;
    while its line waits, other lines of that log are refused with ENOSPC, an uncached load says why
    it cannot read the log, and no checkpoint deletes the journal (a crash then replays the line,
    once); once there is room the line is written before the next one."""
    home = tmp_path / "home"
    store, root = await started(home, cast)
    log_path = home / "conversations" / root.id / LOG_NAME
    disk = FullDisk(monkeypatch)
    state = await store.load(root.id)
    assert state is not None
    state.title = "changed by the run"
    reply = cast.alice_says("the reply", tags=[["E", root.id]])

    assert await store.append_event(root.id, reply, state=state)

    assert await store.is_processed(reply.id)
    assert reply.id.encode() not in log_path.read_bytes()
    again = await store.load(root.id)
    assert again is not None
    assert again.title == "changed by the run"
    assert [e.id for e in again.history] == [root.id, reply.id]
    assert not await store.append_event(root.id, reply, state=again)  # the caller's retry: a duplicate
    later = cast.alice_says("while the first waits", tags=[["E", root.id]])
    again.title = "changed by a run whose event is refused"
    with pytest.raises(OSError, match="an accepted line is not yet written") as refused:
        await store.append_event(root.id, later, state=again)
    assert refused.value.errno == errno.ENOSPC
    assert not await store.is_processed(later.id)
    assert snapshot_title(home, root.id) == "changed by the run"  # no state without its event
    with pytest.raises(OSError, match="checkpoint held back"):
        await store._committer.checkpoint()
    store._cache.clear()
    with pytest.raises(OSError, match="an accepted line is not yet written") as unreadable:
        await store.load(root.id)
    assert unreadable.value.errno == errno.ENOSPC
    shutil.copytree(home, tmp_path / "crash")  # a crash at this instant

    disk.full = False
    assert await store.append_event(root.id, later)
    lines = log_path.read_bytes()
    assert lines.index(reply.id.encode()) < lines.index(later.id.encode())
    await store.close()

    assert journal_files(home) == []
    assert await history(home, root.id) == [root.id, reply.id, later.id]
    assert await history(tmp_path / "crash", root.id) == [root.id, reply.id]


@pytest.mark.parametrize("room_before_close", [True, False])
async def test_a_line_waiting_at_close_is_written_or_kept_in_the_journal(
    tmp_path: Path, cast: Cast, monkeypatch: pytest.MonkeyPatch, room_before_close: bool
) -> None:
    """Room back before the close: its final checkpoint writes the waiting line and deletes the journal.
    Still full: the journal stays and the next open replays the line. Either way it is there once."""
    home = tmp_path / "home"
    store, root = await started(home, cast)
    disk = FullDisk(monkeypatch)
    reply = cast.alice_says("the reply", tags=[["E", root.id]])
    assert await store.append_event(root.id, reply)
    disk.full = not room_before_close
    await store.close()
    disk.full = False

    assert bool(journal_files(home)) != room_before_close
    assert await history(home, root.id) == [root.id, reply.id]
    assert journal_files(home) == []


@pytest.mark.parametrize("fsync", ["always", "batch"])
async def test_a_failed_bucket_write_cut_back_never_removes_a_line_committed_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: FsyncPolicy
) -> None:
    """The derived lines' writer and a commit (``mark_processed``) both append to an event-id bucket.
    A derived write that fails (a full disk) is cut back to the bucket's size before it: a line the
    commit appended while it was being written was cut with it, though acknowledged, and the id was
    processed no more once its bucket was read again (a restart)."""
    store = FileSystemStore(tmp_path / "home", fsync=fsync)
    await store.open()
    marked, queued = "abc" + "1" * 61, "abc" + "2" * 61
    writing, committed = threading.Event(), threading.Event()

    def fails_after_a_commit(fd: int, data: bytes) -> None:
        writing.set()
        committed.wait(0.5)  # the commit's line lands meanwhile (unless it waits for this write)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(derived, "write_all", fails_after_a_commit)
    store._processed.add(queued, "some-conversation")

    async def derived_round() -> None:
        async with store._derived.lock:
            await store._derived.flush_locked()

    round_task = asyncio.create_task(derived_round())
    assert await asyncio.to_thread(writing.wait, 5)
    await store.mark_processed(marked)
    committed.set()
    await round_task
    assert store._derived.unwritten
    monkeypatch.undo()
    await store.close()

    reopened = FileSystemStore(tmp_path / "home", fsync=fsync)
    await reopened.open()
    try:
        assert await reopened.is_processed(marked)
        assert await reopened.is_processed(queued)
    finally:
        await reopened.close()


async def test_always_a_snapshot_saved_with_an_event_whose_line_failed_keeps_its_old_content(
    tmp_path: Path, cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``always``: the line's write fails (a full disk), the call raises, and the snapshot saved with it
    is not written (it was: the state had the run's changes without its event)."""
    home = tmp_path / "home"
    store = FileSystemStore(home, fsync="always")
    await store.open()
    root = cast.user_says("root", kind=11)
    conversation = Conversation(id=root.id, title="t", created_at=1, updated_at=1)
    conversation.append(root)
    await store.create(conversation)
    monkeypatch.setattr(direct, "write_all", FullDisk(monkeypatch).write)
    state = await store.load(root.id)
    assert state is not None
    state.title = "changed by the run"
    reply = cast.alice_says("the reply", tags=[["E", root.id]])
    with pytest.raises(OSError, match="No space left") as failed:
        await store.append_event(root.id, reply, state=state)
    assert failed.value.errno == errno.ENOSPC
    assert snapshot_title(home, root.id) == "t"
    assert not await store.is_processed(reply.id)
    loaded = await store.load(root.id)
    assert loaded is not None
    assert (loaded.title, [e.id for e in loaded.history]) == ("t", [root.id])
    await store.close()


async def test_a_commits_bucket_write_that_fails_part_way_leaves_no_part_of_its_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``batch`` commit's write to an event-id bucket fails half-way (a full disk): the call fails, and the
    bucket is cut back, so the next line written to it (the derived writer's, or a commit's) does not run
    into half a line and become an unreadable one."""
    store = FileSystemStore(tmp_path / "home", fsync="batch")
    await store.open()
    marked = "abd" + "1" * 61
    bucket = tmp_path / "home" / "conversations" / ".events" / bucket_of(marked)
    before = bucket.read_bytes() if bucket.exists() else b""

    def half_then_full(fd: int, data: bytes) -> None:
        if os.readlink(f"/proc/self/fd/{fd}") == str(bucket):
            os.write(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        write_all(fd, data)

    monkeypatch.setattr(group_commit, "write_all", half_then_full)
    with pytest.raises(OSError, match="No space left"):
        await store.mark_processed(marked)
    monkeypatch.undo()
    try:
        assert bucket.read_bytes() == before
    finally:
        await store.close()
