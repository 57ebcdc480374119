"""``tenexd migrate --from-store``: a filesystem store copied whole into the store config.toml names (here a
filesystem store moved with ``storage.path``; tests/integration/storage/test_store_copy.py copies into
PostgreSQL): conversations with their state and archive, every processed id (a deleted conversation's too),
every small value; the daemon's start check then finds the store used, and nothing is answered twice."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from tenex_daemon.adapters.storage.filesystem import FileSystemStore
from tenex_daemon.adapters.storage.filesystem.store_format import FORMAT_NAME, STORE_FORMAT, StoreFormatError
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.app.daemon import SUBSCRIPTION_ID
from tenex_daemon.app.settings import load_settings
from tenex_daemon.app.store_check import (
    COPY_KEY,
    EmptyStoreError,
    copying_mark,
    left_in_the_home,
    refuse_an_empty_store_beside_the_homes,
    used_before,
)
from tenex_daemon.app.store_copy import StoreCopyError, copy_store, shared_keys
from tenex_daemon.app.wiring import build_store
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.ports import Store
from tenex_daemon.core.search import SearchQuery
from tests.unit.cli.conftest import tenexd
from tests.unit.cli.test_cli import seed_conversation

CURSOR = "relay.cursor:tenexd-mentions:ws://127.0.0.1:1"


def seed(home: Path) -> dict[str, str]:
    """Three conversations in ``home``'s own store: one archived, one deleted (its ids stay processed); an id
    processed without a conversation; a relay cursor and a run journal. Return their ids by name."""
    kept = seed_conversation(home, "Kept", "first", "second")
    archived = seed_conversation(home, "Archived", "old news")
    deleted = seed_conversation(home, "Deleted", "gone")

    async def go() -> None:
        store = FileSystemStore(home)
        await store.open()
        try:
            await store.set_archived(archived, True)
            assert await store.delete(deleted)
            await store.mark_processed("ab" * 32)
            await store.set_meta(CURSOR, "1700000000")
            await store.set_meta("runs.pending", json.dumps([{"dispatch": "cd" * 32}]))
            await store.set_meta("watchdog.store", "1")
        finally:
            await store.close()

    asyncio.run(go())
    return {"kept": kept, "archived": archived, "deleted": deleted}


async def assert_copied(store: Store, ids: dict[str, str], journal_key: str) -> None:
    """``store`` holds what :func:`seed` made, copied: the two kept conversations (one archived, with its
    title and history), the deleted one's and the lone processed id, the cursor, the run journal under
    ``journal_key``, and no watchdog value."""
    rows = {row.id: row for row in await store.search(SearchQuery())}
    assert set(rows) == {ids["kept"], ids["archived"]}
    assert (rows[ids["kept"]].title, rows[ids["kept"]].archived) == ("Kept", False)
    assert rows[ids["archived"]].archived
    kept = await store.load(ids["kept"])
    assert kept is not None
    assert [e.content for e in kept.history] == ["first", "second"]
    for event_id in (ids["deleted"], "ab" * 32, kept.history[1].id):
        assert await store.is_processed(event_id)
    assert await store.get_meta(CURSOR) == "1700000000"
    assert await store.get_meta(journal_key) == json.dumps([{"dispatch": "cd" * 32}])
    assert await store.get_meta("watchdog.store") is None


def moved(home: Path, tmp_path: Path) -> Path:
    """Point the home's settings at a new, empty filesystem store (``storage.path``); return its folder."""
    target = tmp_path / "new-store"
    target.mkdir()
    config = home / "config.toml"
    config.write_text(config.read_text().replace("[storage]\n", f'[storage]\npath = "{target}"\n', 1))
    return target


def test_migrate_from_store_copies_everything_and_the_start_check_passes(home: Path, tmp_path: Path) -> None:
    """The copy holds each conversation (history, title, archive), the deleted one's and the lone processed
    id, the cursor and the run journal (under its own key: a filesystem store is one daemon's), not the old
    watchdog value; the daemon's start check finds the new store used, so it starts and answers nothing
    again."""
    ids = seed(home)
    target = moved(home, tmp_path)
    settings = load_settings(home)
    assert left_in_the_home(settings) == 2

    code, out = tenexd(home, "migrate", "--from-store", str(home), "--json")

    assert code == 0, out
    report = json.loads(out)
    assert (report["conversations"], report["archived"], report["renamed"], report["unreadable"]) == (2, 1, {}, [])
    assert report["processed"] == 2  # the deleted conversation's root and the lone id

    async def check() -> None:
        store = FileSystemStore(target)
        await store.open()
        try:
            await assert_copied(store, ids, "runs.pending")
            assert await used_before(settings, store, SUBSCRIPTION_ID)
        finally:
            await store.close()

    asyncio.run(check())


