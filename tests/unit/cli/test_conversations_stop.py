"""`tenexd conversations stop ID [--agent SLUG]` with no daemon running: the runs a crashed daemon left
journaled for the conversation are removed (the next start does not redo them) and the stop is recorded."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from tenex_daemon.app.home import load_agents, load_project_pubkey
from tenex_daemon.app.settings import load_settings
from tenex_daemon.app.wiring import build_store
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.services.runs import PENDING_RUNS_KEY
from tenex_daemon.testing import EventFactory
from tests.unit.cli.conftest import USER, tenexd


def on_store(home: Path, action: Any) -> Any:
    """Run ``action(manager)`` on the home's store (opened and closed around it)."""

    async def go() -> Any:
        settings = load_settings(home)
        store = build_store(settings)
        await store.open()
        try:
            manager = ConversationManager(store, load_agents(settings), load_project_pubkey(settings))
            return await action(manager)
        finally:
            await store.close()

    return asyncio.run(go())


def seed_with_journaled_runs(home: Path) -> tuple[str, str]:
    """A conversation to the planner and another, each with a run a crashed daemon left journaled (the
    planner's and the executor's in the first); return both ids."""

    async def seed(manager: ConversationManager) -> tuple[str, str]:
        events = EventFactory()
        planner = manager.agents.get("planner")
        first = events.event(USER, "Plan it", kind=11, tags=[["p", planner.pubkey]])
        second = events.event(USER, "Plan that", kind=11, tags=[["p", planner.pubkey]])
        for root in (first, second):
            await manager.create_conversation(root)
        journal = [
            {"dispatch": "b" * 64},
            {"conversation_id": first.id, "trigger_id": first.id, "agent_slug": "planner"},
            {"conversation_id": first.id, "trigger_id": first.id, "agent_slug": "executor"},
            {"conversation_id": second.id, "trigger_id": second.id, "agent_slug": "planner"},
        ]
        await manager.store.set_meta(PENDING_RUNS_KEY, json.dumps(journal))
        return first.id, second.id

    ids: tuple[str, str] = on_store(home, seed)
    return ids


def journal(home: Path) -> list[dict[str, Any]]:
    """The home's stored run journal."""

    async def read(manager: ConversationManager) -> list[dict[str, Any]]:
        raw = await manager.store.get_meta(PENDING_RUNS_KEY)
        return list(json.loads(raw or "[]"))

    entries: list[dict[str, Any]] = on_store(home, read)
    return entries


def test_stop_removes_the_conversations_journaled_runs_and_records_the_stop(home: Path) -> None:
    """`conversations stop ID --agent planner` removes only the planner's journaled run of that conversation;
    a second stop without --agent removes the executor's; the other conversation's run and the dispatch
    stay; both stops are recorded as the owner's in the conversation's metadata."""
    first, second = seed_with_journaled_runs(home)

    code, out = tenexd(home, "conversations", "stop", first, "--agent", "planner")
    assert code == 0, out
    assert "stopped planner" in out
    assert [(e.get("conversation_id"), e.get("agent_slug")) for e in journal(home)] == [
        (None, None), (first, "executor"), (second, "planner"),
    ]

    code, out = tenexd(home, "conversations", "stop", first)
    assert code == 0, out
    assert "stopped executor" in out
    assert [e.get("conversation_id") for e in journal(home)] == [None, second]

    code, out = tenexd(home, "conversations", "stop", first)
    assert "nothing was running" in out
    code, out = tenexd(home, "conversations", "show", first, "--json")
    stops = json.loads(out)["metadata"]["extra"]["stops"]
    assert [(s["by"], s["agents"]) for s in stops] == [("owner", ["planner"]), ("owner", ["executor"]), ("owner", [])]


def test_stop_of_an_unknown_conversation_or_agent_fails(home: Path) -> None:
    """An unknown conversation exits 1 (not found), an agent slug the home does not have exits 2 (bad input,
    as ``context --agent`` and ``send --to`` do), and neither changes anything."""
    first, _ = seed_with_journaled_runs(home)

    unknown = tenexd(home, "conversations", "stop", "f" * 64)[0]
    nobody = tenexd(home, "conversations", "stop", first, "--agent", "nobody")[0]

    assert (unknown, nobody) == (1, 2)
    assert len(journal(home)) == 4
