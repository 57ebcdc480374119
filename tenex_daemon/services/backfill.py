"""How an event a rebuild merges (a backfill) counts: as written when it was, not when the rebuild ran
(docs/ARCHITECTURE.md, "Delivery"). The conversation manager dates a conversation it creates and the
events it appends by these rules when asked to backfill."""

from __future__ import annotations

from tenex_daemon.core.agents import AgentDirectory
from tenex_daemon.core.context import is_person_message
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.events import NostrEvent


def written_at(event: NostrEvent, now_ms: int) -> int:
    """When ``event`` counts as written (ms since the epoch): its ``created_at``, or ``now_ms`` for an event
    dated ahead of the clock (a conversation's times are never in the future)."""
    return min(event.created_at * 1000, now_ms)


def is_newest_person_message(conversation: Conversation, agents: AgentDirectory, event: NostrEvent) -> bool:
    """Whether no person's message in history is newer than ``event`` (its ``created_at``): a message a
    rebuild merges becomes the latest person message only then (one scan of history, for a rebuild)."""
    return not any(
        e.created_at > event.created_at and is_person_message(conversation, agents, e)
        for e in conversation.history
    )
