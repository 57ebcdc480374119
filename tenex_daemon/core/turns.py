"""Orchestrator turns: one routing decision, the agents it routed to and their completions."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from tenex_daemon.core.phases import Phase


class Completion(BaseModel):
    """An agent's completion of its part of a turn."""

    agent: str
    message: str
    timestamp: int
    """Milliseconds since the epoch."""


class OrchestratorTurn(BaseModel):
    """A routing decision and its progress. It closes when every routed agent completed."""

    turn_id: str
    timestamp: int
    """Milliseconds since the epoch when the turn started."""
    phase: Phase
    agents: list[str]
    completions: list[Completion] = Field(default_factory=list)
    reason: str | None = None
    is_completed: bool = False

    def has_completed(self, agent: str) -> bool:
        """Return whether ``agent`` already completed in this turn."""
        return any(c.agent == agent for c in self.completions)

    def add_completion(self, agent: str, message: str, timestamp: int) -> bool:
        """Record ``agent``'s completion once; return False for a repeat or a stranger.

        The turn closes when every routed agent has completed.
        """
        if self.is_completed or agent not in self.agents or self.has_completed(agent):
            return False
        self.completions.append(Completion(agent=agent, message=message, timestamp=timestamp))
        if all(self.has_completed(a) for a in self.agents):
            self.is_completed = True
        return True

    def routing_entry(self) -> dict[str, Any]:
        """Return the turn as a routing entry of the orchestrator's JSON context."""
        return {
            "phase": self.phase.value,
            "agents": list(self.agents),
            "completions": [c.model_dump() for c in self.completions],
            "reason": self.reason or "",
            "timestamp": self.timestamp,
        }
