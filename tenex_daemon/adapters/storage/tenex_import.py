"""Import conversations from a TENEX TypeScript-era home into any Store.

The source layout (TENEX's ``FileSystemAdapter``)::

    .tenex/conversations/<id>.json          one conversation
    .tenex/conversations/archive/<id>.json  archived conversations
    .tenex/conversations/metadata.json      {"conversations": [{id, title, createdAt, updatedAt, ...}]}

History is a list of NDK ``serialize(true, true)`` strings: the JSON array
``[0, pubkey, created_at, kind, tags, content, sig, id]`` (7 items when the id was left out).
Every imported event is re-verified (id hash and Schnorr signature); an event that fails is
not accepted into history but reported in the :class:`ImportReport` and kept, raw, in the
conversation's ``metadata.extra["tenex_import"]["rejected"]``. Timestamps written in seconds
or milliseconds are normalized to milliseconds.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from coincurve import PublicKeyXOnly
from pydantic import ValidationError

from tenex_daemon.core.conversation import (
    UNTITLED,
    AgentState,
    Conversation,
    ConversationMetadata,
)
from tenex_daemon.core.errors import ConversationExistsError
from tenex_daemon.core.events import NostrEvent, compute_event_id
from tenex_daemon.core.execution_time import ExecutionTime
from tenex_daemon.core.ids import is_hex
from tenex_daemon.core.phases import BUILT_IN_PHASES, Phase, PhaseTransition
from tenex_daemon.core.ports import Store
from tenex_daemon.core.turns import Completion, OrchestratorTurn
from tenex_daemon.core.vocabulary import TAG_TITLE

log = structlog.get_logger(__name__)

MS_THRESHOLD = 100_000_000_000
"""Timestamps below this are seconds (it is 1973 in milliseconds, year 5138 in seconds)."""

_METADATA_FIELDS = {
    "summary": "summary", "requirements": "requirements", "plan": "plan",
    "readFiles": "read_files", "read_files": "read_files",
    "last_user_message": "last_user_message", "lastUserMessage": "last_user_message",
}


def to_ms(value: Any) -> int:
    """Normalize a timestamp in seconds or milliseconds (int, float or numeric string) to ms."""
    number = float(value)
    return round(number * 1000) if abs(number) < MS_THRESHOLD else round(number)


@dataclass
class ImportProblem:
    """Something that could not be imported as it was."""

    path: str
    conversation_id: str | None
    reason: str
    index: int | None = None
    """Position in the source history, for an event."""
    raw: Any = None


@dataclass
class ImportReport:
    """What :func:`import_tenex_home` did."""

    imported: list[str] = field(default_factory=list)
    already_present: list[str] = field(default_factory=list)
    failed: list[ImportProblem] = field(default_factory=list)
    """Conversation files that could not be read at all (left in place, untouched)."""
    rejected_events: list[ImportProblem] = field(default_factory=list)
    """Events that failed verification (bad id, bad signature, bad shape)."""
    duplicate_events: int = 0
    events_imported: int = 0
    notes: list[ImportProblem] = field(default_factory=list)
    """Fields that were repaired (unknown phase, index out of range...)."""

    @property
    def clean(self) -> bool:
        """Whether everything was imported exactly as found."""
        return not (self.failed or self.rejected_events or self.notes)


class _BadEventError(ValueError):
    pass


def parse_ndk_event(raw: Any) -> NostrEvent:
    """Return the event of one NDK-serialized history entry, verified; raise ValueError otherwise.

    Accepts the serialized string, the array itself, or a NIP-01 object.
    """
    data = json.loads(raw) if isinstance(raw, str) else raw
    if isinstance(data, dict):
        fields = data
    elif isinstance(data, list) and len(data) in (7, 8) and data[0] == 0:
        fields = {
            "pubkey": data[1], "created_at": data[2], "kind": data[3], "tags": data[4],
            "content": data[5], "sig": data[6], "id": data[7] if len(data) == 8 else None,
        }
    else:
        raise _BadEventError(
            "not an NDK serialized event (expected [0, pubkey, created_at, kind, tags, content, sig, id?])"
        )
    try:
        computed = compute_event_id(
            fields["pubkey"], fields["created_at"], fields["kind"], fields["tags"], fields["content"]
        )
    except (KeyError, TypeError) as exc:
        raise _BadEventError(f"malformed event fields: {exc}") from exc
    given = fields.get("id") or computed
    if given != computed:
        raise _BadEventError(f"id {given} does not match the event's content (hash {computed})")
    try:
        event = NostrEvent.model_validate({**fields, "id": computed})
    except ValidationError as exc:
        raise _BadEventError(f"invalid event shape: {exc.errors()[0]['msg']}") from exc
    try:
        valid = PublicKeyXOnly(bytes.fromhex(event.pubkey)).verify(
            bytes.fromhex(event.sig), bytes.fromhex(event.id)
        )
    except ValueError:
        valid = False
    if not valid:
        raise _BadEventError("signature does not verify")
    return event


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "agent"


def _phase(value: Any, problems: list[str]) -> Phase:
    name = str(value).lower()
    if name in BUILT_IN_PHASES:  # TENEX's phases are the seven built in
        return Phase(name)
    problems.append(f"unknown phase {value!r} read as chat")
    return Phase.CHAT


class _ConversationImport:
    """Turns one TypeScript-era conversation object into a Conversation."""

    def __init__(self, path: Path, data: dict[str, Any], index_row: dict[str, Any] | None,
                 archived: bool, report: ImportReport) -> None:
        self.path = path
        self.data = data
        self.row = index_row or {}
        self.archived = archived or bool(self.row.get("archived"))
        self.report = report
        self.problems: list[str] = []
        if not is_hex(data["id"], 64):  # a conversation's id is its root event's: the CLI and API ask for one
            given = str(data["id"])[:80]
            raise ValueError(f"conversation id must be 64 lowercase hex characters, got {given!r}")
        self.id = str(data["id"])

    def build(self) -> Conversation:
        history, rejected, kept_before = self._history()
        created = self._created_at(history)
        updated = to_ms(self.row["updatedAt"]) if "updatedAt" in self.row else (
            history[-1].created_at * 1000 if history else created
        )
        phase = _phase(self.data.get("phase", "chat"), self.problems)
        conversation = Conversation(
            id=self.id,
            title=str(self.data.get("title") or self._root_title(history)),
            root_kind=history[0].kind if history else 11,
            phase=phase,
            phase_started_at=to_ms(self.data.get("phaseStartedAt") or created),
            created_at=created,
            updated_at=updated,
            metadata=self._metadata(),
            archived=self.archived,
        )
        for event in history:
            conversation.append(event)
        for slug, state in (self.data.get("agentStates") or {}).items():
            conversation.agent_states[slug] = self._agent_state(slug, state, kept_before, len(history), phase)
        transitions = self.data.get("phaseTransitions") or []
        conversation.phase_transitions = [self._transition(t, history) for t in transitions]
        conversation.orchestrator_turns = [self._turn(t) for t in self.data.get("orchestratorTurns") or []]
        conversation.execution_time = self._execution_time()
        if rejected or self.problems:
            conversation.metadata.extra["tenex_import"] = {
                "source": str(self.path), "rejected": rejected, "notes": list(self.problems),
            }
        for note in self.problems:
            self.report.notes.append(ImportProblem(str(self.path), self.id, note))
        return conversation

    @staticmethod
    def _root_title(history: list[NostrEvent]) -> str:
        return (history[0].tag_value(TAG_TITLE) if history else None) or UNTITLED

    def _history(self) -> tuple[list[NostrEvent], list[Any], list[int]]:
        """Return (verified events, rejected raw entries, kept-count before each source index)."""
        events: list[NostrEvent] = []
        rejected: list[Any] = []
        kept_before: list[int] = []
        seen: set[str] = set()
        for index, raw in enumerate(self.data.get("history") or []):
            kept_before.append(len(events))
            try:
                event = parse_ndk_event(raw)
            except (ValueError, TypeError) as exc:
                rejected.append(raw)
                self.report.rejected_events.append(
                    ImportProblem(str(self.path), self.id, str(exc), index=index, raw=raw)
                )
                log.warning("import_event_rejected", conversation_id=self.id, index=index, reason=str(exc))
                continue
            if event.id in seen:
                self.report.duplicate_events += 1
                continue
            seen.add(event.id)
            events.append(event)
        kept_before.append(len(events))
        return events, rejected, kept_before

    def _created_at(self, history: list[NostrEvent]) -> int:
        if "createdAt" in self.row:
            return to_ms(self.row["createdAt"])
        if history:
            return history[0].created_at * 1000
        return to_ms(self.data.get("phaseStartedAt") or 0)

    def _metadata(self) -> ConversationMetadata:
        source = dict(self.data.get("metadata") or {})
        known: dict[str, Any] = {}
        for name, target in _METADATA_FIELDS.items():
            if name in source:
                known[target] = source.pop(name)
        try:
            metadata = ConversationMetadata.model_validate({**known, "extra": source})
        except ValidationError as exc:
            self.problems.append(f"metadata kept as extra ({exc.errors()[0]['msg']})")
            metadata = ConversationMetadata(extra={**source, **known})
        return metadata

    def _agent_state(self, slug: str, state: dict[str, Any], kept_before: list[int], length: int,
                     phase: Phase) -> AgentState:
        index = int(state.get("lastProcessedMessageIndex", 0))
        if not 0 <= index < len(kept_before):
            self.problems.append(f"agent {slug}: lastProcessedMessageIndex {index} clamped to history")
            index = min(max(index, 0), len(kept_before) - 1)
        session = state.get("claudeSessionId")
        by_phase = state.get("claudeSessionsByPhase") or {}
        if session is None and by_phase:
            session = (
                by_phase.get(phase.value) or by_phase.get(phase.value.upper()) or list(by_phase.values())[-1]
            )
        return AgentState(last_processed_index=min(kept_before[index], length), session_id=session)

    def _transition(self, raw: dict[str, Any], history: list[NostrEvent]) -> PhaseTransition:
        timestamp = to_ms(raw.get("timestamp", 0))
        name = str(raw.get("agentName", ""))
        return PhaseTransition(
            from_phase=_phase(raw.get("from", "chat"), self.problems),
            to_phase=_phase(raw.get("to", "chat"), self.problems),
            message=str(raw.get("message", "")),
            timestamp=timestamp,
            agent_slug=str(raw.get("agentSlug") or _slug(name)),
            agent_pubkey=str(raw.get("agentPubkey", "")),
            agent_name=name,
            reason=raw.get("reason"),
            summary=raw.get("summary"),
            history_index=sum(1 for e in history if e.created_at * 1000 <= timestamp),
        )

    def _turn(self, raw: dict[str, Any]) -> OrchestratorTurn:
        return OrchestratorTurn(
            turn_id=str(raw.get("turnId") or raw.get("turn_id")),
            timestamp=to_ms(raw.get("timestamp", 0)),
            phase=_phase(raw.get("phase", "chat"), self.problems),
            agents=list(raw.get("agents") or []),
            completions=[
                Completion(agent=str(c["agent"]), message=str(c.get("message", "")),
                           timestamp=to_ms(c.get("timestamp", 0)))
                for c in raw.get("completions") or []
            ],
            reason=raw.get("reason"),
            is_completed=bool(raw.get("isCompleted", raw.get("is_completed", False))),
        )

    def _execution_time(self) -> ExecutionTime:
        raw = self.data.get("executionTime") or {}
        start = raw.get("currentSessionStart")
        return ExecutionTime(
            total_seconds=int(raw.get("totalSeconds", 0)),
            current_session_start=to_ms(start) if start is not None else None,
            is_active=bool(raw.get("isActive", False)),
            last_updated=to_ms(raw.get("lastUpdated", 0)),
        )


def _conversations_dir(src_dir: Path) -> Path:
    for candidate in (src_dir / "conversations", src_dir / ".tenex" / "conversations"):
        if candidate.is_dir():
            return candidate
    if src_dir.name == "conversations" and src_dir.is_dir():
        return src_dir
    raise FileNotFoundError(f"no TENEX conversations folder under {src_dir}")


def _index_rows(folder: Path, report: ImportReport) -> dict[str, dict[str, Any]]:
    path = folder / "metadata.json"
    if not path.exists():
        return {}
    try:
        rows = json.loads(path.read_text("utf-8"))["conversations"]
        return {str(row["id"]): row for row in rows}
    except (ValueError, KeyError, TypeError) as exc:
        report.notes.append(ImportProblem(str(path), None, f"metadata.json unreadable, ignored: {exc}"))
        return {}


async def import_tenex_home(src_dir: str | Path, store: Store) -> ImportReport:
    """Import every conversation of a TENEX TypeScript-era home into ``store``.

    ``src_dir`` is the project folder, its ``.tenex`` folder, or the ``conversations`` folder.
    Conversations already in the store are left alone (the import can be re-run). Source
    files are only read, never changed.
    """
    folder = _conversations_dir(Path(src_dir))
    report = ImportReport()
    rows = _index_rows(folder, report)
    sources = [(p, False) for p in sorted(folder.glob("*.json")) if p.name != "metadata.json"]
    archive = folder / "archive"
    if archive.is_dir():
        sources += [(p, True) for p in sorted(archive.glob("*.json"))]
    for path, archived in sources:
        try:
            data = json.loads(path.read_text("utf-8"))
            if not isinstance(data, dict) or "id" not in data:
                raise ValueError("not a conversation object (no id)")
            row = rows.get(str(data["id"]))
            conversation = _ConversationImport(path, data, row, archived, report).build()
        except (ValueError, KeyError, TypeError, ValidationError) as exc:
            report.failed.append(ImportProblem(str(path), None, f"{type(exc).__name__}: {exc}"))
            log.error("import_conversation_failed", path=str(path), error=str(exc))
            continue
        try:
            await store.create(conversation)
        except ConversationExistsError:
            report.already_present.append(conversation.id)
            continue
        report.imported.append(conversation.id)
        report.events_imported += len(conversation.history)
    log.info(
        "tenex_import_done", imported=len(report.imported), failed=len(report.failed),
        rejected_events=len(report.rejected_events),
    )
    return report
