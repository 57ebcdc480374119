"""How an agent answers: ask its backend, run the tools it calls, ask again until it answers with text.

The loop is shared by a conversation's runs (:mod:`~tenex_daemon.services.agent_runner`) and by the
answers of delegated requests (:mod:`~tenex_daemon.services.delegation`); each fits what it sends
to the agent's token budget (docs/CONTEXT.md, "When history does not fit").
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

import structlog

from tenex_daemon.core.agents import Agent
from tenex_daemon.core.budget import TokenBudget
from tenex_daemon.core.context import AgentContext
from tenex_daemon.core.llm import (
    AssistantToolCalls,
    BackendError,
    BackendErrorKind,
    CompletionRequest,
    CompletionResult,
    ContextTooLongError,
    LLMBackend,
    LLMMessage,
)
from tenex_daemon.core.ports import PartialTextPublisher
from tenex_daemon.core.pricing import TokenPrices
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.services.persona import DEFAULT_RECENT_IN_PERSONA, PersonaSpec, build_persona, persona_text
from tenex_daemon.services.token_budget import RETRY_SHARES, RunBudget
from tenex_daemon.services.tools import DEFAULT_RECENT_CONVERSATIONS, ToolContext, ToolRegistry

DEFAULT_MAX_TOOL_ROUNDS = 8
"""How many times one run may ask its backend before an answer without tool calls is required."""
TOOL_LOOP_ERROR = "tool_loop"
"""The error kind of a run stopped because its backend kept calling tools."""
KEY_PREFIXES = ("sk", "rk", "org", "proj", "key", "sess")
"""How OpenAI's and Anthropic's keys and account ids begin (``sk-proj-``, ``sk-ant-``, ``org-``), before a
``-``: a piece of one is taken as a key when it holds a digit, ``*`` or ``…`` (masked), or is 16
characters long, so ``key-value`` is none."""
OTHER_KEY_PREFIXES = (
    "sk", "rk", "gsk", "xai", "hf", "pplx", "nvapi", "csk", "r8", "ghp", "gho", "ghu", "ghs", "github_pat",
    "glpat",
)
"""How other providers' keys begin (Groq, xAI, Hugging Face, Perplexity, NVIDIA, Cerebras, Replicate,
GitHub, GitLab; Stripe-like ``sk_``), before a ``-`` or ``_``: taken as a key only when 16 characters long
at least and holding a digit, ``*`` or ``…``, so a code name (``hf_hub_download``, ``sess_id_123``) or a
model's (``pplx-70b-online``) is none."""
_TOKEN = r"[\w.~+/=*…-]"
"""A bearer token's characters: base64 (``/`` included, RFC 6750), URL-safe base64, masked ones."""
_KEY_VALUE = r"[\w.~+=*…-]"
"""An ``api_key=`` value's characters: as a token's, but a ``/`` ends it (what follows in a URL is kept)."""
_LETTERS = r"(?:(?=[A-Za-z]*[a-z])(?=[A-Za-z]*[A-Z])[A-Za-z]{16,}|[A-Za-z]{24,})(?![\w.~+/=*…-])"
"""A token of letters alone: 16 or more of both cases, or 24 or more of one (no word is that long), and
nothing of a token's after them (``header_is_missing``, ``authentication/authorization`` are words)."""
CREDENTIAL = re.compile(
    rf"\b(?:{'|'.join(KEY_PREFIXES)})-(?:(?=[\w*.…-]*[\d*…])[\w*.…-]{{3,}}[\w*…]|[\w-]{{16,}})"
    rf"|\b(?:{'|'.join(OTHER_KEY_PREFIXES)})[-_](?=[\w*.…-]*[\d*…])[\w*.…-]{{15,}}[\w*…]"
    r"|\bAIza[\w-]{30,}"  # Google's
    rf"|(?P<bearer>(?i:\bbearer\s+))"
    rf"(?:(?={_TOKEN}*[\d*…])(?={_TOKEN}*[A-Za-z]){_TOKEN}{{8,}}|{_LETTERS})"
    rf"|(?P<label>(?i:\b(?:x-)?api[-_]?key[\"']?\s*[:=]\s*[\"']?))"
    rf"(?:(?={_KEY_VALUE}*[\d*…])(?={_KEY_VALUE}*[A-Za-z]){_KEY_VALUE}{{8,}}|{_LETTERS})"
)
"""What a provider's error text may show of a key or an account, left out of the error reply: OpenAI's 401
names the key masked (``sk-proj-abc…wxyz``), a 429 the ``org-…`` id, a server may echo the header it was
sent (``Bearer <token>``) or ``api_key=<token>``. A token after ``Bearer`` or ``api_key:`` holds a letter
and a digit, ``*`` or ``…`` and is 8 characters long at least, or is letters alone (:data:`_LETTERS`), so
``the bearer of``, ``bearer 12345678`` or ``Bearer authentication/authorization`` is none. (A backend leaves
out its own key, whatever its shape, before: this catches what the server shows of others and of masked
ones.)"""
EMPTY_ANSWER = "empty_answer"
"""The error kind of a backend's final answer with nothing in it (an unexplained refusal, a filter)."""
CUT_AT_LENGTH = ("length", "max_tokens")
"""The finish reasons of an answer the model was cut off in at its length limit (OpenAI's and llama.cpp's,
Anthropic's)."""
CUT_NOTE = "\n\n[Cut off: this answer reached the model's length limit.]"
"""Added to an answer cut off at the length limit, so a reader knows it is not whole."""
CUT_BY_FILTER = ("content_filter", "refusal")
"""The finish reasons of an answer the provider's filter stopped (OpenAI's and compatible servers',
Anthropic's streaming classifier's): what came before is published, said to be cut."""
FILTER_NOTE = "\n\n[Cut off: the provider's content filter stopped this answer.]"
"""Added to an answer the provider's content filter stopped, so a reader knows it is not whole."""
DEFAULT_TOOLS = ("complete", "switch_phase", "end_conversation", "get_conversation")

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class AgentProfile:
    """What an agent run needs besides the conversation: persona, backend and the tools it is offered."""

    agent: Agent
    instructions: str
    backend: LLMBackend
    model: str | None = None
    temperature: float | None = None
    max_tokens: int | None = None
    tools: tuple[str, ...] = DEFAULT_TOOLS
    """Names of the tools offered to the model (from the runner's registry)."""
    budget: TokenBudget | None = None
    """The agent's token budget (docs/CONTEXT.md); None sends full history."""
    recent_in_persona: int = DEFAULT_RECENT_IN_PERSONA
    """How many of the person's recent ended conversations with the agent its persona recalls (0: none)."""
    list_recent: int = DEFAULT_RECENT_CONVERSATIONS
    """How many conversations ``get_conversation``'s ``list_recent`` lists by default."""
    prices: TokenPrices | None = None
    """What the agent's model costs per token; None: its replies carry no ``llm-cost-usd``."""

    def cost_usd(self, result: CompletionResult) -> float | None:
        """What ``result``'s tokens cost at the agent's prices (None when unpriced or unknown)."""
        if self.prices is None:
            return None
        return self.prices.cost_usd(result.prompt_tokens, result.completion_tokens)

    @property
    def persona_spec(self) -> PersonaSpec:
        """What the agent's persona is made of (:mod:`~tenex_daemon.services.persona`)."""
        return PersonaSpec(self.agent, self.instructions, self.budget, self.recent_in_persona)

    @property
    def system_prompt(self) -> str:
        """The persona without a conversation: no referenced article, no recent conversations."""
        return persona_text(self.persona_spec)


