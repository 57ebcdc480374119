"""Loop limits of orchestrator routing (docs/ARCHITECTURE.md: "routing loops stop at a hop limit and on
a repeated identical routing decision"), per conversation.

A user message resets a conversation's limits. The state lives in memory: a restart forgets it,
so a conversation gets at most one more round of turns after a restart.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tenex_daemon.services.orchestrator import RoutingDecision, RoutingStop

DEFAULT_TURN_LIMIT = 10
TRACKED_CONVERSATIONS = 4096


@dataclass(slots=True)
class _RoutingState:
    turns: int = 0
    """Decisions that started a turn since the last user message."""
    last_decision: tuple[tuple[str, ...], str | None] | None = None
    completions_at_last: int = 0
    ended: bool = False


class RoutingLimits:
    """Counts orchestrator turns since the last user message and spots repeated decisions.

    ``turn_limit`` turns may start without a new user message; the next decision is refused.
    A decision equal (same agents, same phase) to the previous one, with no completion
    recorded since that one was made, is refused too.
    """

    def __init__(self, turn_limit: int = DEFAULT_TURN_LIMIT) -> None:
        if turn_limit < 1:
            raise ValueError("turn_limit must be at least 1")
        self.turn_limit = turn_limit
        self._states: OrderedDict[str, _RoutingState] = OrderedDict()

    def _state(self, conversation_id: str) -> _RoutingState:
        state = self._states.get(conversation_id)
        if state is None:
            state = self._states[conversation_id] = _RoutingState()
            while len(self._states) > TRACKED_CONVERSATIONS:
                self._states.popitem(last=False)
        else:
            self._states.move_to_end(conversation_id)
        return state

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

    def record(self, conversation_id: str, decision: RoutingDecision, completions: int) -> RoutingStop | None:
        """Record ``decision`` made when the conversation held ``completions`` completions.

        Return REPEATED_DECISION (and record nothing) when it repeats the previous decision
        with no new completion; otherwise count it (a turn, or END) and return None.
        """
        state = self._state(conversation_id)
        key = (decision.agents, decision.phase)
        if state.last_decision == key and completions <= state.completions_at_last:
            return RoutingStop.REPEATED_DECISION
        state.last_decision = key
        state.completions_at_last = completions
        if decision.is_end:
            state.ended = True
        else:
            state.turns += 1
        return None

    def turns(self, conversation_id: str) -> int:
        """Turns started since the last user message."""
        state = self._states.get(conversation_id)
        return 0 if state is None else state.turns
