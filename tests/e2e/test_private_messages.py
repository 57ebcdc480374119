"""Private conversations end to end: a nostr-tools NIP-17 client (``nostr-tools/nip17``) talks to an agent of
a real daemon through a real relay, and the relay never holds a word of it in the clear."""

from __future__ import annotations

import asyncio
import json
import shutil
import stat
import uuid
from pathlib import Path
from typing import Any

import pytest

from tenex_daemon.app.status import read_status
from tenex_daemon.core.events import compute_event_id
from tenex_daemon.testing import KeyPair
from tests.e2e.harness import REPO, DaemonProcess, Home, node_script, run_cli
from tests.integration.nostr.harness import LocalRelayServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NIP17_CLIENT = REPO / "tests" / "node" / "nip17_client.mjs"
OFFLINE_ANSWER = "(offline backend) received"
"""What every answer of the offline backend says (it quotes the question after it)."""


async def nip17(request: dict[str, Any], within: float = 60.0) -> dict[str, Any]:
    """Run the nostr-tools NIP-17 client with one request and return its JSON answer."""
    return await node_script(NIP17_CLIENT, request, within)


def rumor_ok(rumor: dict[str, Any]) -> bool:
    """Whether a rumor's id is the NIP-01 hash of its fields and it carries no signature."""
    computed = compute_event_id(rumor["pubkey"], rumor["created_at"], rumor["kind"], rumor["tags"], rumor["content"])
    return computed == rumor["id"] and not rumor.get("sig")


def files_holding(root: Path, needle: bytes) -> list[Path]:
    """Every file under ``root`` whose bytes contain ``needle``."""
    return [path for path in root.rglob("*") if path.is_file() and needle in path.read_bytes()]


async def test_a_nip17_client_is_answered_privately_and_the_relay_holds_no_plaintext(
    relay: LocalRelayServer, home: Home, tmp_path: Path
) -> None:
    """A person's NIP-17 message to the planner is answered by a gift-wrapped kind-14 rumor the person's
    nostr-tools client unwraps; a reply to that answer continues the same private conversation; a
    stranger's private message is never answered; every event the relay holds (a REQ for everything, and
    the raw bytes of its LMDB files) is free of both questions, both answers and the rumors' ids; the
    home keeps the decrypted conversation in files of mode 0600; the copies of its answers wrapped for the
    agent come back counted as its own, not as refusals."""
    daemon = DaemonProcess(home)
    await daemon.start()
    try:
        planner = home.agent("planner")
        stranger = KeyPair.generate()
        question = f"private question {uuid.uuid4().hex}"
        follow_up = f"private follow-up {uuid.uuid4().hex}"
        await nip17({"op": "send", "relay": relay.url, "secret": stranger.secret, "to": planner,
                     "message": f"stranger {uuid.uuid4().hex}"})
        first = await nip17({"op": "converse", "relay": relay.url, "secret": home.owner_secret, "to": planner,
                             "message": question, "want": 1, "timeout_ms": 30000})
        assert len(first["replies"]) == 1, daemon.log_tail()
        answer = first["replies"][0]
        assert answer["kind"] == 14
        assert answer["pubkey"] == planner
        assert rumor_ok(answer)
        assert ["p", home.owner] in answer["tags"]
        assert OFFLINE_ANSWER in answer["content"]
        assert question in answer["content"]
        root = next(t[1] for t in answer["tags"] if t[0] == "e")  # the message it answers: the rumor received

        second = await nip17({"op": "converse", "relay": relay.url, "secret": home.owner_secret, "to": planner,
                              "message": follow_up, "reply_to": answer["id"], "want": 1, "timeout_ms": 30000})
        assert len(second["replies"]) == 1, daemon.log_tail()
        again = second["replies"][0]
        assert follow_up in again["content"]
        assert "received 3 messages" in again["content"]

        code, shown = await run_cli(home, "conversations", "show", root, "--json")
        assert code == 0, shown
        stored = json.loads(shown)
        history = stored["history"]
        assert [e["content"] for e in history[::2]] == [question, follow_up]
        assert [e["id"] for e in history[1::2]] == [answer["id"], again["id"]]
        assert all(e["kind"] == 14 and e["sig"] == "" and rumor_ok(e) for e in history)
        assert ["e", history[2]["id"], "", "reply"] in again["tags"]
        assert stored["title"] == "Untitled Conversation"  # no title or summary is made for it

        ignored = await nip17({"op": "collect", "relay": relay.url, "secret": stranger.secret, "from": planner,
                               "timeout_ms": 1500})
        assert ignored["replies"] == []
        status = read_status(home.path / "run" / "status.json", stale_after_s=30.0).data
        assert status is not None
        assert status["events"]["rejected"].get("author_not_allowed", 0) >= 1
        for _ in range(50):  # the agent's copies of its two answers come back: counted, never as refusals
            status = read_status(home.path / "run" / "status.json", stale_after_s=30.0).data
            if status is not None and status["events"]["own_copies"] >= 2:
                break
            await asyncio.sleep(0.1)
        assert status is not None
        assert status["events"]["own_copies"] >= 2
        assert "agent_private_copy" not in status["events"]["rejected"]

        held = (await nip17({"op": "dump", "relay": relay.url}))["events"]
        secrets = [question, follow_up, OFFLINE_ANSWER, *(e["id"] for e in history)]
        text = json.dumps(held, ensure_ascii=False)
        assert len(held) > 4
        assert not [s for s in secrets if s in text]
        assert {e["kind"] for e in held}.isdisjoint({14, 13, 1111, 21111, 24111, 24112, 513})
        wraps = [e for e in held if e["kind"] == 1059]
        assert len(wraps) >= 8  # per message: one to the agent and the sender's own copy; per answer: person, agent
        assert not any(e["pubkey"] == planner for e in wraps)  # wrapped by one-time keys
    finally:
        await daemon.stop()
        daemon.kill()
    relay.stop()
    for needle in (question, follow_up, OFFLINE_ANSWER):
        assert files_holding(relay.db_path, needle.encode()) == []
    kept = files_holding(home.path, question.encode())
    assert kept, "the decrypted conversation is stored in the home"
    assert all((home.path / "conversations") in path.parents for path in kept), kept  # never in a log
    for path in kept:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE(home.path.stat().st_mode) == 0o700


