"""The ``batch`` policy's commit journal: one fsync per group, replayed after a crash or a power loss.

A power loss is simulated by copying the home while the store is open (so nothing is flushed
or closed) and cutting the copy's logs back to what an earlier fsync had made durable: only
the journal then holds the acknowledged appends.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

import tenex_daemon.adapters.storage.filesystem.store as store_module
from tenex_daemon.adapters.storage import atomic
from tenex_daemon.adapters.storage.filesystem import LOG_NAME, FileSystemStore, committer, journal
from tenex_daemon.adapters.storage.filesystem.erasure import tombstone
from tenex_daemon.adapters.storage.filesystem.folder import scan_folder
from tenex_daemon.adapters.storage.filesystem.journal import (
    append_frame,
    checkpoint_frame,
    create_frame,
    forget_frame,
    read_journal,
    replace_frame,
)
from tenex_daemon.adapters.storage.filesystem.journal_replay import replay
from tenex_daemon.adapters.storage.filesystem.layout import JOURNAL_DIR
from tenex_daemon.adapters.storage.filesystem.lock import StoreOpenError
from tenex_daemon.adapters.storage.filesystem.ops import Op
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.errors import ConversationExistsError
from tests.conftest import Cast


async def open_batch(home: Path) -> FileSystemStore:
    """An open store with the batch policy."""
    store = FileSystemStore(home, fsync="batch")
    await store.open()
    return store


async def start(store: FileSystemStore, cast: Cast, title: str = "Journal drill") -> Conversation:
    """A new conversation with its root event."""
    root = cast.user_says(title, kind=11, tags=[["title", title]])
    conversation = Conversation(id=root.id, title=title, created_at=1, updated_at=1)
    conversation.append(root)
    await store.create(conversation)
    return conversation


def crash_copy(home: Path, target: Path) -> Path:
    """Copy a home whose store is still open, as a crash at this instant would leave it."""
    shutil.copytree(home, target)
    return target


async def title_after_reopening(home: Path, conversation_id: str) -> str | None:
    """Open ``home`` (a crash copy: its journal is replayed) and return the conversation's title."""
    reopened = FileSystemStore(home, fsync="batch")
    await reopened.open()
    try:
        loaded = await reopened.load(conversation_id)
        return None if loaded is None else loaded.title
    finally:
        await reopened.close()


def journal_files(home: Path) -> list[str]:
    """Names of the journal files present."""
    folder = home / "conversations" / JOURNAL_DIR
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


async def history_ids(home: Path, conversation_id: str, *, fsync: str = "always") -> tuple[list[str], set[str]]:
    """Open ``home``, return the conversation's event ids and the kinds of repair made."""
    store = FileSystemStore(home, fsync="batch" if fsync == "batch" else "always")
    await store.open()
    try:
        loaded = await store.load(conversation_id)
        assert loaded is not None
        return [e.id for e in loaded.history], {a.kind for a in store.recovery}
    finally:
        await store.close()


async def recreate(store: FileSystemStore, cast: Cast, conversation_id: str) -> str:
    """Delete the conversation, create a new one under the same id, append one event; return its id."""
    assert await store.delete(conversation_id)
    await store.create(Conversation(id=conversation_id, title="Again", created_at=2, updated_at=2))
    fresh = cast.bob_says("after the re-creation")
    await store.append_event(conversation_id, fresh)
    return fresh.id


def test_frames_round_trip_and_a_forget_drops_earlier_appends() -> None:
    """Frames decode to what was written; a forget frame drops that conversation's earlier appends only."""
    data = (
        append_frame("a/events.log", 0, b"one\n")
        + append_frame(".events/abc", 7, b"\nid -")
        + append_frame("b/events.log", 4, b"two\n")
        + forget_frame("a")
        + append_frame("a/events.log", 0, b"three\n")
    )
    read = read_journal(data)
    assert read.appends == [
        (".events/abc", 7, b"\nid -"), ("b/events.log", 4, b"two\n"), ("a/events.log", 0, b"three\n"),
    ]
    assert read.forgotten == {"a"}
    assert (read.good_end, read.corrupt) == (len(data), False)
    torn = read_journal(data + append_frame("c/events.log", 0, b"four\n")[:-2])
    assert (torn.good_end, torn.corrupt) == (len(data), False)


