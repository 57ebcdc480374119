"""Telling the person when an agent's event could not be published at all.

The outbox tries an event again until a relay accepts it, except when every relay refused it for good
(:class:`~tenex_daemon.core.errors.EventRefusedError`: NIP-01 ``blocked:`` or ``invalid:`` for its size,
or a rumor too long to gift-wrap). The event stays saved in its conversation (``tenexd conversations
show`` reads it), and the person gets a short notice from the same agent instead, saying why: a reply
to the event's trigger, tagged ``["error", "system"]`` and addressed to the person only, so it runs
nobody (docs/ARCHITECTURE.md, "Delivery"). A notice that is itself refused gets no notice.
"""

from __future__ import annotations

from tenex_daemon.core.errors import EventRefusedError
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.ports import ReplyComposer
from tenex_daemon.core.text import shortened
from tenex_daemon.core.vocabulary import TAG_DELEGATION, TAG_ERROR
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.services.notices import compose_notice, store_notice
from tenex_daemon.services.outbox import OutboxEntry

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
        reasons = shortened("; ".join(refusal.reasons) or str(refusal), REASON_CHARS)
        what = self._what(entry.event, name)
        content = f"{what} could not be published: the relays refused it ({reasons})."
        slug = entry.agent_slug
        notice = compose_notice(self._manager, self._composer, conversation, trigger, slug, content)
        saved = await store_notice(self._manager, conversation.id, notice, kind_of="refusal")
        return notice if saved else None

    def _what(self, event: NostrEvent, name: str) -> str:
        """What was refused: "<name>'s answer", or for a side of a ``send_message`` exchange "<name>'s
        message to <the agents it addresses>"."""
        if event.tag_value(TAG_DELEGATION) is None:
            return f"{name}'s answer"
        agents = (self._manager.agents.by_pubkey(pubkey) for pubkey in event.tag_values("p"))
        to = ", ".join(dict.fromkeys(agent.name for agent in agents if agent is not None)) or "another agent"
        return f"{name}'s message to {to}"