class AnswerLoop:
    """The tool loop: at most ``max_tool_rounds`` backend calls per answer, tools from ``tools``."""

    def __init__(self, manager: ConversationManager, tools: ToolRegistry, max_tool_rounds: int) -> None:
        if max_tool_rounds < 1:
            raise ValueError("max_tool_rounds must be at least 1")
        self._manager = manager
        self._tools = tools
        self._max_tool_rounds = max_tool_rounds

    async def answer(
        self, profile: AgentProfile, context: AgentContext, tools: ToolContext
    ) -> tuple[CompletionResult, str | None]:
        """Ask the backend, run the tools it calls, ask again until it answers; return (answer, error kind).

        Each assistant message with tool calls is followed at once by one result per call,
        so a call and its result are never separated in what the backend is sent. A
        ``complete`` call ends the loop without another backend call. Before each backend
        call what is sent is fitted to the agent's token budget (:meth:`_complete_within_budget`).
        """
        offered = profile.tools
        specs = self._tools.specs(offered)
        messages: list[LLMMessage] = list(context.messages)
        session_id = context.session_id
        model: str | None = None
        prompt_tokens: int | None = None
        completion_tokens: int | None = None
        cid = tools.conversation_id
        slug = profile.agent.slug

        async def save_summary(summary: str, covers: int) -> None:
            await self._manager.update_agent_state(cid, slug, summary=(summary, covers))

        conversation = await self._manager.get_conversation(cid)
        # built before the budget is applied: the budget counts the whole persona
        persona = await build_persona(
            self._manager.store, self._manager.agents, profile.persona_spec, conversation, tools.trigger
        )
        budget = RunBudget(
            context,
            persona,
            profile.budget,
            profile.backend.inner if isinstance(profile.backend, PartialStreamer) else profile.backend,
            slug,
            profile.agent.name,
            save_summary,
            model=profile.model,
            conversation_id=cid,
        )
        try:
            for _ in range(self._max_tool_rounds):
                result = await self._complete_within_budget(
                    profile,
                    budget,
                    messages,
                    CompletionRequest(
                        agent_slug=profile.agent.slug,
                        agent_name=profile.agent.name,
                        system_prompt=persona,
                        messages=(),
                        session_id=session_id,
                        model=profile.model,
                        tools=specs,
                        temperature=profile.temperature,
                        max_tokens=profile.max_tokens,
                    ),
                )
                model = result.model or model
                session_id = result.session_id or session_id
                prompt_tokens = _add(prompt_tokens, result.prompt_tokens)
                completion_tokens = _add(completion_tokens, result.completion_tokens)
                usage = CompletionResult(
                    text="",
                    model=model,
                    session_id=session_id,
                    prompt_tokens=prompt_tokens,
                    completion_tokens=completion_tokens,
                    extra=result.extra,
                )
                if not result.tool_calls:
                    if not result.text.strip():  # nothing to publish: the person is told why instead
                        ended = f" (it ended with {result.finish_reason!r})" if result.finish_reason else ""
                        name = profile.backend.name
                        text = f"I could not answer: the {name} backend gave an empty answer{ended}."
                        return replace(usage, text=text, finish_reason=result.finish_reason), EMPTY_ANSWER
                    note = _cut_note(result.finish_reason)
                    if note:
                        result = replace(result, text=result.text.rstrip() + note)
                    if len(messages) == len(context.messages):
                        return result, None  # no tool was called: the backend's answer as it is
                    return replace(usage, text=result.text, finish_reason=result.finish_reason), None
                messages.append(AssistantToolCalls(result.tool_calls, result.text))
                for call in result.tool_calls:
                    messages.append(await self._tools.execute(call, tools, offered))
                if tools.effects.complete:
                    text = tools.effects.completion_summary or result.text.strip() or "Done."
                    return replace(usage, text=text), None
            log.warning(
                "tool_loop_stopped",
                agent=profile.agent.slug,
                conversation_id=tools.conversation_id,
                rounds=self._max_tool_rounds,
            )
            text = (
                f"I could not answer: I kept calling tools and reached the limit of "
                f"{self._max_tool_rounds} model calls for one reply."
            )
            return replace(usage, text=text, extra={}), TOOL_LOOP_ERROR
        except BackendError as exc:
            failed = redacted(str(exc))  # the reply may be public: no piece of a key or account id in it
            log.warning(
                "backend_failed", agent=profile.agent.slug, conversation_id=tools.conversation_id,
                backend=profile.backend.name, error_kind=exc.kind, error=failed,
                action=f"the person is told; {_ADVICE.get(exc.kind, _CHECK_SETTINGS)}",
            )
            text = f"I could not answer: the {profile.backend.name} backend failed ({exc.kind}): {failed}"
            # Tokens spent by earlier rounds of this run, and by a summary call of the failed one, were spent.
            return _spent(text, model, prompt_tokens, completion_tokens, budget), exc.kind
        except Exception as exc:
            log.exception("backend_crashed", agent=profile.agent.slug, conversation_id=tools.conversation_id)
            text = f"I could not answer: internal error ({type(exc).__name__})."
            # as for a backend's error: the tokens of the earlier rounds were spent
            return _spent(text, model, prompt_tokens, completion_tokens, budget), "internal"

    async def _complete_within_budget(
        self,
        profile: AgentProfile,
        budget: RunBudget,
        messages: Sequence[LLMMessage],
        request: CompletionRequest,
    ) -> CompletionResult:
        """Send ``request`` with ``messages`` fitted to the agent's budget (docs/CONTEXT.md).

        When the provider still answers that the context is too long, retry with 50%, then 25%,
        then none of the middle messages (each try that would send the same as the one before is
        skipped); the last try's error is raised. Summary calls' tokens are added to the result.
        """
        sent = await budget.fit(messages)
        failure: ContextTooLongError | None = None
        for share in (None, *RETRY_SHARES):
            if share is not None:
                shrunk = budget.shrink(messages, share)
                if shrunk == list(sent):
                    continue
                log.warning(
                    "context_too_long_retry",
                    agent=profile.agent.slug,
                    share=share,
                    messages=len(shrunk),
                    error=str(failure),
                )
                sent = shrunk
            try:
                result = await profile.backend.complete(replace(request, messages=tuple(sent)))
                break
            except ContextTooLongError as exc:
                failure = exc
        else:
            assert failure is not None
            raise failure
        prompt, completion = budget.take_usage()
        if prompt or completion:
            result = replace(
                result,
                prompt_tokens=_add(result.prompt_tokens, prompt),
                completion_tokens=_add(result.completion_tokens, completion),
            )
        return result


