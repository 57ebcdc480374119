"""`tenexd send --reply-to` into a private (NIP-17) conversation is refused before anything is signed or sent:
a public reply would publish the text in the clear, and the daemon takes no public event into it
(docs/PROTOCOL.md, "Private conversations"). Checked where the CLI finds the conversation: the store (no
daemon) and a running daemon's control API."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tenex_daemon.adapters.nostr.private import make_rumor
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.app.control_api import ControlServer
from tenex_daemon.app.home import init_home, load_agents, load_project_pubkey
from tenex_daemon.app.settings import load_settings
from tenex_daemon.app.wiring import build_store
from tenex_daemon.cli import send as send_module
from tenex_daemon.cli.main import app
from tenex_daemon.cli.send import PrivateConversationError, SendError, compose_message
from tenex_daemon.cli.send_command import _reply_to_argument
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.services.conversation_manager import ConversationManager
from tests.unit.cli.test_archive_restore_repeat import Daemon
from tests.unit.cli.test_cli import seed_conversation


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A home made by init (its owner key generated, so `send` may sign), pointed at a relay nobody runs."""
    path = tmp_path / "home"
    init_home(path, relays=["ws://127.0.0.1:1"])
    return path


class Touched:
    """What `send` did with keys and relays: the events it signed and the relay pools it opened (each
    refused at once, so nothing can go out)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Record every signature and every relay pool from now on."""
        self.signed: list[NostrEvent] = []
        self.pools: list[list[str]] = []
        original = Signer.sign

        def sign(signer: Signer, kind: int, content: str, tags: list[list[str]], *args: Any, **kw: Any) -> NostrEvent:
            event = original(signer, kind, content, tags, *args, **kw)
            self.signed.append(event)
            return event

        def pool(urls: list[str], **_: Any) -> None:
            self.pools.append(list(urls))
            raise SendError("a relay pool was opened")

        monkeypatch.setattr(Signer, "sign", sign)
        monkeypatch.setattr(send_module, "RelayPool", pool)


async def add_private_conversation(manager: ConversationManager, owner: str) -> tuple[str, str]:
    """Store the owner's private conversation with the planner (its first message and the planner's
    answer, rumors as the daemon stores them); return (its id, the answer's id)."""
    planner = manager.agents.get("planner")
    first = make_rumor(owner, "my salary is 90k", [["p", planner.pubkey]], 1_790_000_000)
    await manager.create_conversation(first, channel=f"dm:planner:{owner}")
    answer = make_rumor(planner.pubkey, "noted", [["p", owner], ["e", first.id, "", "reply"]], 1_790_000_010)
    await manager.add_event(first.id, answer)
    return first.id, answer.id


def seed_private_conversation(home: Path) -> tuple[str, str]:
    """:func:`add_private_conversation` in the home's store; return (its id, the planner's answer's id)."""

    async def go() -> tuple[str, str]:
        settings = load_settings(home)
        store = build_store(settings)
        await store.open()
        try:
            manager = ConversationManager(store, load_agents(settings), load_project_pubkey(settings))
            assert settings.owner is not None
            return await add_private_conversation(manager, settings.owner)
        finally:
            await store.close()

    return asyncio.run(go())


def send(home: Path, *args: str) -> tuple[int, str]:
    """Run ``tenexd --home HOME send ARGS``; return (exit code, stderr)."""
    result = CliRunner().invoke(app, ["--home", str(home), "send", *args], catch_exceptions=False)
    return result.exit_code, result.stderr


def assert_refused(outcome: tuple[int, str], conversation: str, touched: Touched) -> None:
    """The send exited 2 saying the conversation is private and how to continue it, and signed nothing and
    opened no relay."""
    code, stderr = outcome
    assert code == 2, stderr
    assert f"conversation {conversation} is private" in stderr
    assert "publish your text in the clear" in stderr
    said = " ".join(stderr.split())
    assert '`tenexd send --private --to planner "..."` continues your open private conversation with planner' in said
    assert (touched.signed, touched.pools) == ([], [])


def test_a_reply_into_a_private_conversation_of_the_store_is_refused_before_signing(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no daemon, `send --reply-to` naming a private conversation by its short id, or a later message of
    it by its whole id, exits 2 saying it is private and that `send --private --to planner` continues it;
    nothing is signed and no relay is opened. A public conversation's short id and a whole id the home does
    not know (the relays may have it) are still taken."""
    conversation, answer = seed_private_conversation(home)
    public = seed_conversation(home, "Picnic", "Plan a picnic")
    touched = Touched(monkeypatch)

    assert_refused(send(home, "and bonuses?", "--reply-to", conversation[:8], "--to", "executor"), conversation, touched)
    assert_refused(send(home, "and bonuses?", "--reply-to", answer, "--to", "executor"), conversation, touched)
    assert _reply_to_argument(load_settings(home), public[:8]) == public
    assert _reply_to_argument(load_settings(home), "ab" * 32) == "ab" * 32


async def test_a_reply_into_a_private_conversation_the_daemon_holds_is_refused_before_signing(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a daemon answering on the control socket (the conversation only it holds), `send --reply-to`
    naming the private conversation by its short id or its whole id, or the planner's answer in it, exits 2
    saying it is private; nothing is signed and no relay is opened."""
    settings = load_settings(home)
    manager = ConversationManager(MemoryStore(), load_agents(settings), load_project_pubkey(settings))
    assert settings.owner is not None
    conversation, answer = await add_private_conversation(manager, settings.owner)
    touched = Touched(monkeypatch)

    async with ControlServer(Daemon(manager), settings.control_socket_path):
        outcomes = [
            await asyncio.to_thread(send, home, "and bonuses?", "--reply-to", reference)
            for reference in (conversation[:8], conversation, answer)
        ]

    for outcome in outcomes:
        assert_refused(outcome, conversation, touched)


def test_a_private_message_as_the_parent_of_a_reply_is_never_signed(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`compose_message`, which signs what `send` publishes, refuses a parent that is a private conversation's
    message (a kind-14 rumor, unsigned, as the home stores it) with PrivateConversationError instead of
    signing a public reply to it: the last guard, should the lookup before it not have read the home."""
    settings = load_settings(home)
    owner = Signer.from_file(settings.owner_key_path)
    agents = load_agents(settings)
    planner = next(a for a in agents if a.slug == "planner")
    rumor = make_rumor(planner.pubkey, "noted", [["p", owner.pubkey]], 1_790_000_010)
    touched = Touched(monkeypatch)

    with pytest.raises(PrivateConversationError) as refused:
        compose_message(
            settings, owner, "and bonuses?", planner, {a.pubkey for a in agents}, parent=rumor, kind=None,
            title=None,
        )

    assert "private conversation" in str(refused.value)
    assert touched.signed == []
