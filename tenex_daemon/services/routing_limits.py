"""Loop limits of orchestrator routing (docs/ARCHITECTURE.md, "Orchestrator turns"), per conversation.

A user message resets a conversation's limits. They are stored with the conversation, in its
``metadata.extra`` under :data:`ROUTING_LIMITS_KEY` (saved with the turn a decision starts), so a
restart keeps them: :meth:`RoutingLimits.load` reads them back before each routing.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import structlog

from tenex_daemon.core.conversation import Conversation
from tenex_daemon.services.orchestrator import RoutingDecision, RoutingStop

DEFAULT_TURN_LIMIT = 10
TRACKED_CONVERSATIONS = 4096
ROUTING_LIMITS_KEY = "routing_limits"
"""The key of a conversation's routing limits in ``metadata.extra``: ``{"turns", "last_decision": {"agents",
"phase"} or null, "ended"}`` (a ``completions_at_last`` stored by an older version is read and ignored)."""

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class RoutingState:
    """One conversation's routing limits since its last user message."""

    turns: int = 0
    """Decisions that started a turn since the last user message."""
    last_decision: tuple[tuple[str, ...], str | None] | None = None
    """(agents, phase) of the last decision since the last user message."""
    ended: bool = False

    def to_json(self) -> dict[str, Any]:
        """The state as stored under :data:`ROUTING_LIMITS_KEY`."""
        last = self.last_decision
        return {
            "turns": self.turns,
            "last_decision": None if last is None else {"agents": list(last[0]), "phase": last[1]},
            "ended": self.ended,
        }

    @classmethod
    def from_json(cls, value: object) -> RoutingState:
        """Read a stored state; a missing one is a fresh state, a malformed one is logged and fresh."""
        if value is None:
            return cls()
        state = _parse_state(value)
        if state is None:
            log.warning("routing_limits_unreadable", value=repr(value)[:200], action="limits start afresh")
            return cls()
        return state


def _parse_state(value: object) -> RoutingState | None:
    """The state stored as ``value``, or None when it is not one."""
    if not isinstance(value, dict):
        return None
    turns, ended = value.get("turns"), value.get("ended")
    if type(turns) is not int or not isinstance(ended, bool):
        return None
    last = value.get("last_decision")
    if last is None:
        return RoutingState(turns, None, ended)
    agents = last.get("agents") if isinstance(last, dict) else None
    phase = last.get("phase") if isinstance(last, dict) else None
    if not isinstance(agents, list) or not all(isinstance(a, str) for a in agents):
        return None
    if phase is not None and not isinstance(phase, str):
        return None
    return RoutingState(turns, (tuple(agents), phase), ended)


class RoutingLimits:
    """Counts orchestrator turns since the last user message and spots repeated decisions.

    ``turn_limit`` turns may start without a new user message; the next decision is refused.
    A decision equal (same agents, same phase) to the previous one since the last user message is
    refused too: the orchestrator answering the agents' completions by sending them back to the same
    work is the loop the design names (docs/ARCHITECTURE.md, "Orchestrator turns"). The dispatcher
    :meth:`load`\\ s a conversation's stored limits before routing it and stores :meth:`snapshot` after a
    change.
    """

    def __init__(self, turn_limit: int = DEFAULT_TURN_LIMIT) -> None:
        if turn_limit < 1:
            raise ValueError("turn_limit must be at least 1")
        self.turn_limit = turn_limit
        self._states: OrderedDict[str, RoutingState] = OrderedDict()

    def _state(self, conversation_id: str) -> RoutingState:
        state = self._states.get(conversation_id)
        if state is None:
            state = self._states[conversation_id] = RoutingState()
            while len(self._states) > TRACKED_CONVERSATIONS:
                self._states.popitem(last=False)
        else:
            self._states.move_to_end(conversation_id)
        return state

    def load(self, conversation: Conversation) -> dict[str, Any]:
        """Take the limits stored with ``conversation`` as its current ones; return them as stored."""
        state = RoutingState.from_json(conversation.metadata.extra.get(ROUTING_LIMITS_KEY))
        self._states[conversation.id] = state
        self._states.move_to_end(conversation.id)
        while len(self._states) > TRACKED_CONVERSATIONS:
            self._states.popitem(last=False)
        return state.to_json()

    def snapshot(self, conversation_id: str) -> dict[str, Any]:
        """The conversation's current limits, as they are stored (:data:`ROUTING_LIMITS_KEY`)."""
        state = self._states.get(conversation_id)
        return (state if state is not None else RoutingState()).to_json()

    def user_message(self, conversation_id: str) -> None:
        """A user wrote: the turn count, the last decision and an END are forgotten."""
        self._states.pop(conversation_id, None)

    def ended(self, conversation_id: str) -> bool:
        """Whether routing ended (an END decision) since the last user message."""
        state = self._states.get(conversation_id)
        return state is not None and state.ended

    def check_turn_limit(self, conversation_id: str) -> RoutingStop | None:
        """Return TURN_LIMIT when no further turn may start before the user writes again."""
        state = self._states.get(conversation_id)
        if state is not None and state.turns >= self.turn_limit:
            return RoutingStop.TURN_LIMIT
        return None

    def record(
        self, conversation_id: str, decision: RoutingDecision, current_phase: str | None = None
    ) -> RoutingStop | None:
        """Record ``decision``: return REPEATED_DECISION (and record nothing) when it repeats the
        previous decision since the last user message; otherwise count it (a turn, or END) and return None.

        Decisions are compared as they run: their agents in any order, and a decision naming no phase in
        ``current_phase`` (the conversation's, where it keeps it).
        """
        state = self._state(conversation_id)
        key = (tuple(sorted(decision.agents)), decision.phase or current_phase)
        if state.last_decision == key:
            return RoutingStop.REPEATED_DECISION
        state.last_decision = key
        if decision.is_end:
            state.ended = True
        else:
            state.turns += 1
        return None

    def turns(self, conversation_id: str) -> int:
        """Turns started since the last user message."""
        state = self._states.get(conversation_id)
        return 0 if state is None else state.turns
