"""Derived lines (index records, event-id bucket lines) after a power loss, and a load that meets a line
being appended.

The derived lines are written in rounds and fsynced only when the index is compacted. A power loss (the
page cache lost, not only the process) could keep an index record saying "the log is N bytes" and lose
the bucket line of the event it counts: the log's size then matched the index, open skipped its rescan,
and the event was not known as processed: a relay's copy of it was stored a second time. Open now trusts
only what the index snapshot counted (its bucket lines were fsynced before it) and rescans every log
grown since.

A load (a cache miss) reading a log while a large line was being appended to it (a page at a time) took
the line's first part for a torn tail and cut it: the line, acknowledged a moment later, was lost.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from tenex_daemon.adapters.storage.atomic import write_all
from tenex_daemon.adapters.storage.filesystem import (
    LOG_NAME,
    FileSystemStore,
    FsyncPolicy,
    direct,
    encode_line,
    group_commit,
    recovery,
    scan_log,
)
from tenex_daemon.adapters.storage.filesystem import derived as derived_module
from tenex_daemon.adapters.storage.filesystem import folder as folder_module
from tenex_daemon.adapters.storage.filesystem.derived import sync_files
from tenex_daemon.adapters.storage.filesystem.folder import ScannedFolder, scan_folder
from tenex_daemon.adapters.storage.filesystem.index import read_index
from tenex_daemon.adapters.storage.filesystem.layout import Layout
from tenex_daemon.adapters.storage.filesystem.processed import bucket_line, bucket_of
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.search import SearchQuery
from tests.conftest import Cast


async def flush_derived(store: FileSystemStore) -> None:
    """Write the waiting derived lines now (a round: written, not fsynced)."""
    async with store._derived.lock:
        await store._derived.flush_locked()


def lose_bucket_lines(home: Path, events: list[NostrEvent], conversation_id: str) -> None:
    """What a power loss does to the bucket lines of ``events``: written, never fsynced, gone."""
    for event in events:
        bucket = home / "conversations" / ".events" / bucket_of(event.id)
        line = bucket_line(event.id, conversation_id)
        assert line in bucket.read_bytes(), "the round wrote it"
        bucket.write_bytes(bucket.read_bytes().replace(line, b""))


def log_lines_of(home: Path, conversation_id: str, event_id: str) -> int:
    payloads = scan_log((home / "conversations" / conversation_id / LOG_NAME).read_bytes()).payloads
    return sum(json.loads(payload)["id"] == event_id for payload in payloads)


async def new_conversation(store: FileSystemStore, cast: Cast, title: str = "t") -> Conversation:
    root = cast.user_says(title, kind=11)
    conversation = Conversation(id=root.id, title=title, created_at=1, updated_at=1)
    conversation.append(root)
    await store.create(conversation)
    return conversation


@pytest.mark.parametrize("fsync", ["always", "batch"])
@pytest.mark.parametrize("created_since_snapshot", [False, True])
async def test_a_power_loss_that_keeps_an_index_record_but_not_its_bucket_line_loses_no_processed_id(
    tmp_path: Path, cast: Cast, fsync: FsyncPolicy, created_since_snapshot: bool
) -> None:
    """The index log's record counting an event survived the power loss, its bucket line did not: every
    event of the log is still known as processed after open (a relay's copy of it is a duplicate, not
    stored a second time), its line is in the log once, and open made the bucket line durable again
    before it returned (a second power loss right after finds it on disk)."""
    home = tmp_path / "home"
    store = FileSystemStore(home, fsync=fsync)
    await store.open()
    if not created_since_snapshot:
        conversation = await new_conversation(store, cast)
        await store.close()
        await store.open()  # an index snapshot that counts the root
    else:
        await new_conversation(store, cast, "older")  # the snapshot counts another conversation
        await store.close()
        await store.open()
        conversation = await new_conversation(store, cast)
    root = conversation.history[0]
    event = cast.alice_says("accepted", tags=[["E", root.id]])
    assert await store.append_event(root.id, event)
    await flush_derived(store)  # the bucket line, then the index record: written, not fsynced
    await store._committer.checkpoint()  # batch: the logs fsynced, the journal that covered them gone
    copy = tmp_path / "power-loss"
    shutil.copytree(home, copy)  # the machine lost power at this instant
    await store.close()
    lost = [event, root] if created_since_snapshot else [event]
    lose_bucket_lines(copy, lost, root.id)

    reopened = FileSystemStore(copy, fsync=fsync)
    await reopened.open()
    try:
        assert reopened.recovery == []  # nothing disagreed: nothing to report as repaired
        buckets = copy / "conversations" / ".events"
        for lost_event in lost:
            assert await reopened.is_processed(lost_event.id)
            assert bucket_line(lost_event.id, root.id) in (buckets / bucket_of(lost_event.id)).read_bytes()
        assert not await reopened.append_event(root.id, event)
        assert log_lines_of(copy, root.id, event.id) == 1
        [row] = await reopened.search(SearchQuery(id_prefix=root.id))
        assert row.event_count == 2
    finally:
        await reopened.close()


async def test_a_clean_close_leaves_no_log_to_rescan(
    tmp_path: Path, cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rescans after a power loss cost nothing after a clean close: its compaction leaves no index
    record newer than the snapshot, so open reads no log."""
    home = tmp_path / "home"
    store = FileSystemStore(home, fsync="batch")
    await store.open()
    conversation = await new_conversation(store, cast)
    for i in range(3):
        await store.append_event(conversation.id, cast.alice_says(f"reply {i}"))
    await flush_derived(store)
    await store.close()
    scans: list[str] = []

    def counted(folder: Path, conversation_id: str, *args: Any, **kwargs: Any) -> ScannedFolder:
        scans.append(conversation_id)
        return scan_folder(folder, conversation_id, *args, **kwargs)

    monkeypatch.setattr(recovery, "scan_folder", counted)
    await store.open()
    try:
        assert scans == []
        assert store.recovery == []
        assert await store.is_processed(conversation.id)
    finally:
        await store.close()


