"""Conversations an earlier tenexd stored, brought up to date once, at the daemon's start
(docs/ARCHITECTURE.md, "Conversation lifecycle": Upgrading).

A conversation stored before the lifecycle's fields is brought up to date each time it loads
(:meth:`~tenex_daemon.core.conversation.Conversation.from_state`); this pass saves each such one once, so
the index rows the sweeps choose by (last activity, title source, end, description) are right before
the first sweep: none is ended, archived, deleted or described by the time of the upgrade.
"""

from __future__ import annotations

import structlog

from tenex_daemon.core.search import SearchQuery
from tenex_daemon.services.conversation_manager import ConversationManager

log = structlog.get_logger(__name__)


async def save_upgraded_conversations(manager: ConversationManager) -> int:
    """Save every conversation an earlier tenexd stored (its row has no last activity), brought up to date;
    return how many. One that fails is logged and left (it is brought up to date as it loads, and saved
    so by its next change)."""
    upgraded = 0
    for row in await manager.store.search(SearchQuery()):
        if row.activity_at:
            continue
        try:
            if await manager.save_upgraded(row.id):
                upgraded += 1
        except Exception:
            log.exception("conversation_upgrade_failed", conversation_id=row.id)
    if upgraded:
        log.info("conversations_upgraded", count=upgraded)
    return upgraded
