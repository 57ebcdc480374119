"""Typed identifiers used across tenexd."""

from __future__ import annotations

from typing import Final, NewType

_HEX: Final = frozenset("0123456789abcdef")

EventId = NewType("EventId", str)
"""A Nostr event id: 64 lowercase hex characters."""

PubKey = NewType("PubKey", str)
"""A Nostr public key in hex (x-only, 64 lowercase hex characters)."""

ConversationId = NewType("ConversationId", str)
"""A conversation's id: the id of its root event."""

AgentSlug = NewType("AgentSlug", str)
"""An agent's short, stable name inside a project (``planner``, ``executor``...)."""

TurnId = NewType("TurnId", str)
"""An orchestrator turn's id."""


def is_hex(value: object, length: int) -> bool:
    """Whether ``value`` is a string of exactly ``length`` lower-case hex characters."""
    return isinstance(value, str) and len(value) == length and _HEX.issuperset(value)
