"""The tool loop of an agent run (complete, switch_phase, end_conversation, get_conversation), scripted."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import pytest

from tenex_daemon import ConversationManager, MemoryStore, NostrEvent
from tenex_daemon.adapters.llm.offline import OfflineBackend
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.llm import (
    AssistantToolCalls,
    BackendError,
    CompletionRequest,
    CompletionResult,
    LLMMessage,
    ToolCall,
    ToolResult,
)
from tenex_daemon.core.phases import Phase
from tenex_daemon.services.agent_runner import DEFAULT_TOOLS, AgentProfile, AgentRunner
from tenex_daemon.services.answering import CUT_NOTE
from tenex_daemon.services.runs import RunRequest
from tenex_daemon.testing.fakes import FakePublisher, RecordingRouting, ScriptedBackend
from tests import pipeline
from tests.conftest import Cast


def calls(*items: tuple[str, str, dict[str, object]]) -> CompletionResult:
    """A backend answer asking for tools: (call id, tool name, arguments) each."""
    return CompletionResult(
        text="", model="scripted", tool_calls=tuple(ToolCall(i, name, args) for i, name, args in items)
    )


def text(content: str) -> CompletionResult:
    """A backend answer with text only."""
    return CompletionResult(text=content, model="scripted", prompt_tokens=10, completion_tokens=5)


@dataclass
class Rig:
    """A manager, a runner with one scripted agent (Alice), and fake I/O."""

    manager: ConversationManager
    runner: AgentRunner
    publisher: FakePublisher
    backend: ScriptedBackend
    routing: RecordingRouting
    """Stands in for the dispatcher: the replies a run tells it about."""

    @property
    def hooked(self) -> list[NostrEvent]:
        """The saved replies the run told its routing about."""
        return self.routing.saved


def make_rig(cast: Cast, backend: ScriptedBackend | OfflineBackend, max_tool_rounds: int = 8) -> Rig:
    """The daemon's pipeline whose agents all think through ``backend``, with the real reply composer."""
    profiles = {
        a.slug: AgentProfile(a, "", backend, temperature=0.2, max_tokens=64)
        for a in cast.agents
    }
    base = pipeline.build_rig(
        cast, profiles=profiles, composer=pipeline.real_composer(cast), max_tool_rounds=max_tool_rounds
    )
    scripted = backend if isinstance(backend, ScriptedBackend) else ScriptedBackend([])
    return Rig(base.manager, base.runner, base.publisher, scripted, RecordingRouting())


