"""FileSystemStore specifics: recovery from damaged files, the home lock, bounded memory, the index."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from tenex_daemon.adapters.storage.filesystem import (
    LOG_NAME,
    STATE_NAME,
    FileSystemStore,
    FsyncPolicy,
    StoreLockedError,
    encode_event,
    scan_log,
)
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.phases import Phase
from tenex_daemon.core.search import SearchQuery
from tests.conftest import Cast


async def make_home(tmp_path: Path, cast: Cast, *, replies: int = 5) -> tuple[Path, str, list[str]]:
    """A closed home with one conversation (titled "Recovery drill") and ``replies`` replies."""
    home = tmp_path / "home"
    store = FileSystemStore(home)
    await store.open()
    root = cast.user_says("root", kind=11, tags=[["title", "Recovery drill"]])
    conversation = Conversation(id=root.id, title="Recovery drill", created_at=1, updated_at=1)
    conversation.append(root)
    await store.create(conversation)
    event_ids = [root.id]
    for i in range(replies):
        event = cast.alice_says(f"reply {i}")
        await store.append_event(root.id, event)
        event_ids.append(event.id)
    conversation.phase = Phase.PLAN
    await store.save_state(conversation)
    await store.close()
    return home, root.id, event_ids


def kinds(store: FileSystemStore) -> set[str]:
    """The kinds of repair the store reported."""
    return {action.kind for action in store.recovery}


def corrupt_files(home: Path) -> list[str]:
    """Names of the files moved to conversations/corrupt/."""
    folder = home / "conversations" / "corrupt"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


async def test_clean_reopen_needs_no_repair(tmp_path: Path, cast: Cast) -> None:
    """A home closed cleanly opens with no repair and no file moved aside."""
    home, conversation_id, event_ids = await make_home(tmp_path, cast)
    store = FileSystemStore(home)
    await store.open()
    assert store.recovery == []
    loaded = await store.load(conversation_id)
    assert loaded is not None
    assert [e.id for e in loaded.history] == event_ids
    await store.close()
    assert corrupt_files(home) == []


async def test_truncated_log_tail_is_cut_and_logged(tmp_path: Path, cast: Cast) -> None:
    """A half-written last line is cut on open; every complete event stays and appends work after it."""
    home, conversation_id, event_ids = await make_home(tmp_path, cast)
    log_path = home / "conversations" / conversation_id / LOG_NAME
    data = log_path.read_bytes()
    log_path.write_bytes(data + data[: len(data) // 3 // 2])  # a torn partial line, no newline
    store = FileSystemStore(home)
    await store.open()
    assert "torn_tail_cut" in kinds(store)
    assert log_path.read_bytes() == data
    event = cast.bob_says("after the cut")
    await store.append_event(conversation_id, event)
    await store.close()
    store = FileSystemStore(home)
    await store.open()
    assert store.recovery == []
    loaded = await store.load(conversation_id)
    assert loaded is not None
    assert [e.id for e in loaded.history] == [*event_ids, event.id]
    await store.close()


async def test_log_cut_mid_line_loses_only_the_unfinished_event(tmp_path: Path, cast: Cast) -> None:
    """A log truncated inside its last line keeps every event before it and reports the cut."""
    home, conversation_id, event_ids = await make_home(tmp_path, cast)
    log_path = home / "conversations" / conversation_id / LOG_NAME
    data = log_path.read_bytes()
    log_path.write_bytes(data[:-40])
    store = FileSystemStore(home)
    await store.open()
    assert "torn_tail_cut" in kinds(store)
    loaded = await store.load(conversation_id)
    assert loaded is not None
    assert [e.id for e in loaded.history] == event_ids[:-1]
    [row] = await store.search(SearchQuery())
    assert row.event_count == len(event_ids) - 1
    await store.close()


async def test_garbage_snapshot_is_moved_aside_and_state_rebuilt(tmp_path: Path, cast: Cast) -> None:
    """A snapshot full of garbage goes to corrupt/ (not deleted); the history survives and the state is rebuilt."""
    home, conversation_id, event_ids = await make_home(tmp_path, cast)
    state_path = home / "conversations" / conversation_id / STATE_NAME
    state_path.write_bytes(b"\x00garbage{{{")
    store = FileSystemStore(home)
    await store.open()
    assert {"moved_to_corrupt", "state_rebuilt"} <= kinds(store)
    loaded = await store.load(conversation_id)
    assert loaded is not None
    assert [e.id for e in loaded.history] == event_ids
    assert loaded.title == "Recovery drill"
    await store.close()
    [moved] = corrupt_files(home)
    assert moved.startswith(f"{conversation_id}.state.json")
    assert (home / "conversations" / "corrupt" / moved).read_bytes() == b"\x00garbage{{{"


async def test_corrupt_line_inside_log_is_salvaged_and_original_kept(tmp_path: Path, cast: Cast) -> None:
    """A damaged line mid-log: the original is copied to corrupt/ on load, the good events stay loadable."""
    home, conversation_id, event_ids = await make_home(tmp_path, cast)
    log_path = home / "conversations" / conversation_id / LOG_NAME
    lines = log_path.read_bytes().split(b"\n")
    lines[2] = lines[2][:20] + b"X" + lines[2][21:]
    original = b"\n".join(lines)
    log_path.write_bytes(original)
    store = FileSystemStore(home)
    await store.open()
    loaded = await store.load(conversation_id)  # same size: found when read, not by open's stat
    assert "log_salvaged" in kinds(store)
    assert loaded is not None
    assert [e.id for e in loaded.history] == event_ids[:2] + event_ids[3:]
    await store.close()
    [moved] = corrupt_files(home)
    assert (home / "conversations" / "corrupt" / moved).read_bytes() == original


async def test_missing_index_is_rebuilt_from_the_data(tmp_path: Path, cast: Cast) -> None:
    """With the index folder gone, open rebuilds it from the conversation files."""
    home, conversation_id, event_ids = await make_home(tmp_path, cast)
    for path in (home / "conversations" / ".index").iterdir():
        path.unlink()
    store = FileSystemStore(home)
    await store.open()
    assert "index_rebuilt" in kinds(store)
    [row] = await store.search(SearchQuery(title="recovery"))
    assert (row.id, row.event_count, row.phase) == (conversation_id, len(event_ids), Phase.PLAN)
    assert row.participants == sorted({cast.user.pubkey, cast.alice.pubkey})
    await store.close()
    store = FileSystemStore(home)
    await store.open()
    assert store.recovery == []
    await store.close()


async def test_index_listing_a_missing_conversation_is_repaired(tmp_path: Path, cast: Cast) -> None:
    """An index entry whose folder vanished is dropped on open; load returns None, search omits it."""
    home, conversation_id, _ = await make_home(tmp_path, cast)
    folder = home / "conversations" / conversation_id
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()
    store = FileSystemStore(home)
    await store.open()
    assert "index_entry_removed" in kinds(store)
    assert await store.load(conversation_id) is None
    assert await store.search(SearchQuery()) == []
    await store.close()


async def test_unindexed_events_are_picked_up_on_open(tmp_path: Path, cast: Cast) -> None:
    """Events durable in a log but missing from the index (a crash between the two) are counted and processed."""
    home, conversation_id, event_ids = await make_home(tmp_path, cast)
    extra = cast.bob_says("written, never indexed")
    log_path = home / "conversations" / conversation_id / LOG_NAME
    log_path.write_bytes(log_path.read_bytes() + encode_event(extra))
    store = FileSystemStore(home)
    await store.open()
    assert "index_entry_repaired" in kinds(store)
    assert await store.is_processed(extra.id)
    [row] = await store.search(SearchQuery())
    assert row.event_count == len(event_ids) + 1
    assert cast.bob.pubkey in row.participants
    await store.close()


async def test_second_opener_is_refused_with_the_holders_pid(tmp_path: Path) -> None:
    """A second store on the same home fails with an error naming the holding process's pid."""
    first = FileSystemStore(tmp_path / "home")
    await first.open()
    second = FileSystemStore(tmp_path / "home")
    with pytest.raises(StoreLockedError, match=f"process {os.getpid()}"):
        await second.open()
    await first.close()
    await second.open()
    await second.close()


