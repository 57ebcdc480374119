"""``tenexd migrate --from-smarthole data.json`` end to end on a home made by ``tenexd init``."""

from __future__ import annotations

import asyncio
import json
import stat
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.adapters.storage.filesystem.lock import lock_home, unlock_home
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.app.control_api import ControlServer
from tenex_daemon.app.home import load_agents, load_project_pubkey
from tenex_daemon.app.settings import load_settings
from tenex_daemon.app.wiring import build_store
from tenex_daemon.cli.main import app
from tenex_daemon.core.context import ChatMessage
from tenex_daemon.core.search import SearchQuery
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.testing import KeyPair
from tests.unit.cli.test_archive_restore_repeat import Daemon as Running

USER = KeyPair.from_seed(902)


def tenexd(home: Path, *args: str) -> tuple[int, str, str]:
    """Run ``tenexd --home HOME ARGS`` in-process; return (exit code, stdout, stderr)."""
    result = CliRunner().invoke(app, ["--home", str(home), *args], catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A home made by ``tenexd init`` with USER as the owner (so it has no owner key file)."""
    path = tmp_path / "home"
    code, out, _ = tenexd(path, "init", "--owner", USER.npub, "--relay", "ws://127.0.0.1:1")
    assert code == 0, out
    return path


def data_file(tmp_path: Path, *, bad: bool = False) -> Path:
    """A data.json with one ended conversation (an answer with tools) and a legacy history of one entry;
    with ``bad``, a third conversation that is not an object."""
    conversations: list[Any] = [{
        "id": "conv-1", "startedAt": "2024-01-01T10:00:00.000Z", "endedAt": "2024-01-01T10:30:00.000Z",
        "title": "Groceries", "summary": "A grocery list was written.",
        "messages": [
            {"id": "m1", "timestamp": "2024-01-01T10:00:00.000Z", "role": "user", "content": "Make a grocery list"},
            {"id": "m2", "timestamp": "2024-01-01T10:00:04.000Z", "role": "assistant", "content": "Done.",
             "toolsUsed": ["write_file"]},
        ],
    }]
    if bad:
        conversations.append("oops")
    data = {
        "conversationData": {"conversations": conversations},
        "history": {"recentConversations": [{
            "id": "h1", "timestamp": "2023-12-01T09:00:00Z", "userMessage": "Hello",
            "assistantResponse": "Hi there", "toolsUsed": [],
        }]},
    }
    path = tmp_path / ("bad.json" if bad else "data.json")
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def stored_views(home: Path, slug: str) -> dict[str, tuple[list[ChatMessage], dict[str, list[str]], int | None]]:
    """Each stored conversation's title -> (the messages ``slug`` would be shown, tools_used, ended_at)."""

    async def go() -> dict[str, tuple[list[ChatMessage], dict[str, list[str]], int | None]]:
        settings = load_settings(home)
        store = build_store(settings)
        await store.open()
        try:
            manager = ConversationManager(store, load_agents(settings), load_project_pubkey(settings))
            views = {}
            for row in await store.search(SearchQuery()):
                conversation = await store.load(row.id)
                assert conversation is not None
                context = await manager.preview_agent_messages(row.id, slug)
                views[row.title] = (context.messages, conversation.tools_used, conversation.ended_at)
            return views
        finally:
            await store.close()

    return asyncio.run(go())


def test_migrate_from_smarthole_imports_once_as_the_default_agent(home: Path, tmp_path: Path) -> None:
    """The import stores both conversations as the default agent's, makes a 0600 import key, and a second
    run reports the first and changes nothing."""
    path = data_file(tmp_path)
    code, out, _ = tenexd(home, "migrate", "--from-smarthole", str(path), "--json")
    assert code == 0, out
    report = json.loads(out)
    assert len(report["imported"]) == 2
    assert (report["events_imported"], report["failed"], report["clean"]) == (4, [], True)
    assert report["already_imported"] is None
    key = home / "keys" / "import.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    user_pubkey = Signer.from_file(key).pubkey

    settings = load_settings(home)
    slug = settings.default_agent_slug
    assert slug is not None
    views = stored_views(home, slug)
    assert set(views) == {"Groceries", "Migrated Conversation History"}
    messages, tools, ended = views["Groceries"]
    # the agent's answer, the newest event, is the preview's trigger: shown as its own (docs/CONTEXT.md, step 4)
    assert [(m.role, m.content) for m in messages] == [("user", "Make a grocery list"), ("system", "[Planner]: Done.")]
    assert list(tools.values()) == [["write_file"]]
    assert ended == 1_704_105_000_000
    messages, _, ended = views["Migrated Conversation History"]
    assert [(m.role, m.content) for m in messages] == [("user", "Hello"), ("system", "[Planner]: Hi there")]
    assert ended is not None

    code, out, _ = tenexd(home, "migrate", "--from-smarthole", str(path), "--json")
    assert code == 0, out
    again = json.loads(out)
    assert again["imported"] == []
    assert again["already_imported"]["imported"] == 2
    code, out, _ = tenexd(home, "migrate", "--from-smarthole", str(path))
    assert code == 0
    assert "already imported" in out
    assert "nothing changed" in out
    assert Signer.from_file(key).pubkey == user_pubkey
    assert set(stored_views(home, slug)) == {"Groceries", "Migrated Conversation History"}


def test_migrate_from_smarthole_reports_failures_with_exit_1(home: Path, tmp_path: Path) -> None:
    """A conversation that cannot be imported is listed and the command exits 1; the rest is imported."""
    bad = data_file(tmp_path, bad=True)
    code, out, _ = tenexd(home, "migrate", "--from-smarthole", str(bad), "--agent", "planner")
    assert code == 1, out
    assert "imported 2 conversation(s)" in out
    assert "conversation #1 is not an object" in out
    views = stored_views(home, "planner")
    assert [m.role for m in views["Groceries"][0]] == ["user", "system"]  # the agent's answer as the trigger


def test_migrate_from_smarthole_refuses_bad_input(home: Path, tmp_path: Path) -> None:
    """Neither list in the file, both sources, an unknown agent, a missing file or a folder given for the file
    exit 2 with the reason."""
    other = tmp_path / "settings.json"
    other.write_text(json.dumps({"enabled": True}), encoding="utf-8")
    code, _, err = tenexd(home, "migrate", "--from-smarthole", str(other))
    assert code == 2
    assert "no SmartHole data found" in err
    code, _, err = tenexd(home, "migrate", "--from", str(tmp_path), "--from-smarthole", str(other))
    assert code == 2
    assert "one of --from, --from-smarthole, --from-store and --reopen" in err
    code, _, err = tenexd(home, "migrate", "--from-smarthole", str(data_file(tmp_path)), "--agent", "nobody")
    assert code == 2
    assert "'nobody'" in err
    code, _, err = tenexd(home, "migrate", "--from-smarthole", str(tmp_path / "missing.json"))
    assert code == 2
    assert "missing.json" in err
    code, _, err = tenexd(home, "migrate", "--from-smarthole", str(tmp_path))
    assert code == 2
    assert "Is a directory" in err


def test_migrate_from_smarthole_needs_the_daemon_stopped(home: Path, tmp_path: Path) -> None:
    """While another holder has the store's lock, nothing is imported and the command says to stop the daemon."""
    fd = lock_home(load_settings(home).conversations_path)
    try:
        code, _, err = tenexd(home, "migrate", "--from-smarthole", str(data_file(tmp_path)))
    finally:
        unlock_home(fd)
    assert code == 1
    assert "stop the daemon" in err
    assert stored_views(home, "planner") == {}


async def test_migrate_refuses_while_a_daemon_answers_on_the_homes_control_socket(home: Path, tmp_path: Path) -> None:
    """A daemon that answers on the home's control API (one on a PostgreSQL database holds no lock the command
    would meet) keeps `migrate` from importing: it exits 1 saying to stop the daemon, stores nothing, and makes
    no import key."""
    settings = load_settings(home)
    manager = ConversationManager(MemoryStore(), load_agents(settings), load_project_pubkey(settings))
    async with ControlServer(Running(manager), settings.control_socket_path):
        code, _, err = await asyncio.to_thread(tenexd, home, "migrate", "--from-smarthole", str(data_file(tmp_path)))

    assert code == 1
    assert "stop the daemon" in err
    assert await asyncio.to_thread(stored_views, home, "planner") == {}
    assert not (home / "keys" / "import.key").exists()
