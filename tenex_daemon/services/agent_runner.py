"""One agent run: build its view, ask its backend (running the tools it calls), save the reply, then
sign and publish it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import structlog

from tenex_daemon.core.agents import Agent, AuthorRole
from tenex_daemon.core.budget import TokenBudget
from tenex_daemon.core.context import AgentContext
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.llm import (
    AssistantToolCalls,
    BackendError,
    CompletionRequest,
    CompletionResult,
    ContextTooLongError,
    LLMBackend,
    LLMMessage,
)
from tenex_daemon.core.ports import PartialTextPublisher, Publisher, ReplyComposer, ReplySpec
from tenex_daemon.core.vocabulary import TAG_DELEGATION, TAG_EVENT
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.services.delegation import Delegation, RunDelegator
from tenex_daemon.services.runs import RunRequest
from tenex_daemon.services.threads import ThreadManager
from tenex_daemon.services.token_budget import RETRY_SHARES, RunBudget
from tenex_daemon.services.tools import (
    SEND_MESSAGE,
    RunEffects,
    ToolContext,
    ToolRegistry,
    mark_conversation_ended,
)

DEFAULT_MAX_TOOL_ROUNDS = 8
"""How many times one run may ask its backend before an answer without tool calls is required."""
TOOL_LOOP_ERROR = "tool_loop"
"""The error kind of a run stopped because its backend kept calling tools."""
DEFAULT_TOOLS = ("complete", "switch_phase", "end_conversation", "get_conversation")
DEFAULT_PARTIAL_INTERVAL_S = 0.5
"""While a backend streams, the text so far is published at most this often (kind 21111)."""

log = structlog.get_logger(__name__)


class RunObserver(Protocol):
    """Told about runs (the app turns this into metrics)."""

    def run_finished(self, agent_slug: str, seconds: float, error: str | None) -> None:
        """A run ended; ``error`` names the failure kind, if any."""

    def reply_published(self, agent_slug: str, trigger_id: str, sent_at: float) -> None:
        """A reply to ``trigger_id`` reached at least one relay; ``sent_at``: when it was sent (epoch s)."""


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
    """The agent's token budget (CONTEXT.md, seed 003); None sends full history."""

    @property
    def system_prompt(self) -> str:
        """The persona put before the agent's messages."""
        base = f"You are {self.agent.name} ({self.agent.slug}), an agent of a TENEX project."
        return f"{base}\n\n{self.instructions}" if self.instructions else base


ReplyHook = Callable[[str, NostrEvent], Awaitable[object]]


def user_destination(conversation: Conversation, trigger: NostrEvent, manager: ConversationManager) -> str:
    """Return the person a reply goes to: the trigger's author if a user, else the newest user in history."""
    directory = manager.agents
    if directory.role_of(trigger.pubkey, conversation.claims_agent(trigger.pubkey)) is AuthorRole.USER:
        return trigger.pubkey
    for event in reversed(conversation.history):
        role = directory.role_of(event.pubkey, conversation.claims_agent(event.pubkey))
        if role is AuthorRole.USER:
            return event.pubkey
    root = conversation.root
    return root.pubkey if root is not None else trigger.pubkey