def test_other_process_is_refused_while_home_is_held(tmp_path: Path) -> None:
    """A daemon in another process cannot open a home this process holds."""
    code = (
        "import asyncio, sys\n"
        "from tenex_daemon.adapters.storage.filesystem import FileSystemStore, StoreLockedError\n"
        "async def main():\n"
        "    try:\n"
        "        await FileSystemStore(sys.argv[1]).open()\n"
        "    except StoreLockedError as exc:\n"
        "        print(exc); return\n"
        "    print('opened')\n"
        "asyncio.run(main())\n"
    )

    async def scenario() -> str:
        store = FileSystemStore(tmp_path / "home")
        await store.open()
        try:
            child = await asyncio.create_subprocess_exec(
                sys.executable, "-c", code, str(tmp_path / "home"), stdout=asyncio.subprocess.PIPE
            )
            out, _ = await asyncio.wait_for(child.communicate(), timeout=60)
        finally:
            await store.close()
        return out.decode()

    out = asyncio.run(scenario())
    assert f"in use by process {os.getpid()}" in out


async def test_cache_is_bounded_and_evicted_conversations_reload(tmp_path: Path, cast: Cast) -> None:
    """No more than cache_size conversations stay loaded; an evicted one loads again from disk intact."""
    store = FileSystemStore(tmp_path / "home", cache_size=3)
    await store.open()
    created: list[Conversation] = []
    for i in range(8):
        root = cast.user_says(f"conversation {i}", kind=11)
        conversation = Conversation(id=root.id)
        conversation.append(root)
        await store.create(conversation)
        await store.append_event(root.id, cast.alice_says(f"answer {i}"))
        created.append(conversation)
    assert len(store._cache) == 3
    first = await store.load(created[0].id)
    assert first is not None
    assert len(first.history) == 2
    assert len(store._cache) == 3
    await store.close()


