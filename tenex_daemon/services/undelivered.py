"""Telling the person when an agent's event could not be published at all.

The outbox tries an event again until a relay accepts it, except when every relay refused it for good
(:class:`~tenex_daemon.core.errors.EventRefusedError`: NIP-01 ``blocked:`` or ``invalid:`` for its size,
or a rumor too long to gift-wrap). The event stays saved in its conversation (``tenexd conversations
show`` reads it), and the person gets a short notice from the same agent instead, saying why: a reply
to the event's trigger, tagged ``["error", "system"]`` and addressed to the person only, so it runs
nobody (docs/ARCHITECTURE.md, "Delivery"). A notice that is itself refused gets no notice.
"""

from __future__ import annotations

import structlog

from tenex_daemon.core.errors import ConversationArchivedError, EventRefusedError
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.ports import ReplyComposer, ReplySpec
from tenex_daemon.core.vocabulary import TAG_ERROR
from tenex_daemon.services.agent_runner import user_destination
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.services.outbox import OutboxEntry

log = structlog.get_logger(__name__)

REASON_CHARS = 300
"""The most of the relays' own words a notice quotes."""


class RefusalNotices:
    """Gives the notice of an event every relay refused for good (the outbox's ``on_refused``)."""

    def __init__(self, manager: ConversationManager, composer: ReplyComposer) -> None:
        self._manager = manager
        self._composer = composer

    async def notice(self, entry: OutboxEntry, refusal: EventRefusedError) -> NostrEvent | None:
        """Save and return the notice for ``entry``'s refused event (None: a refused notice, or its
        conversation is gone or archived)."""
        if entry.event.has_tag(TAG_ERROR):
            return None
        conversation = await self._manager.get_conversation(entry.conversation_id)
        if conversation is None:
            return None
        index = conversation.index_of(entry.trigger_id) if entry.trigger_id is not None else None
        trigger = conversation.history[index] if index is not None else conversation.root
        if trigger is None:
            return None
        name = self._manager.agents.get(entry.agent_slug).name
        reasons = "; ".join(refusal.reasons) or str(refusal)
        if len(reasons) > REASON_CHARS:
            reasons = reasons[: REASON_CHARS - 1] + "…"
        spec = ReplySpec(
            agent_slug=entry.agent_slug,
            trigger=trigger,
            root=conversation.root,
            task_id=conversation.task_id,
            content=f"{name}'s answer could not be published: the relays refused it ({reasons}).",
            destinations=(user_destination(conversation, trigger, self._manager),),
            phase=conversation.phase.value,
            net_time_seconds=conversation.execution_time.total(self._manager.now_ms()),
            error=True,
        )
        notice = self._composer.compose(spec)
        try:
            await self._manager.add_event(entry.conversation_id, notice)
        except ConversationArchivedError:
            log.info("refusal_notice_not_saved", conversation_id=entry.conversation_id, reason="archived")
            return None
        return notice