def test_migrate_from_store_refuses_a_used_store_a_missing_one_and_the_same_one(home: Path, tmp_path: Path) -> None:
    """A second copy into the now used store exits 1 (nothing copied twice), a folder with no store exits 2,
    and the store config.toml names itself exits 2."""
    seed(home)
    moved(home, tmp_path)
    assert tenexd(home, "migrate", "--from-store", str(home))[0] == 0

    again, _ = tenexd(home, "migrate", "--from-store", str(home))
    missing, _ = tenexd(home, "migrate", "--from-store", str(tmp_path / "nothing"))
    itself, _ = tenexd(home, "migrate", "--from-store", str(tmp_path / "new-store"))

    assert (again, missing, itself) == (2, 2, 2)


def test_copy_store_refuses_a_target_holding_conversations_or_copied_already(home: Path, tmp_path: Path) -> None:
    """copy_store itself refuses, whoever calls it, a target that holds a conversation of its own, and one a
    copy filled whole already (nothing is copied twice)."""
    seed_conversation(home, "Old", "hello")
    target_home = moved(home, tmp_path)
    seed_conversation(home, "The new store's own", "hi")  # the settings name the new store now
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    async def go() -> None:
        target = FileSystemStore(target_home)
        await target.open()
        try:
            with pytest.raises(StoreCopyError, match="holds conversations already"):
                await copy_store(home, target)
        finally:
            await target.close()
        fresh = FileSystemStore(elsewhere)
        await fresh.open()
        try:
            await copy_store(home, fresh)
            with pytest.raises(StoreCopyError, match="made by a copy already"):
                await copy_store(home, fresh)
        finally:
            await fresh.close()

    asyncio.run(go())