async def test_index_grows_by_appends_and_compacts(tmp_path: Path, cast: Cast) -> None:
    """Appending writes one small index line per event (no index rewrite) until compaction folds them."""
    store = FileSystemStore(tmp_path / "home", fsync="batch")
    await store.open()
    root = cast.user_says("indexed", kind=11)
    conversation = Conversation(id=root.id)
    conversation.append(root)
    await store.create(conversation)
    await store.close()
    await store.open()
    index_dir = tmp_path / "home" / "conversations" / ".index"
    snapshot_before = (index_dir / "snapshot.json").stat().st_mtime_ns
    for i in range(20):
        await store.append_event(root.id, cast.alice_says(f"n{i}"))
    await store._derived.run()
    assert (index_dir / "snapshot.json").stat().st_mtime_ns == snapshot_before
    [log_file] = list(index_dir.glob("log.*"))
    records = scan_log(log_file.read_bytes()).payloads
    assert len(records) == 20
    assert json.loads(records[-1])["n"] == 21
    await store.close()
    assert list(index_dir.glob("log.*")) == []
    snapshot = json.loads((index_dir / "snapshot.json").read_bytes())
    assert snapshot["entries"][0]["n"] == 21


@pytest.mark.parametrize("fsync", ["always", "batch"])
async def test_an_event_made_durable_without_its_state_counts_once(
    tmp_path: Path, cast: Cast, monkeypatch: pytest.MonkeyPatch, fsync: FsyncPolicy
) -> None:
    """An event saved with its conversation's state when the state cannot be written (a full disk) but
    its line could: the event counts (True, processed), so the same event again is a duplicate and a
    reopened store holds it once (the call raised, and a retry stored it a second time)."""
    import errno

    from tenex_daemon.adapters.storage.filesystem import direct, group_commit

    store = FileSystemStore(tmp_path / "home", fsync=fsync)
    await store.open()
    root = cast.user_says("root", kind=11)
    conversation = Conversation(id=root.id, title="t", created_at=1, updated_at=1)
    conversation.append(root)
    await store.create(conversation)
    reply = cast.alice_says("the reply", tags=[["E", root.id]])

    def no_room(*_: object, **__: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr(group_commit, "stage", no_room)
        patched.setattr(direct, "replace_file", no_room)
        state = await store.load(root.id)
        assert state is not None
        assert await store.append_event(root.id, reply, state=state)
    assert await store.is_processed(reply.id)
    again = await store.load(root.id)
    assert again is not None
    assert not await store.append_event(root.id, reply, state=again)
    await store.close()

    reopened = FileSystemStore(tmp_path / "home", fsync=fsync)
    await reopened.open()
    try:
        loaded = await reopened.load(root.id)
        assert loaded is not None
        assert [e.id for e in loaded.history] == [root.id, reply.id]
    finally:
        await reopened.close()
