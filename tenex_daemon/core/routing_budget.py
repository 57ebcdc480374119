"""The orchestrator's routing context within its token budget (docs/CONTEXT.md, "When history does not fit").

The orchestrator is an agent: when its system prompt plus the routing context JSON exceed its budget,
the oldest finished turns are left out (the newest that fit are kept, in order) and the context says so
under :data:`ROUTING_NOTE_KEY`. The newest finished turn is never left out: it holds the completion being
routed (a completion reaches the orchestrator once it closed its turn). When that turn alone is too much
(an agent's completion of a whole file, a person's very long message), every long text in what is left
(the person's request and latest message, the turns' completions and reasons) is cut to the longest
length that fits, ending in ``…``. Nothing is left out while the context fits: full history is the rule.

Pure functions: the caller gives the budget, whose counter is the orchestrator model's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Final

from tenex_daemon.core.budget import TokenBudget

ROUTING_NOTE_KEY: Final = "routing_history_note"
"""The key, after ``routing_history``, that says how many older turns were left out (only then present)."""
SHORTEST_CUT: Final = 200
"""Texts are never cut shorter than this many characters (the model then gets the context over budget)."""


def routing_note(count: int) -> str:
    """What the context says where ``count`` older turns were left out."""
    return f"[Note: {count} older turns truncated to stay within token limit]"


def fit_routing_context(context: dict[str, Any], system_prompt: str, budget: TokenBudget) -> dict[str, Any]:
    """Return ``context`` if it fits ``budget`` with ``system_prompt``; else a copy that fits (see the
    module docstring), or comes as close as cutting texts to :data:`SHORTEST_CUT` characters allows."""
    fixed = budget.count(system_prompt)

    def fits(candidate: dict[str, Any]) -> bool:
        return fixed + budget.count(json.dumps(candidate, ensure_ascii=False)) <= budget.limit

    if fits(context):
        return context
    history: list[dict[str, Any]] = context["routing_history"]
    most = len(history) - 1  # the newest finished turn stays
    if most < 1:
        return _texts_cut(context, fits)
    low, high = 1, most  # the fewest turns left out with which it fits, by bisection
    while low < high:
        middle = (low + high) // 2
        if fits(_without_oldest(context, middle)):
            high = middle
        else:
            low = middle + 1
    trimmed = _without_oldest(context, low)
    if fits(trimmed):
        return trimmed
    return _texts_cut(trimmed, fits)


def _without_oldest(context: dict[str, Any], count: int) -> dict[str, Any]:
    """The context without its ``count`` oldest finished turns, saying so."""
    fitted = {key: value for key, value in context.items() if key != "current_routing"}
    fitted["routing_history"] = context["routing_history"][count:]
    fitted[ROUTING_NOTE_KEY] = routing_note(count)
    fitted["current_routing"] = context["current_routing"]
    return fitted


def _texts_cut(context: dict[str, Any], fits: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The context with every text longer than the longest length that fits cut to it (bisection)."""
    longest = max(len(text) for text in _texts(context))
    low, high = SHORTEST_CUT, max(longest, SHORTEST_CUT)
    while low < high:
        middle = (low + high + 1) // 2
        if fits(_cut_to(context, middle)):
            low = middle
        else:
            high = middle - 1
    return _cut_to(context, low)


def _texts(context: dict[str, Any]) -> list[str]:
    current = context["current_routing"]
    turns = [*context["routing_history"], *([current] if current else [])]
    texts = [context["user_request"], context["latest_user_message"]]
    for turn in turns:
        texts.append(turn.get("reason") or "")
        texts.extend(completion["message"] for completion in turn["completions"])
    return texts


def _cut_to(context: dict[str, Any], limit: int) -> dict[str, Any]:
    def cut(text: str) -> str:
        return text if len(text) <= limit else text[: limit - 1] + "…"

    def turn_cut(turn: dict[str, Any]) -> dict[str, Any]:
        completions = [{**c, "message": cut(c["message"])} for c in turn["completions"]]
        reason = turn.get("reason")
        return {**turn, "reason": cut(reason) if reason else reason, "completions": completions}

    current = context["current_routing"]
    return {
        **context,
        "user_request": cut(context["user_request"]),
        "latest_user_message": cut(context["latest_user_message"]),
        "routing_history": [turn_cut(turn) for turn in context["routing_history"]],
        "current_routing": turn_cut(current) if current else current,
    }
