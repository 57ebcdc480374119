"""The orchestrator's turn cycle: routing decisions by a scripted model, turns, completions, END and loop limits."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from tenex_daemon import ConversationManager, MemoryStore, NostrEvent
from tenex_daemon.adapters.llm.offline import OfflineBackend
from tenex_daemon.adapters.nostr.codec import ReplyDetails, build_agent_reply
from tenex_daemon.app.wiring import routing_fallbacks
from tenex_daemon.core.budget import TokenBudget
from tenex_daemon.core.context import ChatMessage
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.llm import (
    BackendError,
    CompletionRequest,
    CompletionResult,
    ContextTooLongError,
    LLMBackend,
)
from tenex_daemon.core.phases import Phase, PhaseRules
from tenex_daemon.core.ports import Store
from tenex_daemon.core.routing_budget import ROUTING_NOTE_KEY
from tenex_daemon.core.vocabulary import TAG_TOOL, TOOL_COMPLETE
from tenex_daemon.services import dispatcher as dispatcher_module
from tenex_daemon.services import runs as runs_module
from tenex_daemon.services.agent_runner import AgentProfile, AgentRunner
from tenex_daemon.services.dispatcher import EventDispatcher, HandleResult, Outcome
from tenex_daemon.services.orchestrator import (
    END,
    AnswerError,
    LLMOrchestrator,
    RoutingDecision,
    RoutingStop,
    RuleBasedOrchestrator,
    parse_routing_answer,
)
from tenex_daemon.services.routing_limits import ROUTING_LIMITS_KEY, RoutingLimits
from tenex_daemon.services.runs import RunScheduler
from tenex_daemon.testing import FakeClock
from tenex_daemon.testing.fakes import FailingBackend, FakePublisher, ScriptedBackend, TargetingLog
from tests import pipeline
from tests.conftest import Cast
from tests.unit.services.test_tool_loop import calls, text

CONTEXT_KEYS = {"user_request", "latest_user_message", "routing_history", "current_routing"}
ENTRY_KEYS = {"phase", "agents", "completions", "reason", "timestamp"}
COMPLETION_KEYS = {"agent", "message", "timestamp"}


def completes(*summaries: str) -> ScriptedBackend:
    """An agent backend that calls `complete` once per run, with each summary in turn."""
    return ScriptedBackend([calls((f"c{n}", "complete", {"summary": s})) for n, s in enumerate(summaries)])


def replies(content: str) -> ScriptedBackend:
    """An agent backend that answers in plain text (to the user, no completion addressed to the orchestrator)."""
    return ScriptedBackend([text(content)])


def answers(*texts: str) -> ScriptedBackend:
    """An orchestrator backend that answers each routing request with the next text."""
    return ScriptedBackend([CompletionResult(text=t, model="scripted") for t in texts])


def alternating(reason: str, count: int = 12) -> ScriptedBackend:
    """An orchestrator that never ends: it sends alice, then bob, then alice again, ... (no decision repeats
    the one before it, so only the turn limit stops it)."""
    return answers(*(f'{{"agents": ["{("alice", "bob")[i % 2]}"], "reason": "{reason}"}}' for i in range(count)))


class BrokenBackend:
    """An orchestrator backend whose provider is down."""

    name = "broken"

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Fail as an unreachable provider does."""
        raise BackendError("unreachable", "connection refused")


@dataclass
class Rig:
    """The daemon's pipeline routing with the LLM orchestrator; agents think through scripts."""

    base: pipeline.Rig
    orchestrator: LLMOrchestrator
    targeting: TargetingLog

    @property
    def manager(self) -> ConversationManager:
        """The pipeline's manager."""
        return self.base.manager

    @property
    def scheduler(self) -> RunScheduler:
        """The pipeline's scheduler."""
        return self.base.scheduler

    @property
    def dispatcher(self) -> EventDispatcher:
        """The pipeline's dispatcher."""
        return self.base.dispatcher

    @property
    def runner(self) -> AgentRunner:
        """The pipeline's runner."""
        return self.base.runner

    @property
    def publisher(self) -> FakePublisher:
        """What went to the relays."""
        return self.base.publisher

    @property
    def after_reply(self) -> list[HandleResult]:
        """How each saved agent reply was targeted, in order."""
        return self.targeting.results


def make_rig(
    cast: Cast,
    orchestrator_backend: Any,
    *,
    alice: LLMBackend | None = None,
    bob: ScriptedBackend | None = None,
    turn_limit: int = 10,
    default_agent: str = "alice",
    store: Store | None = None,
    orchestrator_budget: TokenBudget | None = None,
    phase_rules: PhaseRules | None = None,
    whitelist: tuple[str, ...] = (),
) -> Rig:
    """The daemon's pipeline with an LLM orchestrator over ``orchestrator_backend``; agents think through scripts
    (over ``store``: a rig built again on the same store is the daemon after a restart; ``whitelist``: who
    besides the owner may write)."""
    backends: dict[str, LLMBackend] = {
        "alice": alice or completes("done"),
        "bob": bob or completes("done"),
        "orchestrator": OfflineBackend(),
    }
    profiles = {a.slug: AgentProfile(a, "", backends[a.slug]) for a in cast.agents}
    made: list[LLMOrchestrator] = []

    def llm_orchestrator(manager: ConversationManager) -> LLMOrchestrator:
        made.append(
            LLMOrchestrator(
                manager,
                orchestrator_backend,
                RuleBasedOrchestrator(manager.agents, default_agent),
                default_agent=default_agent,
                roles={"alice": "builds things", "bob": "reviews things"},
                budget=orchestrator_budget,
            )
        )
        return made[0]

    targeting = TargetingLog()
    base = pipeline.build_rig(
        cast,
        profiles=profiles,
        composer=pipeline.real_composer(cast),
        orchestrator=llm_orchestrator,
        reply_observer=targeting,
        default_agent=default_agent,
        turn_limit=turn_limit,
        hop_limit=6,
        store=store,
        phase_rules=phase_rules,
        whitelist=whitelist,
    )
    return Rig(base, made[0], targeting)


