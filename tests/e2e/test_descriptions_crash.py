"""A conversation's title and summary survive a crash: the daemon is SIGKILLed while its summarizer thinks
about an ended conversation; after a restart the conversation is described once and its kind-513 event
reaches the relay once (docs/ARCHITECTURE.md, "Conversation lifecycle")."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict

import pytest

from tenex_daemon.adapters.nostr.relay_pool import PoolSettings, ReceivedEvent, RelayPool
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.core.events import NostrEvent
from tests.e2e.harness import DaemonProcess, Home, run_cli, set_summarizer_backend
from tests.integration.nostr.harness import LocalRelayServer
from tests.llm_servers import Reply, ScriptedServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

COMPLETIONS = "/v1/chat/completions"
TITLE = "Planning the spring product launch"
SUMMARY = "The person asked the planner for a launch plan. The planner answered."


def completion(text: str) -> dict[str, object]:
    """An OpenAI chat completion saying ``text``."""
    return {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "scripted",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
        "usage": {"prompt_tokens": 50, "completion_tokens": 20, "total_tokens": 70},
    }


def add_summarizer(home: Home, server: ScriptedServer) -> None:
    """Configure ``[conversations.summarizer]``: an OpenAI-compatible backend on the scripted server."""
    set_summarizer_backend(
        home,
        f"""
kind = "openai"
model = "scripted"
base_url = "{server.url("/v1")}"
options = {{ timeout = 600, max_retries = 0 }}
""",
    )


def asked(server: ScriptedServer) -> int:
    """How many times the summarizer was asked."""
    return len([path for path, _ in server.requests if path == COMPLETIONS])


async def test_a_description_interrupted_by_sigkill_is_made_once_after_restart(
    relay: LocalRelayServer, home: Home, scripted_server: ScriptedServer
) -> None:
    """The owner ends a conversation; while the summarizer has not answered, the daemon is SIGKILLed. After a
    restart with a summarizer that answers, the conversation is described once (title source model) and
    exactly one kind-513 event for it, status ended, signed by the project key, is on the relay."""
    scripted_server.replies[COMPLETIONS] = Reply(hang=True)
    add_summarizer(home, scripted_server)
    owner = Signer.from_text(home.owner_secret)
    seen: defaultdict[int, list[NostrEvent]] = defaultdict(list)

    async def on_event(received: ReceivedEvent) -> None:
        seen[received.event.kind].append(received.event)

    client = RelayPool([relay.url], on_event=on_event, settings=PoolSettings(publish_timeout=10.0))
    daemon = DaemonProcess(home)
    await daemon.start()
    await client.start()
    try:
        await client.subscribe("watch", [{"kinds": [1111], "authors": [home.agent("planner")]}])
        await client.subscribe("metadata", [{"kinds": [513], "authors": [home.project]}])
        assert await client.wait_connected(within=10)
        root = owner.sign(11, "Help me plan the spring product launch", [["p", home.agent("planner")]])
        await client.publish(root)
        async with asyncio.timeout(30):
            while not seen[1111]:  # noqa: ASYNC110 - the pool's callback fills it
                await asyncio.sleep(0.1)

        code, _ = await run_cli(home, "conversations", "end", root.id, "--reason", "done")
        assert code == 0, daemon.log_tail()
        async with asyncio.timeout(30):
            while asked(scripted_server) < 1:  # noqa: ASYNC110 - the server's handler fills it
                await asyncio.sleep(0.05)
        daemon.kill()  # SIGKILL while the summarizer thinks: the description was never stored

        answer = json.dumps({"title": TITLE, "summary": SUMMARY})
        scripted_server.replies[COMPLETIONS] = Reply(body=completion(f"Here you go:\n```json\n{answer}\n```"))
        await daemon.start()
        async with asyncio.timeout(30):
            while not [e for e in seen[513] if e.tag_value("e") == root.id]:  # noqa: ASYNC110
                await asyncio.sleep(0.1)
        await asyncio.sleep(2.0)  # a second 513, if any, would come now
        code, shown = await run_cli(home, "conversations", "show", root.id, "--json")
    finally:
        await client.stop()
        await daemon.stop()
        daemon.kill()

    published = [e for e in seen[513] if e.tag_value("e") == root.id]
    assert len(published) == 1, daemon.log_tail()
    [event] = published
    assert event.pubkey == home.project
    assert {t[0]: t[1] for t in event.tags} == {
        "e": root.id, "title": TITLE, "summary": SUMMARY, "status": "ended", "a": f"31933:{home.owner}:demo",
    }
    assert code == 0
    conversation = json.loads(shown)
    assert (conversation["title"], conversation["title_source"], conversation["description"]) == (
        TITLE, "model", SUMMARY
    )
    assert conversation["summary"]["description_published"] is True
    assert asked(scripted_server) == 2, "asked once before the crash, once after"
    assert daemon.log_path.read_text().count("conversation_description_made") == 1
