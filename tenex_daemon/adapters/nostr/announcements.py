"""What the project announces about itself: each agent's kind-0 profile and the kind-24010 heartbeat.

Agents are Nostr citizens (NIP-AE draft): a profile says it is a bot's (``["bot"]``) and whose
(``["p", <owner>]``); the heartbeat says which model each agent thinks with and which tools it is
offered, in the shapes TENEX clients read (docs/PROTOCOL.md).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from tenex_daemon.core.agents import Agent
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.vocabulary import (
    KIND_PROFILE,
    KIND_PROJECT_STATUS,
    TAG_BOT,
    TAG_MODEL,
    TAG_PUBKEY,
    TAG_TOOL,
)

from .codec import Tags, heartbeat_tags
from .signer import Signer


@dataclass(frozen=True, slots=True)
class AgentCapabilities:
    """What the heartbeat tells about one agent: the model it thinks with and the tools it is offered."""

    model: str | None
    tools: tuple[str, ...] = ()


def profile_tags(owner: str | None) -> Tags:
    """The tags of an agent's kind-0 profile: ``["bot"]``, then ``["p", <owner>]`` when there is an owner."""
    tags: Tags = [[TAG_BOT]]
    if owner:
        tags.append([TAG_PUBKEY, owner])
    return tags


def profile_event(signer: Signer, agent: Agent, about: str, owner: str | None = None) -> NostrEvent:
    """Return an agent's kind-0 profile, tagged as a bot's and (when configured) its owner's."""
    content = json.dumps({"name": agent.name, "display_name": agent.name, "about": about}, ensure_ascii=False)
    return signer.sign(KIND_PROFILE, content, profile_tags(owner))


def _grouped(pairs: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """Value -> the slugs that have it, both in first-seen order, each slug once per value."""
    groups: dict[str, list[str]] = {}
    for value, slug in pairs:
        slugs = groups.setdefault(value, [])
        if slug not in slugs:
            slugs.append(slug)
    return groups


def capability_tags(agents: Sequence[Agent], capabilities: Mapping[str, AgentCapabilities]) -> Tags:
    """The heartbeat's model and tool tags: ``["model", <model>, <slug>...]`` per model, then
    ``["tool", <tool>, <slug>...]`` per tool, each naming the agents (in the agents' order) that use it.

    An agent missing from ``capabilities``, or without a model, gets no model tag.
    """
    known = [(agent.slug, capabilities[agent.slug]) for agent in agents if agent.slug in capabilities]
    models = _grouped((c.model, slug) for slug, c in known if c.model)
    tools = _grouped((tool, slug) for slug, c in known for tool in c.tools)
    return [[TAG_MODEL, model, *slugs] for model, slugs in models.items()] + [
        [TAG_TOOL, tool, *slugs] for tool, slugs in tools.items()
    ]


def heartbeat_event(
    project_signer: Signer,
    agents: Sequence[Agent],
    project: tuple[str, str] | None,
    capabilities: Mapping[str, AgentCapabilities] | None = None,
) -> NostrEvent:
    """Return the project's kind-24010 status heartbeat: one ``["agent", pubkey, slug]`` tag per agent,
    the project's ``a`` tag, then each model's and each tool's tag (:func:`capability_tags`)."""
    tags = heartbeat_tags(((agent.pubkey, agent.slug) for agent in agents), project)
    if capabilities:
        tags += capability_tags(agents, capabilities)
    return project_signer.sign(KIND_PROJECT_STATUS, "", tags)
