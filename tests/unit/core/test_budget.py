"""Token budgets as pure functions (docs/CONTEXT.md "When history does not fit")."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from tenex_daemon import ConversationManager
from tenex_daemon.core.budget import (
    BudgetStrategy,
    TokenBudget,
    estimate_tokens,
    fit_sliding_window,
    message_tokens,
    plan_window,
    render,
    split_units,
    summarized_until,
    summary_message,
    summary_request,
    total_tokens,
    truncation_note,
)
from tenex_daemon.core.context import NEW_INTERACTION, WHILE_AWAY_HEADER, ChatMessage, Role
from tenex_daemon.core.llm import AssistantToolCalls, LLMMessage, ToolCall, ToolResult
from tests.conftest import Cast


def say(role: Role, tag: str, tokens: int = 10) -> ChatMessage:
    """A message whose content starts with ``tag`` and costs exactly ``tokens`` (characters/4)."""
    return ChatMessage(role, tag.ljust(tokens * 4, "."))


def chat(count: int) -> list[LLMMessage]:
    """``count`` messages of 10 tokens each, user and assistant in turn, the first a user's."""
    return [say("user" if i % 2 == 0 else "assistant", f"m{i}") for i in range(count)]


def tool_pair(call_id: str, result_tokens: int = 20) -> list[LLMMessage]:
    """An assistant's tool call followed by its result."""
    return [
        AssistantToolCalls((ToolCall(call_id, "get_conversation", {"id": call_id}),)),
        ToolResult(call_id, "get_conversation", "r".ljust(result_tokens * 4, ".")),
    ]


def assert_tool_pairs_whole(messages: Sequence[LLMMessage], source: Sequence[LLMMessage]) -> None:
    """Each tool call is followed by exactly the results that followed it in ``source``, and no result is orphaned."""
    for index, message in enumerate(messages):
        if isinstance(message, AssistantToolCalls):
            start = list(source).index(message)
            expected = []
            for following in source[start + 1 :]:
                if not isinstance(following, ToolResult):
                    break
                expected.append(following)
            assert list(messages[index + 1 : index + 1 + len(expected)]) == expected
        if isinstance(message, ToolResult):
            assert index > 0
            assert isinstance(messages[index - 1], AssistantToolCalls | ToolResult)


def test_characters_per_four_rounds_up() -> None:
    """Without a known tokenizer a text costs its characters divided by four, rounded up."""
    assert [estimate_tokens("x" * n) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]


def test_budget_is_eighty_percent_of_the_window_by_default() -> None:
    """The default budget is 80% of the model's context window; a ratio outside (0, 1] is refused."""
    assert TokenBudget.of_window(1000).limit == 800
    assert TokenBudget.of_window(1000, 0.5, BudgetStrategy.SUMMARIZE).limit == 500
    with pytest.raises(ValueError, match="ratio"):
        TokenBudget.of_window(1000, 1.5)


def test_tool_calls_cost_their_names_and_arguments() -> None:
    """A tool call is counted with its name and JSON arguments, a result with its name and content."""
    call, result = tool_pair("c1", result_tokens=5)
    assert message_tokens(call, estimate_tokens) == estimate_tokens("get_conversation") + estimate_tokens(
        '{"id": "c1"}'
    )
    assert message_tokens(result, estimate_tokens) == estimate_tokens("get_conversation") + 5


def test_under_budget_the_messages_are_returned_unchanged() -> None:
    """Messages that fit the budget (persona included) are sent exactly as built: the same list."""
    messages = chat(7)
    persona = "p" * 40
    budget = TokenBudget(total_tokens(persona, messages, estimate_tokens))

    assert fit_sliding_window(persona, messages, (6,), budget) is messages


def test_over_budget_sliding_window_keeps_first_user_message_and_newest_and_notes_the_cut() -> None:
    """Over budget: the first user message, a note counting the cut messages where they were, then the newest that fit."""
    messages = chat(7)  # m0..m5 history, m6 the trigger
    note = estimate_tokens(truncation_note(7).content)
    budget = TokenBudget(10 + 10 + note + 20)  # first user + trigger + note + two more

    fitted = fit_sliding_window("", messages, (6,), budget)

    assert fitted == [messages[0], truncation_note(3), messages[4], messages[5], messages[6]]
    assert fitted[1] == ChatMessage("system", "[Note: 3 older messages truncated to stay within token limit]")
    assert total_tokens("", fitted, estimate_tokens) <= budget.limit


def test_the_persona_counts_against_the_budget() -> None:
    """A longer persona prompt leaves room for fewer history messages."""
    messages = chat(7)
    budget = TokenBudget(10 + 10 + estimate_tokens(truncation_note(7).content) + 40)

    short = fit_sliding_window("", messages, (6,), budget)
    long = fit_sliding_window("p" * 80, messages, (6,), budget)

    assert len(short) - len(long) == 2


def test_the_first_user_message_is_kept_even_when_agents_spoke_first() -> None:
    """The first *user* message is kept wherever it is; a note stands where each cut began (the agent's
    message before it, and the messages after it)."""
    messages: list[LLMMessage] = [
        say("system", "[Bob]: hi"),
        say("user", "first"),
        *chat(6)[1:],
        say("user", "t"),
    ]
    fitted = fit_sliding_window("", messages, (len(messages) - 1,), TokenBudget(40))

    assert fitted[:3] == [truncation_note(1), messages[1], truncation_note(len(messages) - 3)]
    assert fitted[-1] == messages[-1]


