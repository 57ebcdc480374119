"""tenexd end to end: a nostr-tools client, a real relay, the daemon as a subprocess."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
import websockets

from tenex_daemon.app.settings import load_settings
from tenex_daemon.app.status import read_status
from tenex_daemon.testing import KeyPair, sign_event
from tests.e2e.harness import DaemonProcess, Home, node_client, run_cli
from tests.integration.nostr.harness import LocalRelayServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BLOCK_TAIL = (
    "=== END OF HISTORY ===\nRespond to the most recent user message above, considering the context.\n\n"
)


def tag(event: dict[str, Any], name: str) -> list[str] | None:
    """The first tag of an event named ``name``."""
    return next((t for t in event["tags"] if t and t[0] == name), None)


async def converse(
    relay: LocalRelayServer,
    secret: str,
    template: dict[str, Any],
    authors: list[str],
    *,
    thread_root: str | None = None,
    want: int = 1,
    timeout_ms: int = 5000,
    since: int | None = None,
) -> dict[str, Any]:
    """Publish as a person and collect the agents' replies in the thread."""
    request: dict[str, Any] = {
        "op": "converse",
        "relay": relay.url,
        "secret": secret,
        "template": template,
        "reply_authors": authors,
        "want": want,
        "timeout_ms": timeout_ms,
    }
    if thread_root is not None:
        request["thread_root"] = thread_root
    if since is not None:
        request["since"] = since
    return await node_client(request)


def thread_tags(root: dict[str, Any]) -> list[list[str]]:
    """NIP-22 tags a client puts on a reply to a kind-11 root."""
    return [
        ["E", root["id"], "", root["pubkey"]],
        ["K", str(root["kind"])],
        ["P", root["pubkey"]],
        ["e", root["id"], "", root["pubkey"]],
        ["k", str(root["kind"])],
    ]


async def test_agent_replies_within_5s_with_the_protocol_tags(
    relay: LocalRelayServer, home: Home, daemon: DaemonProcess
) -> None:
    """A kind-11 p-tagging an agent gets, within 5 s, one verified reply with E/K/P, e/k, p, a, phase and net-time tags."""
    planner = home.agent("planner")
    answer = await converse(
        relay,
        home.owner_secret,
        {"kind": 11, "content": "Plan a picnic", "tags": [["p", planner]]},
        [planner],
    )

    root = answer["published"]
    assert len(answer["replies"]) == 1, daemon.log_tail()
    reply = answer["replies"][0]
    assert answer["valid"] == [True]
    assert answer["latency_ms"][0] < 5000
    assert reply["kind"] == 1111
    assert reply["pubkey"] == planner
    assert tag(reply, "E") == ["E", root["id"], "", home.owner]
    assert tag(reply, "K") == ["K", "11"]
    assert tag(reply, "P") == ["P", home.owner]
    assert tag(reply, "e") == ["e", root["id"], "", home.owner]
    assert tag(reply, "k") == ["k", "11"]
    assert [t for t in reply["tags"] if t[0] == "p"] == [["p", home.owner]]
    project = load_settings(home.path, {}).project.d_tag
    assert tag(reply, "a") == ["a", f"31933:{home.owner}:{project}"]
    assert tag(reply, "phase") == ["phase", "chat"]
    net_time = tag(reply, "net-time")
    assert net_time is not None
    assert int(net_time[1]) >= 0


async def test_a_thread_addressed_to_the_project_by_its_a_tag_alone_is_routed_and_answered(
    relay: LocalRelayServer, home: Home, daemon: DaemonProcess
) -> None:
    """A kind-11 naming no agent, only the project by its ``a`` tag (as TENEX clients start a conversation),
    reaches the daemon and is routed by the orchestrator: an agent answers it (it was never received)."""
    project = load_settings(home.path, {}).project.d_tag
    agents = [a.pubkey for a in home.init.agents]
    answer = await converse(
        relay,
        home.owner_secret,
        {"kind": 11, "content": "Plan a picnic", "tags": [["a", f"31933:{home.owner}:{project}"]]},
        agents,
    )

    assert len(answer["replies"]) == 1, daemon.log_tail()
    reply = answer["replies"][0]
    assert tag(reply, "E") == ["E", answer["published"]["id"], "", home.owner]
    assert [t for t in reply["tags"] if t[0] == "p"] == [["p", home.owner]]