async def test_power_loss_after_acknowledgement_is_replayed_from_the_journal(
    tmp_path: Path, cast: Cast
) -> None:
    """Appends acknowledged by a batch commit survive the loss of every un-fsynced log byte."""
    home = tmp_path / "home"
    store = await open_batch(home)
    conversation = await start(store, cast)
    log_path = home / "conversations" / conversation.id / LOG_NAME
    durable_size = log_path.stat().st_size  # create() fsynced this much
    events = [cast.alice_says(f"reply {i}") for i in range(20)]
    await asyncio.gather(*(store.append_event(conversation.id, e) for e in events[:10]))
    for event in events[10:]:
        await store.append_event(conversation.id, event)
    copy = crash_copy(home, tmp_path / "copy")
    await store.close()
    copied_log = copy / "conversations" / conversation.id / LOG_NAME
    os.truncate(copied_log, durable_size)  # the page cache was lost: only the journal has the replies

    ids, repairs = await history_ids(copy, conversation.id)

    assert ids == [conversation.id] + [e.id for e in events]
    assert "journal_replayed" in repairs
    assert journal_files(copy) == []
    assert journal_files(home) == []  # a clean close checkpoints and removes the journal


async def test_replay_keeps_what_the_log_has_and_cuts_only_a_torn_tail(tmp_path: Path, cast: Cast) -> None:
    """A log holding half of the acknowledged appends plus a torn line gets exactly the missing half."""
    home = tmp_path / "home"
    store = await open_batch(home)
    conversation = await start(store, cast)
    log_path = home / "conversations" / conversation.id / LOG_NAME
    events = [cast.alice_says(f"reply {i}") for i in range(6)]
    sizes = []
    for event in events:
        await store.append_event(conversation.id, event)
        sizes.append(log_path.stat().st_size)
    copy = crash_copy(home, tmp_path / "copy")
    await store.close()
    copied_log = copy / "conversations" / conversation.id / LOG_NAME
    os.truncate(copied_log, sizes[2] + 17)  # three replies, then the start of the fourth

    ids, repairs = await history_ids(copy, conversation.id)

    assert ids == [conversation.id] + [e.id for e in events]
    assert "journal_replayed" in repairs
    assert copied_log.read_bytes() == log_path.read_bytes()


async def test_torn_journal_tail_is_cut_and_every_whole_frame_replayed(tmp_path: Path, cast: Cast) -> None:
    """A frame being written at the crash is dropped (it was never acknowledged); the rest replays."""
    home = tmp_path / "home"
    store = await open_batch(home)
    conversation = await start(store, cast)
    durable_size = (home / "conversations" / conversation.id / LOG_NAME).stat().st_size
    events = [cast.alice_says(f"reply {i}") for i in range(4)]
    for event in events:
        await store.append_event(conversation.id, event)
    copy = crash_copy(home, tmp_path / "copy")
    await store.close()
    (name,) = journal_files(copy)
    journal_path = copy / "conversations" / JOURNAL_DIR / name
    torn = append_frame(f"{conversation.id}/{LOG_NAME}", 10**6, b"never acknowledged\n")[:-5]
    journal_path.write_bytes(journal_path.read_bytes() + torn)
    copied_log = copy / "conversations" / conversation.id / LOG_NAME
    os.truncate(copied_log, durable_size)

    ids, repairs = await history_ids(copy, conversation.id)

    assert ids == [conversation.id] + [e.id for e in events]
    assert {"torn_tail_cut", "journal_replayed"} <= repairs


async def test_corrupt_journal_is_copied_aside_and_its_good_frames_replayed(
    tmp_path: Path, cast: Cast
) -> None:
    """A frame failing its checksum stops the replay there; the journal is kept in corrupt/."""
    home = tmp_path / "home"
    store = await open_batch(home)
    conversation = await start(store, cast)
    first, second = cast.alice_says("first"), cast.alice_says("second")
    await store.append_event(conversation.id, first)
    log_path = home / "conversations" / conversation.id / LOG_NAME
    after_first = log_path.stat().st_size
    await store.append_event(conversation.id, second)
    copy = crash_copy(home, tmp_path / "copy")
    await store.close()
    (name,) = journal_files(copy)
    journal_path = copy / "conversations" / JOURNAL_DIR / name
    data = bytearray(journal_path.read_bytes())
    data[-3] ^= 0xFF  # inside the second frame
    journal_path.write_bytes(bytes(data))
    copied_log = copy / "conversations" / conversation.id / LOG_NAME
    os.truncate(copied_log, after_first - 1)  # the first reply's line lost its newline

    ids, repairs = await history_ids(copy, conversation.id)

    assert first.id in ids
    assert "moved_to_corrupt" in repairs
    kept = sorted(p.name for p in (copy / "conversations" / "corrupt").iterdir())
    assert any(p.startswith(f"journal.{name}.") for p in kept)


async def test_deleted_conversation_never_receives_its_old_appends(tmp_path: Path, cast: Cast) -> None:
    """A conversation deleted and created again under the same id is not fed the deleted one's events."""
    home = tmp_path / "home"
    store = await open_batch(home)
    conversation = await start(store, cast)
    old = [cast.alice_says(f"old {i}") for i in range(3)]
    for event in old:
        await store.append_event(conversation.id, event)
    fresh = await recreate(store, cast, conversation.id)
    copy = crash_copy(home, tmp_path / "copy")
    await store.close()

    ids, _ = await history_ids(copy, conversation.id)

    assert ids == [fresh]