async def settle(rig: Rig) -> None:
    """Wait until no run is scheduled (runs started by routing included) and replies are published."""
    async with asyncio.timeout(10):
        while rig.scheduler.in_flight:  # noqa: ASYNC110 - runs schedule runs; the scheduler has no idle event
            await asyncio.sleep(0.01)
    await rig.runner.flush(5.0)


def routing_contexts(backend: ScriptedBackend) -> list[dict[str, Any]]:
    """The routing context of each request the orchestrator's model got (its first, JSON message)."""
    contexts = []
    for request in backend.requests:
        first = request.messages[0]
        assert isinstance(first, ChatMessage)
        assert first.role == "user"
        contexts.append(json.loads(first.content))
    return contexts


def thread(root: NostrEvent) -> list[list[str]]:
    """Tags of a reply in ``root``'s conversation."""
    return [["E", root.id, "", root.pubkey], ["K", "11"]]


async def test_two_agents_complete_then_verification_then_end(cast: Cast) -> None:
    """A request routed to two agents closes its turn on their completions, then verification, then END."""
    model = answers(
        '{"agents": ["alice", "bob"], "phase": "execute", "reason": "build it"}',
        'Next:\n```json\n{"agents": ["alice"], "phase": "verification", "reason": "check it"}\n```',
        'All good. {"agents": ["END"], "reason": "verified"}',
    )
    alice, bob = completes("alice built", "alice verified"), completes("bob built")
    rig = make_rig(cast, model, alice=alice, bob=bob)
    root = cast.user_says("Build a bridge", kind=11)

    first = await rig.dispatcher.handle(root)
    await settle(rig)

    assert (first.outcome, first.agents) == (Outcome.SCHEDULED, ("alice", "bob"))
    assert [r.reason for r in rig.after_reply] == [
        RoutingStop.TURN_WAITING.value,
        "check it",
        RoutingStop.END.value,
    ]
    assert rig.after_reply[1].agents == ("alice",)
    first_ctx, second_ctx, third_ctx = routing_contexts(model)
    assert all(len(r.messages) == 1 for r in model.requests)  # one user message holding the JSON
    assert first_ctx == {
        "user_request": "Build a bridge", "latest_user_message": "Build a bridge", "routing_history": [],
        "current_routing": None,
    }
    assert list(first_ctx) == ["user_request", "latest_user_message", "routing_history", "current_routing"]
    assert set(second_ctx) == CONTEXT_KEYS
    assert second_ctx["current_routing"] is None
    [built] = second_ctx["routing_history"]
    assert set(built) == ENTRY_KEYS
    assert (built["phase"], built["agents"], built["reason"]) == ("execute", ["alice", "bob"], "build it")
    assert all(set(c) == COMPLETION_KEYS for c in built["completions"])
    assert sorted((c["agent"], c["message"]) for c in built["completions"]) == [
        ("alice", "alice built"),
        ("bob", "bob built"),
    ]
    assert third_ctx["current_routing"] is None
    assert third_ctx["routing_history"][0] == built
    checked = third_ctx["routing_history"][1]
    assert (checked["phase"], checked["agents"]) == ("verification", ["alice"])
    assert [(c["agent"], c["message"]) for c in checked["completions"]] == [("alice", "alice verified")]
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert conversation.phase is Phase.VERIFICATION
    assert [(t.from_phase, t.to_phase, t.agent_slug) for t in conversation.phase_transitions] == [
        (Phase.CHAT, Phase.EXECUTE, "orchestrator"),
        (Phase.EXECUTE, Phase.VERIFICATION, "orchestrator"),
    ]
    assert all(turn.is_completed for turn in conversation.orchestrator_turns)
    assert (len(alice.requests), len(bob.requests), len(model.requests)) == (2, 1, 3)  # END ran nobody
    assert {e.pubkey for e in rig.publisher.published} == {cast.alice.pubkey, cast.bob.pubkey}
    prompt = model.requests[0].system_prompt
    assert "- alice: builds things" in prompt
    assert "- bob: reviews things" in prompt
    assert '{"agents": ["END"]' in prompt
    assert "verification" in prompt


async def test_no_completion_is_counted_twice(cast: Cast) -> None:
    """Each completion event is counted once in its turn, even when the dispatcher sees it again."""
    model = answers('{"agents": ["alice", "bob"], "reason": "both"}', '{"agents": ["END"], "reason": "done"}')
    rig = make_rig(cast, model)
    root = cast.user_says("Two things", kind=11)
    await rig.dispatcher.handle(root)
    await settle(rig)
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    completion = next(e for e in conversation.history if e.has_tag(TAG_TOOL, TOOL_COMPLETE))

    again = await rig.dispatcher.after_reply(root.id, completion)
    duplicate = await rig.dispatcher.handle(completion)

    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    completions = [c.agent for turn in conversation.orchestrator_turns for c in turn.completions]
    assert sorted(completions) == ["alice", "bob"]
    assert sum(e.has_tag(TAG_TOOL, TOOL_COMPLETE) for e in conversation.history) == 2
    assert (again.outcome, again.reason) == (Outcome.STORED, RoutingStop.ENDED.value)
    assert duplicate.outcome is Outcome.DUPLICATE
    assert len(model.requests) == 2