async def test_what_was_addressed_to_the_project_before_the_first_start_is_not_answered(
    relay: LocalRelayServer, home: Home
) -> None:
    """A thread the owner addressed to the project by its ``a`` tag 20 days before the daemon first ran (a
    home made for a project people wrote to for months) is not answered as new; one written since is."""
    project = f"31933:{home.owner}:{load_settings(home.path, {}).project.d_tag}"
    old = sign_event(KeyPair(home.owner_secret, home.owner), "An old thread", kind=11, tags=[["a", project]],
                     created_at=int(time.time()) - 20 * 86_400)
    async with websockets.connect(relay.url) as ws:
        await ws.send(json.dumps(["EVENT", old.model_dump()]))
        assert json.loads(await ws.recv())[2] is True
    agents = [a.pubkey for a in home.init.agents]
    daemon = DaemonProcess(home)
    await daemon.start()
    try:
        new = await converse(relay, home.owner_secret, {"kind": 11, "content": "A new one", "tags": [["a", project]]},
                             agents)
        answered_old = await node_client({"op": "query", "relay": relay.url, "filters": [{"#E": [old.id]}]})
    finally:
        await daemon.stop()
        daemon.kill()

    assert len(new["replies"]) == 1, daemon.log_tail()
    assert answered_old["events"] == []


async def test_second_agent_mid_conversation_sees_the_context_md_view(
    relay: LocalRelayServer, home: Home, daemon: DaemonProcess
) -> None:
    """`tenexd context` shows a not-yet-involved agent the docs/CONTEXT.md view; p-tagged, it answers from exactly 5 messages."""
    planner, executor = home.agent("planner"), home.agent("executor")
    first = await converse(
        relay,
        home.owner_secret,
        {"kind": 11, "content": "We need a logo", "tags": [["p", planner]]},
        [planner],
    )
    root = first["published"]
    assert len(first["replies"]) == 1, daemon.log_tail()
    planner_reply = first["replies"][0]

    code, out = await run_cli(home, "context", root["id"], "--agent", "executor", "--json")

    assert code == 0, out
    shown = [(m["role"], m["content"]) for m in json.loads(out)["messages"]]
    assert shown == [
        ("user", "We need a logo"),
        ("system", "=== MESSAGES WHILE YOU WERE AWAY ===\n\n🟢 USER:\nWe need a logo\n\n" + BLOCK_TAIL),
        ("system", "=== NEW INTERACTION ==="),
        ("system", f"[Planner]: {planner_reply['content']}"),
    ]

    second = await converse(
        relay,
        home.owner_secret,
        {"kind": 1111, "content": "Executor, please draw it", "tags": [*thread_tags(root), ["p", executor]]},
        [executor],
        thread_root=root["id"],
    )

    assert len(second["replies"]) == 1, daemon.log_tail()
    # user, [Planner], while-away block, marker, trigger: the offline backend reports what it was sent.
    assert second["replies"][0]["content"] == (
        "Executor (offline backend) received 5 messages. Latest: Executor, please draw it"
    )


async def test_task_gets_its_own_conversation(
    relay: LocalRelayServer, home: Home, daemon: DaemonProcess
) -> None:
    """A kind-1934 task p-tagging an agent starts its own conversation and the reply's root kind is 1934."""
    executor = home.agent("executor")
    answer = await converse(
        relay,
        home.owner_secret,
        {"kind": 1934, "content": "Task: tidy the repo", "tags": [["p", executor]]},
        [executor],
    )

    assert len(answer["replies"]) == 1, daemon.log_tail()
    assert tag(answer["replies"][0], "K") == ["K", "1934"]
    code, out = await run_cli(home, "conversations", "list", "--json")
    assert code == 0, out
    assert answer["published"]["id"] in out


