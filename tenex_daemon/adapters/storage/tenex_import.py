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
or milliseconds are normalized to milliseconds; one that is no time (before 1970, past the year 9999,
or more than a day past now, as a microsecond count read as milliseconds is) is refused like a bad
one: an event dated so is rejected, a conversation's own time falls back to its events'.

A file whose optional parts have an unexpected JSON type (``agentStates`` a list,
``executionTime`` a number, a transition that is a string, a bad timestamp in a turn...) is still
imported: the malformed part (or list item) is left out, reported in the report's ``notes`` naming
it, and kept, raw, in ``metadata.extra["tenex_import"]["dropped"]`` under that name, so nothing of
the source is lost and the conversation's history is not held back by a broken side field. Text that is
not valid Unicode (a lone surrogate such as ``"\\ud83d"``, a broken emoji: it can be neither signed nor
stored) makes its part malformed so (the title, one ``metadata`` key, one agent's state...); an event
holding such text is rejected; what is kept raw has it written as the escape ``\\ud83d``. A file
that is not a conversation (no object, a bad id, a ``history`` that is not a list) is reported in
``failed``; no content of a file stops the import of the others.

How a conversation comes in: its title (``title_source`` ``tag`` when it is the root's ``title`` tag,
else ``import``; untitled, none), its ``metadata.summary`` as its summary too, ``activity_at`` its
newest event. A titled one counts as described (``described_at`` = its activity), so no model retitles
it. An archived one is ended at its newest event (``ended_by`` ``import``); another whose newest event
is older than the idle timeout is ended ``idle`` at that event plus the timeout, as the SmartHole import
does. Every imported conversation holds its import record in ``metadata.extra["tenex_import"]`` (at
least its source file): the description service reads it as "imported" and never publishes a kind 513
for it (``tenex_daemon/services/descriptions.py``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import structlog
from coincurve import PublicKeyXOnly
from pydantic import ValidationError

from tenex_daemon.adapters.nostr.codec.frames import MAX_FUTURE_S
from tenex_daemon.core.conversation import (
    UNTITLED,
    AgentState,
    Conversation,
    ConversationMetadata,
    TitleSource,
)
from tenex_daemon.core.errors import ConversationExistsError
from tenex_daemon.core.events import NostrEvent, compute_event_id
from tenex_daemon.core.execution_time import ExecutionTime
from tenex_daemon.core.ids import is_hex
from tenex_daemon.core.phases import BUILT_IN_PHASES, Phase, PhaseTransition
from tenex_daemon.core.ports import Clock, Store, SystemClock
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


MAX_FUTURE_MS = MAX_FUTURE_S * 1000
"""An imported time may be at most this far (a day) past now, as an event's ``created_at`` on the wire."""
MAX_TIME_MS = 253_402_300_799_999
"""9999-12-31T23:59:59.999Z: a later number is no time (a corrupt value, or microseconds read as ms)."""

EXTRA_KEY = "tenex_import"
"""The key of a conversation's import record in ``metadata.extra`` (every imported conversation has one)."""
ENDED_BY_IMPORT = "import"
ENDED_BY_IDLE = "idle"
DEFAULT_IDLE_TIMEOUT_MS = 30 * 60_000
"""The idle timeout when the caller gives none: the default of ``conversations.idle_timeout_min``."""
NOT_UNICODE = "not valid Unicode (a lone surrogate)"

_T = TypeVar("_T")
_FILE_ERRORS = (ValueError, KeyError, TypeError, IndexError, AttributeError, OverflowError, RecursionError)
"""What reading one conversation file may raise on data of an unexpected shape (it is reported failed)."""
_PART_ERRORS = (ValueError, KeyError, TypeError, OverflowError)
"""What converting one optional part may raise (pydantic's ValidationError is a ValueError)."""
_JSON_TYPES = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
               float: "a number", type(None): "null"}


def to_ms(value: Any) -> int:
    """Normalize a timestamp in seconds or milliseconds (int, float or numeric string) to ms."""
    number = float(value)
    return round(number * 1000) if abs(number) < MS_THRESHOLD else round(number)


def _shown(value: Any) -> str:
    """``repr(value)``, cut to 80 characters for a report."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def checked_ms(ms: int, value: Any, now_ms: int | None = None) -> int:
    """``ms`` (read from ``value``) when it is a time; ValueError (``bad timestamp ...``) when it is before
    1970, past the year 9999, or more than :data:`MAX_FUTURE_MS` past ``now_ms`` (when given)."""
    if ms < 0:
        raise ValueError(f"bad timestamp {_shown(value)} (before 1970)")
    if ms > MAX_TIME_MS:
        raise ValueError(f"bad timestamp {_shown(value)} (after the year 9999)")
    if now_ms is not None and ms > now_ms + MAX_FUTURE_MS:
        raise ValueError(f"bad timestamp {_shown(value)} (more than a day in the future)")
    return ms


def time_ms(value: Any, now_ms: int | None = None) -> int:
    """Return :func:`to_ms` of a number or numeric string that is a time (see :func:`checked_ms`);
    raise ValueError (``bad timestamp ...``) for anything else."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"bad timestamp {_shown(value)}")
    try:
        ms = to_ms(value)
    except (ValueError, OverflowError):
        raise ValueError(f"bad timestamp {_shown(value)}") from None
    return checked_ms(ms, value, now_ms)


def is_unicode(value: Any) -> bool:
    """Whether every text in the JSON value ``value`` (its strings and its objects' keys) can be written
    as UTF-8: one holding a lone surrogate (``"\\ud83d"`` in JSON, half an emoji) can be neither signed
    nor stored."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return False
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return True


def storable_text(text: str) -> str:
    """``text`` with each character UTF-8 cannot hold (a lone surrogate) written as its escape ``\\udXXX``."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def storable(value: Any) -> Any:
    """The JSON value ``value`` with its texts made :func:`storable_text` (itself when they all are)."""
    if is_unicode(value):
        return value
    if isinstance(value, str):
        return storable_text(value)
    if isinstance(value, dict):
        return {storable(key): storable(item) for key, item in value.items()}
    if isinstance(value, list):
        return [storable(item) for item in value]
    return value


def _check_unicode(value: Any, what: str = "it") -> None:
    """ValueError naming ``what`` when ``value`` holds text that is not valid Unicode."""
    if not is_unicode(value):
        raise ValueError(f"{what} is {NOT_UNICODE}")


def _validation_reason(exc: ValidationError) -> str:
    """The first error of a pydantic validation, with the field it is about."""
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    return f"{where}: {first['msg']}" if where else str(first["msg"])


def _json_type(value: Any) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _object(value: Any, what: str) -> dict[str, Any]:
    """``value`` when it is a JSON object; ValueError naming ``what`` otherwise."""
    if not isinstance(value, dict):
        raise ValueError(f"{what} is {_json_type(value)}, not an object")
    return value


def _list(value: Any, what: str) -> list[Any]:
    """``value`` when it is a JSON list; ValueError naming ``what`` otherwise."""
    if not isinstance(value, list):
        raise ValueError(f"{what} is {_json_type(value)}, not a list")
    return value


def _title_text(value: Any) -> str | None:
    """A title as text (a number as its digits); None when it is absent or blank."""
    text = str(value) if value else ""
    return text if text.strip() else None


def _an_object(value: Any) -> dict[str, Any]:
    """``value`` when it is a JSON object (a part named by the caller); ValueError otherwise."""
    return _object(value, "it")


def _a_list(value: Any) -> list[Any]:
    """``value`` when it is a JSON list (a part named by the caller); ValueError otherwise."""
    return _list(value, "it")


def _text(value: Any, what: str) -> str | None:
    """``value`` when it is a string or null; ValueError naming ``what`` otherwise."""
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{what} is {_json_type(value)}, not a string")
    return value


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
    except UnicodeEncodeError:
        raise _BadEventError(f"its text is {NOT_UNICODE}") from None
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
                 archived: bool, report: ImportReport, now_ms: int,
                 idle_timeout_ms: int = DEFAULT_IDLE_TIMEOUT_MS) -> None:
        self.path = path
        self.data = data
        self.row = index_row or {}
        self.archived = archived or bool(self.row.get("archived"))
        self.report = report
        self.now_ms = now_ms
        self.idle_timeout_ms = idle_timeout_ms
        self.problems: list[str] = []
        self.dropped: dict[str, Any] = {}
        """The malformed parts left out, raw, by the name they are reported under."""
        if not is_hex(data["id"], 64):  # a conversation's id is its root event's: the CLI and API ask for one
            given = str(data["id"])[:80]
            raise ValueError(f"conversation id must be 64 lowercase hex characters, got {given!r}")
        self.id = str(data["id"])

    def build(self) -> Conversation:
        history, rejected, kept_before = self._history()
        started = self._optional_time(self.data.get("phaseStartedAt"), "phaseStartedAt")
        created = self._created_at(history, started)
        updated = self._updated_at(history, created)
        activity = max(event.created_at for event in history) * 1000 if history else updated
        phase = _phase(self.data.get("phase", "chat"), self.problems)
        title, title_source = self._title(history)
        metadata = self._metadata()
        summary = metadata.summary if isinstance(metadata.summary, str) and metadata.summary.strip() else None
        conversation = Conversation(
            id=self.id,
            title=title,
            title_source=title_source,
            root_kind=history[0].kind if history else 11,
            phase=phase,
            phase_started_at=started or created,
            created_at=created,
            updated_at=updated,
            activity_at=activity,
            summary=summary,
            described_at=activity if title_source is not None else None,
            metadata=metadata,
            archived=self.archived,
        )
        for event in history:
            conversation.append(event)
        self._end(conversation)
        conversation.agent_states = self._agent_states(kept_before, len(history), phase)
        transition = partial(self._transition, history=history)
        conversation.phase_transitions = self._items("phaseTransitions", transition)
        conversation.orchestrator_turns = self._items("orchestratorTurns", self._turn)
        execution = self._part("executionTime", self.data.get("executionTime") or {}, self._execution_time)
        conversation.execution_time = execution or ExecutionTime()
        notes = [storable_text(note) for note in self.problems]
        record: dict[str, Any] = {
            # never before the newest event (one a skewed clock dated after the import is still backlog)
            "source": str(self.path), "imported_at": max(self.now_ms, activity), "rejected": rejected,
            "notes": notes,
        }
        if self.dropped:
            record["dropped"] = dict(self.dropped)
        conversation.metadata.extra[EXTRA_KEY] = storable(record)
        for note in notes:
            self.report.notes.append(ImportProblem(str(self.path), self.id, note))
        return conversation

    def _title(self, history: list[NostrEvent]) -> tuple[str, TitleSource | None]:
        """The title and where it came from: the root's ``title`` tag (``tag``) when the file's title is
        that or absent, else the file's (``import``); none (untitled) when neither is there."""
        tagged = history[0].tag_value(TAG_TITLE) if history else None
        title = self._part("title", self.data.get("title"), _title_text) or tagged
        if not title:
            return UNTITLED, None
        return title, TitleSource.TAG if title == tagged else TitleSource.IMPORT

    def _end(self, conversation: Conversation) -> None:
        """End an archived conversation at its newest event (``import``), and one idle longer than the idle
        timeout at that event plus the timeout (``idle``); leave the others active."""
        activity = conversation.activity_at
        if self.archived:
            conversation.ended_at = activity
            conversation.ended_by, conversation.end_reason = ENDED_BY_IMPORT, "archived in TENEX"
        elif self.now_ms - activity >= self.idle_timeout_ms:
            conversation.ended_at = activity + self.idle_timeout_ms
            conversation.ended_by, conversation.end_reason = ENDED_BY_IDLE, "idle in TENEX"

    def _part(
        self, name: str, raw: Any, convert: Callable[[Any], _T], *, items_apart: bool = False
    ) -> _T | None:
        """``convert(raw)``; None when the part is malformed (text in it that is not valid Unicode makes it
        so, unless ``items_apart``: its items are parts of their own): noted (instead of what converting it
        noted), and kept raw under ``name``."""
        noted = len(self.problems)
        try:
            if not items_apart:
                _check_unicode(raw)
            return convert(raw)
        except _PART_ERRORS as exc:
            reason = _validation_reason(exc) if isinstance(exc, ValidationError) else str(exc)
            del self.problems[noted:]
            self._drop(name, raw, reason)
            return None

    def _drop(self, name: str, raw: Any, reason: str) -> None:
        """Note the part ``name`` left out for ``reason`` and keep it raw."""
        self.problems.append(f"{name} left out: {reason}")
        self.dropped[name] = raw
        log.warning("import_part_dropped", conversation_id=self.id, part=storable_text(name), reason=reason)

    def _items(self, name: str, convert: Callable[[Any], _T]) -> list[_T]:
        """The converted items of the list ``name``, each malformed one (or a non-list) left out."""
        items = self._part(name, self.data.get(name) or [], _a_list, items_apart=True)
        built = (self._part(f"{name}[{n}]", item, convert) for n, item in enumerate(items or []))
        return [item for item in built if item is not None]

    def _optional_time(self, value: Any, what: str) -> int | None:
        """The time ``value`` (falsy: none) in ms; None, noted, when it is no time."""
        if not value:
            return None
        try:
            return time_ms(value, self.now_ms)
        except ValueError as exc:
            self.problems.append(f"{what}: {exc}, ignored")
            return None

    def _history(self) -> tuple[list[NostrEvent], list[Any], list[int]]:
        """Return (verified events, rejected raw entries, kept-count before each source index)."""
        events: list[NostrEvent] = []
        rejected: list[Any] = []
        kept_before: list[int] = []
        seen: set[str] = set()
        latest = self.now_ms // 1000 + MAX_FUTURE_S
        for index, raw in enumerate(_list(self.data.get("history") or [], "history")):
            kept_before.append(len(events))
            try:
                event = parse_ndk_event(raw)
                if event.created_at > latest:
                    raise _BadEventError(f"created_at {event.created_at} is more than a day in the future")
            except (ValueError, TypeError, RecursionError) as exc:
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

    def _created_at(self, history: list[NostrEvent], started: int | None) -> int:
        created = self._optional_time(self.row.get("createdAt"), "metadata.json createdAt")
        if created is not None:
            return created
        if history:
            return history[0].created_at * 1000
        return started or 0

    def _updated_at(self, history: list[NostrEvent], created: int) -> int:
        updated = self._optional_time(self.row.get("updatedAt"), "metadata.json updatedAt")
        if updated is not None:
            return updated
        return history[-1].created_at * 1000 if history else created

    def _metadata(self) -> ConversationMetadata:
        given = self.data.get("metadata") or {}
        source = dict(self._part("metadata", given, _an_object, items_apart=True) or {})
        for key, value in list(source.items()):
            if not (is_unicode(key) and is_unicode(value)):
                self._drop(f"metadata.{key}", value, f"it is {NOT_UNICODE}")
                del source[key]
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

    def _agent_states(self, kept_before: list[int], length: int, phase: Phase) -> dict[str, AgentState]:
        """Each agent's state, a malformed one (or a non-object ``agentStates``) left out."""
        states = self._part("agentStates", self.data.get("agentStates") or {}, _an_object, items_apart=True)
        built: dict[str, AgentState] = {}
        for slug, state in (states or {}).items():
            convert = partial(
                self._agent_state, slug=slug, kept_before=kept_before, length=length, phase=phase
            )
            made = self._part(f"agentStates.{slug}", state, convert)
            if made is not None:
                built[slug] = made
        return built

    def _agent_state(self, raw: Any, *, slug: str, kept_before: list[int], length: int,
                     phase: Phase) -> AgentState:
        state = _an_object(raw)
        _check_unicode(slug, "its agent's name")
        index = int(state.get("lastProcessedMessageIndex", 0))
        session = _text(state.get("claudeSessionId"), "claudeSessionId")
        by_phase = _object(state.get("claudeSessionsByPhase") or {}, "claudeSessionsByPhase")
        if session is None and by_phase:
            session = _text(
                by_phase.get(phase.value) or by_phase.get(phase.value.upper()) or list(by_phase.values())[-1],
                "claudeSessionsByPhase's session",
            )
        if not 0 <= index < len(kept_before):
            self.problems.append(f"agent {slug}: lastProcessedMessageIndex {index} clamped to history")
            index = min(max(index, 0), len(kept_before) - 1)
        return AgentState(last_processed_index=min(kept_before[index], length), session_id=session)

    def _transition(self, raw: Any, *, history: list[NostrEvent]) -> PhaseTransition:
        fields = _an_object(raw)
        timestamp = time_ms(fields.get("timestamp", 0), self.now_ms)
        name = str(fields.get("agentName", ""))
        return PhaseTransition(
            from_phase=_phase(fields.get("from", "chat"), self.problems),
            to_phase=_phase(fields.get("to", "chat"), self.problems),
            message=str(fields.get("message", "")),
            timestamp=timestamp,
            agent_slug=str(fields.get("agentSlug") or _slug(name)),
            agent_pubkey=str(fields.get("agentPubkey", "")),
            agent_name=name,
            reason=_text(fields.get("reason"), "reason"),
            summary=_text(fields.get("summary"), "summary"),
            history_index=sum(1 for e in history if e.created_at * 1000 <= timestamp),
        )

    def _turn(self, raw: Any) -> OrchestratorTurn:
        fields = _an_object(raw)
        return OrchestratorTurn(
            turn_id=str(fields.get("turnId") or fields.get("turn_id")),
            timestamp=time_ms(fields.get("timestamp", 0), self.now_ms),
            phase=_phase(fields.get("phase", "chat"), self.problems),
            agents=_list(fields.get("agents") or [], "agents"),
            completions=[self._completion(c) for c in _list(fields.get("completions") or [], "completions")],
            reason=_text(fields.get("reason"), "reason"),
            is_completed=bool(fields.get("isCompleted", fields.get("is_completed", False))),
        )

    def _completion(self, raw: Any) -> Completion:
        fields = _object(raw, "a completion")
        if "agent" not in fields:
            raise ValueError("a completion has no agent")
        return Completion(agent=str(fields["agent"]), message=str(fields.get("message", "")),
                          timestamp=time_ms(fields.get("timestamp", 0), self.now_ms))

    def _execution_time(self, raw: Any) -> ExecutionTime:
        fields = _an_object(raw)
        start = fields.get("currentSessionStart")
        return ExecutionTime(
            total_seconds=int(fields.get("totalSeconds", 0)),
            current_session_start=time_ms(start, self.now_ms) if start is not None else None,
            is_active=bool(fields.get("isActive", False)),
            last_updated=time_ms(fields.get("lastUpdated", 0), self.now_ms),
        )


