"""Conversations that end and are remembered, end to end: a real relay, the daemon as a subprocess, a
person's kind-1 notes, SmolLM2 (llama.cpp's server) writing the title and summary of a conversation the
idle timeout ended, its kind-513 event on the relay, and the next conversation's request recalling it."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict

import pytest

from tenex_daemon.adapters.nostr.relay_pool import PoolSettings, ReceivedEvent, RelayPool
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.core.conversation import UNTITLED
from tenex_daemon.core.events import NostrEvent
from tests.e2e.harness import DaemonProcess, Home, run_cli, scripted_agent, set_summarizer_backend
from tests.integration.nostr.harness import LocalRelayServer
from tests.llm_servers import LlamaServer, ScriptedServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DAEMON_ENV = {
    "TENEX_DAEMON__STREAM_PARTIALS": "false",
    "TENEX_CONVERSATIONS__IDLE_TIMEOUT_MIN": "0.05",  # 3 s
    "TENEX_CONVERSATIONS__SWEEP_INTERVAL_MIN": "0.01",  # 0.6 s
}


def use_summarizer(home: Home, llama: LlamaServer) -> None:
    """Titles and summaries come from SmolLM2 through llama.cpp's OpenAI-compatible server."""
    set_summarizer_backend(
        home,
        f"""
kind = "openai"
model = "{llama.model}"
base_url = "{llama.base_url}"
temperature = 0.0
options = {{ max_tokens = 96, timeout = 120, max_retries = 0 }}
""",
    )


class Person:
    """A person on the relay writing kind-1 notes to the planner, watching replies and kind 513."""

    def __init__(self, relay: LocalRelayServer, home: Home) -> None:
        self.home = home
        self.owner = Signer.from_text(home.owner_secret)
        self.replies: defaultdict[str, list[NostrEvent]] = defaultdict(list)
        self.metadata: list[NostrEvent] = []
        self.client = RelayPool([relay.url], on_event=self._on_event, settings=PoolSettings(publish_timeout=10.0))

    async def _on_event(self, received: ReceivedEvent) -> None:
        event = received.event
        if event.kind == 513:
            self.metadata.append(event)
            return
        for tag in event.tags:
            if len(tag) > 1 and tag[0] == "e":
                self.replies[tag[1]].append(event)

    async def start(self) -> None:
        await self.client.start()
        authors = [self.home.agent("planner")]
        await self.client.subscribe("replies", [{"kinds": [1, 1111], "authors": authors}, {"kinds": [513]}])
        assert await self.client.wait_connected(within=10)

    async def note(self, text: str) -> NostrEvent:
        event = self.owner.sign(1, text, [["p", self.home.agent("planner")]])
        await self.client.publish(event)
        return event

    async def reply_to(self, note: NostrEvent, within: float) -> None:
        async with asyncio.timeout(within):
            while not self.replies[note.id]:  # noqa: ASYNC110 - the pool's callback fills it
                await asyncio.sleep(0.1)

    async def metadata_for(self, root_id: str, within: float) -> NostrEvent:
        async with asyncio.timeout(within):
            while True:
                for event in self.metadata:
                    if event.tag_value("e") == root_id:
                        return event
                await asyncio.sleep(0.2)


async def show(home: Home, conversation_id: str) -> dict[str, object]:
    code, out = await run_cli(home, "conversations", "show", conversation_id, "--json")
    assert code == 0, out
    shown = json.loads(out)
    assert isinstance(shown, dict)
    return shown


async def test_an_idle_conversation_is_titled_by_smollm2_published_and_recalled_by_the_next(
    relay: LocalRelayServer, home: Home, llama_server: LlamaServer, scripted_server: ScriptedServer
) -> None:
    """The idle timeout ends a kind-1 conversation; SmolLM2 gives it a title (not "Untitled Conversation")
    and a summary; a kind-513 event with both is published; the person's next note starts a new
    conversation whose model request carries "## Recent conversations" with that title."""
    scripted_agent(home, "planner", scripted_server, "Noted: Miso goes to the vet on Friday.")
    use_summarizer(home, llama_server)
    daemon = DaemonProcess(home, env=DAEMON_ENV)
    await daemon.start()
    person = Person(relay, home)
    await person.start()
    try:
        first = await person.note("My cat Miso needs a vet appointment on Friday at 10am.")
        await person.reply_to(first, within=30)

        published = await person.metadata_for(first.id, within=240)  # idle 3 s, then SmolLM2 on 2 cores

        shown = await show(home, first.id)
        assert shown["status"] == "ended", daemon.log_tail()
        assert shown["ended_by"] == "idle"
        title, summary = shown["title"], shown["description"]
        assert isinstance(title, str)
        assert title.strip()
        assert title != UNTITLED
        # SmolLM2 named it (the fallback would say "fallback"; the log says why the model's answer was not used)
        assert shown["title_source"] == "model", "\n".join([
            line for line in daemon.log_tail(400).splitlines() if "description" in line
        ])
        assert isinstance(summary, str)
        assert summary.strip()
        assert published.tag_value("title") == title
        assert published.tag_value("summary") == summary
        assert published.tag_value("status") == "ended"
        assert published.pubkey == home.project

        second = await person.note("Can you remind me what we planned?")
        await person.reply_to(second, within=30)

        assert second.id != first.id
        shown_second = await show(home, second.id)
        assert shown_second["id"] == second.id  # a new conversation: the old one had ended
        persona = scripted_server.requests[-1][1]["messages"][0]
        assert persona["role"] == "system"
        assert "\n## Recent conversations\n" in persona["content"], persona["content"]
        assert f"· {title}: " in persona["content"]
    finally:
        await person.client.stop()
        assert await daemon.stop() == 0
