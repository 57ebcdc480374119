"""Agents with language models, end to end: a real relay, the daemon as a subprocess, a nostr-tools client.

The model is SmolLM2-135M served by llama.cpp's OpenAI-compatible server (started once per test session);
provider failures come from a scripted HTTP server that answers like one.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.e2e.harness import DaemonProcess, Home, node_client, run_cli, set_agent_backend
from tests.integration.nostr.harness import LocalRelayServer
from tests.llm_servers import LlamaServer, Reply, ScriptedServer, free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

COMPLETIONS = "/v1/chat/completions"


def tag(event: dict[str, Any], name: str) -> list[str] | None:
    """The first tag of an event named ``name``."""
    return next((t for t in event["tags"] if t and t[0] == name), None)


async def ask(
    relay: LocalRelayServer, home: Home, slug: str, content: str, *, timeout_ms: int = 20_000
) -> dict[str, Any]:
    """Start a conversation addressed to ``slug``; return the node client's answer (reply and partials)."""
    return await node_client(
        {
            "op": "converse",
            "relay": relay.url,
            "secret": home.owner_secret,
            "template": {"kind": 11, "content": content, "tags": [["p", home.agent(slug)]]},
            "reply_authors": [home.agent(slug)],
            "want": 1,
            "timeout_ms": timeout_ms,
            "partials": True,
        },
        within=timeout_ms / 1000 + 30,
    )


async def test_real_model_answers_through_a_real_relay(
    relay: LocalRelayServer, home: Home, llama_server: LlamaServer
) -> None:
    """A person's question reaches the served model through the relay and the openai backend; its answer
    comes back streamed (partials), with usage recorded on the reply and in the conversation."""
    set_agent_backend(
        home,
        "planner",
        f"""
kind = "openai"
model = "{llama_server.model}"
base_url = "{llama_server.base_url}"
temperature = 0.0
options = {{ max_tokens = 48, timeout = 120, max_retries = 0 }}
""",
    )
    daemon = DaemonProcess(home, env={"TENEX_DAEMON__PARTIAL_INTERVAL_S": "0.02"})
    await daemon.start()
    try:
        answer = await ask(relay, home, "planner", "What is the capital of France?", timeout_ms=90_000)
        assert answer["replies"], daemon.log_tail()
        [reply] = answer["replies"]
        assert "paris" in reply["content"].lower()
        assert tag(reply, "error") is None
        assert tag(reply, "llm-model") == ["llm-model", llama_server.model]
        prompt_tokens = tag(reply, "llm-prompt-tokens")
        completion_tokens = tag(reply, "llm-completion-tokens")
        assert prompt_tokens is not None
        assert int(prompt_tokens[1]) > 0
        assert completion_tokens is not None
        assert int(completion_tokens[1]) > 0

        partials = answer["partials"]
        assert len(partials) >= 2, "the streamed answer was published as it grew"
        assert all(reply["content"].startswith(p["content"]) for p in partials)
        assert [tag(p, "streaming") for p in partials] == [
            ["streaming", str(n)] for n in range(1, len(partials) + 1)
        ]

        code, out = await run_cli(home, "conversations", "show", answer["published"]["id"], "--json")
        assert code == 0, out
        tokens = json.loads(out)["tokens"]["by_agent"]["planner"]
        assert tokens["prompt"] > 0
        assert tokens["completion"] > 0
    finally:
        await daemon.stop()


async def test_backend_failures_become_error_replies_and_the_daemon_keeps_going(
    relay: LocalRelayServer, home: Home, scripted_server: ScriptedServer
) -> None:
    """401, 429, context too long, a silent server and a closed port each give the person a reply tagged
    ["error", "system"] naming what failed; every conversation keeps its message and reply; the daemon runs on,
    its status degraded by the agent whose backend failed three runs in a row."""
    set_agent_backend(
        home,
        "planner",
        f"""
kind = "openai"
model = "scripted"
base_url = "{scripted_server.url("/v1")}"
options = {{ timeout = 2, max_retries = 0 }}
""",
    )
    set_agent_backend(
        home,
        "executor",
        f"""
kind = "openai"
model = "nobody-listens"
base_url = "http://127.0.0.1:{free_port()}/v1"
options = {{ timeout = 2, max_retries = 0 }}
""",
    )
    failures = [
        ("planner", Reply(401, {"error": {"message": "Incorrect API key provided"}}), "auth"),
        ("planner", Reply(429, {"error": {"message": "Rate limit reached"}}), "rate_limit"),
        (
            "planner",
            Reply(400, {"error": {"message": "This model's maximum context length is 2048 tokens"}}),
            "context_too_long",
        ),
        ("planner", Reply(hang=True), "timeout"),
        ("executor", None, "unreachable"),
    ]
    daemon = DaemonProcess(home)
    await daemon.start()
    try:
        conversations = []
        for slug, reply, kind in failures:
            if reply is not None:
                scripted_server.replies[COMPLETIONS] = reply
            answer = await ask(relay, home, slug, f"Please help ({kind})")
            assert answer["replies"], f"{kind}: no reply\n{daemon.log_tail()}"
            [error_reply] = answer["replies"]
            assert tag(error_reply, "error") == ["error", "system"], kind
            assert kind in error_reply["content"], error_reply["content"]
            assert error_reply["content"].startswith("I could not answer")
            conversations.append(answer["published"]["id"])

        for conversation_id in conversations:
            code, out = await run_cli(home, "conversations", "show", conversation_id, "--json")
            assert code == 0, out
            assert len(json.loads(out)["history"]) == 2
        # the daemon runs on, and says the planner's backend failed its last three runs (the context too long
        # was the message's doing, not the backend's)
        code, out = await run_cli(home, "status", "--json")
        assert code == 1, out
        report = json.loads(out)
        assert report["state"] == "running"
        assert report["status"]["degraded"] == "agent planner: its last 3 runs ended in an error reply (timeout)"
    finally:
        assert await daemon.stop() == 0
