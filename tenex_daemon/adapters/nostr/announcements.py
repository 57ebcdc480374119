"""What the project announces about itself: each agent's kind-0 profile and kind-10050 relay list, and
the kind-24010 heartbeat.

Agents are Nostr citizens (NIP-AE draft): a profile says it is a bot's (``["bot"]``) and whose
(``["p", <owner>]``); the heartbeat says which model each agent thinks with and which tools it is
offered, in the shapes TENEX clients read; the relay list tells NIP-17 clients where to send an agent
private messages (docs/PROTOCOL.md).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from tenex_daemon.core.agents import Agent
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.vocabulary import (
    KIND_DM_RELAYS,
    KIND_PROFILE,
    KIND_PROJECT_STATUS,
)

from .codec import capability_tags, dm_relay_tags, heartbeat_tags, profile_tags
from .signer import Signer

if TYPE_CHECKING:
    from .relay_pool import RelayPool

log = structlog.get_logger(__name__)

ANNOUNCE_TIMEOUT_S = 5.0
"""How long the start waits for the relays to take the agents' announcements."""


@dataclass(frozen=True, slots=True)
class AgentCapabilities:
    """What the heartbeat tells about one agent: the model it thinks with and the tools it is offered."""

    model: str | None
    tools: tuple[str, ...] = ()


def profile_event(signer: Signer, agent: Agent, about: str, owner: str | None = None) -> NostrEvent:
    """Return an agent's kind-0 profile, tagged as a bot's and (when configured) its owner's."""
    content = json.dumps({"name": agent.name, "display_name": agent.name, "about": about}, ensure_ascii=False)
    return signer.sign(KIND_PROFILE, content, profile_tags(owner))


def dm_relays_event(signer: Signer, relays: Iterable[str]) -> NostrEvent:
    """Return an agent's kind-10050 relay list (NIP-17): the relays its private messages are read from."""
    return signer.sign(KIND_DM_RELAYS, "", dm_relay_tags(relays))


async def announce(
    pool: RelayPool, agents: Sequence[tuple[Agent, Signer, str]], owner: str | None,
    dm_relays: Sequence[str] | None,
) -> None:
    """Publish each agent's (agent, signer, about) profile (kind 0) and, with ``dm_relays`` (private
    messages are answered), its relay list (kind 10050: the daemon's relays, where NIP-17 clients send it
    private messages), all at once; failures are logged, never fatal."""
    announced: list[tuple[str, NostrEvent]] = []
    for agent, signer, about in agents:
        announced.append((agent.slug, profile_event(signer, agent, about, owner)))
        if dm_relays is not None:
            announced.append((agent.slug, dm_relays_event(signer, dm_relays)))

    async def publish(slug: str, event: NostrEvent) -> None:
        result = await pool.publish(event, timeout=ANNOUNCE_TIMEOUT_S, raise_on_failure=False)
        if not result.ok:
            log.warning("announcement_not_published", agent=slug, kind=event.kind)

    await asyncio.gather(*(publish(slug, event) for slug, event in announced))


def heartbeat_event(
    project_signer: Signer,
    agents: Sequence[Agent],
    project: tuple[str, str] | None,
    capabilities: Mapping[str, AgentCapabilities] | None = None,
) -> NostrEvent:
    """Return the project's kind-24010 status heartbeat: one ``["agent", pubkey, slug]`` tag per agent,
    the project's ``a`` tag, then each model's and each tool's tag (:func:`capability_tags`)."""
    tags = heartbeat_tags(((agent.pubkey, agent.slug) for agent in agents), project)
    if capabilities:  # an agent missing from them: no model or tool tag
        known = [(a.slug, capabilities[a.slug]) for a in agents if a.slug in capabilities]
        tags += capability_tags([(slug, c.model, c.tools) for slug, c in known])
    return project_signer.sign(KIND_PROJECT_STATUS, "", tags)
