"""The agents' persona specs read from a home's settings, for the context preview when no daemon runs.

A running daemon's preview uses its runner's profiles (:attr:`AgentRunner.profiles`), built by
:func:`~tenex_daemon.app.wiring.build_agent_profile` from the same settings; this builds no backend,
so an agent whose budget depends on a loaded local model (its tokenizer, or its ``n_ctx`` when no
``context_window`` is set) is counted as characters/4 here, or has no budget.
"""

from __future__ import annotations

from collections.abc import Iterable

from tenex_daemon.app.settings import Settings
from tenex_daemon.app.wiring import build_token_budget
from tenex_daemon.core.agents import Agent
from tenex_daemon.services.persona import PersonaSpec


def persona_specs(settings: Settings, agents: Iterable[Agent]) -> dict[str, PersonaSpec]:
    """Each configured agent's persona spec by slug: its name, instructions, token budget and
    ``conversations.recent_in_persona``."""
    configured = {a.slug: a for a in settings.agents}
    specs: dict[str, PersonaSpec] = {}
    for agent in agents:
        agent_settings = configured.get(agent.slug)
        if agent_settings is None:
            continue
        specs[agent.slug] = PersonaSpec(
            agent,
            agent_settings.instructions,
            build_token_budget(agent_settings.backend, None),
            settings.conversations.recent_in_persona,
        )
    return specs
