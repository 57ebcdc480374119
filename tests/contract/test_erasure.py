"""Deleting a conversation erases it everywhere, on every store (memory, filesystem both fsync
policies, PostgreSQL): no byte of its content (events, title, summary, delegation threads, index
rows) is left in what the store keeps, while its event ids stay processed (docs/ARCHITECTURE.md,
"Conversation lifecycle")."""

from __future__ import annotations

import os
from pathlib import Path

import asyncpg
import pytest

from tenex_daemon.adapters.storage.filesystem import FileSystemStore
from tenex_daemon.adapters.storage.postgres import PostgresStore
from tenex_daemon.core.conversation import TitleSource
from tenex_daemon.core.ports import Store
from tenex_daemon.core.search import SearchQuery
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.services.threads import ThreadManager
from tenex_daemon.testing import FakeClock
from tests.conftest import Cast
from tests.contract.conftest import StoreHarness

pytestmark = pytest.mark.integration

MARKER = "Zq7-erase-me-unique-marker"
KEPT = "Kp4-kept-conversation-marker"


def files_bytes(home: Path) -> dict[Path, bytes]:
    """Every regular file under ``home`` (binary), by path."""
    found: dict[Path, bytes] = {}
    for folder, _, names in os.walk(home):
        for name in names:
            path = Path(folder) / name
            if path.is_file() and not path.is_symlink():
                found[path] = path.read_bytes()
    return found


async def postgres_text(dsn: str) -> dict[str, bytes]:
    """The text of every row of every table of the database, by table (what any query can return)."""
    conn = await asyncpg.connect(dsn)
    try:
        tables = [
            row["name"]
            for row in await conn.fetch(
                "SELECT quote_ident(table_name) AS name FROM information_schema.tables "
                "WHERE table_schema = 'public' AND table_type = 'BASE TABLE'"
            )
        ]
        found: dict[str, bytes] = {}
        for table in tables:
            rows = await conn.fetch(f"SELECT t::text AS row FROM {table} t")  # names quoted by quote_ident
            found[table] = "\n".join(row["row"] for row in rows).encode("utf-8")
        return found
    finally:
        await conn.close()


async def where_found(store: Store, marker: str) -> list[str]:
    """Where the store keeps ``marker``: files (filesystem), tables (PostgreSQL) or its memory."""
    needle = marker.encode("utf-8")
    if isinstance(store, FileSystemStore):
        return [str(path) for path, data in files_bytes(store.home).items() if needle in data]
    if isinstance(store, PostgresStore):
        return [table for table, data in (await postgres_text(store.dsn)).items() if needle in data]
    return ["memory"] if needle in repr(vars(store)).encode("utf-8") else []


def manager_of(store: Store, cast: Cast, clock: FakeClock) -> ConversationManager:
    return ConversationManager(store, cast.agents, cast.project.pubkey, clock=clock, owner_pubkey=cast.user.pubkey)


async def test_deleting_leaves_no_byte_of_the_conversation_and_keeps_its_ids_processed(
    harness: StoreHarness, cast: Cast
) -> None:
    """A conversation whose content, title tag, summary and delegation thread carry a unique marker is,
    once deleted, nowhere in the store (before and after a reopen), its event ids stay processed, and
    another conversation (with its own thread) is intact."""
    clock = FakeClock()
    store = await harness.open()
    manager = manager_of(store, cast, clock)
    root = cast.user_says(f"Please plan {MARKER}", kind=11, tags=[["title", f"Title {MARKER}"]])
    doomed = await manager.create_conversation(root)
    reply = cast.alice_says(f"Sure, {MARKER} it is")
    await manager.add_event(doomed.id, reply)
    await manager.end_conversation(doomed.id, by="owner", reason=f"done with {MARKER}")
    described = await manager.describe(
        doomed.id, title=None, summary=f"A summary of {MARKER}.", source=TitleSource.MODEL, for_activity=1
    )
    assert described.title == f"Title {MARKER}"
    other = await manager.create_conversation(cast.user_says(f"Another talk {KEPT}", kind=11))
    threads = ThreadManager(store=store)
    for cid, text in ((doomed.id, MARKER), (other.id, KEPT)):
        thread = await threads.get_thread(cid, "alice", "bob")
        await threads.add_item_and_save(thread, {"role": "user", "content": f"delegated {text}"})
    store = await harness.reopen(store)  # the filesystem's index snapshot now holds the title
    manager = manager_of(store, cast, clock)
    await manager.add_event(doomed.id, cast.user_says(f"one more {MARKER}"))  # in batch's journal
    assert await where_found(store, MARKER)

    assert await manager.delete_conversation(doomed.id)
    threads.forget_conversation(doomed.id)

    assert await where_found(store, MARKER) == []
    for _ in range(2):
        assert await store.is_processed(root.id)
        assert await store.is_processed(reply.id)
        assert await store.load(doomed.id) is None
        assert [row.id for row in await store.search(SearchQuery())] == [other.id]
        assert await ThreadManager(store=store).get_thread(doomed.id, "alice", "bob") == (
            await ThreadManager().get_thread(doomed.id, "alice", "bob")
        )
        kept_thread = await ThreadManager(store=store).get_thread(other.id, "alice", "bob")
        assert kept_thread.items == [{"role": "user", "content": f"delegated {KEPT}"}]
        assert await where_found(store, KEPT)
        store = await harness.reopen(store)
    assert await where_found(store, MARKER) == []
