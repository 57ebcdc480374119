"""How an incoming event is classified once, before one handler takes it."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from tenex_daemon.core.events import NostrEvent


class EventClass(StrEnum):
    """What an incoming event is to tenexd."""

    NEW_CONVERSATION = "new_conversation"
    REPLY = "reply"
    TASK = "task"
    STOP = "stop"
    """A request to stop the runs of a conversation (kind 24134): ``conversation_id`` names it."""
    PRIVATE = "private"
    """A NIP-17 private message (the kind-14 rumor of a gift wrap): it joins the person's private
    conversation with the agent."""
    IGNORED = "ignored"


@dataclass(frozen=True, slots=True)
class Classification:
    """The class of an event, the conversation it belongs to, and why it is ignored if it is."""

    kind: EventClass
    conversation_id: str | None = None
    reason: str | None = None
    is_task: bool = False


class EventClassifier(Protocol):
    """Reads an event's kind and threading tags (implemented with the Nostr codec).

    A pure function of the event: the relay pool's delivery lanes and the dispatcher each
    classify the same event, and both get the same answer without sharing any state.
    """

    def __call__(self, event: NostrEvent) -> Classification:
        """Return the event's classification."""