async def test_a_looping_orchestrator_is_stopped_at_the_turn_limit(cast: Cast) -> None:
    """An orchestrator that routes every completion to more work stops after turn_limit turns, until the user
    writes again."""
    model = alternating("once more")
    alice, bob = completes("did it"), completes("did it too")
    rig = make_rig(cast, model, alice=alice, bob=bob, turn_limit=3)
    root = cast.user_says("Loop forever", kind=11)

    await rig.dispatcher.handle(root)
    await settle(rig)

    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert len(conversation.orchestrator_turns) == 3
    assert (len(model.requests), len(alice.requests), len(bob.requests)) == (3, 2, 1)
    assert (rig.after_reply[-1].outcome, rig.after_reply[-1].reason) == (Outcome.STORED, "turn_limit")
    follow = await rig.dispatcher.handle(cast.user_says("Go on", tags=thread(root)))
    assert follow.outcome is Outcome.SCHEDULED
    await settle(rig)
    assert rig.after_reply[-1].reason == "turn_limit"
    assert len(model.requests) == 6


class WindowedBackend:
    """An orchestrator model with a context window of ``window_chars`` characters: a longer request is refused
    as too long, as a provider does; each request's size is recorded."""

    name = "windowed"

    def __init__(self, window_chars: int, *texts: str) -> None:
        self.window_chars = window_chars
        self.answers = answers(*texts)
        self.sizes: list[int] = []

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Refuse a request over the window, else answer with the next scripted decision."""
        size = len(request.system_prompt) + sum(len(m.content) for m in request.messages)
        self.sizes.append(size)
        if size > self.window_chars:
            raise ContextTooLongError(message="prompt is too long")
        return await self.answers.complete(request)


async def test_a_long_conversations_routing_context_is_fitted_to_the_orchestrators_budget(cast: Cast) -> None:
    """With its model's budget, the orchestrator is sent the routing context fitted to it (the oldest turns left
    out, saying so), so a long conversation keeps its model's routing instead of falling back to the rules."""
    window = 50_000
    backend = WindowedBackend(
        window, '{"agents": ["alice"], "reason": "work"}', '{"agents": ["END"], "reason": "done"}'
    )
    backend.answers.script *= 3  # alice, END, alice, END, ...
    big = "x" * 30_000
    budget = TokenBudget.of_window(window // 4)  # characters/4: 80% of the window
    rig = make_rig(cast, backend, alice=completes(big, big, big), orchestrator_budget=budget)
    root = cast.user_says("one", kind=11)
    await rig.dispatcher.handle(root)
    await settle(rig)
    for words in ("two", "three"):
        await rig.dispatcher.handle(cast.user_says(words, tags=thread(root)))
        await settle(rig)

    assert len(backend.sizes) == 6
    assert max(backend.sizes) <= window
    last = routing_contexts(backend.answers)[-1]
    assert last[ROUTING_NOTE_KEY] == "[Note: 2 older turns truncated to stay within token limit]"
    assert last["latest_user_message"] == "three"
    [newest] = last["routing_history"]  # the turn alice's last completion closed, whole
    assert newest["completions"][0]["message"] == big
    assert [r.reason for r in rig.after_reply] == [RoutingStop.END.value] * 3  # the model routed every time


def test_a_decision_repeating_the_one_before_is_refused_until_the_user_writes() -> None:
    """The same agents (in any order) and phase as the decision before are refused (its reason does not
    matter; no phase means the conversation's); another phase or another agent is a new decision, and a user
    message allows any."""
    limits = RoutingLimits(turn_limit=10)
    decision = RoutingDecision(("alice",), "again", "execute")

    assert limits.record("c", decision) is None
    assert limits.record("c", RoutingDecision(("alice",), "in other words", "execute")) is RoutingStop.REPEATED_DECISION
    assert limits.record("c", RoutingDecision(("alice",), "again", "chat")) is None
    assert limits.record("c", RoutingDecision(("alice",), "again", "chat")) is RoutingStop.REPEATED_DECISION
    assert limits.record("c", RoutingDecision(("alice",), "same phase kept", None), "chat") is RoutingStop.REPEATED_DECISION
    assert limits.record("c", RoutingDecision(("bob", "alice"), "both", "chat")) is None
    assert limits.record("c", RoutingDecision(("alice", "bob"), "both again", "chat")) is RoutingStop.REPEATED_DECISION
    limits.user_message("c")
    assert limits.record("c", RoutingDecision(("alice",), "again", "chat")) is None
    assert limits.turns("c") == 1


async def test_an_orchestrator_sending_an_agent_back_to_the_same_work_is_stopped(cast: Cast) -> None:
    """The orchestrator that answers alice's completion by routing alice in the same phase again is stopped
    as a loop (``repeated_decision``): alice runs once, not until the turn limit."""
    model = answers('{"agents": ["alice"], "phase": "execute", "reason": "again"}')
    alice = completes("did it")
    rig = make_rig(cast, model, alice=alice)

    await rig.dispatcher.handle(cast.user_says("Loop", kind=11))
    await settle(rig)

    assert len(alice.requests) == 1
    assert (rig.after_reply[-1].outcome, rig.after_reply[-1].reason) == (
        Outcome.STORED, RoutingStop.REPEATED_DECISION.value
    )
    assert len(model.requests) == 2


async def test_the_turn_limit_survives_a_restart(cast: Cast) -> None:
    """A daemon restarted on the same store still refuses the turn past the limit (the model is not asked
    again), until the user writes; the count is kept in the conversation's metadata."""
    store = MemoryStore()
    model = alternating("once more")
    rig = make_rig(cast, model, alice=completes("did it"), bob=completes("did it too"), turn_limit=3, store=store)
    root = cast.user_says("Loop forever", kind=11)
    await rig.dispatcher.handle(root)
    await settle(rig)
    assert rig.after_reply[-1].reason == RoutingStop.TURN_LIMIT.value
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    last = conversation.history[-1]

    restarted_model = answers('{"agents": ["alice"], "reason": "after the restart"}')
    restarted = make_rig(cast, restarted_model, alice=completes("again"), turn_limit=3, store=store)
    again = await restarted.dispatcher.after_reply(root.id, last)

    assert (again.outcome, again.reason) == (Outcome.STORED, RoutingStop.TURN_LIMIT.value)
    assert restarted_model.requests == []
    assert conversation.metadata.extra[ROUTING_LIMITS_KEY]["turns"] == 3
    follow = await restarted.dispatcher.handle(cast.user_says("Go on", tags=thread(root)))
    assert (follow.outcome, follow.agents) == (Outcome.SCHEDULED, ("alice",))


async def test_the_last_decision_and_an_end_survive_a_restart(cast: Cast) -> None:
    """After a restart the stored last decision still refuses its repetition, and an
    END still ends routing: the completion that got END is not routed again."""
    store = MemoryStore()
    model = answers('{"agents": ["alice"], "phase": "execute", "reason": "build"}')
    rig = make_rig(cast, model, alice=replies("working on it"), store=store)
    root = cast.user_says("Build a shed", kind=11)
    await rig.dispatcher.handle(root)
    await settle(rig)

    restarted = make_rig(cast, answers('{"agents": ["END"], "reason": "done"}'), store=store)
    conversation = await restarted.manager.get_conversation(root.id)
    assert conversation is not None
    limits = RoutingLimits()
    limits.load(conversation)
    same = RoutingDecision(("alice",), "build again", "execute")
    assert limits.record(root.id, same) is RoutingStop.REPEATED_DECISION
    assert limits.turns(root.id) == 1

    completion = cast.alice_says("built", tags=[*thread(root), ["e", root.id], [TAG_TOOL, TOOL_COMPLETE]])
    ended = await restarted.dispatcher.handle(completion)
    assert ended.reason == RoutingStop.END.value
    third_model = answers('{"agents": ["bob"], "reason": "paint"}')
    again = make_rig(cast, third_model, store=store)
    after = await again.dispatcher.after_reply(root.id, completion)

    assert (after.outcome, after.reason) == (Outcome.STORED, RoutingStop.ENDED.value)
    assert third_model.requests == []


async def test_invalid_answers_are_retried_once_then_the_default_agent_is_used(cast: Cast) -> None:
    """An answer without JSON is fed back once; a second invalid answer routes to the default agent."""
    model = answers("Alice should do it.", '{"agents": [], "reason": "nobody"}')
    rig = make_rig(cast, model, bob=replies("on it"), default_agent="bob")
    root = cast.user_says("Anything", kind=11)

    result = await rig.dispatcher.handle(root)

    assert (result.outcome, result.agents) == (Outcome.SCHEDULED, ("bob",))
    assert result.reason is not None
    assert result.reason.startswith("default agent")
    assert len(model.requests) == 2
    retry = model.requests[1].messages
    assert [m.role for m in retry] == ["user", "assistant", "user"]
    assert retry[1].content == "Alice should do it."
    assert isinstance(retry[2], ChatMessage)
    assert "no JSON object" in retry[2].content
    await settle(rig)


async def test_after_two_invalid_answers_a_persons_mention_is_honoured_as_the_rules_route_it(cast: Cast) -> None:
    """A person's message naming ``@alice`` that the model twice answers invalidly goes to Alice, as the
    rule-based router routes it, not to the default agent; the fallback is counted."""
    model = answers("Bob should do it.", "Still Bob.")
    rig = make_rig(cast, model, alice=replies("here"), bob=replies("on it"), default_agent="bob")
    root = cast.user_says("@alice what is 2+2?", kind=11)

    result = await rig.dispatcher.handle(root)

    assert (result.outcome, result.agents) == (Outcome.SCHEDULED, ("alice",))
    assert result.reason is not None
    assert result.reason.startswith("mentioned @alice (orchestrator answer invalid")
    assert routing_fallbacks(rig.base.pipeline) == {"invalid_answer": 1}
    await settle(rig)


async def test_an_unknown_slug_is_fed_back_and_counts_as_the_retry(cast: Cast) -> None:
    """A decision naming an unknown agent is fed back with the real slugs; the corrected answer is used."""
    model = answers('{"agents": ["carol"], "reason": "x"}', '{"agents": ["bob"], "reason": "bob reviews"}')
    rig = make_rig(cast, model, bob=replies("looks fine"))
    root = cast.user_says("Review this", kind=11)

    result = await rig.dispatcher.handle(root)

    assert (result.agents, result.reason) == (("bob",), "bob reviews")
    feedback = model.requests[1].messages[-1]
    assert isinstance(feedback, ChatMessage)
    assert "unknown agent 'carol'" in feedback.content
    assert "alice, bob" in feedback.content
    await settle(rig)

    stubborn = answers('{"agents": ["carol"]}', '{"agents": ["orchestrator"]}')
    rig = make_rig(cast, stubborn, alice=replies("fine"), default_agent="alice")
    result = await rig.dispatcher.handle(cast.user_says("Again", kind=11))
    assert result.agents == ("alice",)
    assert len(stubborn.requests) == 2
    await settle(rig)


async def test_a_backend_failure_falls_back_to_rule_based_routing(cast: Cast) -> None:
    """When the orchestrator's backend fails, the rule-based route is used (an @mention, else the default),
    and the fallback is counted for the status and /metrics."""
    rig = make_rig(cast, BrokenBackend())

    result = await rig.dispatcher.handle(cast.user_says("Please @bob look", kind=11))

    assert (result.outcome, result.agents, result.reason) == (Outcome.SCHEDULED, ("bob",), "mentioned @bob")
    assert routing_fallbacks(rig.base.pipeline) == {"backend_failed": 1}
    await settle(rig)


async def test_a_forbidden_phase_change_keeps_the_current_phase(cast: Cast) -> None:
    """A decision naming a phase the rules forbid still starts its turn, in the current phase."""
    model = answers('{"agents": ["alice"], "phase": "reflection", "reason": "think"}', '{"agents": ["END"]}')
    rig = make_rig(cast, model)
    root = cast.user_says("Reflect", kind=11)

    result = await rig.dispatcher.handle(root)
    await settle(rig)

    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert result.agents == ("alice",)
    assert (conversation.phase, conversation.orchestrator_turns[0].phase) == (Phase.CHAT, Phase.CHAT)
    assert conversation.phase_transitions == []


async def test_a_decision_repeating_one_whose_phase_move_was_refused_is_stopped(cast: Cast) -> None:
    """The orchestrator sends Alice to reflection (a move the rules refuse: her turn runs in chat), then, on
    her completion, sends her again naming no phase: the same work in the same phase, so a repeated decision
    that stops routing; she runs once."""
    model = answers(
        '{"agents": ["alice"], "phase": "reflection", "reason": "think"}', '{"agents": ["alice"], "reason": "again"}'
    )
    alice = completes("thought")
    rig = make_rig(cast, model, alice=alice)

    await rig.dispatcher.handle(cast.user_says("Reflect", kind=11))
    await settle(rig)

    assert len(alice.requests) == 1
    assert rig.after_reply[-1].reason == RoutingStop.REPEATED_DECISION.value


async def test_a_phase_the_project_added_is_offered_and_routed_to(cast: Cast) -> None:
    """With a phase the project's table adds, the orchestrator's prompt lists it with its moves, a decision
    naming it starts a turn in it, and switch_phase offers it; a phase the project has not is refused."""
    rules = PhaseRules({"chat": ["review"], "review": ["chat"]})
    model = answers('{"agents": ["alice"], "phase": "review", "reason": "review it"}', '{"agents": ["END"]}')
    alice = completes("reviewed")
    rig = make_rig(cast, model, alice=alice, phase_rules=rules)
    root = cast.user_says("Review my draft", kind=11)

    await rig.dispatcher.handle(root)
    await settle(rig)

    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert (conversation.phase, conversation.orchestrator_turns[0].phase) == (Phase("review"), Phase("review"))
    assert "- review -> chat" in rig.orchestrator.system_prompt
    assert "- plan" not in rig.orchestrator.system_prompt
    [switch] = [tool for tool in alice.requests[0].tools if tool.name == "switch_phase"]
    assert switch.parameters["properties"]["phase"]["enum"] == ["chat", "review"]
    with pytest.raises(AnswerError, match="unknown phase 'plan'; the phases are chat, review"):
        parse_routing_answer('{"agents": ["alice"], "phase": "plan"}', ["alice"], rules.phases)


async def test_an_explicit_p_tag_wins_over_routing(cast: Cast) -> None:
    """A user who p-tags an agent gets that agent; the orchestrator's model is not asked."""
    model = answers('{"agents": ["alice"], "reason": "no"}')
    rig = make_rig(cast, model, bob=replies("here"))

    result = await rig.dispatcher.handle(cast.user_says("Bob, you", kind=11, tags=[["p", cast.bob.pubkey]]))
    await settle(rig)

    assert result.agents == ("bob",)
    assert model.requests == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"agents": ["alice"], "reason": "r"}', RoutingDecision(("alice",), "r")),
        (
            '```json\n{"agents": ["bob"], "phase": "plan", "reason": "r"}\n```',
            RoutingDecision(("bob",), "r", "plan"),
        ),
        (
            'I pick {"agents": ["alice", "bob"], "reason": "r"} because',
            RoutingDecision(("alice", "bob"), "r"),
        ),
        ('{"agents": ["end"], "reason": "done"}', RoutingDecision((END,), "done")),
        ('{"agents": ["alice"], "phase": "null", "reason": "r"}', RoutingDecision(("alice",), "r")),
        (
            '{"agents": ["alice"], "phase": "Execute", "reason": "r"}',
            RoutingDecision(("alice",), "r", "execute"),
        ),
    ],
)
def test_answers_in_fences_or_text_are_parsed(text: str, expected: RoutingDecision) -> None:
    """The first JSON object is taken from a fence or surrounding text; END is recognised."""
    assert parse_routing_answer(text, ["alice", "bob"]) == expected


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("no json here", "no JSON object"),
        ('{"agents": []}', "agents"),
        ('{"agents": ["END", "alice"]}', "END"),
        ('{"agents": ["alice"], "phase": "party"}', "phase"),
        ('{"agents": ["zed"]}', "unknown agent 'zed'"),
    ],
)
def test_invalid_answers_say_what_is_wrong(text: str, error: str) -> None:
    """An answer that is not a valid decision raises an error naming the problem (fed back to the model)."""
    with pytest.raises(AnswerError, match=error):
        parse_routing_answer(text, ["alice", "bob"])


