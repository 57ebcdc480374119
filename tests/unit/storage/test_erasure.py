"""FileSystemStore deletion erases what a conversation leaves outside its folder: copies repairs moved to
``corrupt/``, index log records and snapshot rows, batch's journal and its small values."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tenex_daemon.adapters.storage.filesystem import FileSystemStore, derived
from tenex_daemon.adapters.storage.filesystem.erasure import (
    SharedRounds,
    corrupt_copies,
    scan_owned_values,
    tombstone,
)
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.erasure import owned_value_prefixes, value_owner
from tenex_daemon.core.search import SearchQuery
from tenex_daemon.services.threads import ThreadManager
from tests.conftest import Cast

MARKER = b"Xr9-fs-erasure-marker"


def holding(home: Path, needle: bytes = MARKER) -> list[str]:
    """The files under ``home`` (relative names) whose bytes contain ``needle``."""
    found = []
    for folder, _, names in os.walk(home):
        for name in names:
            path = Path(folder) / name
            if needle in path.read_bytes():
                found.append(str(path.relative_to(home)))
    return sorted(found)


async def new_conversation(store: FileSystemStore, cast: Cast, text: str) -> Conversation:
    root = cast.user_says(text, kind=11, tags=[["title", text]])
    conversation = Conversation(id=root.id, title=text, created_at=1, updated_at=1)
    conversation.append(root)
    await store.create(conversation)
    return conversation


async def wait_for(condition: Callable[[], bool], within: float = 5.0) -> None:
    """Poll ``condition()`` every few milliseconds until it is true (derived lines are written in rounds)."""
    deadline = asyncio.get_running_loop().time() + within
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never became true"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("fsync", ["always", "batch"])
async def test_delete_erases_corrupt_copies_index_logs_and_the_journal(
    tmp_path: Path, cast: Cast, monkeypatch: pytest.MonkeyPatch, fsync: str
) -> None:
    """A conversation whose damaged snapshot was moved to corrupt/, whose title is in the index snapshot
    and in an index log written since, and (batch) in the commit journal, leaves none of it after its
    deletion; the other conversation stays whole and searchable."""
    monkeypatch.setattr(derived, "FLUSH_INTERVAL", 0.01)
    home = tmp_path / "home"
    store = FileSystemStore(home, fsync=fsync)  # type: ignore[arg-type]  # parametrized policy
    await store.open()
    doomed = await new_conversation(store, cast, f"doomed {MARKER.decode()}")
    other = await new_conversation(store, cast, "kept conversation")
    await store.close()
    state = home / "conversations" / doomed.id / "state.json"
    state.write_bytes(state.read_bytes()[:-5] + b"{{{garbage")  # unreadable: moved to corrupt/ on open
    await store.open()
    doomed.phase_started_at = 2
    await store.save_state(doomed)  # a new index log record, and (batch) a journal frame
    index_log = home / "conversations" / ".index"
    await wait_for(lambda: any(MARKER in p.read_bytes() for p in index_log.glob("log.*")))
    places = holding(home)
    assert any(name.startswith("conversations/corrupt/") for name in places)
    assert "conversations/.index/snapshot.json" in places
    assert any(name.startswith("conversations/.journal/") for name in places) == (fsync == "batch")

    assert await store.delete(doomed.id)

    assert holding(home) == []
    assert await store.is_processed(doomed.id)
    assert [row.id for row in await store.search(SearchQuery())] == [other.id]
    await store.close()
    await store.open()
    assert holding(home) == []
    assert await store.load(doomed.id) is None
    assert (await store.load(other.id)) is not None
    await store.close()


async def test_values_stored_before_a_reopen_are_found_and_erased(tmp_path: Path, cast: Cast) -> None:
    """Delegation threads saved in an earlier run of the store are found on disk by their keys and
    erased with their conversation (tombstoned, then removed); the other conversation's stay."""
    home = tmp_path / "home"
    store = FileSystemStore(home, fsync="batch")
    await store.open()
    doomed = await new_conversation(store, cast, "doomed")
    other = await new_conversation(store, cast, "other")
    threads = ThreadManager(store=store)
    for cid in (doomed.id, other.id):
        for pair in (("alice", "bob"), ("alice", None)):
            thread = await threads.get_thread(cid, *pair)
            await threads.add_item_and_save(thread, f"{cid} {MARKER.decode()}")
    await store.set_meta("channel.alice:someone", doomed.id)  # ids only: not the conversation's
    await store.close()
    await store.open()

    assert await store.delete(doomed.id)

    assert holding(home, f"{doomed.id} {MARKER.decode()}".encode()) == []
    assert len(holding(home, f"{other.id} {MARKER.decode()}".encode())) == 2
    assert await store.get_meta("channel.alice:someone") == doomed.id
    await store.close()


async def test_a_tombstone_reads_as_absent(tmp_path: Path) -> None:
    """A small value's tombstone (what a crash mid-deletion can leave in its file) reads as no
    value, and a value set again over it reads back."""
    store = FileSystemStore(tmp_path / "home")
    await store.open()
    key = "thread:abc__alice__bob"
    await store.set_meta(key, "secret")
    path = store.root / ".meta"
    [file] = list(path.iterdir())
    file.write_bytes(tombstone(key))
    assert await store.get_meta(key) is None
    await store.set_meta(key, "again")
    assert await store.get_meta(key) == "again"
    await store.close()