def test_a_copy_cut_short_is_refused_a_start_and_taken_up_again_by_the_same_command(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy whose database went away after its first conversation: the daemon's start check refuses the
    store, naming the command that finishes it; that command run again skips what was copied and copies the
    rest, and the store then starts."""
    ids = seed(home)
    moved(home, tmp_path)
    settings = load_settings(home)
    target = FileSystemStore(tmp_path / "new-store")
    create = target.create
    made: list[str] = []

    async def gone_after_one(conversation: Conversation) -> None:
        if made:
            raise OSError("the database went away")
        made.append(conversation.id)
        await create(conversation)

    async def cut_short() -> None:
        await target.open()
        try:
            monkeypatch.setattr(target, "create", gone_after_one)
            with pytest.raises(OSError, match="went away"):
                await copy_store(home, target)
            with pytest.raises(EmptyStoreError, match="tenexd migrate --from-store"):
                await refuse_an_empty_store_beside_the_homes(settings, target, SUBSCRIPTION_ID)
        finally:
            monkeypatch.undo()
            await target.close()

    asyncio.run(cut_short())
    code, out = tenexd(home, "migrate", "--from-store", str(home), "--json")

    async def started() -> None:
        store = FileSystemStore(tmp_path / "new-store")
        await store.open()
        try:
            await assert_copied(store, ids, "runs.pending")
            await refuse_an_empty_store_beside_the_homes(settings, store, SUBSCRIPTION_ID)
        finally:
            await store.close()

    assert code == 0, out
    assert json.loads(out)["conversations"] == 2
    asyncio.run(started())


def test_an_outbox_copied_into_a_shared_store_comes_with_a_run_journal_to_be_found_by(home: Path) -> None:
    """Into a store daemons share, an old outbox and its gift wraps go under a project daemon's keys, and a
    run journal is written under its key when the old store had none: the daemons look for a dead one's run
    journal, then take its outbox over with it."""
    project = "ee" * 32

    async def go() -> MemoryStore:
        store = FileSystemStore(home)
        await store.open()
        try:
            await store.set_meta("outbox.pending", "[1]")
            await store.set_meta("outbox.wraps", "[2]")
        finally:
            await store.close()
        target = MemoryStore()
        await target.open()
        report = await copy_store(home, target, renames=shared_keys(project))
        assert report.renamed == {"outbox.pending": f"outbox.pending.{project}", "outbox.wraps": f"outbox.wraps.{project}"}
        return target

    target = asyncio.run(go())

    async def values() -> tuple[str | None, ...]:
        keys = (f"outbox.pending.{project}", f"outbox.wraps.{project}", f"runs.pending.{project}", "outbox.pending")
        return tuple([await target.get_meta(key) for key in keys])

    assert asyncio.run(values()) == ("[1]", "[2]", "[]", None)


def test_a_source_refused_leaves_the_target_unmarked(home: Path, tmp_path: Path) -> None:
    """A source store refused when the copy opens it (here one a newer tenexd wrote) leaves the target as it
    was: not marked as a copy under way, so a daemon may still start on it."""
    seed_conversation(home, "Old", "hello")
    (home / "conversations" / FORMAT_NAME).write_text(f"{STORE_FORMAT + 1}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    async def go() -> str | None:
        target = FileSystemStore(elsewhere)
        await target.open()
        try:
            with pytest.raises(StoreFormatError):
                await copy_store(home, target)
            return await target.get_meta(COPY_KEY)
        finally:
            await target.close()

    assert asyncio.run(go()) is None


BEFORE_LIFECYCLE = Path(__file__).resolve().parents[2] / "fixtures" / "before_lifecycle"
ENDED_BY_THE_PLANNER = "91db9507e251f0cbccf990b7db4451b059c03fca21d1e4ded65b1960213d7e93"


async def test_a_store_an_earlier_tenexd_wrote_is_copied_brought_up_to_date_with_its_ends_kept(
    tmp_path: Path,
) -> None:
    """A store written before the lifecycle's fields, copied before today's daemon ever ran on it: the
    planner's end (who, when, why) is in the copy as recorded then and counts as an end, and the old
    keys are gone from ``extra``. Its rows look up to date in the target, so no later pass would mend it
    (the copy lost the end, and the first sweep then ended it anew as idle)."""
    source = tmp_path / "old"
    shutil.copytree(BEFORE_LIFECYCLE / "conversations", source / "conversations")
    target = MemoryStore()

    await copy_store(source, target)

    ending = await target.load(ENDED_BY_THE_PLANNER)
    assert ending is not None
    assert (ending.ended_at, ending.ended_by, ending.end_reason) == (1796031727244, "planner", "user said done")
    assert "ended_by" not in ending.metadata.extra
    assert ENDED_BY_THE_PLANNER in {row.id for row in await target.search(SearchQuery(ended=True))}


def test_an_event_the_source_salvaged_out_of_a_damaged_log_stays_processed_in_the_copy(home: Path) -> None:
    """An event whose log line fails its checksum leaves the source's history (the log is salvaged) but
    stays processed there; the copy marks it processed too, so the relays' copy of it is not answered
    again."""
    ids = seed(home)
    log = next((home / "conversations").rglob(f"{ids['kept']}/events.log"))
    lines = log.read_bytes().split(b"\n")
    damaged = next(i for i, line in enumerate(lines) if b'"content":"second"' in line)
    victim = json.loads(lines[damaged].split(b" ", 1)[1])  # a line: its checksum, a space, the event
    lines[damaged] = lines[damaged].replace(b'"content":"second"', b'"content":"secone"', 1)
    log.write_bytes(b"\n".join(lines))
    target = MemoryStore()

    async def copy_and_read() -> tuple[Conversation | None, bool]:
        await copy_store(home, target)
        return await target.load(ids["kept"]), await target.is_processed(victim["id"])

    kept, processed = asyncio.run(copy_and_read())
    assert kept is not None
    assert [e.content for e in kept.history] == ["first"]
    assert processed


def test_the_old_store_is_refused_a_daemon_after_the_copy_until_the_operator_reopens_it(
    home: Path, tmp_path: Path
) -> None:
    """Once copied away, the old store is marked: config.toml pointed back at it, the daemon's start check
    refuses it (it lacks all the copy gained since), naming the copy and `tenexd migrate --reopen`, which lifts
    the mark (once: again it exits 2); the copy itself is not marked."""
    seed(home)
    config = home / "config.toml"
    before = config.read_text()
    target = moved(home, tmp_path)
    assert tenexd(home, "migrate", "--from-store", str(home))[0] == 0

    async def start_check() -> None:
        settings = load_settings(home)
        store = build_store(settings)
        await store.open()
        try:
            await refuse_an_empty_store_beside_the_homes(settings, store, SUBSCRIPTION_ID)
        finally:
            await store.close()

    asyncio.run(start_check())  # the copy, which config.toml names, starts
    config.write_text(before)  # switched back to the old store
    with pytest.raises(EmptyStoreError, match=f"was copied into the filesystem store at {target}.*tenexd migrate --reopen"):
        asyncio.run(start_check())

    code, out = tenexd(home, "migrate", "--reopen")
    assert code == 0, out
    asyncio.run(start_check())
    assert tenexd(home, "migrate", "--reopen")[0] == 2


def test_a_store_copied_away_is_not_copied_again_unless_reopened_but_a_copy_cut_short_is_finished(
    home: Path, tmp_path: Path
) -> None:
    """Copied into one store, the old store is refused as the source of another copy (the daemon ran on the
    first copy since: a second would lack all it gained), naming the first; a copy cut short after the old
    store was marked is still finished by the command again; `--reopen --json` says what it lifted."""
    seed(home)
    moved(home, tmp_path)
    assert tenexd(home, "migrate", "--from-store", str(home))[0] == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    async def copy_into(folder: Path, *, cut_short: bool = False) -> None:
        target = FileSystemStore(folder)
        await target.open()
        try:
            if cut_short:
                await target.set_meta(COPY_KEY, copying_mark(home))
            await copy_store(home, target)
        finally:
            await target.close()

    with pytest.raises(StoreCopyError, match=f"was copied into the filesystem store at {tmp_path / 'new-store'}"):
        asyncio.run(copy_into(elsewhere))
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    asyncio.run(copy_into(resumed, cut_short=True))  # the old store marked, this copy not yet whole

    config = home / "config.toml"
    config.write_text(config.read_text().replace(f'path = "{tmp_path / "new-store"}"\n', ""))
    code, out = tenexd(home, "migrate", "--reopen", "--json")
    assert code == 0, out
    assert json.loads(out)["copied"].startswith("into ")