class PartialStreamer:
    """Wraps a run's backend so the text it streams is published as it grows (kind 21111).

    The text streamed so far is published by a ticker at most once per ``interval_s``, and
    only when it changed; the ticker stops when the backend call returns, so a backend that
    cannot stream (it hands over the whole text once, at the end) publishes no partial, and
    the final reply is never preceded by a partial of the same text. Partials are best
    effort: a failed publication is logged and the run goes on.
    """

    def __init__(
        self,
        backend: LLMBackend,
        sink: PartialTextPublisher,
        interval_s: float,
        agent_slug: str,
        conversation_id: str,
        trigger_id: str,
    ) -> None:
        self.name = backend.name
        self.inner = backend
        """The wrapped backend (summary calls go to it directly: they are not the agent's reply)."""
        self._sink = sink
        self._interval = interval_s
        self._agent = agent_slug
        self._conversation = conversation_id
        self._trigger = trigger_id
        self._text = ""
        self._published = ""
        self.sequence = 0
        """How many partials this run published."""
        self._publishing: asyncio.Task[None] | None = None

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Call the backend with a chunk callback; publish the growing text while it runs."""
        self._text = ""
        self._published = ""
        outer = request.on_chunk

        async def on_chunk(piece: str) -> None:
            self._text += piece
            if outer is not None:
                await outer(piece)

        ticker = asyncio.create_task(self._tick())
        try:
            return await self.inner.complete(replace(request, on_chunk=on_chunk))
        finally:
            ticker.cancel()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            text = self._text
            if text.strip() and text != self._published and self._publishing is None:
                self._published = text
                self.sequence += 1
                self._publishing = asyncio.create_task(self._publish(text, self.sequence))

    async def _publish(self, text: str, sequence: int) -> None:
        try:
            await self._sink.partial(self._agent, self._conversation, self._trigger, text, sequence)
        except Exception as exc:
            log.info("partial_not_published", agent=self._agent, error=str(exc))
        finally:
            self._publishing = None

    async def close(self) -> None:
        """Wait for a partial still being published (so it goes out before the final reply)."""
        if self._publishing is not None:
            await asyncio.gather(self._publishing, return_exceptions=True)


_CHECK_SETTINGS = "check the backend settings (base_url, api_key_env, model)"
_ADVICE = {
    BackendErrorKind.CONTEXT_TOO_LONG: (
        "the message and persona outgrow the model's window even with the middle of history cut: set the "
        "agent's backend.context_window to the model's real window, or use a model with a larger one"
    ),
    BackendErrorKind.RATE_LIMIT: "the provider limits the calls: wait, or raise the account's limits",
    BackendErrorKind.TIMEOUT: "the model took too long: raise options.timeout, or use a faster model",
}
"""What the operator can do, by the kind of a backend's failure (settings are checked otherwise)."""


