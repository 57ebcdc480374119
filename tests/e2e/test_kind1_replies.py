"""Kind-1 conversations end to end: real Nostr clients (nostr-tools, NDK, `tenexd send --kind 1`), a real
relay and the daemon as a subprocess. Agents answer a kind-1 thread with kind 1 (NIP-10), never with a
kind-1111 comment that kind-1 clients do not show."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tenex_daemon.adapters.nostr.codec import usd_text
from tenex_daemon.core.pricing import TokenPrices
from tests.e2e.harness import REPO, DaemonProcess, Home, node_client, run_cli, set_agent_backend
from tests.integration.nostr.harness import LocalRelayServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NDK_THREAD = REPO / "tests" / "node" / "ndk_thread.mjs"
PRICED_BACKEND = """
kind = "offline"
price_per_million_input_tokens = 3.0
price_per_million_output_tokens = 15.0
"""


def e_tags(event: dict[str, Any]) -> list[list[str]]:
    """The event's ``e`` tags, as written."""
    return [t for t in event["tags"] if t[0] == "e"]


def tag_value(event: dict[str, Any], name: str) -> str | None:
    """The value of the event's first tag named ``name``."""
    return next((t[1] for t in event["tags"] if t[0] == name and len(t) > 1), None)


def agent_keys(home: Home) -> list[str]:
    """Every agent's public key."""
    return [a.pubkey for a in home.init.agents]