def _conversations_dir(src_dir: Path) -> Path:
    for candidate in (src_dir / "conversations", src_dir / ".tenex" / "conversations"):
        if candidate.is_dir():
            return candidate
    if src_dir.name == "conversations" and src_dir.is_dir():
        return src_dir
    raise FileNotFoundError(f"no TENEX conversations folder under {src_dir}")


def _index_rows(folder: Path, report: ImportReport) -> dict[str, dict[str, Any]]:
    """The rows of ``metadata.json`` by conversation id; a row that is not an object with an id is noted."""
    path = folder / "metadata.json"
    if not path.exists():
        return {}
    try:
        listing = _object(json.loads(path.read_text("utf-8")), "metadata.json")
        rows = _list(listing["conversations"], "its conversations")
    except (*_FILE_ERRORS, OSError) as exc:
        report.notes.append(ImportProblem(str(path), None, f"metadata.json unreadable, ignored: {exc}"))
        return {}
    found: dict[str, dict[str, Any]] = {}
    for index, row in enumerate(rows):
        if isinstance(row, dict) and "id" in row:
            found[str(row["id"])] = row
        else:
            reason = f"metadata.json conversations[{index}] is not an object with an id, ignored"
            report.notes.append(ImportProblem(str(path), None, reason, index=index, raw=row))
    return found