async def test_a_lost_home_gets_its_private_conversation_back_from_the_agents_gift_wraps(
    relay: LocalRelayServer, home: Home, tmp_path: Path
) -> None:
    """After a private exchange, a home deleted and re-created with the same keys gets the private
    conversation back with `conversations rebuild --all` (the person's messages from the wraps to the agent,
    the answers from the copies the daemon wrapped for the agent itself), identical event for event, and a
    second rebuild adds nothing."""
    daemon = DaemonProcess(home)
    await daemon.start()
    try:
        planner = home.agent("planner")
        first = await nip17({"op": "converse", "relay": relay.url, "secret": home.owner_secret, "to": planner,
                             "message": "remember this", "want": 1, "timeout_ms": 30000})
        answer = first["replies"][0]
        second = await nip17({"op": "converse", "relay": relay.url, "secret": home.owner_secret, "to": planner,
                              "message": "and this", "reply_to": answer["id"], "want": 1, "timeout_ms": 30000})
        assert len(second["replies"]) == 1, daemon.log_tail()
        root = next(t[1] for t in answer["tags"] if t[0] == "e")
        code, shown = await run_cli(home, "conversations", "show", root, "--json")
        assert code == 0, shown
        before = json.loads(shown)["history"]
    finally:
        await daemon.stop()
        daemon.kill()
    restored = Home(tmp_path / "restored", home.init)
    restored.path.mkdir(mode=0o700)
    shutil.copytree(home.path / "keys", restored.path / "keys")
    shutil.copy2(home.path / "config.toml", restored.path / "config.toml")
    shutil.rmtree(home.path)

    code, out = await run_cli(restored, "conversations", "rebuild", "--all", "--json", within=120)

    assert code == 0, out
    report = json.loads(out)
    assert report["conversations"] == {"found": 1, "created": 1, "updated": 0}
    assert report["events"]["added"] == 4
    code, shown = await run_cli(restored, "conversations", "show", root, "--json")
    assert code == 0, shown
    assert json.loads(shown)["history"] == before
    code, out = await run_cli(restored, "conversations", "rebuild", "--all", "--json", within=120)
    assert code == 0, out
    assert json.loads(out)["events"]["added"] == 0


async def test_tenexd_send_private_talks_to_an_agent_in_gift_wraps_only(relay: LocalRelayServer, home: Home) -> None:
    """`tenexd send --private` sends the owner's message as a gift-wrapped kind-14 rumor and prints the agent's
    answer, unwrapped from the wrap the daemon made for the owner; the relay holds neither text in the clear,
    and the daemon keeps the exchange as a private conversation rooted at the rumor sent. A second message
    joins that conversation, and the command names it (not the second rumor). The relay also holds the
    agent's NIP-17 relay list (kind 10050), naming it: where a NIP-17 client sends the agent messages."""
    daemon = DaemonProcess(home)
    await daemon.start()
    try:
        question = f"private via send {uuid.uuid4().hex}"
        code, out = await run_cli(
            home, "send", "--private", question, "--to", "planner", "--timeout", "30", "--json", within=60
        )
        assert code == 0, out + daemon.log_tail()
        *replies, summary = [json.loads(line) for line in out.splitlines() if line.strip()]
        sent, answer = summary["sent"], replies[0]["reply"]
        again_code, again_out = await run_cli(
            home, "send", "--private", "and one more", "--to", "planner", "--timeout", "30", "--json", within=60
        )
        lines = [json.loads(line) for line in again_out.splitlines() if line.strip()] if again_code == 0 else [{}]
        *again_replies, again = lines
        held = (await nip17({"op": "dump", "relay": relay.url}))["events"]
        code, shown = await run_cli(home, "conversations", "show", sent["id"], "--json")
    finally:
        await daemon.stop()
        daemon.kill()

    assert (sent["kind"], sent["sig"], sent["tags"]) == (14, "", [["p", home.agent("planner")]])
    assert rumor_ok(sent)
    assert summary["answered"] is True
    assert (answer["kind"], answer["pubkey"]) == (14, home.agent("planner"))
    assert ["e", sent["id"], "", "reply"] in answer["tags"]
    assert question in answer["content"]
    assert OFFLINE_ANSWER in answer["content"]
    text = json.dumps(held, ensure_ascii=False)
    assert question not in text
    assert OFFLINE_ANSWER not in text
    assert {e["kind"] for e in held}.isdisjoint({14, 13})
    relay_lists = [e for e in held if e["kind"] == 10050 and e["pubkey"] == home.agent("planner")]
    assert [e["tags"] for e in relay_lists] == [[["relay", relay.url]]]
    assert summary["conversation_id"] == sent["id"]
    assert again_code == 0, again_out
    assert again["sent"]["id"] != sent["id"]
    assert again["conversation_id"] == sent["id"]  # it joined the open private conversation
    assert code == 0, shown
    history = [e["id"] for e in json.loads(shown)["history"]]
    assert history == [sent["id"], answer["id"], again["sent"]["id"], again_replies[0]["reply"]["id"]]
