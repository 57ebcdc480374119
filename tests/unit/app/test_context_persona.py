"""The control API's context preview has the persona a run sends, built from the daemon's own profiles, so the
preview and the run cannot drift apart."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tenex_daemon import ConversationManager
from tenex_daemon.app.control_api import create_app
from tenex_daemon.app.metrics import Metrics
from tenex_daemon.app.wiring import Pipeline
from tenex_daemon.core.budget import BudgetStrategy, TokenBudget
from tenex_daemon.core.conversation import TitleSource
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.llm import LLMMessage
from tenex_daemon.services.answering import AgentProfile
from tenex_daemon.services.orchestrator import LLMOrchestrator, RuleBasedOrchestrator
from tenex_daemon.services.runs import RunRequest
from tenex_daemon.testing.fakes import ScriptedBackend
from tests import pipeline
from tests.conftest import Cast
from tests.unit.services.test_tool_loop import text

RECENT = "\n## Recent conversations\n- 2023-11-14 · Database: They chose PostgreSQL.\n"


@dataclass
class Target:
    """A ControlTarget; with ``pipeline`` set it also stands for a running daemon's pipeline."""

    manager: ConversationManager
    pipeline: Pipeline | None = None
    metrics: Metrics = field(default_factory=Metrics)

    def status(self) -> Mapping[str, Any]:
        """A fixed status."""
        return {"state": "running"}


async def preview_persona(target: Target, conversation_id: str) -> str:
    """GET the context preview for Alice; return its persona."""
    async with TestClient(TestServer(create_app(target))) as client:
        response = await client.get(f"/api/v1/conversations/{conversation_id}/context", params={"agent": "alice"})
        assert response.status == 200, await response.text()
        persona: str = (await response.json())["persona"]
        return persona


