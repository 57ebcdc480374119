"""What the daemon asks its relays for (docs/PROTOCOL.md, "Who answers an event"): events that p-tag its
agents or its project key; events the owner or a whitelisted person addresses to the project by its ``a``
tag (``31933:<owner>:<d>``, as TENEX clients start a conversation with no agent named: the orchestrator
routes them, none being p-tagged), from when the daemon first asked for them on (:func:`addressed_since`);
and stop requests (kind 24134) from the people who may stop runs, or p-tagging an agent (a stranger's is
then counted as refused)."""

from __future__ import annotations

import time
from typing import Any

from tenex_daemon.adapters.nostr.codec import project_address
from tenex_daemon.app.settings import Settings
from tenex_daemon.core.ports import Store
from tenex_daemon.core.vocabulary import KIND_COMMENT, KIND_CONVERSATION_ROOT, KIND_NOTE, KIND_STOP, KIND_TASK

INCOMING_KINDS = [KIND_NOTE, KIND_CONVERSATION_ROOT, KIND_COMMENT, KIND_TASK]
ADDRESSED_SINCE_KEY = "intake.project_address_since"
"""The small value holding when the daemon first asked for what is addressed to the project by its ``a``
tag (Unix seconds)."""


async def addressed_since(store: Store) -> int:
    """When the daemon first asked its relays for what is addressed to the project by its ``a`` tag: now, the
    first time (kept). It is never asked for from before: a home made for a project people wrote to for
    months (or one upgraded to ask for it) would otherwise answer every such message as new. One kept ahead of
    now (a first start while the clock ran fast) would keep every such message from being asked again after a
    downtime until that time came: it is kept as now instead. (Not as where the subscription's cursors ask
    from: those may be months old, from before the first asking; the downtime just before this start is not
    asked for by that filter.)"""
    stored = await store.get_meta(ADDRESSED_SINCE_KEY)
    now = int(time.time())
    if stored is not None and stored.isdigit() and int(stored) <= now:
        return int(stored)
    await store.set_meta(ADDRESSED_SINCE_KEY, str(now))
    return now


def intake_filters(settings: Settings, pubkeys: list[str], since: int) -> list[dict[str, Any]]:
    """The filters of the daemon's subscription: ``pubkeys`` are its agents' and its project key. Only people
    may address the project by its ``a`` tag (every reply of the agents carries it too), from ``since`` on
    (:func:`addressed_since`)."""
    people = sorted({p for p in (settings.owner, *settings.whitelist) if p})
    filters: list[dict[str, Any]] = [
        {"kinds": INCOMING_KINDS, "#p": pubkeys},
        {"kinds": [KIND_STOP], "#p": pubkeys},
    ]
    if settings.owner:
        address = project_address(settings.owner, settings.project.d_tag)
        filters.append({"kinds": INCOMING_KINDS, "#a": [address], "authors": people, "since": since})
    if people:
        filters.append({"kinds": [KIND_STOP], "authors": people})
    return filters
