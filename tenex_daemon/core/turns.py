"""Orchestrator turns: one routing decision, the agents it routed to and their completions."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.phases import Phase
from tenex_daemon.core.thread_tags import read_threading


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
    trigger_id: str | None = None
    """The event the routed agents answer: a completion counts for this turn only when it replies
    to it (a late answer to an earlier, superseded turn's trigger does not close this one)."""

    def answered_by(self, event: NostrEvent) -> bool:
        """Whether ``event`` replies to this turn's trigger: the event its threading tags name as the one
        answered (:func:`~tenex_daemon.core.thread_tags.read_threading`). Naming the trigger is not enough:
        a kind-1 reply names the thread's root too, and a turn the root triggered is not answered by a
        reply to a later message."""
        return self.trigger_id is None or read_threading(event).parent_id == self.trigger_id

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

    def add_late_completion(self, agent: str, message: str, timestamp: int) -> bool:
        """Record ``agent``'s completion in this turn after a newer turn superseded it (it stays closed):
        the orchestrator's routing history shows what the agent did. False for a repeat or a stranger."""
        if agent not in self.agents or self.has_completed(agent):
            return False
        self.completions.append(Completion(agent=agent, message=message, timestamp=timestamp))
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