async def test_a_message_p_tagging_the_orchestrator_is_routed_not_answered(cast: Cast) -> None:
    """The orchestrator p-tagged is asked for a decision; it never runs as a chat agent nor publishes a reply."""
    model = answers('{"agents": ["bob"], "reason": "bob knows"}')
    rig = make_rig(cast, model, bob=replies("here"))

    result = await rig.dispatcher.handle(
        cast.user_says("Who?", kind=11, tags=[["p", cast.orchestrator.pubkey]])
    )
    await settle(rig)

    assert (result.outcome, result.agents) == (Outcome.SCHEDULED, ("bob",))
    assert len(model.requests) == 1
    assert [e.pubkey for e in rig.publisher.published] == [cast.bob.pubkey]


async def test_a_follow_up_after_end_reaches_an_agent(cast: Cast) -> None:
    """END in answer to a person's message is fed back quoting that message; the agent it names answers."""
    model = answers(
        '{"agents": ["alice"], "reason": "build"}',
        '{"agents": ["END"], "reason": "done"}',
        '{"agents": ["END"], "reason": "still done"}',
        '{"agents": ["bob"], "reason": "bob paints"}',
    )
    bob = replies("Painted red.")
    rig = make_rig(cast, model, alice=completes("built"), bob=bob)
    root = cast.user_says("Build a shed", kind=11)
    await rig.dispatcher.handle(root)
    await settle(rig)
    assert rig.after_reply[-1].reason == RoutingStop.END.value

    follow = await rig.dispatcher.handle(cast.user_says("Now paint it red", tags=thread(root)))
    await settle(rig)

    assert (follow.outcome, follow.agents) == (Outcome.SCHEDULED, ("bob",))
    feedback = model.requests[3].messages[-1]
    assert isinstance(feedback, ChatMessage)
    assert "END is not possible" in feedback.content
    assert '"Now paint it red"' in feedback.content
    assert len(bob.requests) == 1


