"""The orchestrator's routing context fitted to its token budget (docs/CONTEXT.md, "When history does not fit";
the orchestrator is an agent): full when it fits; else the oldest turns left out with a note, then long texts cut."""

from __future__ import annotations

import json
from typing import Any

from tenex_daemon.core.budget import TokenBudget, estimate_tokens
from tenex_daemon.core.routing_budget import ROUTING_NOTE_KEY, SHORTEST_CUT, fit_routing_context, routing_note

PROMPT = "You are the orchestrator."


def turn(number: int, message: str = "done") -> dict[str, Any]:
    """A finished turn as the routing context shows it."""
    return {
        "phase": "execute",
        "agents": ["alice"],
        "completions": [{"agent": "alice", "message": f"{number}: {message}", "timestamp": number}],
        "reason": f"step {number}",
        "timestamp": number,
    }


def context(
    turns: list[dict[str, Any]], request: str = "Build it", current: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A routing context with these finished turns."""
    return {
        "user_request": request,
        "latest_user_message": request,
        "routing_history": turns,
        "current_routing": current,
    }


def tokens(fitted: dict[str, Any]) -> int:
    """What the fitted context costs with the prompt, counted as the budget counts."""
    return estimate_tokens(PROMPT) + estimate_tokens(json.dumps(fitted, ensure_ascii=False))


def test_a_context_that_fits_is_sent_whole() -> None:
    """Within the budget nothing is left out and no note is added: the same object is returned."""
    whole = context([turn(n) for n in range(5)])
    assert fit_routing_context(whole, PROMPT, TokenBudget(10_000)) is whole


def test_the_oldest_turns_are_left_out_first_and_the_context_says_so() -> None:
    """Over the budget, the fewest oldest turns are left out so that it fits; the newest stay in order and the
    note after the history says how many were left out; the four keys keep their order."""
    turns = [turn(n, "x" * 400) for n in range(20)]
    whole = context(turns)
    budget = TokenBudget(tokens(context(turns[-6:])) + 40)

    fitted = fit_routing_context(whole, PROMPT, budget)

    kept = fitted["routing_history"]
    assert kept == turns[-len(kept):]
    assert len(kept) == 6  # no more left out than needed
    assert tokens(fitted) <= budget.limit
    assert fitted[ROUTING_NOTE_KEY] == routing_note(20 - len(kept))
    assert routing_note(3) == "[Note: 3 older turns truncated to stay within token limit]"
    keys = ["user_request", "latest_user_message", "routing_history", ROUTING_NOTE_KEY, "current_routing"]
    assert list(fitted) == keys
    assert whole["routing_history"] == turns  # the context given is not changed


def test_the_completion_being_routed_is_cut_never_left_out() -> None:
    """The newest finished turn (the one whose completion closed it and is being routed) stays even when it
    alone is over the budget: its completion is cut (ending in …) to what fits, every older turn is left out
    first, and the person's request is kept whole when it is short."""
    newest = turn(9, "y" * 100_000)
    whole = context([turn(1), turn(2), newest])
    budget = TokenBudget(2_000)

    fitted = fit_routing_context(whole, PROMPT, budget)

    assert [t["timestamp"] for t in fitted["routing_history"]] == [9]
    assert fitted[ROUTING_NOTE_KEY] == routing_note(2)
    assert fitted["current_routing"] is None
    message = fitted["routing_history"][0]["completions"][0]["message"]
    assert message.endswith("…")
    assert SHORTEST_CUT <= len(message) < 100_000
    assert fitted["user_request"] == "Build it"
    assert tokens(fitted) <= budget.limit
    assert tokens(fitted) >= budget.limit - 1  # cut no shorter than needed: one character more would not fit
