"""Token budgets in agent runs: what each backend call is sent, summaries stored and extended, retries."""

from __future__ import annotations

from dataclasses import dataclass, field

from tenex_daemon import ConversationManager, NostrEvent
from tenex_daemon.core.budget import (
    SUMMARIZER_PROMPT,
    BudgetStrategy,
    TokenBudget,
    estimate_tokens,
    summary_message,
    summary_request,
    total_tokens,
    truncation_note,
)
from tenex_daemon.core.context import NEW_INTERACTION, WHILE_AWAY_HEADER, AgentContext, ChatMessage
from tenex_daemon.core.llm import (
    AssistantToolCalls,
    BackendError,
    CompletionRequest,
    CompletionResult,
    ContextTooLongError,
    LLMMessage,
    ToolCall,
    ToolResult,
)
from tenex_daemon.services.agent_runner import AgentProfile, AgentRunner
from tenex_daemon.services.runs import RunRequest
from tenex_daemon.services.token_budget import RunBudget
from tests import pipeline
from tests.conftest import Cast
from tests.unit.services.test_tool_loop import calls, text


@dataclass
class RecordingBackend:
    """Answers summary calls from ``summaries`` and agent calls from ``script``; records both.

    The first ``too_long`` agent calls fail with ContextTooLongError, as a provider whose window is full.
    """

    script: list[CompletionResult] = field(default_factory=lambda: [text("ok")])
    summaries: list[str | BackendError] = field(default_factory=list)
    too_long: int = 0
    name: str = "scripted"
    requests: list[CompletionRequest] = field(default_factory=list)
    summary_requests: list[CompletionRequest] = field(default_factory=list)

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Return the next scripted answer (or summary), or fail as configured."""
        if request.system_prompt == SUMMARIZER_PROMPT:
            self.summary_requests.append(request)
            answer = self.summaries[len(self.summary_requests) - 1]
            if isinstance(answer, BackendError):
                raise answer
            return CompletionResult(text=answer, prompt_tokens=7, completion_tokens=3)
        self.requests.append(request)
        if len(self.requests) <= self.too_long:
            raise ContextTooLongError(message="prompt is too long: 9000 tokens > 8192 maximum")
        index = min(len(self.requests) - self.too_long, len(self.script)) - 1
        return self.script[index]

    def sent(self, index: int = -1) -> list[LLMMessage]:
        """The messages of one agent call (default: the last)."""
        return list(self.requests[index].messages)


@dataclass
class Rig:
    """A manager and a runner whose agents think through one recording backend under one budget."""

    manager: ConversationManager
    runner: AgentRunner
    backend: RecordingBackend
    persona: str


INSTRUCTIONS = "You are an agent of a TENEX team."
"""Instructions that make Alice's persona 13 tokens and Bob's 12 (characters/4): the sizes the expected
cuts of these tests are counted with."""


def make_rig(cast: Cast, backend: RecordingBackend, budget: TokenBudget | None) -> Rig:
    """The daemon's pipeline whose agents all think through ``backend`` under ``budget``."""
    profiles = {a.slug: AgentProfile(a, INSTRUCTIONS, backend, budget=budget) for a in cast.agents}
    base = pipeline.build_rig(cast, profiles=profiles, composer=pipeline.real_composer(cast))
    return Rig(base.manager, base.runner, backend, profiles["alice"].system_prompt)


def line(tag: str) -> str:
    """Content of exactly 10 tokens (40 characters) that starts with ``tag``."""
    return tag.ljust(40, ".")