async def test_a_plain_reply_is_not_a_completion(cast: Cast) -> None:
    """A routed agent answering without `complete` does not complete its part of the turn (docs/CONTEXT.md):
    the turn waits for a real completion and nothing is routed on the plain reply."""
    model = answers('{"agents": ["alice", "bob"], "reason": "both"}', '{"agents": ["END"], "reason": "done"}')
    rig = make_rig(cast, model, alice=completes("alice done"), bob=replies("I only talk"))
    root = cast.user_says("Two things", kind=11)

    await rig.dispatcher.handle(root)
    await settle(rig)

    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    [turn] = conversation.orchestrator_turns
    assert [c.agent for c in turn.completions] == ["alice"]
    assert not turn.is_completed
    assert len(model.requests) == 1
    assert RoutingStop.TURN_WAITING.value in [r.reason for r in rig.after_reply]


async def test_a_directly_addressed_agents_completion_goes_back_to_the_person(cast: Cast) -> None:
    """An agent the person p-tagged who calls `complete` answers them: no turn routed it, so the
    orchestrator's model is not asked to route the work again."""
    model = answers('{"agents": ["alice"], "reason": "redo"}')
    bob = completes("reviewed")
    rig = make_rig(cast, model, bob=bob)

    await rig.dispatcher.handle(cast.user_says("Bob, review", kind=11, tags=[["p", cast.bob.pubkey]]))
    await settle(rig)

    assert len(bob.requests) == 1
    assert model.requests == []
    assert [(r.outcome, r.reason) for r in rig.after_reply] == [(Outcome.STORED, RoutingStop.NOT_ROUTED.value)]


