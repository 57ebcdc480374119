"""Token budgets: which of a run's messages are sent when they do not fit (docs/CONTEXT.md).

Full history is the rule. Only when the persona prompt plus the messages exceed the budget are
older messages left out, and the context says so: ``sliding_window`` puts a truncation note where
they were cut, ``summarize`` puts a summary of them (made by the caller, see
:func:`summary_request`). Never left out: the first user message, the protected messages (the
while-away block, the marker and the trigger) and the newest unit. A unit is one message, or an
assistant's tool calls together with the tool results that follow it: a call is never separated
from its result.

Pure functions: the caller counts tokens with the agent's counter, asks for summaries and stores them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from tenex_daemon.core.context import ChatMessage
from tenex_daemon.core.llm import AssistantToolCalls, LLMMessage, ToolResult

DEFAULT_BUDGET_RATIO: Final = 0.8
"""The share of the model's context window an agent's messages may use by default."""
CHARS_PER_TOKEN: Final = 4
SUMMARY_SHARE: Final = 0.2
"""The share of the budget kept free for the summary message (also the summary call's max_tokens)."""
SUMMARY_PREFIX: Final = "Previous conversation summary: "
SUMMARIZER_PROMPT: Final = (
    "You summarize conversations for an agent that can no longer see all of them. "
    "Write a concise summary that keeps decisions, facts, names, open questions and what each "
    "participant asked for. Answer with the summary only."
)
"""The system prompt of the summary call."""

TokenCounter = Callable[[str], int]
"""Returns how many tokens a text costs for one model."""


class BudgetStrategy(StrEnum):
    """What replaces older messages when an agent's messages exceed its budget."""

    SLIDING_WINDOW = "sliding_window"
    SUMMARIZE = "summarize"


def estimate_tokens(text: str) -> int:
    """Characters/4, rounded up: the counter for models whose tokenizer is not known here."""
    return -(-len(text) // CHARS_PER_TOKEN)


def truncation_note(count: int) -> ChatMessage:
    """The ``system`` message put where ``count`` older messages were cut."""
    return ChatMessage("system", f"[Note: {count} older messages truncated to stay within token limit]")


def summary_message(summary: str) -> ChatMessage:
    """The ``system`` message that stands for the summarized older messages."""
    return ChatMessage("system", SUMMARY_PREFIX + summary)


@dataclass(frozen=True, slots=True)
class TokenBudget:
    """One agent's budget: at most ``limit`` tokens of persona plus messages, counted by ``count``."""

    limit: int
    strategy: BudgetStrategy = BudgetStrategy.SLIDING_WINDOW
    count: TokenCounter = estimate_tokens

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise ValueError(f"a token budget must be at least 1 token, not {self.limit}")

    @classmethod
    def of_window(
        cls,
        context_window: int,
        ratio: float = DEFAULT_BUDGET_RATIO,
        strategy: BudgetStrategy = BudgetStrategy.SLIDING_WINDOW,
        count: TokenCounter = estimate_tokens,
    ) -> TokenBudget:
        """The budget for a model with ``context_window`` tokens: ``ratio`` of it."""
        if not 0 < ratio <= 1:
            raise ValueError(f"budget ratio must be in (0, 1], not {ratio}")
        return cls(max(int(context_window * ratio), 1), strategy, count)

    @property
    def summary_tokens(self) -> int:
        """Tokens kept free for the summary message, and the most the summary call may write."""
        return max(int(self.limit * SUMMARY_SHARE), 1)


def message_tokens(message: LLMMessage, count: TokenCounter) -> int:
    """Tokens of one message: its text, plus tool names and arguments for tool calls and results."""
    if isinstance(message, AssistantToolCalls):
        calls = sum(
            count(call.name) + count(json.dumps(dict(call.arguments), ensure_ascii=False))
            for call in message.tool_calls
        )
        return count(message.content) + calls
    if isinstance(message, ToolResult):
        return count(message.name) + count(message.content)
    return count(message.content)


def total_tokens(persona: str, messages: Sequence[LLMMessage], count: TokenCounter) -> int:
    """Tokens of the persona prompt plus every message."""
    return count(persona) + sum(message_tokens(m, count) for m in messages)


@dataclass(frozen=True, slots=True)
class Unit:
    """Messages ``start:stop`` that are kept or left out together."""

    start: int
    stop: int
    tokens: int
    pinned: bool
    """Never left out: holds the first user message, a protected message, or is the newest unit."""


def split_units(
    messages: Sequence[LLMMessage], protected: Collection[int], count: TokenCounter
) -> list[Unit]:
    """Group messages into units (tool calls with their results) and mark those never left out."""
    first_user = next(
        (i for i, m in enumerate(messages) if isinstance(m, ChatMessage) and m.role == "user"), None
    )
    pinned = set(protected)
    if first_user is not None:
        pinned.add(first_user)
    units: list[Unit] = []
    start = 0
    while start < len(messages):
        stop = start + 1
        if isinstance(messages[start], AssistantToolCalls):
            while stop < len(messages) and isinstance(messages[stop], ToolResult):
                stop += 1
        tokens = sum(message_tokens(messages[i], count) for i in range(start, stop))
        is_pinned = stop == len(messages) or any(i in pinned for i in range(start, stop))
        units.append(Unit(start, stop, tokens, is_pinned))
        start = stop
    return units


@dataclass(frozen=True, slots=True)
class Window:
    """What to leave out of a run's messages."""

    dropped: tuple[int, ...]
    """Indexes of the messages left out, in order."""
    kept_middle: int
    """How many units that may be left out are kept (what retries take shares of)."""


def plan_window(
    persona: str,
    messages: Sequence[LLMMessage],
    protected: Collection[int],
    count: TokenCounter,
    *,
    limit: int | None,
    covered: int = 0,
    reserve: int = 0,
    max_middle: int | None = None,
) -> Window:
    """Keep the pinned units and the newest other units that fit; leave out the older ones.

    ``limit``: tokens for persona plus messages (None: no limit, only ``max_middle``).
    ``covered``: the leading messages a summary stands for; they are left out whatever fits
    (pinned ones excepted), and ``reserve`` tokens are kept free for the summary message.
    ``max_middle``: keep at most this many units besides the pinned ones (the retries' shrinking).
    The newest unit is pinned: it is sent even when it alone exceeds the limit.
    """
    units = split_units(messages, protected, count)
    used = count(persona) + reserve + sum(u.tokens for u in units if u.pinned)
    gaps = sum(1 for i, u in enumerate(units) if not u.pinned and (i == 0 or units[i - 1].pinned))
    used += gaps * message_tokens(truncation_note(len(messages)), count)  # a note per gap, at most this long
    candidates: list[Unit] = []
    dropped: list[int] = []
    for unit in units:
        if unit.pinned:
            continue
        if unit.stop <= covered:
            dropped.extend(range(unit.start, unit.stop))
        else:
            candidates.append(unit)
    first_kept = len(candidates)
    for position in range(len(candidates) - 1, -1, -1):
        unit = candidates[position]
        if max_middle is not None and len(candidates) - position > max_middle:
            break
        if limit is not None and used + unit.tokens > limit:
            break
        used += unit.tokens
        first_kept = position
    for unit in candidates[:first_kept]:
        dropped.extend(range(unit.start, unit.stop))
    return Window(tuple(sorted(dropped)), len(candidates) - first_kept)


def render(
    messages: Sequence[LLMMessage], window: Window, summary: str | None = None, covered: int = 0
) -> list[LLMMessage]:
    """Return the messages without those ``window`` leaves out, saying where they were cut.

    Left-out messages before ``covered`` are replaced by the summary message (when ``summary`` is
    given) at the first of them; any others by a truncation note at each place they were cut (each run
    of them between kept messages: older history, and a run's own earlier tool calls after its trigger),
    counting that run.
    """
    dropped = set(window.dropped)
    summarized = [i for i in window.dropped if i < covered] if summary is not None else []
    truncated = [i for i in window.dropped if i >= covered] if summarized else list(window.dropped)
    summary_at = summarized[0] if summarized else -1
    notes: dict[int, int] = {}  # first index of each run of truncated messages -> its length
    start = previous = -2
    for index in truncated:
        if index != previous + 1:
            start = index
        notes[start] = notes.get(start, 0) + 1
        previous = index
    result: list[LLMMessage] = []
    for index, message in enumerate(messages):
        if index == summary_at and summary is not None:
            result.append(summary_message(summary))
        if index in notes:
            result.append(truncation_note(notes[index]))
        if index not in dropped:
            result.append(message)
    return result


def fit_sliding_window(
    persona: str, messages: Sequence[LLMMessage], protected: Collection[int], budget: TokenBudget
) -> Sequence[LLMMessage]:
    """Return ``messages`` unchanged when they fit ``budget``, else the ``sliding_window`` cut of them."""
    if total_tokens(persona, messages, budget.count) <= budget.limit:
        return messages
    window = plan_window(persona, messages, protected, budget.count, limit=budget.limit)
    return render(messages, window)


def summarized_until(window: Window, history_end: int) -> int:
    """One past the newest history message ``window`` leaves out (0 when it leaves none out).

    Only history (the messages before ``history_end``) is summarized: it is what the next turn
    shows again, so the stored summary's coverage stays meaningful.
    """
    inside = [i for i in window.dropped if i < history_end]
    return inside[-1] + 1 if inside else 0


def summary_request(previous: str | None, messages: Sequence[LLMMessage]) -> str:
    """The text sent to the summary call: the previous summary, if any, and only the new messages."""
    return summary_request_of_lines(previous, [transcript_line(m) for m in messages])


def summary_request_of_lines(previous: str | None, lines: Sequence[str]) -> str:
    """:func:`summary_request` of messages already written as :func:`transcript_line` s."""
    parts = []
    if previous:
        parts.append(f"The summary so far:\n{previous}")
        parts.append("Extend it with these newer messages:\n" + "\n".join(lines))
    else:
        parts.append("Summarize these messages:\n" + "\n".join(lines))
    return "\n\n".join(parts)


def transcript_line(message: LLMMessage) -> str:
    """``message`` as one line of the transcript a summary call is sent (``role: text``)."""
    if isinstance(message, AssistantToolCalls):
        calls = ", ".join(
            f"{call.name}({json.dumps(dict(call.arguments), ensure_ascii=False)})"
            for call in message.tool_calls
        )
        return f"assistant: {message.content} [called {calls}]".replace(":  [", ": [")
    if isinstance(message, ToolResult):
        return f"tool {message.name}: {message.content}"
    return f"{message.role}: {message.content}"