async def test_checkpoint_starts_a_new_journal_and_keeps_everything(
    tmp_path: Path, cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the size limit the logs are fsynced and a new journal replaces the old one."""
    monkeypatch.setattr(committer, "JOURNAL_LIMIT", 2_000)
    home = tmp_path / "home"
    store = await open_batch(home)
    conversation = await start(store, cast)
    events = [cast.alice_says(f"reply {i} " + "x" * 300) for i in range(12)]
    for event in events:
        await store.append_event(conversation.id, event)
    assert store._committer.journal is not None
    for _ in range(500):  # the last checkpoint may still be running after the last acknowledgement
        if store._committer.journal.generation >= 2 and len(journal_files(home)) == 1:
            break
        await asyncio.sleep(0.01)
    assert store._committer.journal.generation >= 2
    assert len(journal_files(home)) == 1
    copy = crash_copy(home, tmp_path / "copy")
    await store.close()

    ids, _ = await history_ids(copy, conversation.id, fsync="batch")

    assert ids == [conversation.id] + [e.id for e in events]


async def test_failed_journal_write_fails_the_append_and_leaves_the_log_as_it_was(
    tmp_path: Path, cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing is acknowledged without its fsync: the append raises and its bytes are cut back."""
    home = tmp_path / "home"
    store = await open_batch(home)
    conversation = await start(store, cast)
    log_path = home / "conversations" / conversation.id / LOG_NAME
    before = log_path.read_bytes()

    def broken(self: journal.Journal, *args: object, **kwargs: object) -> None:
        raise OSError(5, "I/O error (simulated)")

    with monkeypatch.context() as patch:
        patch.setattr(journal.Journal, "write", broken)
        with pytest.raises(OSError, match="simulated"):
            await store.append_event(conversation.id, cast.alice_says("lost in transit"))
    assert log_path.read_bytes() == before
    kept = cast.alice_says("kept")
    await store.append_event(conversation.id, kept)
    await store.close()

    ids, _ = await history_ids(home, conversation.id)
    assert ids == [conversation.id, kept.id]


async def test_archived_deleted_and_recreated_conversation_keeps_its_new_appends(
    tmp_path: Path, cast: Cast
) -> None:
    """Archive, delete, create again, append: the new append is in the new log after a clean close."""
    home = tmp_path / "home"
    store = await open_batch(home)
    conversation = await start(store, cast)
    await store.append_event(conversation.id, cast.alice_says("before the archive"))
    await store.set_archived(conversation.id, True)
    fresh = await recreate(store, cast, conversation.id)
    await store.close()

    ids, _ = await history_ids(home, conversation.id)

    assert ids == [fresh]


async def test_checkpoint_follows_a_conversation_archived_meanwhile(
    tmp_path: Path, cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log written under <id>/ and archived before the checkpoint is fsynced where it now lives."""
    home = tmp_path / "home"
    store = await open_batch(home)
    conversation = await start(store, cast)
    event = cast.alice_says("archived soon")
    await store.append_event(conversation.id, event)
    await store.set_archived(conversation.id, True)
    synced: list[Path | None] = []
    real = journal.Journal._sync

    def recording(self: journal.Journal, relpath: str) -> Path | None:
        synced.append(real(self, relpath))
        return synced[-1]

    monkeypatch.setattr(journal.Journal, "_sync", recording)
    await store.close()  # the final checkpoint

    assert home / "conversations" / "archive" / conversation.id / LOG_NAME in synced
    ids, _ = await history_ids(home, conversation.id)
    assert ids == [conversation.id, event.id]


async def test_failed_new_journal_at_checkpoint_keeps_the_old_one_working(
    tmp_path: Path, cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If the next journal cannot be created, commits go on in the current one and nothing is lost."""
    monkeypatch.setattr(committer, "JOURNAL_LIMIT", 1)
    home = tmp_path / "home"
    store = await open_batch(home)
    conversation = await start(store, cast)
    real = journal.Journal._create

    def refuse(self: journal.Journal, generation: int) -> int:
        if generation > 0:
            raise OSError(28, "No space left on device (simulated)")
        return real(self, generation)

    monkeypatch.setattr(journal.Journal, "_create", refuse)
    events = [cast.alice_says(f"reply {i}") for i in range(3)]
    for event in events:
        await store.append_event(conversation.id, event)
    assert journal_files(home) == ["0"]
    copy = crash_copy(home, tmp_path / "copy")
    await store.close()

    ids, _ = await history_ids(copy, conversation.id)
    assert ids == [conversation.id] + [e.id for e in events]


async def test_a_checkpoint_without_a_thread_to_fsync_on_keeps_the_journal_covering_its_files(
    tmp_path: Path, cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint whose fsyncs cannot start (no thread: a process or thread limit) keeps every file it was to
    fsync as the journal's to cover, and the journal: it forgot them (only an OSError kept them), and the next
    checkpoint deleted the journal with those files never fsynced (32 of 40 logs in the probe)."""
    home = tmp_path / "home"
    store = await open_batch(home)
    conversation = await start(store, cast)
    for n in range(3):
        await store.append_event(conversation.id, cast.alice_says(f"reply {n}"))
    current = store._committer.journal
    assert current is not None
    dirty = set(current._dirty)

    def no_thread(work: Any, items: Any) -> Any:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(journal, "run_parallel", no_thread)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        await store._committer.checkpoint()

    assert dirty
    assert current._dirty >= dirty
    assert journal_files(home) == ["0"]
    monkeypatch.undo()
    await store.close()


async def test_replayed_conversation_is_rescanned_whole_when_its_buckets_were_lost(
    tmp_path: Path, cast: Cast
) -> None:
    """Index records survived, bucket lines did not: open still knows every event id of a replayed log."""
    home = tmp_path / "home"
    store = await open_batch(home)
    conversation = await start(store, cast)
    events = [cast.alice_says(f"reply {i}") for i in range(5)]
    for event in events[:3]:
        await store.append_event(conversation.id, event)
    async with store._derived.lock:
        await store._derived.flush_locked()  # the index log now counts three replies
    for event in events[3:]:
        await store.append_event(conversation.id, event)
    copy = crash_copy(home, tmp_path / "copy")
    await store.close()
    for bucket in (copy / "conversations" / ".events").iterdir():
        bucket.unlink()  # the power loss took the bucket lines (never fsynced between snapshots)

    reopened = FileSystemStore(copy)
    await reopened.open()
    try:
        for event_id in [conversation.id] + [e.id for e in events]:
            assert await reopened.is_processed(event_id), event_id
    finally:
        await reopened.close()


def test_replace_and_create_frames_round_trip_and_a_forget_drops_them() -> None:
    """Replace frames keep each file's last content, create frames their folder; a forget drops both."""
    data = (
        create_frame("a")
        + replace_frame("a/state.json", b"{1}")
        + replace_frame(".meta/k.json", b"{k1}")
        + replace_frame("a/state.json", b"{2}")
        + create_frame("b")
        + replace_frame("b/state.json", b"{b}")
        + forget_frame("b")
        + replace_frame(".meta/k.json", b"{k2}")
    )
    read = read_journal(data)
    assert read.replaces == {"a/state.json": b"{2}", ".meta/k.json": b"{k2}"}
    assert read.created == ["a"]
    assert (read.good_end, read.corrupt) == (len(data), False)


async def test_power_loss_after_batch_create_and_snapshots_is_replayed(tmp_path: Path, cast: Cast) -> None:
    """A conversation created, appended to and re-snapshotted under batch (no file fsynced, only the
    journal) comes back whole after losing every un-fsynced byte: folder, log and last state."""
    home = tmp_path / "home"
    store = await open_batch(home)
    conversation = await start(store, cast)
    reply = cast.alice_says("a reply")
    await store.append_event(conversation.id, reply)
    conversation.append(reply)
    conversation.title = "Renamed twice"
    await store.save_state(conversation)
    await store.set_meta("cursor", "42")
    copy = crash_copy(home, tmp_path / "copy")
    await store.close()
    # the page cache was lost: neither the folder's rename nor the meta file reached the disk
    shutil.rmtree(copy / "conversations" / conversation.id)
    for meta in (copy / "conversations" / ".meta").iterdir():
        meta.unlink()

    reopened = FileSystemStore(copy, fsync="always")
    await reopened.open()
    try:
        loaded = await reopened.load(conversation.id)
        assert loaded is not None
        assert [e.id for e in loaded.history] == [conversation.id, reply.id]
        assert loaded.title == "Renamed twice"
        assert await reopened.get_meta("cursor") == "42"
        assert "journal_replayed" in {a.kind for a in reopened.recovery}
    finally:
        await reopened.close()
    assert journal_files(copy) == []


async def test_a_stale_snapshot_is_restored_from_the_journal(tmp_path: Path, cast: Cast) -> None:
    """A state file the disk kept in an older version is brought to the last journaled snapshot."""
    home = tmp_path / "home"
    store = await open_batch(home)
    conversation = await start(store, cast)
    state_path = home / "conversations" / conversation.id / "state.json"
    old_state = state_path.read_bytes()
    conversation.title = "Newest title"
    await store.save_state(conversation)
    copy = crash_copy(home, tmp_path / "copy")
    await store.close()
    (copy / "conversations" / conversation.id / "state.json").write_bytes(old_state)

    assert await title_after_reopening(copy, conversation.id) == "Newest title"


async def test_a_failed_journal_write_removes_the_created_folder(
    tmp_path: Path, cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A create whose journal write fails raises and leaves no folder behind; the id stays free."""
    home = tmp_path / "home"
    store = await open_batch(home)
    root = cast.user_says("never made", kind=11)
    conversation = Conversation(id=root.id, title="x", created_at=1, updated_at=1)
    conversation.append(root)
    assert store._committer.journal is not None

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError(5, "journal disk gone")

    monkeypatch.setattr(store._committer.journal, "write", broken)
    with pytest.raises(OSError, match="journal disk gone"):
        await store.create(conversation)
    assert not (home / "conversations" / root.id).exists()
    monkeypatch.undo()
    await store.create(conversation)  # the id is still free
    assert (await store.load(root.id)) is not None
    await store.close()


async def test_two_creates_of_one_id_in_a_group_leave_one_conversation(tmp_path: Path, cast: Cast) -> None:
    """Two creates of the same id committed together: one wins, the other is refused as existing,
    and a replay of the journal brings back the winner alone."""
    home = tmp_path / "home"
    store = await open_batch(home)
    root = cast.user_says("first", kind=11)
    first = Conversation(id=root.id, title="first", created_at=1, updated_at=1)
    first.append(root)
    second = Conversation(id=root.id, title="second", created_at=1, updated_at=1)
    second.append(root)
    second.append(cast.alice_says("not part of the winner"))

    outcomes = await asyncio.gather(store.create(first), store.create(second), return_exceptions=True)

    assert outcomes[0] is None
    assert isinstance(outcomes[1], ConversationExistsError)
    copy = crash_copy(home, tmp_path / "copy")
    await store.close()
    ids, _ = await history_ids(copy, root.id)
    assert ids == [root.id]


async def test_a_snapshot_saved_while_closing_is_not_undone_by_replay(tmp_path: Path, cast: Cast) -> None:
    """A save_state made while close() runs goes through the journal too: a crash before the final
    checkpoint replays it, not the older journaled snapshot."""
    home = tmp_path / "home"
    store = await open_batch(home)
    conversation = await start(store, cast)
    conversation.title = "journaled before closing"
    await store.save_state(conversation)
    store._committer.closing = True  # as close() sets it, before its final checkpoint
    conversation.title = "saved while closing"
    await store.save_state(conversation)
    copy = crash_copy(home, tmp_path / "copy")
    store._committer.closing = False
    await store.close()

    assert await title_after_reopening(copy, conversation.id) == "saved while closing"


async def test_readers_never_see_a_value_being_replaced(tmp_path: Path) -> None:
    """A read racing batch's replacements of a meta value always gets a whole value (one of those
    written), and nothing is taken for corrupt."""
    store = await open_batch(tmp_path / "home")
    values = ["x" * 3000, "short", "y" * 700]
    await store.set_meta("cursor", values[0])
    seen: set[str | None] = set()

    async def write() -> None:
        for i in range(300):
            await store.set_meta("cursor", values[i % 3])

    async def read() -> None:
        for _ in range(600):
            seen.add(await store.get_meta("cursor"))

    await asyncio.gather(write(), read(), read())
    assert seen <= set(values)
    assert [a for a in store.recovery if a.kind == "moved_to_corrupt"] == []
    await store.close()


async def test_loads_never_see_a_snapshot_being_replaced(tmp_path: Path, cast: Cast) -> None:
    """Loads from disk racing batch's replacements of a conversation's snapshot (its temp file
    reused from one swap to the next) always read a whole snapshot: none is taken for corrupt."""
    store = await open_batch(tmp_path / "home")
    conversation = await start(store, cast)
    titles = ["t" * 3000, "short", "u" * 700]
    seen: set[str] = set()

    async def write() -> None:
        for i in range(200):
            conversation.title = titles[i % 3]
            await store.save_state(conversation)

    async def read() -> None:
        for _ in range(200):
            store._cache.clear()  # the load reads the folder
            loaded = await store.load(conversation.id)
            assert loaded is not None
            seen.add(loaded.title)

    await asyncio.gather(write(), read(), read())
    assert seen <= {*titles, "Journal drill"}
    assert [a for a in store.recovery if a.kind in ("moved_to_corrupt", "state_rebuilt")] == []
    await store.close()


async def test_a_log_gets_its_lines_only_after_the_journal_holds_them(
    tmp_path: Path, cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kill just before the journal write would find neither the appends nor a value replaced in
    the same group on disk: no op of a group is visible before the group is durable."""
    home = tmp_path / "home"
    store = await open_batch(home)
    conversation = await start(store, cast)
    log_path = home / "conversations" / conversation.id / LOG_NAME
    seen_at_journal_write: list[bytes] = []
    real_write = journal.Journal.write

    def watched(self: journal.Journal, *args: Any, **kwargs: Any) -> None:
        seen_at_journal_write.append(log_path.read_bytes())
        real_write(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(journal.Journal, "write", watched)
        reply = cast.alice_says("written after the journal")
        await asyncio.gather(store.set_meta("marker", "1"), store.append_event(conversation.id, reply))
    assert seen_at_journal_write
    assert all(reply.id.encode() not in seen for seen in seen_at_journal_write)
    assert reply.id.encode() in log_path.read_bytes()
    await store.close()

    ids, _ = await history_ids(home, conversation.id)
    assert ids == [conversation.id, reply.id]


async def test_a_load_racing_an_append_never_caches_a_history_without_it(
    tmp_path: Path, cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load that reads the log during an append's journal fsync reads it again: the event acknowledged meanwhile is kept."""
    store = await open_batch(tmp_path / "home")
    conversation = await start(store, cast)
    store._cache.clear()  # the next load reads the folder
    real_write, real_scan = journal.Journal.write, scan_folder
    reads = [0]
    in_fsync, log_read, acknowledged = threading.Event(), threading.Event(), threading.Event()

    def slow_write(self: journal.Journal, *args: Any, **kwargs: Any) -> None:
        in_fsync.set()
        assert log_read.wait(10)  # a slow journal fsync: it ends once the load read the log
        real_write(self, *args, **kwargs)

    def slow_scan(*args: Any, **kwargs: Any) -> Any:
        reads[0] += 1
        scanned = real_scan(*args, **kwargs)
        if reads[0] == 1:
            log_read.set()
            assert acknowledged.wait(10)  # a long log being parsed while the append is acknowledged
        return scanned

    monkeypatch.setattr(journal.Journal, "write", slow_write)
    monkeypatch.setattr(store_module, "scan_folder", slow_scan)
    second = cast.alice_says("acknowledged while the log was read")
    appending = asyncio.create_task(store.append_event(conversation.id, second))
    appending.add_done_callback(lambda _: acknowledged.set())
    assert await asyncio.to_thread(in_fsync.wait, 10)  # the group is in its journal fsync
    loaded = await store.load(conversation.id)
    await appending
    again = await store.load(conversation.id)
    assert loaded is not None
    assert again is not None
    assert second.id in [e.id for e in again.history]
    assert reads[0] == 2
    await store.close()


async def test_small_values_wait_in_the_journal_until_its_checkpoint(tmp_path: Path) -> None:
    """Under batch a small value's file is not written per change: reads get the newest value from the
    journal, a crash at that instant keeps it (replay), and the checkpoint writes the file once."""
    home = tmp_path / "home"
    store = await open_batch(home)
    path = store._layout.meta_path("outbox")
    await store.set_meta("outbox", "one")
    await store.set_meta("outbox", "two")
    assert not path.exists()  # nor a temp file: nothing but the journal was written
    assert list(path.parent.iterdir()) == []
    assert await store.get_meta("outbox") == "two"
    copy = crash_copy(home, tmp_path / "copy")

    await store._committer.checkpoint()
    assert b'"two"' in path.read_bytes()
    await store.set_meta("outbox", "three")  # held again, newer than the file
    assert await store.get_meta("outbox") == "three"
    await store.close()  # the final checkpoint writes it
    assert b'"three"' in path.read_bytes()

    reopened = await open_batch(copy)
    try:
        assert await reopened.get_meta("outbox") == "two"
        assert "journal_replayed" in {a.kind for a in reopened.recovery}
    finally:
        await reopened.close()


async def test_an_erased_small_value_leaves_no_file_at_the_checkpoint(tmp_path: Path) -> None:
    """A small value erased (its tombstone committed, as a conversation's deletion does) while the journal
    holds it reads as absent at once, and the checkpoint removes its file (written by an earlier
    checkpoint) rather than leaving a tombstone; after a crash then, the replay removes it too."""
    home = tmp_path / "home"
    store = await open_batch(home)
    key = "thread:c1__alice__bob"
    path = store._layout.meta_path(key)
    await store.set_meta(key, "secret")
    await store._committer.checkpoint()
    assert path.exists()  # written by the checkpoint: the erasure must remove it
    await store.set_meta(key, "newer secret")

    await store._committer.commit([Op("replace", path, tombstone(key), erases=True)])
    assert await store.get_meta(key) is None
    assert b"newer secret" not in path.read_bytes()  # the file is the checkpoint's, untouched
    copy = crash_copy(home, tmp_path / "copy")
    await store._committer.checkpoint()
    assert not path.exists()
    assert list(path.parent.iterdir()) == []
    await store.set_meta(key, "again")  # a value set after the erasure reads back
    assert await store.get_meta(key) == "again"
    await store.close()

    copied_file = copy / "conversations" / ".meta" / path.name
    assert copied_file.exists()  # the crash copy has the older value's file and the tombstone's frame
    reopened = await open_batch(copy)
    try:
        assert await reopened.get_meta(key) is None  # the tombstone's frame is replayed last
        assert not copied_file.exists()  # removed: no file naming what was erased
        assert "journal_replayed" in {a.kind for a in reopened.recovery}
    finally:
        await reopened.close()


async def test_a_small_values_temp_file_left_by_a_kill_is_removed_on_open(tmp_path: Path) -> None:
    """A small value's temp file that was never renamed (the process killed while writing it) is removed
    when the store opens; the value itself is untouched."""
    home = tmp_path / "home"
    store = await open_batch(home)
    await store.set_meta("cursor", "7")
    await store.close()
    meta = home / "conversations" / ".meta"
    leftover = meta / (store._layout.meta_path("cursor").name + ".tmp")
    leftover.write_bytes(b'{"key": "thread:c1__alice__bob", "value": "half writ')

    reopened = await open_batch(home)
    try:
        assert not leftover.exists()
        assert await reopened.get_meta("cursor") == "7"
    finally:
        await reopened.close()


async def test_a_checkpoint_fsyncs_every_value_it_writes_after_one_that_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint that fsynced its files but could not start the next journal file leaves no value for
    the next checkpoint to write again unsynced: every value file a checkpoint writes is among the files
    it fsyncs before it deletes the journal that covered it."""
    store = await open_batch(tmp_path / "home")
    live = store._committer.journal
    assert live is not None
    written: list[Path] = []
    synced: list[str] = []
    real_stage, real_sync, real_create = atomic.stage, live._sync, live._create

    def record_stage(path: Path, data: bytes, *, durable: bool = True) -> tuple[int, int]:
        written.append(path)
        return real_stage(path, data, durable=durable)

    def record_sync(relpath: str) -> Path | None:
        synced.append(relpath)
        return real_sync(relpath)

    def fail_once(generation: int) -> int:
        monkeypatch.setattr(live, "_create", real_create)
        raise OSError(errno.EMFILE, "no descriptor left")

    monkeypatch.setattr(journal, "stage", record_stage)
    monkeypatch.setattr(live, "_sync", record_sync)
    monkeypatch.setattr(live, "_create", fail_once)
    await store.set_meta("outbox", "one")
    with pytest.raises(OSError, match="no descriptor"):
        await store._committer.checkpoint()
    assert [live.relpath(p) for p in written] == [".meta/" + store._layout.meta_path("outbox").name]
    assert set(synced) >= {live.relpath(p) for p in written}

    written.clear()
    synced.clear()
    await store._committer.checkpoint()
    assert {live.relpath(p) for p in written} <= set(synced)
    assert await store.get_meta("outbox") == "one"
    await store.close()


async def test_held_values_stay_readable_when_the_final_checkpoint_is_skipped(tmp_path: Path) -> None:
    """When the final checkpoint cannot write the held values (a failed fsync poisoned the journal, which
    is kept for the next open), reads until the store is closed still get the newest value, not its
    older file; the next open replays it."""
    home = tmp_path / "home"
    store = await open_batch(home)
    await store.set_meta("cursor", "1")
    await store._committer.checkpoint()
    await store.set_meta("cursor", "2")
    live = store._committer.journal
    assert live is not None
    live.poisoned = True
    await store._committer.stop()  # what close() does first
    assert store._committer.journal is None
    assert await store.get_meta("cursor") == "2"
    await store.close()

    reopened = await open_batch(home)
    try:
        assert await reopened.get_meta("cursor") == "2"
    finally:
        await reopened.close()


def _refuse_unlink(monkeypatch: pytest.MonkeyPatch, refused: Path) -> None:
    """Make deleting ``refused`` fail (EIO) until the patch is undone."""
    real = Path.unlink

    def unlink(self: Path, missing_ok: bool = False) -> None:
        if self == refused:
            raise OSError(errno.EIO, "Input/output error (simulated)")
        real(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)


async def test_a_journal_a_checkpoint_could_not_delete_is_never_replayed_over_newer_files(
    tmp_path: Path, cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A journal file whose deletion failed at its checkpoint, sealed by it, is skipped by replay: a small
    value keeps its newest content and a conversation deleted since does not come back, after a crash and
    after a clean close alike; the live store deletes the file at a later checkpoint once it can."""
    home = tmp_path / "home"
    store = await open_batch(home)
    stale = home / "conversations" / JOURNAL_DIR / "0"
    gone = await start(store, cast, "Deleted later")
    await store.set_meta("outbox", "old")
    _refuse_unlink(monkeypatch, stale)
    with pytest.raises(OSError, match="simulated"):
        await store._committer.checkpoint()  # journal 1 started, journal 0 left behind
    await store.set_meta("outbox", "new")
    assert await store.delete(gone.id)  # its traces erased: another checkpoint (journal 2)
    assert journal_files(home) == ["0", "2"]  # that checkpoint failed to delete journal 0 again
    crashed = crash_copy(home, tmp_path / "crashed")
    await store.close()  # journal 0 is still there
    closed = crash_copy(home, tmp_path / "closed")
    monkeypatch.undo()
    store = await open_batch(home)
    await store.set_meta("outbox", "newest")
    _refuse_unlink(monkeypatch, home / "conversations" / JOURNAL_DIR / "1")  # the live journal
    with pytest.raises(OSError, match="simulated"):
        await store._committer.checkpoint()
    monkeypatch.undo()
    await store._committer.checkpoint()  # deletes the left-behind file too
    assert journal_files(home) == ["3"]
    await store.close()

    assert journal_files(closed) == ["0"]
    for copy in (crashed, closed):
        reopened = await open_batch(copy)
        try:
            assert await reopened.get_meta("outbox") == "new"
            assert await reopened.load(gone.id) is None
            assert not (copy / "conversations" / gone.id).exists()
            assert "journal_skipped" in {a.kind for a in reopened.recovery}
            assert len(journal_files(copy)) == 1  # the replayed and the skipped files are gone
        finally:
            await reopened.close()


def test_replay_skips_only_journals_their_checkpoint_sealed(tmp_path: Path) -> None:
    """Replay skips a journal file whose last whole frame is a checkpoint's and replays every other: one
    with records after that frame (a checkpoint that could not start the next journal), or whose frame
    after it is torn, is judged by its last whole frame."""
    root = tmp_path / "conversations"
    folder = root / JOURNAL_DIR
    folder.mkdir(parents=True)
    (root / ".meta").mkdir()
    value = root / ".meta" / "v"

    def replayed(*contents: bytes) -> bytes | None:
        for path in folder.iterdir():
            path.unlink()
        value.unlink(missing_ok=True)
        for generation, content in enumerate(contents):
            (folder / str(generation)).write_bytes(content)
        replay(root, tmp_path / "corrupt")
        return value.read_bytes() if value.exists() else None

    old, new = replace_frame(".meta/v", b"old"), replace_frame(".meta/v", b"new")
    assert replayed(old + checkpoint_frame(0), b"") is None
    assert replayed(old + checkpoint_frame(0) + new[:-1]) is None  # torn: never acknowledged
    assert replayed(old + checkpoint_frame(0) + new) == b"new"
    assert replayed(old, new + checkpoint_frame(1)) == b"old"
    assert replayed(checkpoint_frame(0) + old) == b"old"
    (folder / "0").write_bytes(old + checkpoint_frame(0))
    assert [a.kind for a in replay(root, tmp_path / "corrupt").actions] == ["journal_skipped"]


async def test_a_state_snapshots_temp_file_left_by_a_kill_is_removed_on_open(tmp_path: Path, cast: Cast) -> None:
    """A conversation's state snapshot temp file that was never renamed (the process killed while writing
    it) is removed when the store opens, and the conversation reads back as it was committed."""
    home = tmp_path / "home"
    store = await open_batch(home)
    conversation = await start(store, cast)
    await store.close()
    folder = next(p for p in (home / "conversations").iterdir() if p.name == conversation.id)
    leftover = folder / "state.json.tmp"
    leftover.write_bytes(b'{"format":1,"state":{"id":"half writ')

    reopened = await open_batch(home)
    try:
        assert not leftover.exists()
        loaded = await reopened.load(conversation.id)
        assert loaded is not None
        assert loaded.title == conversation.title
    finally:
        await reopened.close()


async def test_a_conversations_missing_event_log_is_reported_as_history_lost(tmp_path: Path, cast: Cast) -> None:
    """A conversation whose events.log was removed while the store was closed opens with an
    ``event_log_missing`` recovery action (logged as an error) naming the file, not only a quiet repair."""
    home = tmp_path / "home"
    store = await open_batch(home)
    conversation = await start(store, cast)
    await store.close()
    (home / "conversations" / conversation.id / LOG_NAME).unlink()

    reopened = await open_batch(home)
    try:
        missing = [a for a in reopened.recovery if a.kind == "event_log_missing"]
        assert [a.conversation_id for a in missing] == [conversation.id]
        assert "events.log is missing" in missing[0].detail
    finally:
        await reopened.close()


async def test_a_home_file_this_user_may_not_read_is_one_clear_error_and_the_lock_is_freed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file or folder of the home that recovery may not read (another user's, mode 000) makes open fail
    with one StoreOpenError naming it and saying what to check, and leaves the home unlocked."""
    home = tmp_path / "home"
    await (await open_batch(home)).close()
    unreadable = home / "conversations" / ("ab" * 32)

    def denied(layout: object) -> None:
        raise PermissionError(13, "Permission denied", str(unreadable))

    monkeypatch.setattr(store_module, "recover", denied)
    with pytest.raises(StoreOpenError, match=rf"{unreadable} cannot be read or written by this user"):
        await open_batch(home)
    monkeypatch.undo()
    await (await open_batch(home)).close()  # not left locked
