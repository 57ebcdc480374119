"""Incoming events: classified once, then one handler from a table; every outcome has a reason."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from enum import StrEnum

import structlog

from tenex_daemon.core.classify import Classification, EventClass, EventClassifier
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.ports import EventFetcher
from tenex_daemon.core.targeting import (
    SkipReason,
    agent_chain_length,
    choose_target,
    is_allowed_author,
)
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.services.orchestrator import RuleBasedOrchestrator
from tenex_daemon.services.runs import RunRequest, RunScheduler

log = structlog.get_logger(__name__)


class Outcome(StrEnum):
    """What handling an event did."""

    SCHEDULED = "scheduled"
    """Accepted and at least one agent run scheduled."""
    STORED = "stored"
    """Accepted into a conversation; no agent runs (``reason`` says why)."""
    DUPLICATE = "duplicate"
    IGNORED = "ignored"
    """Not accepted (``reason`` says why)."""


@dataclass(frozen=True, slots=True)
class HandleResult:
    """The outcome of one event, for logs, metrics and tests."""

    outcome: Outcome
    reason: str | None = None
    conversation_id: str | None = None
    agents: tuple[str, ...] = ()


Handler = Callable[[NostrEvent, Classification], Awaitable[HandleResult]]


class EventDispatcher:
    """Accepts events into conversations and decides which agent answers.

    An event is accepted (stored durably by the manager) before any run is scheduled.
    """

    def __init__(
        self,
        manager: ConversationManager,
        scheduler: RunScheduler,
        classify: EventClassifier,
        orchestrator: RuleBasedOrchestrator,
        *,
        owner: str | None,
        whitelist: Collection[str] = (),
        hop_limit: int = 6,
        fetcher: EventFetcher | None = None,
    ) -> None:
        self._manager = manager
        self._scheduler = scheduler
        self._classify = classify
        self._orchestrator = orchestrator
        self._owner = owner
        self._whitelist = frozenset(whitelist)
        self._hop_limit = hop_limit
        self._fetcher = fetcher
        self._handlers: dict[EventClass, Handler] = {
            EventClass.NEW_CONVERSATION: self._on_root,
            EventClass.TASK: self._on_root,
            EventClass.REPLY: self._on_reply,
            EventClass.IGNORED: self._on_ignored,
        }

    async def handle(self, event: NostrEvent) -> HandleResult:
        """Classify ``event`` once and run its handler."""
        directory = self._manager.agents
        if not is_allowed_author(event.pubkey, directory, self._owner, self._whitelist):
            return HandleResult(Outcome.IGNORED, SkipReason.AUTHOR_NOT_ALLOWED.value)
        classification = self._classify(event)
        result = await self._handlers[classification.kind](event, classification)
        log.info(
            "event_handled",
            event_id=event.id,
            kind=event.kind,
            classified=classification.kind.value,
            outcome=result.outcome.value,
            reason=result.reason,
            conversation_id=result.conversation_id,
            agents=list(result.agents),
        )
        return result

    async def _on_ignored(self, event: NostrEvent, classification: Classification) -> HandleResult:
        return HandleResult(Outcome.IGNORED, classification.reason or "unclassified")

    async def _on_root(self, event: NostrEvent, classification: Classification) -> HandleResult:
        existing = await self._manager.get_conversation(event.id)
        if existing is not None:
            return HandleResult(Outcome.DUPLICATE, conversation_id=event.id)
        conversation = await self._manager.create_conversation(event)
        return await self._target(conversation.id, event)

    async def _on_reply(self, event: NostrEvent, classification: Classification) -> HandleResult:
        cid = classification.conversation_id
        assert cid is not None
        conversation = await self._manager.get_conversation(cid)
        if conversation is None:
            conversation = await self._adopt_root(cid, event)
            if conversation.id == event.id:
                return await self._target(conversation.id, event)
        if conversation.archived:
            await self._manager.restore_conversation(cid)
            log.info("conversation_restored", conversation_id=cid, reason="new_activity")
        if not await self._manager.add_event(conversation.id, event):
            return HandleResult(Outcome.DUPLICATE, conversation_id=conversation.id)
        return await self._target(conversation.id, event)

    async def _adopt_root(self, root_id: str, reply: NostrEvent) -> Conversation:
        """Start the conversation of a reply with an unknown root: the fetched root, else the reply."""
        root = await self._fetcher.fetch_event(root_id) if self._fetcher is not None else None
        if root is not None and root.id == root_id and root.has_valid_id():
            log.info("conversation_root_fetched", conversation_id=root_id)
            return await self._manager.create_conversation(root)
        log.warning(
            "conversation_root_missing",
            conversation_id=root_id,
            event_id=reply.id,
            action="reply starts the conversation",
        )
        return await self._manager.create_conversation(reply)

    async def after_reply(self, conversation_id: str, reply: NostrEvent) -> HandleResult:
        """Target an agent's own saved reply (it may address another agent or the orchestrator)."""
        return await self._target(conversation_id, reply)

    async def _target(self, conversation_id: str, event: NostrEvent) -> HandleResult:
        directory = self._manager.agents
        target = choose_target(event, directory)
        if target.skip is not None and not target.via_orchestrator:
            return HandleResult(Outcome.STORED, target.skip.value, conversation_id)
        conversation = await self._manager.get_conversation(conversation_id)
        assert conversation is not None
        if directory.by_pubkey(event.pubkey) is not None:
            chain = agent_chain_length(conversation.history, directory)
            if chain > self._hop_limit:
                log.warning(
                    "hop_limit_reached", conversation_id=conversation_id, chain=chain, limit=self._hop_limit
                )
                return HandleResult(Outcome.STORED, SkipReason.HOP_LIMIT.value, conversation_id)
        if not target.via_orchestrator and target.agent is not None:
            request = RunRequest(conversation_id, event.id, target.agent.slug)
            await self._scheduler.submit(request)
            return HandleResult(Outcome.SCHEDULED, None, conversation_id, (target.agent.slug,))
        if target.skip is SkipReason.OWN_EVENT:
            return HandleResult(Outcome.STORED, target.skip.value, conversation_id)
        decision = self._orchestrator.route(conversation, event)
        if decision is None:
            return HandleResult(Outcome.STORED, SkipReason.NO_AGENT.value, conversation_id)
        await self._manager.start_orchestrator_turn(
            conversation_id, decision.phase or conversation.phase, decision.agents, decision.reason
        )
        for slug in decision.agents:
            await self._scheduler.submit(RunRequest(conversation_id, event.id, slug, via_orchestrator=True))
        return HandleResult(Outcome.SCHEDULED, decision.reason, conversation_id, decision.agents)
