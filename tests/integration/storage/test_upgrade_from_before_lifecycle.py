"""A home an earlier tenexd wrote, before the conversation lifecycle, opened by today's (docs/ARCHITECTURE.md,
"Conversation lifecycle": Upgrading): nothing in it is misread, retitled, described, redated or lost.

``tests/fixtures/before_lifecycle/conversations`` is the store of a home written by that tenexd (a person's
conversations with a planner and an executor; one ended by the planner's ``end_conversation`` and archived,
one archived by the CLI, a delegation; the daemon killed with SIGKILL while a run worked, so its commit
journal was left unreplayed and an execution session open). Its agents' keys are not kept.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from tenex_daemon.adapters.storage.filesystem import FileSystemStore
from tenex_daemon.adapters.storage.postgres import PostgresStore
from tenex_daemon.core.conversation import TitleSource
from tenex_daemon.core.search import SearchQuery
from tenex_daemon.services.descriptions import needs_description, row_has_work
from tenex_daemon.services.upgrade import save_upgraded_conversations
from tests import pipeline
from tests.conftest import Cast
from tests.contract.postgres_server import PostgresServer

pytestmark = pytest.mark.integration

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "before_lifecycle"
PICNIC = "461a1ea27965002768b3ab215f705506bc6d0b1dc134a8988d790fdfa7ca27a4"
ENDING = "91db9507e251f0cbccf990b7db4451b059c03fca21d1e4ded65b1960213d7e93"
ROUTED = "d2148f677342cd413a80917439024ee4be6e4716b2edf2766bdd2477b8930e18"
ARCHIVED_BY_CLI = "e07eb6a5d7ce74920f47e83e80b75c59ec150795248d563a5b3436eab0f58580"
TITLES = {"Picnic", "Delegation", "Routed", "Archived", "Ending"}


def copy_of_the_home(home: Path) -> None:
    """Copy the earlier tenexd's store into ``home``, with the modes its files had."""
    shutil.copytree(FIXTURE / "conversations", home / "conversations")
    for path in (home, *home.rglob("*")):
        path.chmod(0o700 if path.is_dir() else 0o600)


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[FileSystemStore]:
    """The earlier tenexd's store, copied, opened by today's (its journal replayed as it opens); closed after."""
    copy_of_the_home(tmp_path)
    opened = FileSystemStore(tmp_path)
    await opened.open()
    yield opened
    await opened.close()


async def test_a_store_from_before_the_lifecycle_is_brought_up_to_date_once_and_nothing_is_lost(
    store: FileSystemStore, cast: Cast
) -> None:
    """Each conversation keeps its history and its title, now the person's (never replaced); its last activity
    is its last update then, not the upgrade's time; the planner's end carries over (who, when, why), and one
    archived through the CLI counts as ended by the owner's archive, as one archived now does; the session a
    crash left open no longer counts; none needs a title or summary from a model or a kind 513; the
    pass saves each once (its rows say so too) and finds nothing the next time."""
    rig = pipeline.build_rig(cast, store=store)
    before = {row.id: await rig.manager.get_conversation(row.id) for row in await store.search(SearchQuery())}
    events = {cid: [e.id for e in c.history] for cid, c in before.items() if c is not None}

    assert await save_upgraded_conversations(rig.manager) == 5
    assert await save_upgraded_conversations(rig.manager) == 0

    rows = await store.search(SearchQuery())
    assert {row.title for row in rows} == TITLES
    for row in rows:
        conversation = await rig.manager.get_conversation(row.id)
        assert conversation is not None
        old = before[row.id]
        assert old is not None
        assert [e.id for e in conversation.history] == events[row.id]
        assert conversation.title_source is TitleSource.TAG
        assert conversation.activity_at == conversation.updated_at == old.updated_at
        assert row.last_activity == old.updated_at
        assert not needs_description(conversation, exchanges=10, after_exchanges=1)
        assert not row_has_work(row, after_exchanges=1)
        assert not conversation.upgraded
    ending = await rig.manager.get_conversation(ENDING)
    assert ending is not None
    assert (ending.ended_at, ending.ended_by, ending.end_reason) == (1796031727244, "planner", "user said done")
    assert "ended_at" not in ending.metadata.extra
    assert ending.archived
    archived = await rig.manager.get_conversation(ARCHIVED_BY_CLI)
    assert archived is not None
    assert archived.archived
    assert (archived.ended_at, archived.ended_by, archived.end_reason) == (archived.activity_at, "owner", "archived")
    routed = await rig.manager.get_conversation(ROUTED)
    assert routed is not None
    assert (routed.execution_time.is_active, routed.execution_time.total_seconds) == (False, 25)
    assert routed.execution_time.total(rig.manager.now_ms()) == 25


