"""Conversation phases and the rules that say which transitions are allowed."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum

from pydantic import BaseModel, ConfigDict

from tenex_daemon.core.errors import PhaseTransitionError


class Phase(StrEnum):
    """The operational phase a conversation is in (docs/ARCHITECTURE.md)."""

    CHAT = "chat"
    BRAINSTORM = "brainstorm"
    PLAN = "plan"
    EXECUTE = "execute"
    VERIFICATION = "verification"
    CHORES = "chores"
    REFLECTION = "reflection"


DEFAULT_TRANSITIONS: Mapping[Phase, frozenset[Phase]] = {
    Phase.CHAT: frozenset({Phase.EXECUTE, Phase.PLAN, Phase.BRAINSTORM}),
    Phase.BRAINSTORM: frozenset({Phase.CHAT, Phase.PLAN, Phase.EXECUTE}),
    Phase.PLAN: frozenset({Phase.EXECUTE, Phase.CHAT}),
    Phase.EXECUTE: frozenset({Phase.VERIFICATION, Phase.CHAT}),
    Phase.VERIFICATION: frozenset({Phase.CHORES, Phase.EXECUTE, Phase.CHAT}),
    Phase.CHORES: frozenset({Phase.REFLECTION, Phase.CHAT}),
    Phase.REFLECTION: frozenset({Phase.CHAT}),
}
"""TENEX's phase rules plus the way back to chat that TENEX clients expect (docs/ARCHITECTURE.md)."""


class PhaseRules:
    """Which phase transitions a project allows. Same-phase handoffs are always allowed."""

    def __init__(self, transitions: Mapping[Phase, Iterable[Phase]] | None = None) -> None:
        source = DEFAULT_TRANSITIONS if transitions is None else transitions
        self._allowed: dict[Phase, frozenset[Phase]] = {
            Phase(k): frozenset(Phase(v) for v in vs) for k, vs in source.items()
        }

    @classmethod
    def permissive(cls) -> PhaseRules:
        """Rules that allow every transition (for projects that do not enforce phases)."""
        every = list(Phase)
        return cls({p: every for p in every})

    def allowed_from(self, phase: Phase) -> frozenset[Phase]:
        """Return the phases reachable from ``phase`` (not counting a same-phase handoff)."""
        return self._allowed.get(phase, frozenset())

    def is_allowed(self, from_phase: Phase, to_phase: Phase) -> bool:
        """Return whether ``from_phase -> to_phase`` is allowed."""
        return from_phase == to_phase or to_phase in self.allowed_from(from_phase)

    def check(self, from_phase: Phase, to_phase: Phase) -> None:
        """Raise :class:`PhaseTransitionError` when the transition is not allowed."""
        if not self.is_allowed(from_phase, to_phase):
            allowed = sorted(p.value for p in self.allowed_from(from_phase))
            raise PhaseTransitionError(from_phase.value, to_phase.value, allowed)


class PhaseTransition(BaseModel):
    """A recorded phase change (or same-phase handoff) with who made it and why."""

    model_config = ConfigDict(frozen=True)

    from_phase: Phase
    to_phase: Phase
    message: str
    timestamp: int
    """Milliseconds since the epoch."""
    agent_slug: str
    agent_pubkey: str
    agent_name: str
    reason: str | None = None
    summary: str | None = None
    history_index: int = 0
    """Length of history when the transition was recorded (used by the while-away block)."""

    @property
    def is_handoff(self) -> bool:
        """Whether this is a same-phase handoff rather than a phase change."""
        return self.from_phase == self.to_phase
