"""The daemon's notices in a conversation: a short reply from an agent that reports what the daemon did
(a stop, an answer the relays refused), tagged ``["error", "system"]`` and addressed to the person only,
so it runs nobody (docs/PROTOCOL.md, "Kinds": 24134; docs/ARCHITECTURE.md, "Delivery")."""

from __future__ import annotations

import structlog

from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.errors import ConversationArchivedError, ConversationNotFoundError
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.ports import ReplyComposer, ReplySpec
from tenex_daemon.services.agent_runner import user_destination
from tenex_daemon.services.conversation_manager import ConversationManager

log = structlog.get_logger(__name__)


def compose_notice(
    manager: ConversationManager,
    composer: ReplyComposer,
    conversation: Conversation,
    trigger: NostrEvent,
    agent_slug: str,
    content: str,
) -> NostrEvent:
    """``agent_slug``'s notice replying to ``trigger``, signed (not saved)."""
    spec = ReplySpec(
        agent_slug=agent_slug,
        trigger=trigger,
        root=conversation.root,
        task_id=conversation.task_id,
        missing_root=conversation.missing_root,
        subject=conversation.subject(),
        content=content,
        destinations=(user_destination(conversation, trigger, manager),),
        phase=conversation.phase.value,
        net_time_seconds=conversation.execution_time.total(manager.now_ms()),
        error=True,
    )
    return composer.compose(spec)


async def store_notice(
    manager: ConversationManager, conversation_id: str, notice: NostrEvent, *, kind_of: str
) -> bool:
    """Save a composed notice in its conversation (it does not reopen an ended one); False when the
    conversation is archived or gone (logged as ``<kind_of>_notice_not_saved``)."""
    try:
        await manager.add_event(conversation_id, notice, reopens=False)
    except (ConversationArchivedError, ConversationNotFoundError) as exc:
        reason = "archived" if isinstance(exc, ConversationArchivedError) else "gone"
        log.info(f"{kind_of}_notice_not_saved", conversation_id=conversation_id, reason=reason)
        return False
    return True