async def test_an_idle_end_after_the_upgrade_keeps_the_last_activity_of_then(
    store: FileSystemStore, cast: Cast
) -> None:
    """The idle timeout ends a conversation from before the lifecycle by its last activity then: after the
    end its row's last activity is still that (before, the end's save made it the upgrade's time, so
    retention archived nothing and deleted the newest first)."""
    rig = pipeline.build_rig(cast, store=store)
    await save_upgraded_conversations(rig.manager)
    picnic = await rig.manager.get_conversation(PICNIC)
    assert picnic is not None
    then = picnic.last_activity

    assert await rig.manager.end_conversation(PICNIC, by="idle", reason="idle_timeout", idle_before=then + 1)

    [row] = [row for row in await store.search(SearchQuery()) if row.id == PICNIC]
    assert (row.last_activity, row.ended_at is not None) == (then, True)


def before_the_lifecycle(state: dict[str, Any], updated_at: int, ended_at: int) -> str:
    """``state`` as an earlier tenexd stored it: no lifecycle fields, its agent's end in ``metadata.extra``."""
    for key in ("activity_at", "ended_at", "ended_by", "end_reason", "summary", "title_source", "described_at",
                "description_published", "channel", "task_id", "previous_session", "missing_root", "tools_used"):
        state.pop(key, None)
    state["updated_at"] = updated_at
    state["metadata"]["extra"] = {"ended_at": ended_at, "ended_by": "alice", "end_reason": "done"}
    return json.dumps(state)


async def test_a_postgresql_conversation_from_before_the_lifecycle_is_brought_up_to_date_by_its_row(
    postgres_server: PostgresServer, cast: Cast
) -> None:
    """On PostgreSQL, conversations whose state and row an earlier tenexd wrote (no lifecycle fields: the
    columns migration 2 added at their defaults; its agent's end in ``metadata.extra``) are found by the pass
    and saved brought up to date: the row's last activity is its last update then, its title the person's;
    one still archived is ended by that end, one a new message restored since (the end's keys left behind)
    is not ended; neither needs a description."""
    store = PostgresStore(await postgres_server.create_database())
    await store.open()
    try:
        rig = pipeline.build_rig(cast, store=store)
        ended = cast.user_says("Plan a picnic", kind=11, tags=[["title", "Picnic"]])
        reopened = cast.user_says("Plan a party", kind=11, tags=[["title", "Party"]])
        for root in (ended, reopened):
            await rig.manager.create_conversation(root)
        conn = await asyncpg.connect(store.dsn)
        try:
            for root, archived in ((ended, True), (reopened, False)):
                state = json.loads(await conn.fetchval("SELECT state FROM conversations WHERE id = $1", root.id))
                await conn.execute(
                    "UPDATE conversations SET state = $2, updated_at = $3, activity_at = 0, ended_at = NULL,"
                    " lifecycle = '{}', archived = $4 WHERE id = $1",
                    root.id, before_the_lifecycle(state, 1_700_000_000_000, 1_699_999_000_000),
                    1_700_000_000_000, archived,
                )
        finally:
            await conn.close()

        assert await save_upgraded_conversations(rig.manager) == 2

        rows = {row.id: row for row in await store.search(SearchQuery())}
        assert (rows[ended.id].last_activity, rows[ended.id].ended_at, rows[ended.id].title_source) == (
            1_700_000_000_000, 1_699_999_000_000, TitleSource.TAG
        )
        assert (rows[reopened.id].last_activity, rows[reopened.id].ended_at) == (1_700_000_000_000, None)
        assert not any(row_has_work(row, after_exchanges=1) for row in rows.values())
        conversation = await rig.manager.get_conversation(ended.id)
        assert conversation is not None
        assert (conversation.ended_by, conversation.end_reason, conversation.upgraded) == ("alice", "done", False)
        still_open = await rig.manager.get_conversation(reopened.id)
        assert still_open is not None
        assert (still_open.is_ended, "ended_at" in still_open.metadata.extra) == (False, False)
        assert await save_upgraded_conversations(rig.manager) == 0
    finally:
        await store.close()
