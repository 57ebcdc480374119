"""What the daemon asks its relays for (docs/PROTOCOL.md, "Who answers an event"): events that p-tag its
agents or its project key; events the owner or a whitelisted person addresses to the project by its ``a``
tag (``31933:<owner>:<d>``, as TENEX clients start a conversation with no agent named: the orchestrator
routes them, none being p-tagged); and stop requests (kind 24134) from the people who may stop runs, or
p-tagging an agent (a stranger's is then counted as refused)."""

from __future__ import annotations

from typing import Any

from tenex_daemon.adapters.nostr.codec import project_address
from tenex_daemon.app.settings import Settings
from tenex_daemon.core.vocabulary import KIND_COMMENT, KIND_CONVERSATION_ROOT, KIND_NOTE, KIND_STOP, KIND_TASK

INCOMING_KINDS = [KIND_NOTE, KIND_CONVERSATION_ROOT, KIND_COMMENT, KIND_TASK]


def intake_filters(settings: Settings, pubkeys: list[str]) -> list[dict[str, Any]]:
    """The filters of the daemon's subscription: ``pubkeys`` are its agents' and its project key. Only people
    may address the project by its ``a`` tag (every reply of the agents carries it too)."""
    people = sorted({p for p in (settings.owner, *settings.whitelist) if p})
    filters: list[dict[str, Any]] = [
        {"kinds": INCOMING_KINDS, "#p": pubkeys},
        {"kinds": [KIND_STOP], "#p": pubkeys},
    ]
    if settings.owner:
        address = project_address(settings.owner, settings.project.d_tag)
        filters.append({"kinds": INCOMING_KINDS, "#a": [address], "authors": people})
    if people:
        filters.append({"kinds": [KIND_STOP], "authors": people})
    return filters
