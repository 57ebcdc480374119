"""A conversation's record of its stops (``metadata.extra["stops"]``, docs/PROTOCOL.md, kind 24134), and
what a run redone after a crash or taken over from a dead daemon reads in it.

Each entry: ``by`` (a pubkey, or ``owner`` for the CLI and the API), ``at`` (ms), ``history`` (how many
events the conversation held when the stop was recorded), ``agents`` (the slugs stopped), ``named`` (the
slugs the stop asked for; None: every agent), ``event_id`` (the request's), ``finished`` (the ids of the
replies of the runs it let finish, saved after it was recorded but said before it; absent when none) and,
for a stop told between daemons sharing a database, ``stop_id``.
"""

from __future__ import annotations

from typing import Any

from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.events import NostrEvent

STOPS_KEY = "stops"
"""Where a conversation records its stops (``metadata.extra``), newest last."""
STOPS_KEPT = 20
"""How many stops a conversation remembers (the oldest leave first)."""
STOPPED_COMPLETION = "Stopped before answering."
"""What a stopped agent counts as having answered in the orchestrator's open turn."""


def with_stop(kept: object, entry: dict[str, Any], *, replacing: dict[str, Any] | None = None) -> list[Any]:
    """The stops record ``kept`` with ``entry`` added, or merged into the entry of the same request (or
    the same told stop): that one gains the agents stopped. ``replacing``: an entry recorded earlier
    (before the runs were stopped) that ``entry`` completes; it is replaced where it is found as written."""
    stops = list(kept) if isinstance(kept, list) else []
    if replacing is not None:
        for index in range(len(stops) - 1, -1, -1):
            if stops[index] == replacing:
                stops[index] = entry
                return stops
    key = "event_id" if entry["event_id"] is not None else "stop_id"
    value = entry.get(key)
    for index, stop in enumerate(stops):
        if value is not None and isinstance(stop, dict) and stop.get(key) == value:
            merged = {**stop, "agents": _union(stop.get("agents"), entry["agents"])}
            if entry.get("finished"):
                merged["finished"] = _union(stop.get("finished"), entry["finished"])
            stops[index] = merged
            return stops
    return [*stops[-(STOPS_KEPT - 1) :], entry]


def stopped_since(
    conversation: Conversation, trigger: NostrEvent, agent_slug: str, *, recovered: bool = True
) -> bool:
    """Whether a stop naming ``agent_slug`` (or every agent) was recorded after ``trigger`` came: a run for
    it that a crash or a dead daemon left journaled was running or waiting when the person stopped it, and
    is not redone. "After" is by position in history (the trigger among the events the conversation held
    when the stop was recorded); a record from before ``history`` was kept compares times instead (the
    trigger's ``created_at``), for a run redone after a crash (``recovered``) only: a client whose clock lags
    would date a new message before it, which a live run must not take for stopped. One from before
    ``named`` was kept covers the agents it stopped."""
    stops = conversation.metadata.extra.get(STOPS_KEY)
    if not isinstance(stops, list):
        return False
    index = conversation.index_of(trigger.id)
    for stop in stops:
        if not isinstance(stop, dict) or not _came_before(stop, trigger, index, recovered):
            continue
        named = stop["named"] if "named" in stop else stop.get("agents")
        if named is None or (isinstance(named, list) and agent_slug in named):
            return True
    return False


def _came_before(stop: dict[str, Any], trigger: NostrEvent, index: int | None, recovered: bool) -> bool:
    """Whether ``trigger`` (at ``index`` in history) came before ``stop`` was recorded: it stands among the
    events held then, or is a reply the stop let finish."""
    finished = stop.get("finished")
    if isinstance(finished, list) and trigger.id in finished:
        return True
    held = stop.get("history")
    if isinstance(held, int) and index is not None:
        return index < held
    if not recovered:
        return False
    at = stop.get("at")
    return isinstance(at, int) and at >= trigger.created_at * 1000


def _union(kept: object, added: list[Any]) -> list[Any]:
    """``kept`` (a list, else nothing) with the items of ``added`` it lacks, in order."""
    return list(dict.fromkeys([*(kept if isinstance(kept, list) else []), *added]))