async def test_a_late_completion_does_not_close_the_turn_that_superseded_its_own(cast: Cast) -> None:
    """A completion answering an earlier turn's trigger is not counted in the newer turn; one answering
    the newer turn's trigger is."""
    manager = ConversationManager(MemoryStore(), cast.agents, cast.project.pubkey, clock=FakeClock())
    root = cast.user_says("First ask", kind=11)
    await manager.create_conversation(root)
    await manager.start_orchestrator_turn(root.id, Phase.CHAT, ["alice"], "first", trigger_id=root.id)
    second = cast.user_says("Second ask", tags=thread(root))
    await manager.add_event(root.id, second)
    await manager.start_orchestrator_turn(root.id, Phase.CHAT, ["alice"], "second", trigger_id=second.id)

    complete = [TAG_TOOL, TOOL_COMPLETE]
    late = cast.alice_says("first done", tags=[*thread(root), ["e", root.id], complete])
    fresh = cast.alice_says("second done", tags=[*thread(root), ["e", second.id], complete])
    await manager.add_event(root.id, late)
    conversation = await manager.get_conversation(root.id)
    assert conversation is not None
    assert conversation.orchestrator_turns[-1].completions == []
    await manager.add_event(root.id, fresh)

    conversation = await manager.get_conversation(root.id)
    assert conversation is not None
    newest = conversation.orchestrator_turns[-1]
    assert [(c.agent, c.message) for c in newest.completions] == [("alice", "second done")]
    assert newest.is_completed
    superseded = conversation.orchestrator_turns[0]  # the late one is kept where it belongs, shown in history
    assert [(c.agent, c.message) for c in superseded.completions] == [("alice", "first done")]


class HeldCompleter:
    """An agent backend calling `complete` with "<n>: done" at its n-th run; its first run waits for
    ``release``; a tool result gets a plain answer."""

    name = "held"

    def __init__(self) -> None:
        self.runs = 0
        self.asked = asyncio.Event()
        self.release = asyncio.Event()

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Complete (the first run once released), or answer after the tool's result."""
        if request.messages and not isinstance(request.messages[-1], ChatMessage):
            return CompletionResult(text="ok", model="held")
        self.runs += 1
        if self.runs == 1:
            self.asked.set()
            await self.release.wait()
        return calls((f"c{self.runs}", "complete", {"summary": f"{self.runs}: done"}))


async def test_an_agents_completion_of_a_turn_superseded_while_it_worked_reaches_the_orchestrator(
    cast: Cast,
) -> None:
    """The person writes again while the routed agent works: the newer message's turn supersedes the
    first, and the agent's completion of the first, saved later, is shown in that turn's routing history
    when the orchestrator decides next (not lost, not counted in the newer turn)."""
    alice = HeldCompleter()
    orchestrator = ScriptedBackend(
        [text('{"agents": ["alice"], "reason": "one"}'), text('{"agents": ["bob"], "reason": "two"}')]
        + [text('{"agents": ["END"], "reason": "done"}')] * 2
    )
    rig = make_rig(cast, orchestrator, alice=alice)
    root = cast.user_says("task one", kind=11)
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(alice.asked.wait(), 5)
    await rig.dispatcher.handle(cast.user_says("task two", tags=[*thread(root), ["e", root.id]]))

    alice.release.set()
    await settle(rig)

    third = routing_contexts(orchestrator)[2]
    shown = [(t["agents"], [c["message"] for c in t["completions"]]) for t in third["routing_history"]]
    assert shown == [(["alice"], ["1: done"]), (["bob"], ["done"])]