def _add(total: int | None, more: int | None) -> int | None:
    """Sum token counts over a run's backend calls (None while none was reported)."""
    if more is None:
        return total
    return more if total is None else total + more


def _spent(
    text: str, model: str | None, prompt_tokens: int | None, completion_tokens: int | None, budget: RunBudget
) -> CompletionResult:
    """A failed run's error reply with the tokens it spent: its earlier rounds' and the summary calls' not
    yet counted (a summary stored before the call that failed was paid for)."""
    summary_prompt, summary_completion = budget.take_usage()
    if summary_prompt or summary_completion:
        prompt_tokens = (prompt_tokens or 0) + summary_prompt
        completion_tokens = (completion_tokens or 0) + summary_completion
    return CompletionResult(
        text=text, model=model, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens
    )


def _cut_note(finish_reason: str | None) -> str:
    """The note said after an answer that ended so: cut at the length limit, or by the provider's filter."""
    if finish_reason in CUT_AT_LENGTH:
        return CUT_NOTE
    if finish_reason in CUT_BY_FILTER:
        return FILTER_NOTE
    return ""


def _masked(match: re.Match[str]) -> str:
    label = match.group("bearer") or match.group("label")
    return f"{label}<redacted>" if label else "<redacted>"


def redacted(text: str) -> str:
    """``text`` with what looks like a piece of a key or an account id replaced (:data:`CREDENTIAL`); a
    token's label (``Bearer``, ``api_key=``) is kept. For what may be published or logged of a provider's
    error (an agent's error reply, the orchestrator's log)."""
    return CREDENTIAL.sub(_masked, text)