async def test_stranger_is_counted_and_never_answered(
    relay: LocalRelayServer, home: Home, daemon: DaemonProcess
) -> None:
    """An author outside the allow-list triggers nothing, and the rejection is counted in the status."""
    planner = home.agent("planner")
    stranger = "7f" * 32
    answer = await converse(
        relay,
        stranger,
        {"kind": 11, "content": "free work?", "tags": [["p", planner]]},
        [planner],
        timeout_ms=2000,
    )

    assert answer["replies"] == []
    deadline = time.monotonic() + 20  # the status file is rewritten every second or so: more under load
    while True:
        report = read_status(home.path / "run" / "status.json", stale_after_s=30)
        counted = report.data["events"]["rejected"].get("author_not_allowed", 0) if report.data else 0
        if counted >= 1 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert report.data is not None
    assert counted >= 1, daemon.log_tail()


async def test_agent_chain_stops_at_the_hop_limit(
    relay: LocalRelayServer, home: Home, daemon: DaemonProcess
) -> None:
    """Agents p-tagging each other stop being answered once the chain passes the hop limit (2 here)."""
    planner, executor = home.agent("planner"), home.agent("executor")
    first = await converse(
        relay, home.owner_secret, {"kind": 11, "content": "start", "tags": [["p", planner]]}, [planner]
    )
    root = first["published"]
    chain = await converse(
        relay,
        home.agent_secret("planner"),
        {"kind": 1111, "content": "executor, over to you", "tags": [*thread_tags(root), ["p", executor]]},
        [executor],
        thread_root=root["id"],
        timeout_ms=2500,
    )
    # root(user) <- planner reply <- planner's hand-off: a chain of 2 agent events, the limit: answered.
    assert len(chain["replies"]) == 1, daemon.log_tail()
    again = await converse(
        relay,
        home.agent_secret("planner"),
        {"kind": 1111, "content": "executor, once more", "tags": [*thread_tags(root), ["p", executor]]},
        [executor],
        thread_root=root["id"],
        want=2,
        timeout_ms=2500,
    )
    assert len(again["replies"]) == 1  # only the earlier reply: the chain is now too long


async def test_restart_answers_what_came_while_down_once(
    relay: LocalRelayServer, home: Home, daemon: DaemonProcess
) -> None:
    """SIGTERM exits 0; an event published while down is answered once after restart; old ones are not answered again."""
    planner = home.agent("planner")
    first = await converse(
        relay, home.owner_secret, {"kind": 11, "content": "remember me", "tags": [["p", planner]]}, [planner]
    )
    root = first["published"]
    assert len(first["replies"]) == 1, daemon.log_tail()

    assert await daemon.stop() == 0
    code, out = await run_cli(home, "status", "--json")
    assert code == 1
    assert json.loads(out)["state"] == "stopped"
    offline = await node_client(
        {
            "op": "publish",
            "relay": relay.url,
            "secret": home.owner_secret,
            "template": {
                "kind": 1111,
                "content": "are you back?",
                "tags": [*thread_tags(root), ["p", planner]],
            },
        }
    )
    await daemon.start()
    answer = await converse(
        relay,
        home.owner_secret,
        {"kind": 1111, "content": "and now?", "tags": [*thread_tags(root), ["p", planner]]},
        [planner],
        thread_root=root["id"],
        want=3,
        timeout_ms=4000,
        since=0,
    )

    replies = answer["replies"]
    parents = [tag(r, "e")[1] for r in replies if tag(r, "e")]  # type: ignore[index]
    assert parents.count(root["id"]) == 1
    assert parents.count(offline["published"]["id"]) == 1
    assert parents.count(answer["published"]["id"]) == 1
    code, out = await run_cli(home, "status", "--json")
    assert code == 0, out
    report = json.loads(out)
    assert (report["state"], report["healthy"]) == ("running", True)
    assert any(r["url"] == relay.url and r["state"] == "connected" for r in report["status"]["relays"])
    assert report["status"]["conversations"]["total"] == 1
