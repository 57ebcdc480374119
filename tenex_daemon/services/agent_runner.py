"""One agent run: build its view, ask its backend, save the reply, then sign and publish it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from tenex_daemon.core.agents import Agent, AuthorRole
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.llm import BackendError, CompletionRequest, CompletionResult, LLMBackend
from tenex_daemon.core.ports import Publisher, ReplyComposer, ReplySpec
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.services.runs import RunRequest

log = structlog.get_logger(__name__)


class RunObserver(Protocol):
    """Told about runs (the app turns this into metrics)."""

    def run_finished(self, agent_slug: str, seconds: float, error: str | None) -> None:
        """A run ended; ``error`` names the failure kind, if any."""

    def reply_published(self, agent_slug: str, trigger_id: str, sent_at: float) -> None:
        """A reply to ``trigger_id`` reached at least one relay; ``sent_at``: when it was sent (epoch s)."""


@dataclass(frozen=True, slots=True)
class AgentProfile:
    """What an agent run needs besides the conversation: persona and backend."""

    agent: Agent
    instructions: str
    backend: LLMBackend
    model: str | None = None

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
    ) -> None:
        self._manager = manager
        self._profiles = profiles
        self._composer = composer
        self._publisher = publisher
        self._observer = observer
        self._on_reply = on_reply
        self._typing_delay = typing_delay_s
        self._outbox: set[asyncio.Task[None]] = set()

    def set_reply_hook(self, hook: ReplyHook) -> None:
        """Set what is told about each saved reply (the dispatcher's targeting)."""
        self._on_reply = hook

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
        typing_started: list[bool] = [self._typing_delay <= 0]  # no delay: the start is as good as sent
        typing = self._send(self._typing_after(self._typing_delay, profile.agent.slug, cid, typing_started))
        error_kind: str | None = None
        await self._manager.start_execution(cid)
        try:
            context = await self._manager.build_agent_messages(cid, profile.agent.slug, trigger)
            completion = CompletionRequest(
                agent_slug=profile.agent.slug,
                agent_name=profile.agent.name,
                system_prompt=profile.system_prompt,
                messages=context.messages,
                session_id=context.session_id,
                model=profile.model,
            )
            try:
                result = await profile.backend.complete(completion)
            except BackendError as exc:
                error_kind = exc.kind
                result = CompletionResult(
                    text=f"I could not answer: the {profile.backend.name} backend failed ({exc.kind}): {exc}"
                )
            except Exception as exc:
                error_kind = "internal"
                log.exception("backend_crashed", agent=profile.agent.slug, conversation_id=cid)
                result = CompletionResult(text=f"I could not answer: internal error ({type(exc).__name__}).")
        finally:
            await self._manager.stop_execution(cid)
            if not typing_started[0]:
                typing.cancel()  # still waiting out the delay: nothing was sent
        reply = await self._save_reply(request, profile, trigger, result, context.session_id, error_kind)
        self._send(self._deliver(profile.agent.slug, cid, reply, typing_started[0], request.trigger_id))
        if self._observer is not None:
            self._observer.run_finished(profile.agent.slug, time.perf_counter() - started, error_kind)
        if self._on_reply is not None:
            await self._on_reply(cid, reply)
        return reply

    async def _save_reply(
        self,
        request: RunRequest,
        profile: AgentProfile,
        trigger: NostrEvent,
        result: CompletionResult,
        previous_session: str | None,
        error_kind: str | None,
    ) -> NostrEvent:
        cid = request.conversation_id
        conversation = await self._manager.get_conversation(cid)
        assert conversation is not None
        session_id = result.session_id or previous_session
        spec = ReplySpec(
            agent_slug=profile.agent.slug,
            trigger=trigger,
            root=conversation.root,
            content=result.text,
            destinations=(user_destination(conversation, trigger, self._manager),),
            phase=conversation.phase.value,
            net_time_seconds=await self._manager.execution_seconds(cid),
            session_id=session_id,
            model=result.model,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            error=error_kind is not None,
        )
        reply = self._composer.compose(spec)
        await self._manager.add_event(cid, reply)
        if result.session_id and result.session_id != previous_session:
            await self._manager.update_agent_state(cid, profile.agent.slug, session_id=result.session_id)
        if request.via_orchestrator:
            await self._manager.add_completion_to_turn(cid, profile.agent.slug, result.text)
        return reply

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
