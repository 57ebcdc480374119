"""`tenexd conversations rebuild` end to end: a real relay, a real daemon, a home lost and restored from its keys."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.app.settings import load_settings
from tenex_daemon.app.wiring import build_agents, build_store, load_signers
from tenex_daemon.cli.send import send_message
from tenex_daemon.core.search import SearchQuery
from tests.e2e.harness import DaemonProcess, Home, run_cli
from tests.integration.nostr.harness import LocalRelayServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CONVERSATIONS = 20


async def histories(home: Path) -> dict[str, list[str]]:
    """Every stored conversation's history as the JSON of each event, in order (the store opened here)."""
    store = build_store(load_settings(home, {}))
    await store.open()
    try:
        found: dict[str, list[str]] = {}
        for summary in await store.search(SearchQuery()):
            conversation = await store.load(summary.id)
            assert conversation is not None
            found[summary.id] = [json.dumps(e.to_dict()) for e in conversation.history]
        return found
    finally:
        await store.close()


async def converse(home: Home) -> None:
    """A 20-conversation run: each root answered by the planner; every other one followed up by the
    person (replying to the planner's answer) and answered by the executor."""
    settings = load_settings(home.path, {})
    signers, _ = load_signers(settings)
    agents = build_agents(settings, signers)
    owner = Signer.from_file(settings.owner_key_path)
    for n in range(CONVERSATIONS):
        first = await send_message(settings, owner, agents, f"Question {n}", to="planner", timeout=15.0)
        assert first.answered, f"conversation {n}: the planner did not answer"
        if n % 2 == 0:
            parent = first.replies[-1][1]
            second = await send_message(
                settings, owner, agents, f"Follow-up {n}", to="executor", reply_to=parent.id, timeout=15.0
            )
            assert second.answered, f"conversation {n}: the executor did not answer"


def restore_home(lost: Path, fresh: Path) -> None:
    """What a person restoring from a key backup does: a new home with the old keys/ and config.toml."""
    fresh.mkdir(mode=0o700)
    shutil.copytree(lost / "keys", fresh / "keys")
    shutil.copy2(lost / "config.toml", fresh / "config.toml")
    shutil.rmtree(lost)


async def test_a_lost_home_gets_every_conversation_back_byte_identical(
    relay: LocalRelayServer, home: Home, tmp_path: Path
) -> None:
    """After a 20-conversation run, a home deleted and re-created with the same keys gets back every
    conversation from the relay with byte-identical histories, and a second rebuild adds nothing."""
    daemon = DaemonProcess(home)
    await daemon.start()
    try:
        await converse(home)
    finally:
        await daemon.stop()
        daemon.kill()
    before = await histories(home.path)
    assert len(before) == CONVERSATIONS
    restored = Home(tmp_path / "restored", home.init)
    restore_home(home.path, restored.path)

    code, out = await run_cli(restored, "conversations", "rebuild", "--all", "--json", within=120)

    assert code == 0, out
    report = json.loads(out)
    events = sum(len(h) for h in before.values())
    assert report["conversations"] == {"found": CONVERSATIONS, "created": CONVERSATIONS, "updated": 0}
    assert report["events"]["added"] == events
    assert await histories(restored.path) == before

    code, out = await run_cli(restored, "conversations", "rebuild", "--all", "--json", within=120)

    assert code == 0, out
    again = json.loads(out)["events"]
    assert (again["added"], again["already_present"]) == (0, events)
    assert await histories(restored.path) == before


async def test_rebuild_goes_through_a_running_daemon_and_adds_nothing_it_holds(
    relay: LocalRelayServer, home: Home
) -> None:
    """With the daemon running, `conversations rebuild ID` goes through its control API and finds every
    event of the conversation already stored; an id no relay knows exits 1."""
    daemon = DaemonProcess(home)
    await daemon.start()
    try:
        settings = load_settings(home.path, {})
        signers, _ = load_signers(settings)
        owner = Signer.from_file(settings.owner_key_path)
        sent = await send_message(
            settings, owner, build_agents(settings, signers), "Hello", to="planner", timeout=15.0
        )
        assert sent.answered, daemon.log_tail()

        code, out = await run_cli(home, "conversations", "rebuild", sent.conversation_id, "--json")
        unknown, _ = await run_cli(home, "conversations", "rebuild", "ab" * 32, "--json")
    finally:
        await daemon.stop()
        daemon.kill()

    assert code == 0, out
    report = json.loads(out)
    assert report["conversations"] == {"found": 1, "created": 0, "updated": 0}
    assert (report["events"]["added"], report["events"]["already_present"]) == (0, 2)
    assert unknown == 1
