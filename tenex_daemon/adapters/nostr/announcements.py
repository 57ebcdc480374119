"""What the project announces about itself: each agent's kind-0 profile and the kind-24010 heartbeat."""

from __future__ import annotations

import json
from collections.abc import Sequence

from tenex_daemon.core.agents import Agent
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.vocabulary import KIND_PROFILE, KIND_PROJECT_STATUS

from .codec import heartbeat_tags
from .signer import Signer


def profile_event(signer: Signer, agent: Agent, about: str) -> NostrEvent:
    """Return an agent's kind-0 profile."""
    content = json.dumps({"name": agent.name, "display_name": agent.name, "about": about}, ensure_ascii=False)
    return signer.sign(KIND_PROFILE, content, [])


def heartbeat_event(
    project_signer: Signer, agents: Sequence[Agent], project: tuple[str, str] | None
) -> NostrEvent:
    """Return the project's kind-24010 status heartbeat: one ``["agent", pubkey, slug]`` tag per agent."""
    tags = heartbeat_tags(((agent.pubkey, agent.slug) for agent in agents), project)
    return project_signer.sign(KIND_PROJECT_STATUS, "", tags)