class AgentRunner:
    """Carries out :class:`RunRequest` s.

    The reply is added to history (accepted) before it is signed and published, so a
    crash after the model answered never loses it; the relay echo is then a duplicate.
    A backend failure becomes a reply tagged ``["error", "system"]`` saying what failed.
    Typing indicators and the publication of the saved reply run as tracked background
    tasks (:meth:`flush` waits for them), so a run does not hold its slot while relays
    acknowledge. Typing starts once a run has taken ``typing_delay_s`` (a reply faster
    than that shows no indicator, and costs the relays no start/stop pair); a stop is
    sent after the reply only when a start was.

    The agent's tools (``profile.tools``, from ``tools``) are offered to its backend; the
    calls it makes run and their results go back to it until it answers with text, at
    most ``max_tool_rounds`` backend calls per run (then the reply is an error saying so).
    A ``complete`` call makes the reply a completion (tagged ``["tool", "complete"]``,
    addressed to the orchestrator too); ``end_conversation`` archives the conversation
    once the reply is saved.

    With ``threads`` (a :class:`ThreadManager`), an agent other than the orchestrator is
    also offered ``send_message`` whenever another non-orchestrator agent is configured
    (see :mod:`~tenex_daemon.services.delegation`); without it, nobody is.
    """

    def __init__(
        self,
        manager: ConversationManager,
        profiles: Mapping[str, AgentProfile],
        composer: ReplyComposer,
        publisher: Publisher,
        *,
        observer: RunObserver | None = None,
        on_reply: ReplyHook | None = None,
        typing_delay_s: float = 0.0,
        tools: ToolRegistry | None = None,
        max_tool_rounds: int = DEFAULT_MAX_TOOL_ROUNDS,
        partials: PartialTextPublisher | None = None,
        partial_interval_s: float = DEFAULT_PARTIAL_INTERVAL_S,
        threads: ThreadManager | None = None,
    ) -> None:
        if max_tool_rounds < 1:
            raise ValueError("max_tool_rounds must be at least 1")
        self._manager = manager
        self._profiles = profiles
        self._composer = composer
        self._publisher = publisher
        self._observer = observer
        self._on_reply = on_reply
        self._before_save: ReplyHook | None = None
        self._typing_delay = typing_delay_s
        self._tools = tools or ToolRegistry.default()
        self._max_tool_rounds = max_tool_rounds
        if partial_interval_s <= 0:
            raise ValueError("partial_interval_s must be positive")
        self._partials = partials
        self._partial_interval = partial_interval_s
        for profile in profiles.values():
            unknown = set(profile.tools) - set(self._tools.names)
            if unknown:
                raise ValueError(f"agent {profile.agent.slug}: unknown tools {', '.join(sorted(unknown))}")
        self._outbox: set[asyncio.Task[None]] = set()
        self._delegation = (
            None
            if threads is None
            else Delegation(
                manager, profiles, threads, composer, publisher, answer=self._answer, schedule=self._send
            )
        )

    def _delegating(
        self, profile: AgentProfile, cid: str, trigger: NostrEvent
    ) -> tuple[AgentProfile, RunDelegator | None]:
        """The profile offered ``send_message`` too, and the run's delegator, when the agent may delegate."""
        delegation = self._delegation
        if delegation is None or not delegation.can_delegate(profile.agent):
            return profile, None
        tools = profile.tools if SEND_MESSAGE in profile.tools else (*profile.tools, SEND_MESSAGE)
        return replace(profile, tools=tools), delegation.for_run(profile.agent, cid, trigger)

    def set_reply_hook(self, hook: ReplyHook, before_save: ReplyHook | None = None) -> None:
        """Set what is told about each saved reply (the dispatcher's targeting), and what is told
        just before a reply that ``hook`` will be told about is saved (the dispatcher journals it)."""
        self._on_reply = hook
        self._before_save = before_save

    async def run(self, request: RunRequest) -> NostrEvent | None:
        """Run one agent for one trigger; return the reply event (None when the trigger is gone)."""
        started = time.perf_counter()
        cid = request.conversation_id
        profile = self._profiles[request.agent_slug]
        conversation = await self._manager.get_conversation(cid)
        index = conversation.index_of(request.trigger_id) if conversation is not None else None
        if conversation is None or index is None:
            log.error("run_trigger_missing", conversation_id=cid, event_id=request.trigger_id)
            return None
        trigger = conversation.history[index]
        saved = _answer_to(conversation.history, index, profile.agent.pubkey) if request.recovered else None
        if saved is not None:
            # Redone after a crash that came between the reply and the run's end: the reply is
            # saved, maybe never published. It goes out again (relays keep one copy per id).
            log.info("run_skipped", conversation_id=cid, event_id=trigger.id, reason="already answered")
            self._send(self._deliver(profile.agent.slug, cid, saved, False, trigger.id))
            return None
        typing_started: list[bool] = [self._typing_delay <= 0]  # no delay: the start is as good as sent
        typing = self._send(self._typing_after(self._typing_delay, profile.agent.slug, cid, typing_started))
        effects = RunEffects()
        streamer: PartialStreamer | None = None
        if self._partials is not None:
            streamer = PartialStreamer(
                profile.backend, self._partials, self._partial_interval, profile.agent.slug, cid, trigger.id
            )
            profile = replace(profile, backend=streamer)
        slug = profile.agent.slug
        try:
            context = await self._manager.build_agent_messages(cid, slug, trigger, start_execution=True)
            offered, delegator = self._delegating(profile, cid, trigger)
            tool_context = ToolContext(self._manager, cid, profile.agent, effects, delegator)
            result, error_kind = await self._answer(offered, context, tool_context)
        except BaseException:
            await self._stop_typing(streamer, typing, typing_started)
            await self._manager.stop_execution(cid)
            raise
        await self._stop_typing(streamer, typing, typing_started)
        new_session = result.session_id if result.session_id != context.session_id else None
        used = (result.prompt_tokens or 0, result.completion_tokens or 0)
        try:
            # the net time tagged is the live total: the stop is saved after the reply went out
            reply = await self._save_reply(
                request, profile, trigger, result, context.session_id, error_kind, effects
            )
            if effects.end_conversation:
                await mark_conversation_ended(
                    self._manager, cid, slug, effects.end_reason, time.time_ns() // 1_000_000
                )
            self._send(self._deliver(slug, cid, reply, typing_started[0], request.trigger_id))
        except BaseException:
            await self._manager.stop_execution(cid)
            raise
        try:
            # one save: the run's end, its session and token usage
            await self._manager.stop_execution(
                cid, agent_slug=slug, session_id=new_session, add_tokens=used if any(used) else None
            )
        except Exception:  # the reply is saved and on its way: the run still counts and routes on
            log.exception("run_end_not_saved", conversation_id=cid, agent=slug)
        if self._observer is not None:
            self._observer.run_finished(profile.agent.slug, time.perf_counter() - started, error_kind)
        if self._on_reply is not None and not effects.end_conversation:
            # An ended conversation is read-only: nobody is targeted by its last reply.
            await self._on_reply(cid, reply)
        return reply

    async def _answer(
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

        budget = RunBudget(
            context,
            profile.system_prompt,
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
                        system_prompt=profile.system_prompt,
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
            text = f"I could not answer: the {profile.backend.name} backend failed ({exc.kind}): {exc}"
            # Tokens spent by earlier rounds of this run were still spent.
            spent = CompletionResult(
                text=text, model=model, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens
            )
            return spent, exc.kind
        except Exception as exc:
            log.exception("backend_crashed", agent=profile.agent.slug, conversation_id=tools.conversation_id)
            text = f"I could not answer: internal error ({type(exc).__name__})."
            return CompletionResult(text=text), "internal"

    async def _complete_within_budget(
        self,
        profile: AgentProfile,
        budget: RunBudget,
        messages: Sequence[LLMMessage],
        request: CompletionRequest,
    ) -> CompletionResult:
        """Send ``request`` with ``messages`` fitted to the agent's budget (CONTEXT.md, seed 003).

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

    async def _save_reply(
        self,
        request: RunRequest,
        profile: AgentProfile,
        trigger: NostrEvent,
        result: CompletionResult,
        previous_session: str | None,
        error_kind: str | None,
        effects: RunEffects,
    ) -> NostrEvent:
        cid = request.conversation_id
        conversation = await self._manager.get_conversation(cid)
        assert conversation is not None
        session_id = result.session_id or previous_session
        destinations = [user_destination(conversation, trigger, self._manager)]
        complete = effects.complete and error_kind is None
        orchestrator = self._manager.agents.orchestrator
        if complete and orchestrator is not None and orchestrator.slug != profile.agent.slug:
            destinations.append(orchestrator.pubkey)
        spec = ReplySpec(
            agent_slug=profile.agent.slug,
            trigger=trigger,
            root=conversation.root,
            content=result.text,
            destinations=tuple(destinations),
            phase=conversation.phase.value,
            net_time_seconds=await self._manager.execution_seconds(cid),
            session_id=session_id,
            complete=complete,
            model=result.model,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            error=error_kind is not None,
        )
        reply = self._composer.compose(spec)
        if self._before_save is not None and self._on_reply is not None and not effects.end_conversation:
            await self._before_save(cid, reply)
        # A reply tagged ["tool", "complete"] is counted as the open turn's completion here, once.
        await self._manager.add_event(cid, reply)
        return reply

    @staticmethod
    async def _stop_typing(
        streamer: PartialStreamer | None, typing: asyncio.Task[None], typing_started: list[bool]
    ) -> None:
        """The answer is in: wait for a partial still going out, cancel a typing start not yet sent."""
        if streamer is not None:
            await streamer.close()
        if not typing_started[0]:
            typing.cancel()  # still waiting out the delay: nothing was sent

    def _send(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._outbox.add(task)
        task.add_done_callback(self._outbox.discard)
        return task

    async def flush(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for pending publications; return how many are still pending."""
        if not self._outbox:
            return 0
        _, pending = await asyncio.wait(set(self._outbox), timeout=timeout_s)
        return len(pending)

    async def _deliver(
        self, agent_slug: str, conversation_id: str, reply: NostrEvent, typing: bool, trigger_id: str
    ) -> None:
        await self._publish(agent_slug, reply, trigger_id)
        if typing:
            await self._typing(agent_slug, conversation_id, active=False)

    async def _typing_after(
        self, delay_s: float, agent_slug: str, conversation_id: str, started: list[bool]
    ) -> None:
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        started[0] = True
        await self._typing(agent_slug, conversation_id, active=True)

    async def _publish(self, agent_slug: str, reply: NostrEvent, trigger_id: str) -> None:
        sent_at = time.time()
        try:
            await self._publisher.publish(reply)
        except Exception as exc:
            # The reply is saved; a relay that comes back can be given it again by `rebuild`.
            log.error("reply_not_published", agent=agent_slug, event_id=reply.id, error=str(exc))
            return
        if self._observer is not None:
            self._observer.reply_published(agent_slug, trigger_id, sent_at)

    async def _typing(self, agent_slug: str, conversation_id: str, *, active: bool) -> None:
        try:
            await self._publisher.typing(agent_slug, conversation_id, active)
        except Exception as exc:
            log.info("typing_not_published", agent=agent_slug, error=str(exc))


def _answer_to(history: Sequence[NostrEvent], index: int, agent_pubkey: str) -> NostrEvent | None:
    """The agent's saved reply to ``history[index]``: a later event of its ``e``-tagging it (not a
    ``send_message`` request it made meanwhile, which carries a ``delegation`` tag)."""
    trigger_id = history[index].id
    for event in history[index + 1:]:
        if (
            event.pubkey == agent_pubkey
            and event.tag_value(TAG_EVENT) == trigger_id
            and event.tag_value(TAG_DELEGATION) is None
        ):
            return event
    return None


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


def _add(total: int | None, more: int | None) -> int | None:
    """Sum token counts over a run's backend calls (None while none was reported)."""
    if more is None:
        return total
    return more if total is None else total + more
