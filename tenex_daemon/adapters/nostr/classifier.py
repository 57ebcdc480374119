"""What an incoming Nostr event is to tenexd, read from its kind and threading tags alone.

Both functions are pure: the relay pool's lane key and the dispatcher each call them on the
event, so nothing is remembered between the two.
"""

from __future__ import annotations

from tenex_daemon.core.classify import Classification, EventClass
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.vocabulary import (
    KIND_COMMENT,
    KIND_CONVERSATION_ROOT,
    KIND_GIFT_WRAP,
    KIND_NOTE,
    KIND_PRIVATE_MESSAGE,
    KIND_STOP,
    KIND_TASK,
    TAG_EVENT,
    TAG_PUBKEY,
)

from .codec import read_threading


def classify_event(event: NostrEvent) -> Classification:
    """Classify an incoming event: new conversation, reply, task, or ignored with the reason.

    kind 11 starts a conversation; kind 1934 starts a task (its own conversation); kind
    1111 and NIP-10 replies (kind 1 with ``e`` tags) continue the conversation of their
    root (a root of kind 1934 makes it a task reply); a kind-1 note that replies to
    nothing starts a conversation. A kind-24134 stop request names its conversation by its
    first ``e`` tag.
    """
    if event.kind == KIND_CONVERSATION_ROOT:
        return Classification(EventClass.NEW_CONVERSATION, event.id)
    if event.kind == KIND_TASK:
        return Classification(EventClass.TASK, event.id, is_task=True)
    if event.kind == KIND_STOP:
        root = event.tag_value(TAG_EVENT)
        if root is None:
            return Classification(EventClass.IGNORED, reason="stop_without_conversation")
        return Classification(EventClass.STOP, root)
    if event.kind == KIND_PRIVATE_MESSAGE:  # an unwrapped rumor: its conversation is chosen by its channel
        return Classification(EventClass.PRIVATE, event.id)
    if event.kind not in (KIND_COMMENT, KIND_NOTE):
        return Classification(EventClass.IGNORED, reason=f"unsupported_kind:{event.kind}")
    threading = read_threading(event)
    if threading.root_id is None:
        if event.kind == KIND_NOTE:
            return Classification(EventClass.NEW_CONVERSATION, event.id)
        return Classification(EventClass.IGNORED, reason="reply_without_root")
    return Classification(EventClass.REPLY, threading.root_id, is_task=threading.root_kind == KIND_TASK)


def conversation_lane(event: NostrEvent) -> str:
    """The relay pool's lane key: the event's conversation (its own id when it has none).

    Events of one conversation are delivered in order; different conversations at once. Gift wraps
    (kind 1059, opened only after this) go in the lane of the agent they are addressed to, in order.
    """
    if event.kind == KIND_GIFT_WRAP:
        return f"wrap:{event.tag_value(TAG_PUBKEY)}"
    return classify_event(event).conversation_id or event.id