async def test_in_a_kind_1_thread_a_reply_to_a_later_message_does_not_close_the_roots_turn(cast: Cast) -> None:
    """A kind-1 reply names the thread's root in every reply: a completion answering a later message does
    not close the turn the root triggered; one answering the root does."""
    manager = ConversationManager(MemoryStore(), cast.agents, cast.project.pubkey, clock=FakeClock())
    root = cast.user_says("First ask", kind=1)
    await manager.create_conversation(root)
    await manager.start_orchestrator_turn(root.id, Phase.CHAT, ["alice"], "first", trigger_id=root.id)
    later = cast.user_says("Also this", kind=1, tags=[["e", root.id, "", "root"]])
    await manager.add_event(root.id, later)

    done = ReplyDetails(complete=True)
    to_later = cast.alice_says("later done", kind=1, tags=build_agent_reply(later, [], root=root, details=done)[1])
    to_root = cast.alice_says("first done", kind=1, tags=build_agent_reply(root, [], root=root, details=done)[1])
    assert ["e", root.id, "", "root"] in to_later.tags  # the root is named: the old check counted that
    await manager.add_event(root.id, to_later)
    conversation = await manager.get_conversation(root.id)
    assert conversation is not None
    assert conversation.orchestrator_turns[-1].completions == []
    await manager.add_event(root.id, to_root)

    conversation = await manager.get_conversation(root.id)
    assert conversation is not None
    turn = conversation.orchestrator_turns[-1]
    assert [(c.agent, c.message) for c in turn.completions] == [("alice", "first done")]
    assert turn.is_completed


