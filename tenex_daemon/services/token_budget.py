"""One run's token budget: fit what is sent before each backend call, and shrink it for retries.

The pure rules are in :mod:`tenex_daemon.core.budget`; this adds what needs I/O: the ``summarize``
strategy asks the agent's backend for a summary of the newly left-out messages (extending the
stored one, never redoing it) and stores it; when that call fails the run falls back to
``sliding_window`` and says so in the log.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import structlog

from tenex_daemon.core.budget import (
    SUMMARIZER_PROMPT,
    BudgetStrategy,
    TokenBudget,
    Window,
    estimate_tokens,
    message_tokens,
    plan_window,
    render,
    summarized_until,
    summary_message,
    summary_request_of_lines,
    total_tokens,
    transcript_line,
)
from tenex_daemon.core.context import AgentContext, ChatMessage
from tenex_daemon.core.llm import BackendError, CompletionRequest, LLMBackend, LLMMessage

RETRY_SHARES = (0.5, 0.25, 0.0)
"""After a context-too-long answer, the shares of the middle messages kept by each retry."""
ARTICLE_SHARE = 0.25
"""The most of an agent's budget a referenced article may take in its persona (docs/CONTEXT.md)."""

SaveSummary = Callable[[str, int], Awaitable[None]]
"""Stores a summary and how many leading history messages it covers."""

log = structlog.get_logger(__name__)