async def start(rig: Rig, cast: Cast, content: str = "Hello Alice") -> NostrEvent:
    """Create a conversation whose root p-tags Alice; return the root."""
    root = cast.user_says(content, kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.manager.create_conversation(root)
    return root


async def run(
    rig: Rig, root: NostrEvent, trigger: NostrEvent | None = None, *, via_orchestrator: bool = False
) -> NostrEvent:
    """Run Alice on ``trigger`` (default: the root) and wait for the publication."""
    trigger = trigger or root
    request = RunRequest(root.id, trigger.id, "alice", via_orchestrator=via_orchestrator)
    reply = await rig.runner.run(request, rig.routing)
    assert reply is not None
    await rig.runner.flush(5.0)
    return reply


def tail_pairs(messages: Sequence[LLMMessage]) -> list[tuple[str, str]]:
    """(role, call ids) of the messages after the agent's context, for adjacency checks."""
    out = []
    for message in messages:
        if isinstance(message, AssistantToolCalls):
            out.append(("assistant", ",".join(c.id for c in message.tool_calls)))
        elif isinstance(message, ToolResult):
            out.append(("tool", message.tool_call_id))
    return out


async def test_tool_results_follow_their_calls_and_the_backend_is_asked_again(cast: Cast) -> None:
    """Each tool call runs and its result is sent right after the assistant message that asked for it."""
    backend = ScriptedBackend(
        [
            calls(("c1", "get_conversation", {"list_recent": True}), ("c2", "get_conversation", {})),
            calls(("c3", "switch_phase", {"phase": "plan", "reason": "needs a plan"})),
            text("Here is what I found."),
        ]
    )
    rig = make_rig(cast, backend)
    root = await start(rig, cast)

    reply = await run(rig, root)

    assert len(backend.requests) == 3
    first, last = backend.requests[0], backend.requests[-1]
    assert {spec.name for spec in first.tools} == {*DEFAULT_TOOLS, "send_message"}  # Bob can be asked
    assert list(last.messages[: len(first.messages)]) == list(first.messages)
    assert tail_pairs(last.messages[len(first.messages) :]) == [
        ("assistant", "c1,c2"), ("tool", "c1"), ("tool", "c2"), ("assistant", "c3"), ("tool", "c3"),
    ]
    assert not any(result.is_error for result in backend.tool_results())
    assert reply.content == "Here is what I found."
    assert not reply.has_tag("tool", "complete")
    assert rig.publisher.published == [reply]


async def test_profile_temperature_and_max_tokens_reach_every_request(cast: Cast) -> None:
    """The agent's configured temperature and max_tokens are sent with each backend call of the loop."""
    backend = ScriptedBackend([calls(("c1", "get_conversation", {})), text("ok")])
    rig = make_rig(cast, backend)
    root = await start(rig, cast)

    await run(rig, root)

    assert [(r.temperature, r.max_tokens) for r in backend.requests] == [(0.2, 64), (0.2, 64)]


async def test_complete_tags_the_reply_and_closes_the_agents_part_of_the_turn_once(cast: Cast) -> None:
    """`complete` ends the loop without another call; the reply is tagged, p-tags user and orchestrator, counts once."""
    backend = ScriptedBackend([calls(("c1", "complete", {"summary": "Wrote the plan."}))])
    rig = make_rig(cast, backend)
    root = cast.user_says("Plan it", kind=11)
    await rig.manager.create_conversation(root)
    await rig.manager.start_orchestrator_turn(root.id, Phase.CHAT, ["alice", "bob"], "both")

    reply = await run(rig, root, via_orchestrator=True)
    again = await run(rig, root, via_orchestrator=True)

    assert len(backend.requests) == 2  # one backend call per run: complete needs no second call
    assert reply.content == "Wrote the plan."
    assert reply.has_tag("tool", "complete")
    assert again.has_tag("tool", "complete")
    assert reply.tag_values("p") == [cast.user.pubkey, cast.orchestrator.pubkey]
    context = await rig.manager.build_orchestrator_routing_context(root.id)
    completions = context["current_routing"]["completions"]
    assert [(c["agent"], c["message"]) for c in completions] == [("alice", "Wrote the plan.")]
    assert context["routing_history"] == []


async def test_complete_without_summary_uses_the_models_text(cast: Cast) -> None:
    """With no summary, the text the model sent with its `complete` call is the reply."""
    answer = CompletionResult(text="All done here.", tool_calls=(ToolCall("c1", "complete", {}),))
    backend = ScriptedBackend([answer])
    rig = make_rig(cast, backend)
    root = await start(rig, cast)

    reply = await run(rig, root)

    assert reply.content == "All done here."
    assert reply.has_tag("tool", "complete")


async def test_switch_phase_changes_the_phase_with_reason_and_summary(cast: Cast) -> None:
    """An allowed `switch_phase` moves the conversation, records reason and summary, and the reply shows the phase."""
    backend = ScriptedBackend(
        [
            calls(("c1", "switch_phase", {"phase": "plan", "reason": "needs design", "summary": "wants a CLI"})),
            text("Moving to planning."),
        ]
    )
    rig = make_rig(cast, backend)
    root = await start(rig, cast)

    reply = await run(rig, root)

    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert conversation.phase is Phase.PLAN
    transition = conversation.phase_transitions[-1]
    assert (transition.agent_slug, transition.reason, transition.summary) == ("alice", "needs design", "wants a CLI")
    [result] = backend.tool_results()
    assert not result.is_error
    assert "chat to plan" in result.content
    assert reply.tag_values("phase") == ["plan"]


async def test_forbidden_phase_switch_is_reported_to_the_model(cast: Cast) -> None:
    """A transition the phase rules forbid leaves the phase alone and comes back as an error result."""
    backend = ScriptedBackend(
        [calls(("c1", "switch_phase", {"phase": "verification", "reason": "check"})), text("I stay in chat.")]
    )
    rig = make_rig(cast, backend)
    root = await start(rig, cast)

    reply = await run(rig, root)

    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert conversation.phase is Phase.CHAT
    [result] = backend.tool_results()
    assert result.is_error
    assert "verification" in result.content
    assert "execute" in result.content
    assert reply.content == "I stay in chat."
    assert not reply.has_tag("error", "system")


async def test_end_conversation_sends_the_reply_then_ends_it(cast: Cast) -> None:
    """`end_conversation` lets the reply go out, then ends the conversation (not archived) and records who and why."""
    backend = ScriptedBackend([calls(("c1", "end_conversation", {"reason": "user is done"})), text("Goodbye!")])
    rig = make_rig(cast, backend)
    root = await start(rig, cast)

    reply = await run(rig, root)

    assert rig.publisher.published == [reply]
    assert reply.content == "Goodbye!"
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert conversation.is_ended
    assert not conversation.archived
    assert conversation.history[-1].id == reply.id
    assert conversation.end_reason == "user is done"
    assert conversation.ended_by == "alice"
    assert rig.hooked == []  # an ended conversation's last reply targets nobody


async def test_unknown_tools_and_bad_arguments_become_error_results(cast: Cast) -> None:
    """An unknown tool, arguments that fail validation or are not JSON come back as errors; nothing takes effect."""
    backend = ScriptedBackend(
        [
            CompletionResult(
                text="",
                tool_calls=(
                    ToolCall("u1", "fly_to_moon", {}),
                    ToolCall("b1", "switch_phase", {"phase": "moon", "reason": "x"}),
                    ToolCall("b2", "switch_phase", {"phase": "plan"}),
                    ToolCall("j1", "complete", {}, invalid_arguments="{oops"),
                ),
            ),
            text("Sorry, answering plainly."),
        ]
    )
    rig = make_rig(cast, backend)
    root = await start(rig, cast)

    reply = await run(rig, root)

    results = backend.tool_results()
    assert [(r.tool_call_id, r.is_error) for r in results] == [
        ("u1", True), ("b1", True), ("b2", True), ("j1", True),
    ]
    assert "fly_to_moon" in results[0].content
    assert "complete" in results[0].content
    assert "unknown phase" in results[1].content
    assert "reason" in results[2].content
    assert "not a JSON object" in results[3].content
    assert reply.content == "Sorry, answering plainly."
    assert not reply.has_tag("tool", "complete")
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert conversation.phase is Phase.CHAT


async def test_a_backend_that_keeps_calling_tools_is_stopped_with_an_error_reply(cast: Cast) -> None:
    """At the round limit the run stops asking and sends a reply tagged as an error that says why."""
    backend = ScriptedBackend([calls(("c", "get_conversation", {}))])
    rig = make_rig(cast, backend, max_tool_rounds=3)
    root = await start(rig, cast)

    reply = await run(rig, root)

    assert len(backend.requests) == 3
    assert reply.has_tag("error", "system")
    assert "limit of 3" in reply.content
    assert rig.publisher.published == [reply]


async def failing_after_a_tool_round(cast: Cast, error: Exception) -> tuple[NostrEvent, Conversation]:
    """Run Alice with a backend whose first round calls a tool (40 prompt and 7 completion tokens) and whose
    second raises ``error``; return her reply and the conversation after it."""

    @dataclass
    class FailSecond(ScriptedBackend):
        async def complete(self, request: CompletionRequest) -> CompletionResult:
            if self.requests:
                raise error
            return await super().complete(request)

    first = replace(calls(("c1", "get_conversation", {})), prompt_tokens=40, completion_tokens=7)
    rig = make_rig(cast, FailSecond([first]))
    root = await start(rig, cast)
    reply = await run(rig, root)
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    return reply, conversation


async def test_backend_failure_inside_the_loop_becomes_an_error_reply(cast: Cast) -> None:
    """A backend that fails after a tool round still yields one saved error reply, the daemon's run ends
    cleanly, and the tokens the first round spent are still recorded."""

    reply, conversation = await failing_after_a_tool_round(cast, BackendError("timeout", "took too long"))

    assert reply.has_tag("error", "system")
    assert "(timeout)" in reply.content
    assert conversation.history[-1].id == reply.id
    state = conversation.agent_state("alice")
    assert (state.prompt_tokens, state.completion_tokens) == (40, 7)


async def test_an_empty_answer_becomes_an_error_reply_saying_so(cast: Cast) -> None:
    """A backend whose final answer is blank (a refusal without text, a content filter) gives no blank reply:
    the person gets one tagged as an error that says the backend's answer was empty and how it ended."""
    backend = ScriptedBackend([CompletionResult(text="  ", finish_reason="content_filter")])
    rig = make_rig(cast, backend)
    root = await start(rig, cast)

    reply = await run(rig, root)

    assert reply.has_tag("error", "system")
    assert reply.content == "I could not answer: the scripted backend gave an empty answer (it ended with 'content_filter')."
    assert rig.publisher.published == [reply]


async def test_an_internal_failure_inside_the_loop_keeps_the_tokens_spent(cast: Cast) -> None:
    """A backend that crashes with an unexpected error after a tool round yields an error reply, and the
    tokens the first round spent are recorded as for a backend's own error."""
    reply, conversation = await failing_after_a_tool_round(cast, RuntimeError("a stream broke, unmapped"))

    assert reply.has_tag("error", "system")
    assert "internal error (RuntimeError)" in reply.content
    state = conversation.agent_state("alice")
    assert (state.prompt_tokens, state.completion_tokens) == (40, 7)


async def test_a_backends_error_reply_shows_no_piece_of_a_key_or_an_account_id(cast: Cast) -> None:
    """The provider's error text goes into the (maybe public) error reply without what it shows of a key
    (OpenAI's 401 names it masked) or of an account (a 429's organisation id); the rest of it stays."""
    said = "openai: HTTP 401: Incorrect API key provided: sk-proj-abc1***wxyz. Organization org-Xy12ab34 used."
    reply, _ = await failing_after_a_tool_round(cast, BackendError("auth", said))

    assert reply.has_tag("error", "system")
    assert "sk-proj" not in reply.content
    assert "org-Xy12" not in reply.content
    assert "Incorrect API key provided: <redacted>. Organization <redacted> used." in reply.content


async def test_offline_backend_answers_as_before_with_tools_offered(cast: Cast) -> None:
    """The offline backend calls no tool: one call, its text is the reply, unchanged and untagged."""
    rig = make_rig(cast, OfflineBackend())
    root = await start(rig, cast)

    reply = await run(rig, root)

    assert reply.content == "Alice (offline backend) received 1 message. Latest: Hello Alice"
    assert not reply.has_tag("tool", "complete")
    assert not reply.has_tag("error", "system")
    assert reply.tag_values("llm-model") == ["offline"]


def test_profiles_naming_unknown_tools_are_refused(cast: Cast) -> None:
    """A profile offering a tool the registry does not have is a configuration error at start."""
    profile = AgentProfile(cast.alice, "", OfflineBackend(), tools=("complete", "teleport"))
    with pytest.raises(ValueError, match="teleport"):
        pipeline.build_rig(cast, profiles={"alice": profile}, agents=[cast.alice])


class CountingStore(MemoryStore):
    """A memory store that records every write it is asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    async def append_event(
        self, conversation_id: str, event: NostrEvent, *, state: Conversation | None = None
    ) -> bool:
        """Record the append (and whether it carried a state)."""
        self.writes.append("append+state" if state is not None else "append")
        return await super().append_event(conversation_id, event, state=state)

    async def save_state(self, conversation: Conversation) -> None:
        """Record the save."""
        self.writes.append("save_state")
        await super().save_state(conversation)

    async def set_meta(self, key: str, value: str) -> None:
        """Record the small value."""
        self.writes.append(f"set_meta:{key}")
        await super().set_meta(key, value)


async def test_a_reply_and_what_its_run_changed_are_one_durable_write(cast: Cast) -> None:
    """An agent run writes its reply once, together with the agent's processed index, its new session, its
    token usage and the run's working time (nothing is written before the reply); the only other write is
    the outbox's record that the reply waits for a relay."""
    store = CountingStore()
    backend = ScriptedBackend([
        CompletionResult(text="Hi!", model="scripted", session_id="sess-7", prompt_tokens=10, completion_tokens=5)
    ])
    profiles = {a.slug: AgentProfile(a, "", backend) for a in cast.agents}
    rig = pipeline.build_rig(cast, profiles=profiles, store=store, composer=pipeline.real_composer(cast))
    root = cast.user_says("Hello Alice", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.manager.create_conversation(root)
    rig.clock.advance(1_000)
    store.writes.clear()

    async def slow_answer(request: CompletionRequest) -> CompletionResult:
        rig.clock.advance(2_000)  # the model thinks for two seconds
        return await ScriptedBackend.complete(backend, request)

    backend.complete = slow_answer  # type: ignore[method-assign]
    reply = await rig.runner.run(RunRequest(root.id, root.id, "alice"))

    assert reply is not None
    assert store.writes == ["append+state", "set_meta:outbox.pending"]
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    state = conversation.agent_states["alice"]
    assert (state.last_processed_index, state.session_id) == (1, "sess-7")
    assert (state.prompt_tokens, state.completion_tokens) == (10, 5)
    assert conversation.execution_time.total_seconds == 2
    assert not conversation.execution_time.is_active
    assert reply.tag_value("net-time") == "2"  # the tag counts the run that the reply ends
    assert [e.id for e in conversation.history] == [root.id, reply.id]


class FailingAppendStore(CountingStore):
    """A memory store whose next append fails (a full disk, say)."""

    fail_next = True

    async def append_event(
        self, conversation_id: str, event: NostrEvent, *, state: Conversation | None = None
    ) -> bool:
        """Fail once, then append."""
        if self.fail_next:
            self.fail_next = False
            raise OSError(28, "No space left on device")
        return await super().append_event(conversation_id, event, state=state)


async def test_a_reply_that_cannot_be_saved_changes_nothing_and_its_time_counts_once(cast: Cast) -> None:
    """When saving the reply fails, the agent's processed index, session and tokens stay as they were
    (in memory too) and the run's working time is counted once."""
    store = FailingAppendStore()
    backend = ScriptedBackend([
        CompletionResult(text="Hi!", model="scripted", session_id="sess-7", prompt_tokens=10, completion_tokens=5)
    ])
    profiles = {a.slug: AgentProfile(a, "", backend) for a in cast.agents}
    rig = pipeline.build_rig(cast, profiles=profiles, store=store)
    root = cast.user_says("Hello Alice", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.manager.create_conversation(root)

    async def slow_answer(request: CompletionRequest) -> CompletionResult:
        rig.clock.advance(3_000)
        return await ScriptedBackend.complete(backend, request)

    backend.complete = slow_answer  # type: ignore[method-assign]
    with pytest.raises(OSError, match="No space"):
        await rig.runner.run(RunRequest(root.id, root.id, "alice"))

    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert "alice" not in conversation.agent_states
    assert conversation.execution_time.total_seconds == 3
    assert [e.id for e in conversation.history] == [root.id]


@pytest.mark.parametrize("reason", ["length", "max_tokens"])
async def test_an_answer_cut_at_the_length_limit_says_so(cast: Cast, reason: str) -> None:
    """An answer the model was cut off in at its length limit (OpenAI's "length", Anthropic's "max_tokens")
    is published with a note saying it is not whole, after a tool round too; a finished one has none."""
    cut = CompletionResult(text="The plan has three steps: first ", finish_reason=reason)
    rig = make_rig(cast, ScriptedBackend([calls(("c1", "get_conversation", {})), cut, text("Whole.")]))
    root = await start(rig, cast)

    reply = await run(rig, root)
    assert reply.content == "The plan has three steps: first" + CUT_NOTE
    assert not reply.has_tag("error", "system")
    second = cast.user_says("More?", tags=[["E", root.id], ["p", cast.alice.pubkey]])
    await rig.manager.add_event(root.id, second)
    assert (await run(rig, root, second)).content == "Whole."