@dataclass
class SlowModel:
    """An orchestrator model that thinks a while and records how many calls overlap."""

    name: str = "slow"
    running: int = 0
    most: int = 0
    requests: list[CompletionRequest] = field(default_factory=list)

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Route to Alice after a pause."""
        self.requests.append(request)
        self.running += 1
        self.most = max(self.most, self.running)
        await asyncio.sleep(0.05)
        self.running -= 1
        return CompletionResult(text='{"agents": ["alice"], "reason": "alice"}')


async def test_one_routing_at_a_time_per_conversation(cast: Cast) -> None:
    """Two messages routed at once in one conversation are decided one after the other, never together."""
    model = SlowModel()
    rig = make_rig(cast, model, alice=replies("ok"))
    root = cast.user_says("Start", kind=11)
    await rig.dispatcher.handle(root)
    one = cast.user_says("One", tags=thread(root))
    two = cast.user_says("Two", tags=thread(root))

    results = await asyncio.gather(rig.dispatcher.handle(one), rig.dispatcher.handle(two))
    await settle(rig)

    assert [r.outcome for r in results] == [Outcome.SCHEDULED, Outcome.SCHEDULED]
    assert (len(model.requests), model.most) == (3, 1)


async def test_a_foreign_agents_message_may_end_routing(cast: Cast) -> None:
    """END in answer to a message an agent wrote (an unknown author whose event carries agent-only tags: a
    foreign agent, invited by the owner) is taken at once: only a person's message must be answered, so the
    model is not asked again and no agent is sent to answer it."""
    model = answers('{"agents": ["END"], "reason": "agents talking among themselves"}')
    rig = make_rig(cast, model, whitelist=(cast.other_user.pubkey,))
    root = cast.user_says("Meet our agents", kind=11, tags=[["p", cast.other_user.pubkey]])  # invites it
    await rig.dispatcher.handle(root)

    foreign = cast.factory.event(cast.other_user, "I am another backend's agent", tags=[*thread(root), ["llm-model", "x"]])
    result = await rig.dispatcher.handle(foreign)
    await settle(rig)

    assert result.reason == RoutingStop.END.value
    assert len(model.requests) == 1


async def test_a_completion_answering_a_direct_message_after_a_closed_turn_goes_back_to_the_person(
    cast: Cast,
) -> None:
    """Alice closed the routed turn and the orchestrator stopped there (a repeated decision); the person then
    addresses Alice directly and her completion answers them: it is not routed again (the closed turn
    was not answered by it), so the orchestrator's model is not asked and Bob never runs."""
    model = answers('{"agents": ["alice"], "reason": "build"}', '{"agents": ["alice"], "reason": "again"}',
                    '{"agents": ["bob"], "reason": "review"}')
    bob = completes("reviewed")
    rig = make_rig(cast, model, alice=completes("built", "detail added"), bob=bob)
    root = cast.user_says("Build it", kind=11)
    await rig.dispatcher.handle(root)
    await settle(rig)
    assert rig.after_reply[-1].reason == RoutingStop.REPEATED_DECISION.value
    asked = len(model.requests)

    direct = cast.user_says("Alice, one more detail", tags=[*thread(root), ["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(direct)
    await settle(rig)

    assert len(model.requests) == asked
    assert bob.requests == []
    assert (rig.after_reply[-1].outcome, rig.after_reply[-1].reason) == (Outcome.STORED, RoutingStop.NOT_ROUTED.value)


class StoreGoneAfterACompletion(MemoryStore):
    """A store whose next load fails once (a database restarting) right after Alice's completion is saved."""

    def __init__(self, alice: str) -> None:
        super().__init__()
        self.alice = alice
        self.failing = 0

    async def append_event(self, conversation_id: str, event: NostrEvent, **options: Any) -> bool:
        """Append; arm one failing load after Alice's completion."""
        added = await super().append_event(conversation_id, event, **options)
        if event.pubkey == self.alice and event.has_tag(TAG_TOOL, TOOL_COMPLETE):
            self.failing = 1
        return added

    async def load(self, conversation_id: str) -> Conversation | None:
        """Fail once when armed, else load."""
        if self.failing:
            self.failing -= 1
            raise ConnectionError("database restarting")
        return await super().load(conversation_id)


async def test_a_completion_whose_routing_meets_a_store_error_is_routed_on_the_retry(
    cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store fails for a moment while Alice's saved completion is being routed: the routing is tried
    again, so Bob, whom the orchestrator sends next, runs now (not only after the next start)."""
    monkeypatch.setattr(dispatcher_module, "DISPATCH_RETRY_S", (0.01, 0.01))
    model = answers('{"agents": ["alice"], "reason": "build"}', '{"agents": ["bob"], "reason": "review"}',
                    '{"agents": ["END"], "reason": "done"}')
    bob = completes("reviewed")
    store = StoreGoneAfterACompletion(cast.alice.pubkey)
    rig = make_rig(cast, model, bob=bob, store=store)

    await rig.dispatcher.handle(cast.user_says("Build it", kind=11))
    await settle(rig)

    assert store.failing == 0
    assert len(bob.requests) == 1
    assert rig.after_reply[-1].reason == RoutingStop.END.value


async def test_a_store_error_counting_the_orchestrators_tokens_does_not_throw_its_decision_away(
    cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saving the orchestrator's token counts fails (a store error for a moment): its valid decision, Bob,
    is still the one carried out, not rule-based routing's default agent."""
    model = ScriptedBackend([
        CompletionResult(text='{"agents": ["bob"], "reason": "review"}', model="scripted", prompt_tokens=9),
        CompletionResult(text='{"agents": ["END"], "reason": "done"}', model="scripted"),
    ])
    alice, bob = completes("built"), completes("reviewed")
    rig = make_rig(cast, model, alice=alice, bob=bob)
    counting = rig.manager.update_agent_state

    async def failing(conversation_id: str, slug: str, **changes: Any) -> Any:
        if slug == "orchestrator":
            raise ConnectionError("database restarting")
        return await counting(conversation_id, slug, **changes)

    monkeypatch.setattr(rig.manager, "update_agent_state", failing)
    await rig.dispatcher.handle(cast.user_says("Review it", kind=11))
    await settle(rig)

    assert (len(alice.requests), len(bob.requests)) == (0, 1)


async def test_a_completion_whose_run_failed_after_saving_it_is_routed_when_the_run_is_tried_again(
    cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alice's completion is saved, then its outbox write fails (the store gone for a moment): the run tried
    again publishes the saved completion and routes it, so Bob, whom the orchestrator sends next, runs now
    (not only after the next start)."""
    monkeypatch.setattr(runs_module, "RUN_RETRY_S", (0.01, 0.01))
    model = answers('{"agents": ["alice"], "reason": "build"}', '{"agents": ["bob"], "reason": "review"}',
                    '{"agents": ["END"], "reason": "done"}')
    bob = completes("reviewed")
    rig = make_rig(cast, model, bob=bob)
    add = rig.runner.outbox.add
    failed: list[str] = []

    async def failing_once(conversation_id: str, reply: NostrEvent, **options: Any) -> Any:
        if reply.pubkey == cast.alice.pubkey and not failed:
            failed.append(reply.id)
            raise ConnectionResetError("the store went away for a moment")
        return await add(conversation_id, reply, **options)

    monkeypatch.setattr(rig.runner.outbox, "add", failing_once)
    await rig.dispatcher.handle(cast.user_says("Build it", kind=11))
    await settle(rig)

    assert failed
    assert len(bob.requests) == 1
    assert rig.after_reply[-1].reason == RoutingStop.END.value


async def test_a_routed_agent_that_fails_completes_its_part_with_the_error(cast: Cast) -> None:
    """A routed agent whose backend fails answers with its error as its completion: the turn closes on the
    other agent's completion and is routed again with the error in it, instead of waiting for ever."""
    model = answers('{"agents": ["alice", "bob"], "phase": "execute", "reason": "both"}',
                    '{"agents": ["END"], "reason": "alice is down"}')
    rig = make_rig(cast, model, alice=FailingBackend(), bob=completes("bob built it"))
    root = cast.user_says("Build and test", kind=11)

    await rig.dispatcher.handle(root)
    await settle(rig)

    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    [turn] = conversation.orchestrator_turns
    assert turn.is_completed
    failed = next(c for c in turn.completions if c.agent == "alice")
    assert failed.message.startswith("I could not answer: the failing backend failed (rate_limit)")
    assert len(model.requests) == 2  # the closed turn was routed again: the orchestrator ended it
    second = routing_contexts(model)[1]
    assert "rate_limit" in json.dumps(second["routing_history"])


async def test_the_orchestrator_is_told_the_phase_an_agent_moved_the_conversation_to(cast: Cast) -> None:
    """An agent's `switch_phase` within a turn moves the conversation past the phase its turn began in: the
    next routing request's system prompt ends with the phase it is in now, so the model judges its moves
    from it (each request told the phase of that moment)."""
    model = answers('{"agents": ["alice"], "phase": "execute", "reason": "build"}',
                    '{"agents": ["END"], "reason": "done"}')
    switch: dict[str, object] = {"phase": "verification", "reason": "built, now verify", "summary": "built"}
    alice = ScriptedBackend([calls(("s", "switch_phase", switch)), calls(("c", "complete", {"summary": "built"}))])
    rig = make_rig(cast, model, alice=alice)
    root = cast.user_says("Build it", kind=11)

    await rig.dispatcher.handle(root)
    await settle(rig)

    first, second = (request.system_prompt for request in model.requests)
    assert first.endswith("\n\nThe conversation is in the chat phase now.")
    assert second.endswith("\n\nThe conversation is in the verification phase now.")
    assert routing_contexts(model)[1]["routing_history"][0]["phase"] == "execute"  # where its turn began