@dataclass
class RunBudget:
    """The budget state of one agent run (the summary so far, whether summarizing failed).

    ``budget`` None means no budget applies: what is sent is the full list, shrunk only by retries.
    """

    context: AgentContext
    persona: str
    budget: TokenBudget | None
    backend: LLMBackend
    agent_slug: str
    agent_name: str
    save_summary: SaveSummary
    model: str | None = None
    conversation_id: str = ""
    summary: str | None = field(init=False)
    covers: int = field(init=False)
    fell_back: bool = field(default=False, init=False)
    """A summary call failed: the rest of the run uses ``sliding_window``."""
    prompt_tokens: int = field(default=0, init=False)
    """Tokens the summary calls used, not yet added to the run's usage (see :meth:`take_usage`)."""
    completion_tokens: int = field(default=0, init=False)
    _kept_middle: int | None = field(default=None, init=False)
    _summary_sent: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.summary, self.covers, self.fell_back = _stored_summary(self.context)

    @property
    def _count(self) -> Callable[[str], int]:
        return self.budget.count if self.budget is not None else estimate_tokens

    @property
    def _summarizing(self) -> bool:
        return (
            self.budget is not None
            and self.budget.strategy is BudgetStrategy.SUMMARIZE
            and not self.fell_back
        )

    async def fit(self, messages: Sequence[LLMMessage]) -> Sequence[LLMMessage]:
        """Return what to send first: ``messages`` itself when it fits, else the strategy's cut."""
        protected = self.context.protected
        budget = self.budget
        self._summary_sent = False
        if budget is None or total_tokens(self.persona, messages, budget.count) <= budget.limit:
            self._kept_middle = None
            return messages
        if self._summarizing:
            fitted = await self._fit_summarized(messages, budget)
            if fitted is not None:
                return fitted
        window = plan_window(self.persona, messages, protected, budget.count, limit=budget.limit)
        self._kept_middle = window.kept_middle
        log.info(
            "context_truncated",
            agent=self.agent_slug,
            conversation_id=self.conversation_id,
            dropped=len(window.dropped),
            limit=budget.limit,
        )
        return render(messages, window)

    async def _fit_summarized(
        self, messages: Sequence[LLMMessage], budget: TokenBudget
    ) -> Sequence[LLMMessage] | None:
        """The ``summarize`` cut, extending the summary first when more history is cut; None on failure."""
        context = self.context
        window = _summary_window(self.persona, messages, context.protected, budget, self.summary, self.covers)
        until = summarized_until(window, context.summarizable_end)
        if until > self.covers:
            newly = [(i, messages[i]) for i in window.dropped if self.covers <= i < until]
            try:
                async for lines, covers in self._in_parts(newly, until, budget):
                    extended = await self._summarize(lines, budget)
                    await self.save_summary(extended, covers)  # a part done is kept, whatever comes next
                    log.info(
                        "summary_extended",
                        agent=self.agent_slug,
                        conversation_id=self.conversation_id,
                        covers=covers,
                        new_messages=len(lines),
                    )
                    self.summary, self.covers = extended, covers
            except Exception as exc:
                self.fell_back = True
                log.warning(
                    "summary_failed_sliding_window_used",
                    agent=self.agent_slug,
                    conversation_id=self.conversation_id,
                    error=f"{type(exc).__name__}: {exc}",
                )
                return None
        self._kept_middle = window.kept_middle
        self._summary_sent = self.summary is not None and self.covers > 0
        return render(messages, window, self.summary, self.covers)

    async def _in_parts(
        self, newly: Sequence[tuple[int, LLMMessage]], until: int, budget: TokenBudget
    ) -> AsyncIterator[tuple[list[str], int]]:
        """``newly`` (history indexes and messages) as transcript lines, in parts whose messages, with the
        summary so far, fit the budget as an agent's messages must (counted as they are: their text; the
        short summarizer prompt and the summary's room, a fifth of the budget, fit the rest of the model's
        window), each with how many history messages the summary covers once it is extended with that part
        (``until`` for the last). A message longer than a part may hold is cut to it. One part in all, as
        before, unless the messages cut at once outgrow the budget (a pasted log, a window lowered, a long
        history switched to ``summarize``): one request of them all was refused at every run, for good."""
        count = budget.count
        lines: list[str] = []
        used = 0
        for position, (index, message) in enumerate(newly):
            space = budget.limit - count(self.summary or "")
            tokens = message_tokens(message, count)
            if lines and used + tokens > space:
                yield lines, index  # the summary now covers the history before this message
                lines, used = [], 0
                space = budget.limit - count(self.summary or "")
            if space <= 0:
                raise BackendError(message=f"no room in the budget to extend {self.agent_slug}'s summary")
            line = transcript_line(message)
            if tokens > space:  # alone, with the prompt and the request's headings beside it
                fits = space - count(SUMMARIZER_PROMPT) - count(summary_request_of_lines(self.summary, [""]))
                line, tokens = cut_to_tokens(line, max(fits, 1), count), space
            lines.append(line)
            used += tokens
            if position == len(newly) - 1:
                yield lines, until

    async def _summarize(self, lines: Sequence[str], budget: TokenBudget) -> str:
        """Ask the agent's backend for the previous summary extended with ``lines`` (transcript lines)."""
        result = await self.backend.complete(
            CompletionRequest(
                agent_slug=self.agent_slug,
                agent_name=self.agent_name,
                system_prompt=SUMMARIZER_PROMPT,
                messages=(ChatMessage("user", summary_request_of_lines(self.summary, lines)),),
                model=self.model,
                max_tokens=budget.summary_tokens,
            )
        )
        self.prompt_tokens += result.prompt_tokens or 0
        self.completion_tokens += result.completion_tokens or 0
        text = result.text.strip()
        if not text:
            raise BackendError(message=f"{self.backend.name} returned an empty summary")
        # the window kept room for a summary this long (a backend may not keep to max_tokens, or count
        # its tokens otherwise): a longer one is cut to it, so what is sent still fits the budget
        room = budget.summary_tokens
        if self.summary is not None:
            room = max(room, message_tokens(summary_message(self.summary), budget.count))
        fitted = cut_to_tokens(text, room - message_tokens(summary_message(""), budget.count), budget.count)
        if fitted != text:
            log.warning("summary_cut_to_fit", agent=self.agent_slug, conversation_id=self.conversation_id)
        if not fitted.strip():
            raise BackendError(message=f"no room in the budget for {self.backend.name}'s summary")
        return fitted

    def shrink(self, messages: Sequence[LLMMessage], share: float) -> list[LLMMessage]:
        """Return ``messages`` cut to ``share`` of the middle units the first try sent (rounded down).

        The first user message, the protected messages, the newest unit and a summary already
        sent stay; what else is cut is counted in a truncation note.
        """
        protected = self.context.protected
        count = self._count
        covered = self.covers if self._summary_sent else 0
        middle = self._kept_middle
        if middle is None:
            everything = plan_window(self.persona, messages, protected, count, limit=None, covered=covered)
            middle = everything.kept_middle
        window = plan_window(
            self.persona,
            messages,
            protected,
            count,
            limit=None,
            covered=covered,
            max_middle=math.floor(middle * share),
        )
        return render(messages, window, self.summary if self._summary_sent else None, covered)

    def take_usage(self) -> tuple[int, int]:
        """Return (prompt, completion) tokens of summary calls since the last take, and reset them."""
        used = (self.prompt_tokens, self.completion_tokens)
        self.prompt_tokens = self.completion_tokens = 0
        return used