async def test_the_preview_persona_is_the_one_the_run_sends(cast: Cast) -> None:
    """With the daemon's profiles the preview's persona has Alice's instructions and the user's recent
    conversation, and it is exactly the system prompt her run then sends; without profiles only the name."""
    backend = ScriptedBackend([text("Hello.")])
    profiles = {a.slug: AgentProfile(a, "You answer briefly.", backend) for a in cast.agents}
    rig = pipeline.build_rig(cast, profiles=profiles)
    earlier = cast.user_says("Which database?", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.manager.create_conversation(earlier)
    await rig.manager.add_event(earlier.id, cast.alice_says("PostgreSQL.", tags=[["E", earlier.id]]))
    assert await rig.manager.end_conversation(earlier.id, by="idle")
    await rig.manager.describe(
        earlier.id, title="Database", summary="They chose PostgreSQL.", source=TitleSource.MODEL, for_activity=0
    )
    root = cast.user_says("Hi Alice", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.manager.create_conversation(root)

    previewed = await preview_persona(Target(rig.manager, rig.pipeline), root.id)
    bare = await preview_persona(Target(rig.manager), root.id)
    assert await rig.runner.run(RunRequest(root.id, root.id, "alice")) is not None
    await rig.runner.flush(5.0)

    assert previewed == "You are Alice.\nYou answer briefly.\n" + RECENT
    assert backend.requests[0].system_prompt == previewed
    assert bare == "You are Alice.\n" + RECENT


async def preview(target: Target, conversation_id: str) -> dict[str, Any]:
    """GET the context preview for Alice."""
    async with TestClient(TestServer(create_app(target))) as client:
        response = await client.get(f"/api/v1/conversations/{conversation_id}/context", params={"agent": "alice"})
        assert response.status == 200, await response.text()
        found: dict[str, Any] = await response.json()
        return found


def sent(message: LLMMessage) -> dict[str, str]:
    """A message as the preview writes it."""
    return {"role": message.role, "content": message.content}


async def long_conversation(cast: Cast, rig: pipeline.Rig) -> NostrEvent:
    """A conversation of 30 messages between the person and Alice (far over a 200-token budget); the
    newest is the person's, the trigger."""
    root = cast.user_says("Hi Alice, a long story follows. " * 3, kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.manager.create_conversation(root)
    event = root
    for n in range(29):
        say = cast.alice_says if n % 2 == 1 else cast.user_says
        event = say(f"Message {n}: " + "words " * 12, tags=[["E", root.id], ["e", event.id]])
        await rig.manager.add_event(root.id, event)
    return event


async def budgeted(
    cast: Cast, backend: ScriptedBackend, budget: TokenBudget
) -> tuple[pipeline.Rig, NostrEvent, str]:
    """A rig whose agents think through ``backend`` within ``budget``, holding :func:`long_conversation`:
    (the rig, the trigger, the conversation's id)."""
    profiles = {a.slug: AgentProfile(a, "", backend, budget=budget) for a in cast.agents}
    rig = pipeline.build_rig(cast, profiles=profiles)
    trigger = await long_conversation(cast, rig)
    conversation = await rig.manager.find_conversation_of_event(trigger.id)
    assert conversation is not None
    return rig, trigger, conversation


@pytest.mark.parametrize("strategy", [BudgetStrategy.SLIDING_WINDOW, BudgetStrategy.SUMMARIZE])
async def test_the_preview_is_cut_to_the_budget_as_the_runs_first_call_is(
    cast: Cast, strategy: BudgetStrategy
) -> None:
    """With a budget history does not fit, the preview's messages are exactly those the run's first call
    sends (a stored summary that covers the cut included), and it says what the budget did."""
    backend = ScriptedBackend([text("Done.")])
    rig, trigger, conversation = await budgeted(cast, backend, TokenBudget(200, strategy))
    if strategy is BudgetStrategy.SUMMARIZE:  # a summary of everything a cut could leave out: no new call
        await rig.manager.update_agent_state(conversation, "alice", summary=("They talked at length.", 29))

    shown = await preview(Target(rig.manager, rig.pipeline), conversation)
    assert await rig.runner.run(RunRequest(conversation, trigger.id, "alice")) is not None
    await rig.runner.flush(5.0)

    assert len(backend.requests) == 1
    assert shown["messages"] == [sent(m) for m in backend.requests[0].messages]
    cut = shown["budget"]
    assert (cut["limit"], cut["strategy"], cut["to_summarize"]) == (200, strategy.value, 0)
    assert cut["tokens"] > 200
    assert 0 < cut["dropped"] < 30
    first = shown["messages"][1]["content"]
    if strategy is BudgetStrategy.SUMMARIZE:
        assert first == "Previous conversation summary: They talked at length."
    else:
        assert first.startswith("[Note: ")
        assert "older messages truncated" in first


async def test_a_summary_the_run_would_extend_is_counted_and_shown_as_truncated(cast: Cast) -> None:
    """Without a stored summary the run first summarizes the cut (a backend call a preview does not make):
    the preview counts those messages in ``to_summarize`` and shows them as truncated."""
    backend = ScriptedBackend([text("They talked."), text("Done.")])
    # a cut within the budget: summarized in one call (a larger one would be in parts)
    rig, trigger, conversation = await budgeted(cast, backend, TokenBudget(600, BudgetStrategy.SUMMARIZE))

    shown = await preview(Target(rig.manager, rig.pipeline), conversation)
    assert await rig.runner.run(RunRequest(conversation, trigger.id, "alice")) is not None
    await rig.runner.flush(5.0)

    cut = shown["budget"]
    assert 0 < cut["to_summarize"] <= cut["dropped"]
    assert shown["messages"][1]["content"].startswith("[Note: ")
    answered = [sent(m) for m in backend.requests[1].messages]
    assert answered[1]["content"] == "Previous conversation summary: They talked."
    assert len(answered) == len(shown["messages"])


async def test_a_stored_summary_the_run_extends_is_shown_with_the_rest_truncated(cast: Cast) -> None:
    """With a stored summary that covers less than the cut, the preview shows that summary where it stands and
    one truncation note for the messages the run first adds to it (``to_summarize``); the run sends the
    extended summary there instead, and everything after the cut is the same."""
    backend = ScriptedBackend([text("They talked more."), text("Done.")])
    # a cut within the budget: summarized in one call (a larger one would be in parts)
    rig, trigger, conversation = await budgeted(cast, backend, TokenBudget(600, BudgetStrategy.SUMMARIZE))
    await rig.manager.update_agent_state(conversation, "alice", summary=("They talked.", 5))

    shown = await preview(Target(rig.manager, rig.pipeline), conversation)
    assert await rig.runner.run(RunRequest(conversation, trigger.id, "alice")) is not None
    await rig.runner.flush(5.0)

    cut = shown["budget"]
    assert cut["to_summarize"] == cut["dropped"] - 4  # the summary covers 5, the first message always stays
    assert cut["to_summarize"] > 0
    assert shown["messages"][1]["content"] == "Previous conversation summary: They talked."
    assert shown["messages"][2]["content"].startswith(f"[Note: {cut['to_summarize']} older messages truncated")
    answered = [sent(m) for m in backend.requests[1].messages]
    assert answered[1]["content"] == "Previous conversation summary: They talked more."
    assert answered[2:] == shown["messages"][3:]


async def test_without_a_budget_the_preview_says_none_applies(cast: Cast) -> None:
    """An agent without a budget is previewed with every message its context holds, and ``budget`` null."""
    rig = pipeline.build_rig(cast)
    trigger = await long_conversation(cast, rig)
    conversation = await rig.manager.find_conversation_of_event(trigger.id)
    assert conversation is not None

    shown = await preview(Target(rig.manager, rig.pipeline), conversation)

    built = await rig.manager.preview_agent_messages(conversation, "alice", trigger)
    assert shown["budget"] is None
    assert shown["messages"] == [sent(m) for m in built.messages]


async def test_the_orchestrators_preview_is_its_routing_request(cast: Cast) -> None:
    """For the orchestrator the preview is what its model is sent to route (by default for the newest event it
    did not write): its system prompt and one user message holding the routing context, the same as the
    request routing then makes; with no model (rule-based routing) it is refused with 409."""
    model = ScriptedBackend([text('{"agents": ["alice"], "reason": "alice builds"}')])
    profiles = {a.slug: AgentProfile(a, "", ScriptedBackend([text("On it.")])) for a in cast.agents}

    def routing(manager: ConversationManager) -> LLMOrchestrator:
        rules = RuleBasedOrchestrator(manager.agents, "alice")
        return LLMOrchestrator(manager, model, rules, default_agent="alice", roles={"alice": "builds things"})

    rig = pipeline.build_rig(cast, profiles=profiles, orchestrator=routing)
    root = cast.user_says("Build me a shed", kind=11)
    await rig.manager.create_conversation(root)
    # the newest event is the orchestrator's own: the preview's default trigger is the newest it did not write
    await rig.manager.add_event(root.id, cast.factory.event(cast.orchestrator_keys, "Noted.", tags=[["E", root.id]]))

    async with TestClient(TestServer(create_app(Target(rig.manager, rig.pipeline)))) as client:
        response = await client.get(f"/api/v1/conversations/{root.id}/context", params={"agent": "orchestrator"})
        assert response.status == 200, await response.text()
        shown = await response.json()
    async with TestClient(TestServer(create_app(Target(rig.manager)))) as client:
        refused = await client.get(f"/api/v1/conversations/{root.id}/context", params={"agent": "orchestrator"})
        assert refused.status == 409
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert await rig.pipeline.orchestrator.route(conversation, root) is not None  # as the dispatcher routes

    [request] = model.requests
    assert shown["persona"] == request.system_prompt
    assert shown["messages"] == [sent(m) for m in request.messages]
    assert json.loads(shown["messages"][0]["content"])["user_request"] == "Build me a shed"