async def converse(relay: LocalRelayServer, home: Home, template: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """Publish as the owner with the nostr-tools client; collect one agent reply (kinds 1 and 1111)."""
    request = {
        "op": "converse", "relay": relay.url, "secret": home.owner_secret, "template": template,
        "reply_authors": agent_keys(home), "want": 1, "timeout_ms": 10000, **extra,
    }
    return await node_client(request)


async def query(relay: LocalRelayServer, filters: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every stored event matching ``filters`` (the relay's answer up to EOSE)."""
    answer = await node_client({"op": "query", "relay": relay.url, "filters": filters})
    events: list[dict[str, Any]] = answer["events"]
    return events


async def ndk_thread(request: dict[str, Any], within: float = 60.0) -> dict[str, Any]:
    """Run the NDK client with one request and return its JSON answer."""
    proc = await asyncio.create_subprocess_exec(
        "node", str(NDK_THREAD),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(json.dumps(request).encode()), within)
    if proc.returncode != 0:
        raise RuntimeError(f"NDK client failed ({proc.returncode}): {err.decode()}")
    answer: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return answer


async def test_a_nostr_tools_kind_1_thread_is_answered_in_kind_1_with_its_cost(
    relay: LocalRelayServer, home: Home
) -> None:
    """A kind-1 note to an agent and a NIP-10 reply to its answer are both answered with verified kind-1
    events whose nip10.parse names the note as root and the trigger as reply; the relay holds no kind 1111
    in the thread, the daemon one conversation of four events, and each answer carries `llm-cost-usd` =
    its tokens at the configured prices."""
    set_agent_backend(home, "planner", PRICED_BACKEND)
    planner = home.agent("planner")
    daemon = DaemonProcess(home)
    await daemon.start()
    try:
        first = await converse(relay, home, {"kind": 1, "content": "Plan a picnic", "tags": [["p", planner]]})
        note = first["published"]
        assert len(first["replies"]) == 1, daemon.log_tail()
        answer = first["replies"][0]
        follow_up_tags = [
            ["e", note["id"], relay.url, "root", home.owner],
            ["e", answer["id"], relay.url, "reply", planner],
            ["p", planner],
        ]
        second = await converse(
            relay, home, {"kind": 1, "content": "And if it rains?", "tags": follow_up_tags},
            thread_root=note["id"], exclude=[answer["id"]],
        )
        assert len(second["replies"]) == 1, daemon.log_tail()
        follow_up, second_answer = second["published"], second["replies"][0]
        ids = [note["id"], answer["id"], follow_up["id"], second_answer["id"]]
        comments = await query(relay, [{"kinds": [1111], "#E": ids}, {"kinds": [1111], "#e": ids}])
        notes = await query(relay, [{"kinds": [1], "#e": [note["id"]], "authors": agent_keys(home)}])
        code, shown = await run_cli(home, "conversations", "show", note["id"], "--json")
    finally:
        await daemon.stop()
        daemon.kill()

    assert first["valid"] == second["valid"] == [True]
    assert (answer["kind"], second_answer["kind"]) == (1, 1)
    assert (answer["pubkey"], second_answer["pubkey"]) == (planner, planner)
    assert e_tags(answer) == [["e", note["id"], "", "root"]]
    assert e_tags(second_answer) == [["e", note["id"], "", "root"], ["e", follow_up["id"], "", "reply"]]
    assert [t for t in answer["tags"] if t[0] == "p"] == [["p", home.owner]]
    first_thread, second_thread = first["nip10"][0], second["nip10"][0]
    assert (first_thread["root"]["id"], first_thread["reply"]["id"]) == (note["id"], note["id"])
    assert (second_thread["root"]["id"], second_thread["reply"]["id"]) == (note["id"], follow_up["id"])
    assert comments == []
    assert {e["id"] for e in notes} == {answer["id"], second_answer["id"]}
    assert code == 0, shown
    assert [e["id"] for e in json.loads(shown)["history"]] == ids
    for reply in (answer, second_answer):
        prompt = int(tag_value(reply, "llm-prompt-tokens") or 0)
        completion = int(tag_value(reply, "llm-completion-tokens") or 0)
        assert prompt > 0
        assert completion > 0
        assert tag_value(reply, "llm-cost-usd") == usd_text(TokenPrices(3.0, 15.0).cost_usd(prompt, completion))


async def test_an_ndk_kind_1_thread_is_answered_in_kind_1(
    relay: LocalRelayServer, home: Home, daemon: DaemonProcess
) -> None:
    """NDK publishes a kind-1 note and answers the agent's reply with its own `reply()`; both are answered
    with kind 1 threaded under the note (the second naming NDK's reply), and no agent answers without
    a price carries a cost."""
    planner = home.agent("planner")

    result = await ndk_thread({
        "relay": relay.url, "secret": home.owner_secret, "agent": planner, "reply_authors": agent_keys(home),
        "note": "Plan a picnic", "follow_up": "And if it rains?", "timeout_ms": 10000,
    })

    note, answer, reply, second = result["note"], result["answer"], result["reply"], result["second_answer"]
    assert answer is not None, daemon.log_tail()
    assert second is not None, daemon.log_tail()
    assert reply["kind"] == 1
    assert ["e", answer["id"]] in [t[:2] for t in e_tags(reply)]
    assert (answer["kind"], second["kind"]) == (1, 1)
    assert e_tags(answer) == [["e", note["id"], "", "root"]]
    assert e_tags(second) == [["e", note["id"], "", "root"], ["e", reply["id"], "", "reply"]]
    assert tag_value(answer, "llm-cost-usd") is None
    comments = await query(relay, [{"kinds": [1111], "#E": [note["id"]]}, {"kinds": [1111], "#e": [note["id"]]}])
    assert comments == []


async def test_tenexd_send_kind_1_sends_a_note_and_a_nip10_reply_and_prints_kind_1_answers(
    relay: LocalRelayServer, home: Home, daemon: DaemonProcess
) -> None:
    """`tenexd send --kind 1` publishes a top-level kind-1 note and prints the agent's kind-1 answer; a
    `--reply-to` that answer (kind 1 by default for a kind-1 parent) is a NIP-10 reply, answered in kind 1."""
    code, out = await run_cli(
        home, "send", "Plan a picnic", "--kind", "1", "--to", "planner", "--timeout", "20", "--json", within=60
    )
    assert code == 0, out + daemon.log_tail()
    *replies, summary = [json.loads(line) for line in out.splitlines() if line.strip()]
    note, answer = summary["sent"], replies[0]["reply"]

    code, out = await run_cli(
        home, "send", "And if it rains?", "--reply-to", answer["id"], "--to", "planner",
        "--timeout", "20", "--json", within=60,
    )
    assert code == 0, out + daemon.log_tail()
    *more, second_summary = [json.loads(line) for line in out.splitlines() if line.strip()]
    follow_up, second = second_summary["sent"], more[0]["reply"]

    assert (note["kind"], note["tags"]) == (1, [["p", home.agent("planner")]])
    assert summary["answered"] is True
    assert summary["conversation_id"] == note["id"]
    assert answer["kind"] == 1
    assert e_tags(answer) == [["e", note["id"], "", "root"]]
    assert follow_up["kind"] == 1
    assert e_tags(follow_up) == [["e", note["id"], "", "root"], ["e", answer["id"], "", "reply"]]
    assert second_summary["conversation_id"] == note["id"]
    assert second["kind"] == 1
    assert e_tags(second) == [["e", note["id"], "", "root"], ["e", follow_up["id"], "", "reply"]]