def _stored_summary(context: AgentContext) -> tuple[str | None, int, bool]:
    """(summary, messages it covers, fell back) of a run starting from ``context``.

    A run for an older trigger sees less history than the stored summary covers (or, a burst, less in
    its own order); summarizing again from the start is what the contract forbids, so such a run cuts
    by ``sliding_window`` instead."""
    stored = context.summary
    if stored is None or context.summary_covers <= context.summarizable_end:
        return stored, context.summary_covers if stored is not None else 0, False
    return None, 0, True


def _summary_window(
    persona: str,
    messages: Sequence[LLMMessage],
    protected: Sequence[int],
    budget: TokenBudget,
    summary: str | None,
    covers: int,
) -> Window:
    """The ``summarize`` cut's window: room kept for the summary message, the covered messages out."""
    reserve = budget.summary_tokens
    if summary is not None:
        reserve = max(reserve, message_tokens(summary_message(summary), budget.count))
    return plan_window(
        persona, messages, protected, budget.count, limit=budget.limit, covered=covers, reserve=reserve
    )


@dataclass(frozen=True, slots=True)
class BudgetPreview:
    """What a run's first backend call would send under the agent's budget (``tenexd context``)."""

    messages: Sequence[LLMMessage]
    tokens: int
    """Persona plus all the messages, before any cut, as the budget counts them."""
    dropped: int = 0
    """Messages left out (by the summary, or counted in a truncation note)."""
    to_summarize: int = 0
    """Of those, the ones the run would first add to the stored summary: a preview makes no backend
    call, so it shows them as truncated."""


def preview_fit(context: AgentContext, persona: str, budget: TokenBudget) -> BudgetPreview:
    """What :meth:`RunBudget.fit` sends first for ``context``, without calling a backend or saving.

    The same cut: ``sliding_window``, or ``summarize`` with the stored summary (a run that extends it
    first sends the newer summary where this shows a truncation note: :attr:`BudgetPreview.to_summarize`).
    """
    messages = context.messages
    tokens = total_tokens(persona, messages, budget.count)
    if tokens <= budget.limit:
        return BudgetPreview(messages, tokens)
    summary, covers, fell_back = _stored_summary(context)
    if budget.strategy is BudgetStrategy.SUMMARIZE and not fell_back:
        window = _summary_window(persona, messages, context.protected, budget, summary, covers)
        until = summarized_until(window, context.summarizable_end)
        newly = sum(1 for i in window.dropped if covers <= i < until)
        fitted = render(messages, window, summary, covers)
        return BudgetPreview(fitted, tokens, len(window.dropped), newly)
    window = plan_window(persona, messages, context.protected, budget.count, limit=budget.limit)
    return BudgetPreview(render(messages, window), tokens, len(window.dropped))


def cut_to_tokens(text: str, max_tokens: int, count: Callable[[str], int]) -> str:
    """Return the longest start of ``text`` counting at most ``max_tokens`` (``text`` itself when it fits)."""
    if count(text) <= max_tokens:
        return text
    low, high = 0, len(text)  # count(text[:low]) fits, count(text[:high]) does not
    while high - low > 1:
        middle = (low + high) // 2
        if count(text[:middle]) <= max_tokens:
            low = middle
        else:
            high = middle
    return text[:low]


def article_tokens(budget: TokenBudget) -> int:
    """The most tokens a referenced article may take in the persona of an agent with ``budget``."""
    return int(budget.limit * ARTICLE_SHARE)