def test_a_small_values_owner_is_the_conversation_its_thread_key_names() -> None:
    """Thread keys name their conversation; other keys (cursors, channels, journals) belong to none."""
    key = "thread:" + ThreadManager.key("c1", "alice", "bob")
    assert value_owner(key) == "c1"
    assert key.startswith(owned_value_prefixes("c1"))
    assert not key.startswith(owned_value_prefixes("c"))
    assert value_owner("channel.alice:pk") is None
    assert value_owner("thread:no-separator") is None


def test_scanning_finds_owned_values_and_corrupt_copies_by_exact_name(tmp_path: Path) -> None:
    """The disk scan maps thread values to their conversation (unreadable files skipped), and only the
    conversation's own corrupt/ copies match (not those of an id it is a prefix of)."""
    meta = tmp_path / ".meta"
    meta.mkdir()
    (meta / "a.json").write_text(json.dumps({"key": "thread:c1__a__b", "value": "x"}))
    (meta / "b.json").write_text(json.dumps({"key": "nostr.cursor:s:u", "value": "1"}))
    (meta / "c.json").write_bytes(b"{not json")
    assert scan_owned_values(meta) == {"c1": {"thread:c1__a__b"}}
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    names = [
        "c1.state.json.17", "c1.events.log.18", "tmp-c1-42-99.100", "c1-2.state.json.19",
        "tmp-c1-2-42-99.101", "index.snapshot.json.5",
    ]
    for name in names:
        (corrupt / name).write_bytes(b"x")
    assert sorted(p.name for p in corrupt_copies(corrupt, "c1")) == [
        "c1.events.log.18", "c1.state.json.17", "tmp-c1-42-99.100",
    ]



def test_copies_of_shared_files_that_name_the_conversation_go_with_it(tmp_path: Path) -> None:
    """Copies in corrupt/ of files that hold several conversations (a commit journal with a bad frame, an
    index snapshot, a small value) go with a deleted conversation when they name it, and stay when they do
    not (they were left behind with its content)."""
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "journal.0.1796007033714401310").write_bytes(b"frame c1/events.log SECRET\0\0")
    (corrupt / "index.snapshot.json.5").write_bytes(b'{"entries":[{"id":"c2"}]}')
    (corrupt / "meta.0123abcd.json.7").write_bytes(b'{"key":"thread:c1__a__b","value":"SECRET"}')
    (corrupt / "notes.txt").write_bytes(b"c1")
    assert sorted(p.name for p in corrupt_copies(corrupt, "c1")) == [
        "journal.0.1796007033714401310", "meta.0123abcd.json.7",
    ]
    assert [p.name for p in corrupt_copies(corrupt, "c2")] == ["index.snapshot.json.5"]

async def test_requests_made_together_share_one_round() -> None:
    """A request made while a round runs waits for the next round, and every request waiting then is
    answered by that one round: five requests, two rounds."""
    rounds: list[int] = []
    gate = asyncio.Event()

    async def work() -> None:
        rounds.append(len(rounds))
        if len(rounds) == 1:
            await gate.wait()

    shared = SharedRounds(work)
    first = asyncio.create_task(shared.request())
    await asyncio.sleep(0)
    later = [asyncio.create_task(shared.request()) for _ in range(4)]
    await asyncio.sleep(0)
    gate.set()
    await asyncio.gather(first, *later)
    assert rounds == [0, 1]
    await shared.request()
    assert rounds == [0, 1, 2]


async def test_deletions_made_together_leave_the_index_whole(tmp_path: Path, cast: Cast) -> None:
    """Twenty conversations deleted at once (sharing index rewrites) are all gone, before and after a
    reopen, and the five others all stay."""
    store = FileSystemStore(tmp_path / "home", fsync="batch")
    await store.open()
    made = [await new_conversation(store, cast, f"conversation {n}") for n in range(25)]

    assert await asyncio.gather(*(store.delete(c.id) for c in made[:20])) == [True] * 20

    for _ in range(2):
        assert sorted(row.id for row in await store.search(SearchQuery())) == sorted(c.id for c in made[20:])
        await store.close()
        await store.open()
    await store.close()


@pytest.mark.parametrize("fsync", ["always", "batch"])
async def test_deleting_conversations_leaves_no_name_of_their_small_values_in_memory(
    tmp_path: Path, cast: Cast, fsync: str
) -> None:
    """The names of a deleted conversation's small values (its delegation threads) leave the store's memory
    with their files: a daemon making threads for months held one name per thread it ever made."""
    store = FileSystemStore(tmp_path / "home", fsync=fsync)  # type: ignore[arg-type]
    await store.open()
    try:
        before = len(store._meta_files)
        for number in range(20):
            conversation = await new_conversation(store, cast, f"talk {number}")
            await store.set_meta(f"thread:{conversation.id}__alice__bob", '{"items": []}')
            await store.delete(conversation.id)
        await wait_for(lambda: len(store._meta_files) == before)
        assert await store.get_meta(f"thread:{conversation.id}__alice__bob") is None
    finally:
        await store.close()