async def import_tenex_home(
    src_dir: str | Path,
    store: Store,
    *,
    clock: Clock | None = None,
    idle_timeout_ms: int = DEFAULT_IDLE_TIMEOUT_MS,
) -> ImportReport:
    """Import every conversation of a TENEX TypeScript-era home into ``store``.

    ``src_dir`` is the project folder, its ``.tenex`` folder, or the ``conversations`` folder.
    Conversations already in the store are left alone (the import can be re-run). Source
    files are only read, never changed. A file that cannot be read or is not a conversation, or whose
    conversation the store refuses, is reported in ``failed`` and the others are imported; a store that
    cannot be written at all (an ``OSError``: its database does not answer, a full disk) stops the import
    (a new run reports the conversations stored before it already present). ``clock`` (default: the
    system's) dates "now" for refusing times in the future and for ending a conversation idle longer than
    ``idle_timeout_ms``.
    """
    folder = _conversations_dir(Path(src_dir))
    now_ms = (clock or SystemClock()).now_ms()
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
            made = _ConversationImport(path, data, row, archived, report, now_ms, idle_timeout_ms)
            conversation = made.build()
        except (*_FILE_ERRORS, OSError) as exc:
            report.failed.append(ImportProblem(str(path), None, f"{type(exc).__name__}: {exc}"))
            log.error("import_conversation_failed", path=str(path), error=str(exc))
            continue
        try:
            await store.create(conversation)
        except OSError:
            raise  # the store cannot be written at all (its database does not answer, a full disk)
        except ConversationExistsError:
            report.already_present.append(conversation.id)
            continue
        except Exception as exc:  # this file's conversation, refused by the store: the others go on
            report.failed.append(
                ImportProblem(str(path), conversation.id, f"not stored: {type(exc).__name__}: {exc}")
            )
            log.error("import_conversation_not_stored", path=str(path), error=repr(exc))
            continue
        report.imported.append(conversation.id)
        report.events_imported += len(conversation.history)
    log.info(
        "tenex_import_done", imported=len(report.imported), failed=len(report.failed),
        rejected_events=len(report.rejected_events),
    )
    return report