async def test_a_log_grown_since_the_snapshot_is_read_from_the_size_the_snapshot_counted(
    tmp_path: Path, cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a crash, open reads a long log only from where the snapshot's count ends, not whole."""
    home = tmp_path / "home"
    store = FileSystemStore(home)
    await store.open()
    conversation = await new_conversation(store, cast)
    await store.append_events(conversation.id, [cast.alice_says(f"older {i}") for i in range(20)])
    await store.close()
    counted = (home / "conversations" / conversation.id / LOG_NAME).stat().st_size
    await store.open()
    reply = cast.alice_says("since the snapshot")
    await store.append_event(conversation.id, reply)
    await flush_derived(store)
    copy = tmp_path / "crash"
    shutil.copytree(home, copy)
    await store.close()
    starts: list[int] = []
    real_read = folder_module._read_from

    def recorded(path: Path, start: int) -> bytes:
        starts.append(start)
        return real_read(path, start)

    monkeypatch.setattr(folder_module, "_read_from", recorded)
    reopened = FileSystemStore(copy)
    await reopened.open()
    try:
        assert starts == [counted]
        assert await reopened.is_processed(reply.id)
        [row] = await reopened.search(SearchQuery())
        assert row.event_count == 22
    finally:
        await reopened.close()


async def test_a_rescan_of_a_log_grown_since_the_snapshot_counts_a_salvaged_log_once(
    tmp_path: Path, cast: Cast
) -> None:
    """A log grown since the snapshot, read from the size the snapshot counted, turns out to hold a
    corrupt line: it is salvaged whole, and the index counts its events once (the whole log's events
    were added to those already counted)."""
    home = tmp_path / "home"
    store = FileSystemStore(home)
    await store.open()
    conversation = await new_conversation(store, cast)
    await store.close()
    await store.open()
    replies = [cast.alice_says(f"reply {i}") for i in range(3)]
    for reply in replies[:2]:
        await store.append_event(conversation.id, reply)
    await flush_derived(store)  # the index log counts two replies
    await store.append_event(conversation.id, replies[2])  # counted in memory only
    copy = tmp_path / "crash"
    shutil.copytree(home, copy)
    await store.close()
    log_path = copy / "conversations" / conversation.id / LOG_NAME
    lines = log_path.read_bytes().split(b"\n")
    lines[-2] = lines[-2][:30] + (b"X" if lines[-2][30:31] != b"X" else b"Y") + lines[-2][31:]  # the last reply's
    log_path.write_bytes(b"\n".join(lines))

    reopened = FileSystemStore(copy)
    await reopened.open()
    try:
        assert "log_salvaged" in {action.kind for action in reopened.recovery}
        [row] = await reopened.search(SearchQuery())
        assert row.event_count == 3  # the root and the first two replies
        loaded = await reopened.load(conversation.id)
        assert loaded is not None
        assert [e.id for e in loaded.history] == [conversation.id, replies[0].id, replies[1].id]
    finally:
        await reopened.close()


def test_the_index_trusts_a_snapshot_size_only_while_no_record_deletes_or_shortens_its_log(
    tmp_path: Path,
) -> None:
    """The sizes the snapshot counted are kept for the rescan's start, but not for a conversation deleted
    since (another may have taken its id) nor for a log a record says is shorter (cut or salvaged)."""
    layout = Layout(tmp_path / "conversations")
    layout.root.mkdir()
    layout.make_folders()
    rows: list[dict[str, Any]] = [
        {"id": cid, "t": "t", "ph": "chat", "ca": 1, "ua": 1, "n": 3, "ac": 0, "ar": False, "p": [],
         "s": 300, "ss": [10, 10], "lc": {}}
        for cid in ("kept", "grown", "deleted", "shortened")
    ]
    layout.snapshot.write_text(json.dumps({"format": 1, "generation": 1, "entries": rows}))
    records = [
        {"op": "ev", "id": "grown", "n": 4, "s": 400},
        {"op": "del", "id": "deleted"},
        {"op": "put", "e": {**rows[2], "s": 300}},  # a new conversation under the same id
        {"op": "put", "e": {**rows[3], "s": 200, "n": 2}},
    ]
    layout.index_log(1).write_bytes(b"".join(encode_line(json.dumps(r).encode()) for r in records))

    read = read_index(layout, [])

    assert read.synced == {"kept": (300, 3), "grown": (300, 3)}
    assert read.entries["grown"].log_size == 400


@pytest.mark.parametrize("fsync", ["always", "batch"])
async def test_a_load_that_meets_a_line_being_appended_leaves_it_alone(
    tmp_path: Path, cast: Cast, monkeypatch: pytest.MonkeyPatch, fsync: FsyncPolicy
) -> None:
    """A load (a cache miss) reads the log while a large line is being written to it: its first part,
    without its newline, is not a torn tail to cut. The line, acknowledged a moment later, is whole in
    the log, in the loaded history and in the next open's."""
    store = FileSystemStore(tmp_path / "home", fsync=fsync)
    await store.open()
    conversation = await new_conversation(store, cast)
    big = cast.alice_says("x" * 100_000)
    marker = big.id.encode()
    half_written = threading.Event()
    go_on = threading.Event()

    def in_two_parts(fd: int, data: bytes) -> None:  # a page at a time, as a reader may see it
        if marker not in data or not data.endswith(b"\n") or b'"content"' not in data:
            write_all(fd, data)
            return
        half = len(data) // 2
        write_all(fd, data[:half])
        half_written.set()
        assert go_on.wait(10)
        write_all(fd, data[half:])

    monkeypatch.setattr(direct if fsync == "always" else group_commit, "write_all", in_two_parts)
    appending = asyncio.create_task(store.append_event(conversation.id, big))
    assert await asyncio.to_thread(half_written.wait, 10)
    store._cache.clear()  # evicted: the next load reads the files
    try:
        loaded = await store.load(conversation.id)
    finally:
        go_on.set()
    assert await appending
    assert loaded is not None
    assert "torn_tail_cut" not in {action.kind for action in store.recovery}
    scan = scan_log((tmp_path / "home" / "conversations" / conversation.id / LOG_NAME).read_bytes())
    assert (scan.torn, scan.bad_lines, len(scan.payloads)) == (False, 0, 2)
    assert [e.id for e in loaded.history] == [conversation.id, big.id]  # the cached history got it too
    await store.close()

    reopened = FileSystemStore(tmp_path / "home", fsync=fsync)
    await reopened.open()
    try:
        again = await reopened.load(conversation.id)
        assert again is not None
        assert [e.id for e in again.history] == [conversation.id, big.id]
        assert reopened.recovery == []
    finally:
        await reopened.close()


async def test_after_a_failed_fsync_of_derived_lines_no_index_snapshot_counts_them(
    tmp_path: Path, cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An fsync of derived files fails once (an I/O error: the kernel may have dropped the lines it had
    reported written): that compaction fails, and no later one in this process writes a snapshot, since a
    later fsync could succeed without those lines (open then reads every log grown since the last one)."""
    home = tmp_path / "home"
    store = FileSystemStore(home, fsync="batch")
    await store.open()
    conversation = await new_conversation(store, cast)
    root = conversation.history[0]
    assert await store.append_event(root.id, cast.alice_says("accepted", tags=[["E", root.id]]))
    snapshot = home / "conversations" / ".index" / "snapshot.json"
    before = snapshot.read_bytes() if snapshot.exists() else b""
    failures = [OSError(5, "Input/output error")]

    def failing_once(paths: set[Path]) -> None:
        if failures:
            raise failures.pop()
        sync_files(paths)

    monkeypatch.setattr(derived_module, "sync_files", failing_once)
    with pytest.raises(OSError, match="Input/output error"):
        await store._index.compact()
    await store._index.compact()
    assert (snapshot.read_bytes() if snapshot.exists() else b"") == before
    await store.close()
    assert (snapshot.read_bytes() if snapshot.exists() else b"") == before
