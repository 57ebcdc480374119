"""`tenexd context` shows the persona first: the system message the agent's model is sent, built as its runs
build it (instructions from the home, the person's recent conversations with the agent)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from typer.testing import CliRunner

from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.app.home import load_agents, load_project_pubkey
from tenex_daemon.app.settings import load_settings
from tenex_daemon.app.wiring import build_store, routing_system_prompt
from tenex_daemon.cli.main import app
from tenex_daemon.core.conversation import TitleSource
from tenex_daemon.core.phases import Phase
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.services.orchestrator import with_current_phase
from tenex_daemon.testing import EventFactory, FakeClock
from tests.unit.cli.conftest import USER, tenexd

PLANNER_PERSONA = (
    "You are Planner.\nYou turn requests into short, concrete plans.\n"
    "\n## Recent conversations\n- 2023-11-14 · Picnic plans: They chose Saturday.\n"
)


def seed(home: Path) -> str:
    """Store an ended, described conversation of USER with the planner (ended 2023-11-14 UTC) and a new one;
    return the new one's id."""

    async def go() -> str:
        settings = load_settings(home)
        store = build_store(settings)
        await store.open()
        try:
            agents = load_agents(settings)
            manager = ConversationManager(store, agents, load_project_pubkey(settings), clock=FakeClock())
            planner = next(a for a in agents if a.slug == "planner")
            planner_key = Signer.from_file(settings.agent_key_path("planner"))
            events = EventFactory()
            earlier = events.event(USER, "Plan a picnic", kind=11, tags=[["p", planner.pubkey]])
            await manager.create_conversation(earlier)
            await manager.add_event(earlier.id, planner_key.sign(1111, "Saturday.", [["E", earlier.id]]))
            assert await manager.end_conversation(earlier.id, by="owner")
            await manager.describe(
                earlier.id,
                title="Picnic plans",
                summary="They chose Saturday.",
                source=TitleSource.MODEL,
                for_activity=0,
            )
            now = events.event(USER, "What next?", kind=11, tags=[["p", planner.pubkey]])
            await manager.create_conversation(now)
            return now.id
        finally:
            await store.close()

    return asyncio.run(go())


def test_context_json_has_the_persona_the_model_is_sent(home: Path) -> None:
    """`context --json` gives the planner's persona exactly: name, instructions, the recent conversation."""
    conversation = seed(home)

    code, out = tenexd(home, "context", conversation, "--agent", "planner", "--json")

    assert code == 0, out
    context = json.loads(out)
    assert context["persona"] == PLANNER_PERSONA
    assert context["messages"] == [{"role": "user", "content": "What next?"}]


def test_context_prints_the_persona_first_as_the_system_message(home: Path) -> None:
    """`context` prints the persona under a system heading before the first message."""
    conversation = seed(home)

    code, out = tenexd(home, "context", conversation, "--agent", "planner")

    assert code == 0, out
    assert out.startswith("--- [persona] system ---\n" + PLANNER_PERSONA + "\n--- [0] user ---\nWhat next?\n")


def test_context_says_what_the_agents_budget_did(home: Path) -> None:
    """With a context window configured, `context` ends with the budget line (limit, strategy, tokens before
    cuts, messages left out), and `--json` carries the same figures."""
    config = home / "config.toml"
    planner = 'instructions = "You turn requests into short, concrete plans."\n\n[agents.backend]\nkind = "offline"\n'
    text = config.read_text()
    assert planner in text
    config.write_text(text.replace(planner, planner + "context_window = 50\n"))
    conversation = seed(home)

    code, out = tenexd(home, "context", conversation, "--agent", "planner")
    _, raw = tenexd(home, "context", conversation, "--agent", "planner", "--json")

    assert code == 0, out
    budget = json.loads(raw)["budget"]
    assert (budget["limit"], budget["strategy"], budget["dropped"]) == (40, "sliding_window", 0)
    assert out.rstrip().splitlines()[-1] == (
        f"--- budget 40 tokens (sliding_window): {budget['tokens']} before cuts, 0 message(s) left out ---"
    )


def test_context_for_the_orchestrator_is_its_routing_request(home: Path) -> None:
    """Without a daemon, `context --agent orchestrator` shows the routing request its model would get (the
    routing system prompt, then the routing context as one user message); with an offline orchestrator it
    routes by rules and the command says it is sent nothing."""
    conversation = seed(home)
    refused = CliRunner().invoke(app, ["--home", str(home), "context", conversation, "--agent", "orchestrator"])
    assert refused.exit_code == 1
    assert refused.stderr == "error: orchestrator routes by rules here (no model): it is sent nothing\n"

    config = home / "config.toml"
    offline = 'orchestrator = true\n\n[agents.backend]\nkind = "offline"\n'
    text = config.read_text()
    assert offline in text
    config.write_text(text.replace(offline, offline.replace('"offline"', '"openai"\nmodel = "gpt-4o"')))
    code, out = tenexd(home, "context", conversation, "--agent", "orchestrator", "--json")

    assert code == 0, out
    shown = json.loads(out)
    prompt = routing_system_prompt(load_settings(home))
    assert prompt is not None
    assert shown["persona"] == with_current_phase(prompt, Phase.CHAT)
    assert "planner" in shown["persona"]
    [message] = shown["messages"]
    assert message["role"] == "user"
    assert json.loads(message["content"])["user_request"] == "What next?"