async def test_while_away_block_marker_and_trigger_are_never_dropped(
    manager: ConversationManager, cast: Cast
) -> None:
    """An agent p-tagged mid-conversation keeps its while-away block, marker and trigger under a tiny budget."""
    root = cast.user_says("Plan the release " * 10, kind=11, tags=[["p", cast.alice.pubkey]])
    await manager.create_conversation(root)
    for i in range(6):
        await manager.add_event(root.id, cast.alice_says(f"Alice step {i} " * 10))
        await manager.add_event(root.id, cast.user_says(f"User answer {i} " * 10))
    trigger = cast.user_says("Bob, check this", tags=[["p", cast.bob.pubkey]])
    await manager.add_event(root.id, trigger)
    context = await manager.build_agent_messages(root.id, "bob", trigger)
    block, marker, last = context.messages[-3:]

    fitted = fit_sliding_window("", context.messages, context.protected, TokenBudget(50))

    assert context.protected == tuple(range(len(context.messages) - 3, len(context.messages)))
    assert block.content.startswith(WHILE_AWAY_HEADER)
    assert marker.content == NEW_INTERACTION
    assert last == ChatMessage("user", "Bob, check this")
    assert fitted == [context.messages[0], truncation_note(len(context.messages) - 4), block, marker, last]


async def test_a_context_without_block_protects_only_the_trigger(
    manager: ConversationManager, cast: Cast
) -> None:
    """Without a while-away block the trigger alone is protected and all before it is history."""
    root = cast.user_says("Hello Alice", kind=11, tags=[["p", cast.alice.pubkey]])
    await manager.create_conversation(root)

    context = await manager.build_agent_messages(root.id, "alice", root)

    assert context.protected == (0,)
    assert context.history_end == 0


@pytest.mark.parametrize("limit", range(1, 140, 3))
def test_a_tool_call_is_never_split_from_its_results(limit: int) -> None:
    """Whatever the budget, a tool call and the results that follow it are kept or dropped together."""
    messages = [*chat(3), *tool_pair("c1"), ToolResult("c2", "get_conversation", "x" * 40), say("user", "t")]
    messages += [*tool_pair("c3"), *tool_pair("c4")]

    fitted = fit_sliding_window("", messages, (6,), TokenBudget(limit))

    assert_tool_pairs_whole(fitted, messages)
    assert list(fitted[-2:]) == messages[-2:]  # the newest unit always goes
    assert messages[0] in fitted
    assert messages[6] in fitted


def test_units_group_a_call_with_every_result_after_it() -> None:
    """A unit is an assistant's tool calls plus all the tool results right after it."""
    messages = [say("user", "u"), *tool_pair("c1"), ToolResult("c2", "x", "y"), say("assistant", "a")]

    units = split_units(messages, (), estimate_tokens)

    assert [(u.start, u.stop, u.pinned) for u in units] == [(0, 1, True), (1, 4, False), (4, 5, True)]


def test_covered_messages_are_replaced_by_the_summary() -> None:
    """Messages a summary covers are left out and the summary message stands where they began."""
    messages = chat(9)
    window = plan_window("", messages, (8,), estimate_tokens, limit=None, covered=4)

    rendered = render(messages, window, "They planned a release.", covered=4)

    assert window.dropped == (1, 2, 3)
    assert rendered == [messages[0], summary_message("They planned a release."), *messages[4:]]
    assert rendered[1] == ChatMessage("system", "Previous conversation summary: They planned a release.")


def test_summary_and_note_each_stand_for_their_own_cut() -> None:
    """Left-out messages the summary covers go to the summary; further ones are counted in a note."""
    messages = chat(9)
    window = plan_window("", messages, (8,), estimate_tokens, limit=None, covered=3, max_middle=2)

    rendered = render(messages, window, "S", covered=3)

    assert rendered == [
        messages[0],
        summary_message("S"),
        truncation_note(3),
        messages[6],
        messages[7],
        messages[8],
    ]


def test_summarized_until_stops_at_history() -> None:
    """Only history (before the protected tail) is summarized; cut tool messages after it are not."""
    messages = [*chat(5), say("user", "trigger"), *tool_pair("c1"), *tool_pair("c2")]
    window = plan_window("", messages, (5,), estimate_tokens, limit=45)

    assert window.dropped == (1, 2, 3, 4, 6, 7)
    assert summarized_until(window, history_end=5) == 5


def test_max_middle_keeps_the_newest_units() -> None:
    """The retries' cap keeps the newest N units that may be left out, and says how many it kept."""
    messages = chat(10)

    window = plan_window("", messages, (9,), estimate_tokens, limit=None, max_middle=2)
    none = plan_window("", messages, (9,), estimate_tokens, limit=None, max_middle=0)

    assert window.dropped == tuple(range(1, 7))
    assert window.kept_middle == 2
    assert none.dropped == tuple(range(1, 9))
    assert none.kept_middle == 0


def test_summary_request_extends_the_previous_summary_with_only_new_messages() -> None:
    """The summary call is sent the previous summary and the new messages only, as a transcript."""
    first = summary_request(None, [say("user", "a", 1), say("assistant", "bcde", 1)])
    later = summary_request("Earlier: a and b.", [say("system", "[Bob]: x", 2)])

    assert first == "Summarize these messages:\nuser: a...\nassistant: bcde"
    assert later == (
        "The summary so far:\nEarlier: a and b.\n\nExtend it with these newer messages:\nsystem: [Bob]: x"
    )
