"""The run journal's entries: the run a daemon owes (:class:`RunRequest`), the journal's key, an entry read
back, and runs taken out of a journal no daemon runs on (``tenexd conversations stop`` with the daemon down).
The journal itself is written by :class:`~tenex_daemon.services.runs.RunScheduler`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import structlog

from tenex_daemon.core.ports import SmallValues

log = structlog.get_logger(__name__)

PENDING_RUNS_KEY = "runs.pending"


def journal_key_for(daemon_id: str) -> str:
    """The run journal's key of one daemon (its project key) in a store daemons share (PostgreSQL)."""
    return f"{PENDING_RUNS_KEY}.{daemon_id}"


@dataclass(frozen=True, slots=True)
class RunRequest:
    """An agent to run for a trigger in a conversation."""

    conversation_id: str
    trigger_id: str
    agent_slug: str
    via_orchestrator: bool = False
    recovered: bool = False
    """Redone after a restart: the previous process may have saved its reply already."""
    burst: tuple[str, ...] = ()
    """The earlier triggers this run answers together with its own (docs/CONTEXT.md, "Bursts")."""
    person: str = field(default="", compare=False)
    """Whom the run answers (the reply's person; "" unknown): the runs' places are shared fairly between
    people (:class:`~tenex_daemon.runtime.fair_slots.FairSlots`)."""


_REQUEST_FIELDS = ("conversation_id", "trigger_id", "agent_slug")


def journaled_request(item: dict[str, Any], key: str) -> RunRequest | None:
    """The run a journal entry names, recovered; fields it does not know (a journal another version of the
    daemon wrote) are left out. An entry without a conversation, trigger and agent is logged and skipped:
    the journal's other entries are still taken in."""
    if not all(isinstance(item.get(name), str) and item[name] for name in _REQUEST_FIELDS):
        log.error("run_journal_entry_unreadable", key=key, entry=str(item)[:200])
        return None
    burst = item.get("burst", ())
    return RunRequest(
        item["conversation_id"], item["trigger_id"], item["agent_slug"],
        via_orchestrator=item.get("via_orchestrator") is True, recovered=True,
        burst=tuple(str(t) for t in burst) if isinstance(burst, list | tuple) else (),
        person=person if isinstance(person := item.get("person"), str) else "",
    )


async def forget_journaled(
    store: SmallValues,
    conversation_id: str,
    agent_slug: str | None = None,
    *,
    journal_key: str = PENDING_RUNS_KEY,
) -> list[RunRequest]:
    """With no daemon running on the journal: remove the runs of ``conversation_id`` (only
    ``agent_slug``'s when given) from it, so the next start does not redo them; return them."""
    raw = await store.get_meta(journal_key)
    try:
        entries = json.loads(raw) if raw else []
    except ValueError:
        return []
    if not isinstance(entries, list):
        return []

    def chosen(item: object) -> bool:
        return (
            isinstance(item, dict)
            and "dispatch" not in item
            and item.get("conversation_id") == conversation_id
            and (agent_slug is None or item.get("agent_slug") == agent_slug)
        )

    dropped = [item for item in entries if chosen(item)]
    if dropped:
        kept = [item for item in entries if not chosen(item)]
        await store.set_meta(journal_key, json.dumps(kept, separators=(",", ":")))
    fields = set(RunRequest.__dataclass_fields__)
    return [RunRequest(**{k: v for k, v in item.items() if k in fields}) for item in dropped]
