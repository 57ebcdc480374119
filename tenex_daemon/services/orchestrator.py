"""Routing without a language model: an explicit mention wins, else the default agent."""

from __future__ import annotations

from dataclasses import dataclass

from tenex_daemon.core.agents import Agent, AgentDirectory
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.errors import UnknownAgentError
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.targeting import mentioned_agent


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    """Which agents work next, in which phase, and why."""

    agents: tuple[str, ...]
    reason: str
    phase: str | None = None


class RuleBasedOrchestrator:
    """Routes a message addressed to the orchestrator (or to nobody) by rules.

    ``@slug`` or ``@Name`` in the content picks that agent; otherwise the default agent.
    """

    def __init__(self, directory: AgentDirectory, default_agent: str | None) -> None:
        if default_agent is not None and directory.find(default_agent) is None:
            raise UnknownAgentError(default_agent)
        self._directory = directory
        self._default = default_agent

    def route(self, conversation: Conversation, trigger: NostrEvent) -> RoutingDecision | None:
        """Return the decision, or None when there is no agent to route to."""
        agent: Agent | None = mentioned_agent(trigger.content, self._directory)
        if agent is not None:
            return RoutingDecision((agent.slug,), f"mentioned @{agent.slug}")
        if self._default is not None:
            return RoutingDecision((self._default,), "default agent")
        return None
