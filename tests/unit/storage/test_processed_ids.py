"""The filesystem store's processed set keeps a bounded number of ids loaded, however many events the home
took in, and still answers for every id: the buckets it unloads are read again from their files."""

from __future__ import annotations

from pathlib import Path

import pytest

from tenex_daemon import NostrEvent
from tenex_daemon.adapters.storage.filesystem import FileSystemStore, FsyncPolicy
from tenex_daemon.adapters.storage.filesystem.derived import DerivedLines
from tenex_daemon.adapters.storage.filesystem.processed import ProcessedIds, bucket_line
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.testing import EventFactory, KeyPair

MAX_IDS = 40


def loaded(store: FileSystemStore) -> ProcessedIds:
    """The store's processed set (private: what is loaded is not part of the store's port)."""
    processed: ProcessedIds = store._processed
    return processed


def assert_bounded(processed: ProcessedIds) -> None:
    """The ids loaded are counted right and number at most MAX_IDS, the newest bucket aside."""
    buckets = list(processed._buckets.values())
    assert processed.loaded_ids == sum(len(bucket) for bucket in buckets)
    assert processed.loaded_ids - len(buckets[-1]) <= MAX_IDS


@pytest.mark.parametrize("fsync", ["always", "batch"])
async def test_a_store_keeps_at_most_its_id_bound_loaded_and_knows_every_id(tmp_path: Path, fsync: FsyncPolicy) -> None:
    """600 events in 30 conversations and 50 ids marked processed, with at most 40 ids to keep loaded and
    room for every bucket: no more than 40 ids (and the newest bucket) stay loaded, the count kept matches
    the buckets, and every id is still known processed, with its conversation, before and after a reopen."""
    factory = EventFactory()
    person = KeyPair.from_seed(1)
    store = FileSystemStore(tmp_path / "home", fsync=fsync, bucket_cache_size=4096, max_loaded_ids=MAX_IDS)
    await store.open()
    conversations: dict[str, str] = {}
    marked: list[str] = []
    try:
        for number in range(30):
            root = factory.event(person, f"root {number}", kind=11)
            conversation = Conversation(id=root.id, title=f"t{number}", created_at=1, updated_at=1)
            conversation.append(root)
            await store.create(conversation)
            conversations[root.id] = root.id
            for reply in range(19):
                event = factory.event(person, f"reply {number}.{reply}", kind=1111, tags=[["E", root.id]])
                await store.append_event(root.id, event)
                conversations[event.id] = root.id
            stray: NostrEvent = factory.event(person, f"stray {number}", kind=1)
            await store.mark_processed(stray.id)
            marked.append(stray.id)
            assert_bounded(loaded(store))

        for event_id, conversation_id in conversations.items():
            assert await store.is_processed(event_id)
            found = await store.find_event(event_id)
            assert found is not None
            assert found[0] == conversation_id
        assert all([await store.is_processed(event_id) for event_id in marked])
        assert_bounded(loaded(store))
    finally:
        await store.close()

    reopened = FileSystemStore(tmp_path / "home", fsync=fsync, bucket_cache_size=4096, max_loaded_ids=MAX_IDS)
    await reopened.open()
    try:
        assert all([await reopened.is_processed(event_id) for event_id in [*conversations, *marked]])
        assert not await reopened.is_processed("f" * 64)
    finally:
        await reopened.close()


async def test_a_buckets_ids_of_one_conversation_share_its_id(tmp_path: Path) -> None:
    """Read back from its file, a bucket holds each conversation id once, however many of its events it
    lists (a loaded id costs its own string only)."""
    events_dir = tmp_path / ".events"
    events_dir.mkdir()
    conversation = "c" * 64
    lines = b"".join(bucket_line(f"abc{n:061x}", conversation) for n in range(5))
    (events_dir / "abc").write_bytes(lines)
    processed = ProcessedIds(events_dir, DerivedLines(), cache_size=8)

    table = await processed.table("abc" + "0" * 61)

    held = list(table.values())
    assert len(held) == 5
    assert held[0] == conversation
    assert all(value is held[0] for value in held)
    assert processed.loaded_ids == 5


@pytest.mark.parametrize("fsync", ["always", "batch"])
@pytest.mark.parametrize("room_before_close", [True, False])
async def test_an_event_id_whose_bucket_line_could_not_be_written_stays_processed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: FsyncPolicy, room_before_close: bool
) -> None:
    """An event accepted while its bucket line cannot be written (a full disk): the line waits and is
    written once there is room, and no index line says its log is complete before it; whether room comes
    back before the store closes or only after, the reopened store knows the event is processed, so a
    relay's copy is refused as a duplicate (the line was dropped, and the copy stored twice)."""
    import errno

    from tenex_daemon.adapters.storage.filesystem import derived

    factory = EventFactory()
    person = KeyPair.from_seed(1)
    store = FileSystemStore(tmp_path / "home", fsync=fsync)
    await store.open()
    root = factory.event(person, "root", kind=11)
    conversation = Conversation(id=root.id, title="t", created_at=1, updated_at=1)
    conversation.append(root)
    await store.create(conversation)
    await store.append_event(root.id, factory.event(person, "before", kind=1111, tags=[["E", root.id]]))
    async with store._derived.lock:
        await store._derived.flush_locked()
    accepted = factory.event(person, "while the disk is full", kind=1111, tags=[["E", root.id]])
    full = True
    from tenex_daemon.adapters.storage.atomic import write_all

    def no_room_for_its_line(fd: int, data: bytes) -> None:
        if full and accepted.id.encode() in data:
            raise OSError(errno.ENOSPC, "No space left on device")
        write_all(fd, data)

    monkeypatch.setattr(derived, "write_all", no_room_for_its_line)
    assert await store.append_event(root.id, accepted)
    async with store._derived.lock:
        await store._derived.flush_locked()
    full = not room_before_close
    await store.close()

    full = False
    reopened = FileSystemStore(tmp_path / "home", fsync=fsync)
    await reopened.open()
    try:
        assert await reopened.is_processed(accepted.id)
        assert not await reopened.append_event(root.id, accepted)
    finally:
        await reopened.close()
