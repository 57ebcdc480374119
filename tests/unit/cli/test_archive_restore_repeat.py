"""`tenexd conversations archive` of an archived conversation and `restore` of one not archived say so and
exit 1, as `end` of an ended conversation does, both from the store (no daemon) and through a running
daemon's control API (which answers a repeated archive or restore with success: the CLI asks first)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.app.control_api import ControlServer
from tenex_daemon.app.home import load_agents, load_project_pubkey
from tenex_daemon.app.metrics import Metrics
from tenex_daemon.app.settings import load_settings
from tenex_daemon.cli.main import app
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.testing import EventFactory
from tests.unit.cli.conftest import USER
from tests.unit.cli.test_cli import seed_conversation


def tenexd(home: Path, *args: str) -> tuple[int, str, str]:
    """Run ``tenexd --home HOME ARGS`` in-process; return (exit code, stdout, stderr)."""
    result = CliRunner().invoke(app, ["--home", str(home), *args], catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def test_archive_of_an_archived_conversation_exits_1_as_a_second_end_does(home: Path) -> None:
    """Without a daemon, a second `archive` exits 1 saying the conversation is archived already, with the
    exit status a second `end` has, and the conversation stays archived."""
    picnic = seed_conversation(home, "Picnic plans", "Plan a picnic")
    logo = seed_conversation(home, "Logo design", "We need a logo")
    assert tenexd(home, "conversations", "archive", picnic) == (0, f"archived {picnic}\n", "")
    assert tenexd(home, "conversations", "end", logo) == (0, f"ended {logo}\n", "")

    again = tenexd(home, "conversations", "archive", picnic)
    end_again = tenexd(home, "conversations", "end", logo)

    assert again == (1, "", f"error: conversation {picnic} is archived already\n")
    assert end_again == (again[0], "", f"error: conversation {logo} is ended already\n")
    assert picnic[:12] in tenexd(home, "conversations", "list", "--archived")[1]


def test_restore_of_a_conversation_not_archived_exits_1_saying_so(home: Path) -> None:
    """Without a daemon, `restore` of a conversation never archived, or restored already, exits 1 saying it
    is not archived; restoring an archived one still works."""
    picnic = seed_conversation(home, "Picnic plans", "Plan a picnic")

    assert tenexd(home, "conversations", "restore", picnic) == (
        1, "", f"error: conversation {picnic} is not archived\n"
    )
    assert tenexd(home, "conversations", "archive", picnic)[0] == 0
    assert tenexd(home, "conversations", "restore", picnic) == (0, f"restored {picnic}\n", "")
    assert tenexd(home, "conversations", "restore", picnic)[0] == 1
    assert picnic[:12] in tenexd(home, "conversations", "list")[1]


@dataclass
class Daemon:
    """A ControlTarget serving ``manager``, as the daemon does."""

    manager: ConversationManager
    metrics: Metrics = field(default_factory=Metrics)

    def status(self) -> dict[str, Any]:
        """Return a running status."""
        return {"state": "running"}


async def test_through_the_daemon_a_repeated_archive_or_restore_exits_1_saying_so(home: Path) -> None:
    """With a daemon answering on the home's control socket (its conversation is not in the home's store:
    only the control API knows it), a repeated `archive` and a `restore` of a conversation not archived exit
    1 saying so, as without a daemon; the first of each exits 0."""
    settings = load_settings(home)
    manager = ConversationManager(MemoryStore(), load_agents(settings), load_project_pubkey(settings))
    planner = manager.agents.get("planner")
    root = EventFactory().event(USER, "Plan a picnic", kind=11, tags=[["title", "Picnic"], ["p", planner.pubkey]])
    await manager.create_conversation(root)
    picnic = root.id

    async with ControlServer(Daemon(manager), settings.control_socket_path):
        restore_first = await asyncio.to_thread(tenexd, home, "conversations", "restore", picnic)
        archive = await asyncio.to_thread(tenexd, home, "conversations", "archive", picnic)
        archive_again = await asyncio.to_thread(tenexd, home, "conversations", "archive", picnic)
        archived = await is_archived(manager, picnic)
        restore = await asyncio.to_thread(tenexd, home, "conversations", "restore", picnic)
        restore_again = await asyncio.to_thread(tenexd, home, "conversations", "restore", picnic)

    assert restore_first == (1, "", f"error: conversation {picnic} is not archived\n")
    assert archive == (0, f"archived {picnic}\n", "")
    assert archive_again == (1, "", f"error: conversation {picnic} is archived already\n")
    assert archived is True
    assert restore == (0, f"restored {picnic}\n", "")
    assert restore_again == (1, "", f"error: conversation {picnic} is not archived\n")
    assert await is_archived(manager, picnic) is False


async def is_archived(manager: ConversationManager, conversation_id: str) -> bool:
    """Whether the manager's conversation is archived."""
    conversation = await manager.get_conversation(conversation_id)
    assert conversation is not None
    return conversation.archived