async def conversation(rig: Rig, cast: Cast, exchanges: int) -> NostrEvent:
    """A user's root to Alice, then ``exchanges`` of Alice answering and the user replying; return the root."""
    root = cast.user_says(line("root"), kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.manager.create_conversation(root)
    await more(rig, cast, root, exchanges)
    return root


async def more(rig: Rig, cast: Cast, root: NostrEvent, exchanges: int, start: int = 0) -> None:
    """Add ``exchanges`` more Alice-then-user pairs."""
    for i in range(start, start + exchanges):
        await rig.manager.add_event(root.id, cast.alice_says(line(f"alice {i}")))
        await rig.manager.add_event(root.id, cast.user_says(line(f"user {i}")))


async def trigger_alice(rig: Rig, cast: Cast, root: NostrEvent, content: str = "trigger") -> list[LLMMessage]:
    """Add the user's next message, mark all before it seen (no while-away block), return Alice's full view."""
    trigger = cast.user_says(line(content))
    await rig.manager.add_event(root.id, trigger)
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    await rig.manager.update_agent_state(root.id, "alice", last_processed_index=len(conversation.history) - 1)
    context = await rig.manager.preview_agent_messages(root.id, "alice", trigger)
    return list(context.messages)


async def run(rig: Rig, root: NostrEvent, agent: str = "alice") -> NostrEvent:
    """Run ``agent`` on the newest event and wait for the publication."""
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    reply = await rig.runner.run(RunRequest(root.id, conversation.history[-1].id, agent))
    assert reply is not None
    await rig.runner.flush(5.0)
    return reply


async def test_under_budget_the_backend_gets_exactly_the_built_messages(cast: Cast) -> None:
    """A conversation that fits its budget is sent exactly as built: no note, no summary, no summary call."""
    rig = make_rig(cast, RecordingBackend(), TokenBudget.of_window(10_000, strategy=BudgetStrategy.SUMMARIZE))
    root = await conversation(rig, cast, 6)
    full = await trigger_alice(rig, cast, root)

    await run(rig, root)

    assert rig.backend.sent() == full
    assert rig.backend.summary_requests == []


async def test_over_budget_sliding_window_sends_first_message_note_and_newest(cast: Cast) -> None:
    """Over a 100-token window (80-token budget) the run sends the root, a note counting the cut, the newest that fit."""
    rig = make_rig(cast, RecordingBackend(), TokenBudget.of_window(100))
    root = await conversation(rig, cast, 6)
    full = await trigger_alice(rig, cast, root)  # root, 12 exchanges' messages, trigger

    await run(rig, root)

    sent = rig.backend.sent()
    assert sent == [full[0], truncation_note(9), *full[10:]]
    assert sent[1] == ChatMessage("system", "[Note: 9 older messages truncated to stay within token limit]")
    assert total_tokens(rig.persona, sent, estimate_tokens) <= 80


async def test_while_away_block_marker_and_trigger_survive_a_tiny_budget(cast: Cast) -> None:
    """Bob p-tagged mid-conversation under a tiny budget still gets his while-away block, the marker and the trigger."""
    rig = make_rig(cast, RecordingBackend(), TokenBudget.of_window(60))
    root = await conversation(rig, cast, 5)
    trigger = cast.user_says("Bob, your view?", tags=[["p", cast.bob.pubkey]])
    await rig.manager.add_event(root.id, trigger)
    full = (await rig.manager.preview_agent_messages(root.id, "bob", trigger)).messages

    await run(rig, root, agent="bob")

    sent = rig.backend.sent()
    assert sent == [full[0], truncation_note(len(full) - 4), *full[-3:]]
    block, marker, last = sent[-3:]
    assert isinstance(block, ChatMessage)
    assert block.content.startswith(WHILE_AWAY_HEADER)
    assert marker == ChatMessage("system", NEW_INTERACTION)
    assert last == ChatMessage("user", "Bob, your view?")


async def test_the_budget_is_applied_before_each_call_of_the_tool_loop(cast: Cast) -> None:
    """A tool result that overflows the budget cuts history on the next call; the tool call and result stay together."""
    backend = RecordingBackend()
    rig = make_rig(cast, backend, TokenBudget.of_window(300))
    root = await conversation(rig, cast, 6)
    full = await trigger_alice(rig, cast, root)
    backend.script = [calls(("c1", "get_conversation", {"id": root.id})), text("done")]

    reply = await run(rig, root)

    first, second = backend.sent(0), backend.sent(1)
    assert first == full
    call, result = second[-2:]
    assert isinstance(call, AssistantToolCalls)
    assert [c.id for c in call.tool_calls] == ["c1"]
    assert isinstance(result, ToolResult)
    assert result.tool_call_id == "c1"
    assert total_tokens(rig.persona, [*full, call, result], estimate_tokens) > 240
    assert second[0] == full[0]
    assert second[1] == truncation_note(len(full) - (len(second) - 3))
    assert second[-3] == full[-1]  # the trigger
    assert reply.content == "done"


async def test_summarize_replaces_the_cut_by_a_summary_and_extends_it_next_turn(cast: Cast) -> None:
    """The first summary covers the cut history; next turn the summary call gets the old summary and only the new cut."""
    backend = RecordingBackend(summaries=["S1: they planned.", "S2: they planned and built."])
    rig = make_rig(cast, backend, TokenBudget.of_window(200, strategy=BudgetStrategy.SUMMARIZE))
    root = await conversation(rig, cast, 10)
    full = await trigger_alice(rig, cast, root)

    await run(rig, root)

    state = (await rig.manager.get_conversation(root.id)).agent_states["alice"]  # type: ignore[union-attr]
    covers = state.summary_covers
    assert state.summary == "S1: they planned."
    assert covers == 14
    assert [r.messages for r in backend.summary_requests] == [
        (ChatMessage("user", summary_request(None, full[1:covers])),)
    ]
    assert backend.sent() == [full[0], summary_message("S1: they planned."), *full[covers:]]
    assert backend.sent()[1] == ChatMessage("system", "Previous conversation summary: S1: they planned.")
    assert state.prompt_tokens == 10 + 7  # the summary call's tokens count as the run's

    await more(rig, cast, root, 1, start=10)
    full = await trigger_alice(rig, cast, root, "second trigger")
    await run(rig, root)

    state = (await rig.manager.get_conversation(root.id)).agent_states["alice"]  # type: ignore[union-attr]
    extended = state.summary_covers
    assert extended > covers
    assert state.summary == "S2: they planned and built."
    second = backend.summary_requests[1].messages
    assert second == (ChatMessage("user", summary_request("S1: they planned.", full[covers:extended])),)
    assert isinstance(second[0], ChatMessage)
    assert second[0].content.startswith("The summary so far:\nS1: they planned.")
    assert line("alice 0") not in second[0].content  # summarized the first time: never sent again
    assert backend.sent() == [full[0], summary_message("S2: they planned and built."), *full[extended:]]


async def test_a_failed_summary_falls_back_to_the_sliding_window(cast: Cast) -> None:
    """When the summary call fails the run sends the sliding-window cut with its note, and stores no summary."""
    backend = RecordingBackend(summaries=[BackendError("unreachable", "connection refused")])
    rig = make_rig(cast, backend, TokenBudget.of_window(100, strategy=BudgetStrategy.SUMMARIZE))
    root = await conversation(rig, cast, 6)
    full = await trigger_alice(rig, cast, root)

    reply = await run(rig, root)

    assert len(backend.summary_requests) == 1
    assert backend.sent() == [full[0], truncation_note(9), *full[10:]]
    state = (await rig.manager.get_conversation(root.id)).agent_states["alice"]  # type: ignore[union-attr]
    assert state.summary is None
    assert reply.content == "ok"


async def test_context_too_long_is_retried_with_half_a_quarter_and_none_of_the_middle(cast: Cast) -> None:
    """A provider that keeps answering context-too-long gets 10, 7, 5, then 3 messages; then the run replies with the error."""
    backend = RecordingBackend(too_long=4)
    rig = make_rig(cast, backend, None)
    root = await conversation(rig, cast, 4)
    full = await trigger_alice(rig, cast, root)  # root, 8 middle messages, trigger

    reply = await run(rig, root)

    assert [len(r.messages) for r in backend.requests] == [10, 7, 5, 3]
    assert backend.sent(1) == [full[0], truncation_note(4), *full[5:]]
    assert backend.sent(2) == [full[0], truncation_note(6), *full[7:]]
    assert backend.sent(3) == [full[0], truncation_note(8), full[-1]]
    assert reply.content.startswith("I could not answer: the scripted backend failed (context_too_long)")
    assert reply.has_tag("error", "system")


async def test_a_retry_that_fits_is_the_answer(cast: Cast) -> None:
    """When the quarter-middle retry fits, its answer is the reply and no further try is made."""
    backend = RecordingBackend(too_long=2)
    rig = make_rig(cast, backend, None)
    root = await conversation(rig, cast, 4)
    await trigger_alice(rig, cast, root)

    reply = await run(rig, root)

    assert [len(r.messages) for r in backend.requests] == [10, 7, 5]
    assert reply.content == "ok"
    assert not reply.has_tag("error", "system")


async def test_retries_shrink_what_the_budget_kept(cast: Cast) -> None:
    """Retries take shares of the middle the budgeted first try sent, not of the whole history."""
    backend = RecordingBackend(too_long=1)
    rig = make_rig(cast, backend, TokenBudget.of_window(125))  # 100 tokens: 5 middle messages fit
    root = await conversation(rig, cast, 6)
    full = await trigger_alice(rig, cast, root)

    await run(rig, root)

    first, retry = backend.sent(0), backend.sent(1)
    assert first == [full[0], truncation_note(7), *full[8:]]
    assert retry == [full[0], truncation_note(10), *full[11:]]  # half of 5, rounded down: 2


async def test_a_retry_after_a_summary_keeps_it_and_notes_what_else_it_cut(cast: Cast) -> None:
    """A context-too-long retry of a summarized run keeps the summary and adds a note for the further cut."""
    backend = RecordingBackend(summaries=["S1"], too_long=1)
    rig = make_rig(cast, backend, TokenBudget.of_window(200, strategy=BudgetStrategy.SUMMARIZE))
    root = await conversation(rig, cast, 10)
    full = await trigger_alice(rig, cast, root)

    await run(rig, root)

    assert backend.sent(0) == [full[0], summary_message("S1"), *full[14:]]
    assert backend.sent(1) == [full[0], summary_message("S1"), truncation_note(4), *full[18:]]
    assert len(backend.summary_requests) == 1


async def test_a_summary_covering_more_than_an_older_view_is_not_redone(cast: Cast) -> None:
    """A run whose view is shorter than the stored summary's coverage cuts by sliding window, asking no summary."""
    backend = RecordingBackend(summaries=["never"])
    messages: list[ChatMessage] = [
        ChatMessage("user" if i % 2 == 0 else "assistant", line(f"m{i}")) for i in range(9)
    ]
    context = AgentContext(messages, None, 9, protected=(8,), summary="S", summary_covers=20)

    async def save(_summary: str, _covers: int) -> None:
        raise AssertionError("nothing is stored")

    budget = RunBudget(
        context,
        "",
        TokenBudget(60, BudgetStrategy.SUMMARIZE),
        backend,
        "alice",
        "Alice",
        save,
    )

    fitted = await budget.fit(messages)

    assert fitted == [messages[0], truncation_note(5), *messages[6:]]
    assert backend.summary_requests == []


async def test_a_note_stands_at_each_place_messages_were_cut_in_a_tool_loop(cast: Cast) -> None:
    """When the run's own earlier tool call and result are left out (after its trigger) along with older
    history, each cut gets its own note where it was made: the tool call's after the trigger, counting it
    and its result (before, one note before the trigger counted both cuts)."""
    backend = RecordingBackend()
    rig = make_rig(cast, backend, TokenBudget.of_window(300))
    root = await conversation(rig, cast, 6)
    full = await trigger_alice(rig, cast, root)
    backend.script = [
        calls(("c1", "get_conversation", {"id": root.id})),
        calls(("c2", "get_conversation", {"id": root.id})),
        text("done"),
    ]

    await run(rig, root)

    third = backend.sent(2)
    trigger_at = third.index(full[-1])
    after = third[trigger_at + 1:]
    called = [c.id for m in after if isinstance(m, AssistantToolCalls) for c in m.tool_calls]
    assert called == ["c2"]
    assert after[0] == truncation_note(2)  # c1's call and result, cut where they were
    notes = [m for m in third[:trigger_at] if isinstance(m, ChatMessage) and m.content.startswith("[Note:")]
    history_left_out = [m for m in full[:-1] if m not in third]
    assert notes == [truncation_note(len(history_left_out))]  # the older history's own cut, counting it only


async def test_a_summary_calls_tokens_count_when_the_call_after_it_fails(cast: Cast) -> None:
    """The summary is made and stored, then every try of the agent's call is refused as too long: the run
    ends in its error reply, and the summary call's tokens still count as the run's (they were spent)."""
    backend = RecordingBackend(summaries=["S1"], too_long=9)
    rig = make_rig(cast, backend, TokenBudget.of_window(200, strategy=BudgetStrategy.SUMMARIZE))
    root = await conversation(rig, cast, 10)
    await trigger_alice(rig, cast, root)

    reply = await run(rig, root)

    state = (await rig.manager.get_conversation(root.id)).agent_states["alice"]  # type: ignore[union-attr]
    assert reply.has_tag("error", "system")
    assert state.summary == "S1"
    assert (state.prompt_tokens, state.completion_tokens) == (7, 3)


async def test_a_summary_longer_than_its_room_is_cut_so_what_is_sent_fits_the_budget() -> None:
    """The summary call answers three times the tokens it was allowed (a backend that ignores max_tokens, or
    counts its tokens otherwise): the summary is cut to the room the window kept for it, so the messages
    sent still fit the agent's budget."""

    class Wordy:
        name = "wordy"

        async def complete(self, request: CompletionRequest) -> CompletionResult:
            assert request.max_tokens is not None
            return CompletionResult(text="x" * (4 * 3 * request.max_tokens))

    messages = [ChatMessage("user", "root".ljust(40, "."))]
    messages += [ChatMessage("assistant" if i % 2 else "user", f"m{i}".ljust(40, ".")) for i in range(20)]
    messages.append(ChatMessage("user", "trigger".ljust(40, ".")))
    context = AgentContext(messages, None, len(messages), protected=(len(messages) - 1,))
    saved: list[tuple[str, int]] = []

    async def save(summary: str, covers: int) -> None:
        saved.append((summary, covers))

    budget = TokenBudget(100, BudgetStrategy.SUMMARIZE)
    sent = await RunBudget(context, "", budget, Wordy(), "alice", "Alice", save).fit(messages)

    assert saved
    assert total_tokens("", sent, estimate_tokens) <= budget.limit


async def test_a_burst_runs_summary_stands_only_for_history_in_its_own_order(cast: Cast) -> None:
    """A burst run for M2 sees Alice's answer to M1, saved after M2, placed before M2; when its budget cuts all
    of history, its summary stands only for what comes before M2 in history, up to M1, never that answer:
    the next run, which sees history in its own order, finds at those places the same messages."""
    backend = RecordingBackend(summaries=["S1"])
    rig = make_rig(cast, backend, None)
    manager = rig.manager
    root = await conversation(rig, cast, 3)
    m1, m2 = cast.user_says(line("M1")), cast.user_says(line("M2"))
    await manager.add_event(root.id, m1)
    await manager.add_event(root.id, m2)
    await manager.add_event(root.id, cast.alice_says(line("A1 answer to M1")))
    held = await manager.get_conversation(root.id)
    assert held is not None
    await manager.update_agent_state(root.id, "alice", last_processed_index=len(held.history) - 1)
    burst = await manager.preview_agent_messages(root.id, "alice", m2)

    async def save(summary: str, covers: int) -> None:
        await manager.update_agent_state(root.id, "alice", summary=(summary, covers))

    fitting = RunBudget(burst, "", TokenBudget(200, BudgetStrategy.SUMMARIZE), backend, "alice", "Alice", save)
    tool_round: list[LLMMessage] = [
        *burst.messages,
        AssistantToolCalls((ToolCall("c1", "get_conversation", {}),), ""),
        ToolResult("c1", "get_conversation", "z" * 560),
    ]
    await fitting.fit(tool_round)

    [summary_call] = backend.summary_requests
    assert "A1 answer" not in str(summary_call.messages[0])
    state = (await manager.get_conversation(root.id)).agent_states["alice"]  # type: ignore[union-attr]
    in_order = [m.content for m in burst.messages[: state.summary_covers]]
    assert in_order[-1] == m1.content  # up to M1, the newest message before M2 in history


async def test_a_stored_summary_reaching_past_a_bursts_history_in_order_is_not_used() -> None:
    """A stored summary covers more leading messages than a burst view holds in history's own order (its
    later messages stand where the summary's stood): the run cuts by the sliding window instead, so no
    message is hidden behind a summary that never covered it."""
    messages = [ChatMessage("user", line("root"))]
    messages += [ChatMessage("assistant" if i % 2 else "user", line(f"m{i}")) for i in range(12)]
    messages.append(ChatMessage("user", line("trigger")))
    context = AgentContext(
        messages, None, len(messages), protected=(len(messages) - 1,), summary="S1", summary_covers=8, in_order=5
    )

    async def save(summary: str, covers: int) -> None:
        raise AssertionError("no summary is made")

    fitting = RunBudget(context, "", TokenBudget(100, BudgetStrategy.SUMMARIZE), RecordingBackend(), "alice", "Alice", save)
    sent = await fitting.fit(messages)

    assert fitting.fell_back
    assert not [m for m in sent if isinstance(m, ChatMessage) and m.content.startswith("Previous conversation summary")]
    assert sent[-1] == messages[-1]


@dataclass
class WindowedBackend:
    """A provider with a window of ``window`` tokens (characters/4): a longer request, its answer's room
    included, is refused as too long; summaries are "SUMMARY"."""

    window: int
    name: str = "windowed"
    summary_sizes: list[int] = field(default_factory=list)

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Refuse what does not fit the window; else answer."""
        tokens = total_tokens(request.system_prompt, request.messages, estimate_tokens) + (request.max_tokens or 0)
        if request.system_prompt == SUMMARIZER_PROMPT:
            self.summary_sizes.append(tokens)
        if tokens > self.window:
            raise ContextTooLongError(message=f"prompt is too long: {tokens} > {self.window}")
        summary = request.system_prompt == SUMMARIZER_PROMPT
        return CompletionResult(text="SUMMARY" if summary else "ok", prompt_tokens=tokens, completion_tokens=1)


async def test_a_cut_longer_than_the_window_is_summarized_in_parts_that_fit_it(cast: Cast) -> None:
    """A pasted log longer than the model's whole window among the messages cut: the summary is made in
    parts, the log cut to fit one, each request within the window, and stored, so the next run asks for no
    summary again (one request of it all was refused at every run, for good)."""
    backend = WindowedBackend(window=1000)
    budget = TokenBudget.of_window(1000, strategy=BudgetStrategy.SUMMARIZE)
    profiles = {a.slug: AgentProfile(a, INSTRUCTIONS, backend, budget=budget) for a in cast.agents}
    base = pipeline.build_rig(cast, profiles=profiles, composer=pipeline.real_composer(cast))
    rig = Rig(base.manager, base.runner, RecordingBackend(), profiles["alice"].system_prompt)
    root = await conversation(rig, cast, 2)
    await rig.manager.add_event(root.id, cast.user_says("LOG " + "x" * 4800))  # 1,200 tokens
    await more(rig, cast, root, 5, start=2)
    await trigger_alice(rig, cast, root)

    reply = await run(rig, root)

    assert reply.content == "ok"
    assert len(backend.summary_sizes) >= 2
    assert max(backend.summary_sizes) <= 1000
    state = (await rig.manager.get_conversation(root.id)).agent_states["alice"]  # type: ignore[union-attr]
    assert state.summary == "SUMMARY"
    asked = len(backend.summary_sizes)
    await trigger_alice(rig, cast, root, "again")
    await run(rig, root)
    assert len(backend.summary_sizes) == asked
