"""Import a SmartHole plugin's ``data.json`` (its conversations and its legacy history) into any Store.

SmartHole is an Obsidian plugin; what it persists (``saveData``) is one JSON object. Two shapes of
history are read from it:

- **Conversations**: a list under a key ``conversations`` (the plugin keeps
  ``{"conversations": [...], "lastMigrated": ...}`` under ``conversationData``), each
  ``{id, startedAt, endedAt, title, summary, messages: [{id, timestamp, role, content, toolsUsed?}]}``
  with ``role`` ``"user"`` or ``"assistant"``.
- **The legacy history**: a list of ``HistoryEntry``
  ``{id, timestamp, userMessage, assistantResponse, toolsUsed, source?}`` under a key
  ``recentConversations`` (with its ``summaries`` beside it), or under any other key when its
  items have a ``userMessage``.

What is accepted, liberally: the lists at the top level or nested in objects (plugin settings) up
to four levels deep, an object stored as a JSON string, and a top-level list of conversations or of
history entries. Timestamps are ISO 8601 (a time without a zone is UTC) or numbers in seconds or
milliseconds; one before 1970, past the year 9999 or more than a day past now (a microsecond count, a
corrupt number) is a bad timestamp. A file with neither kind of list is refused with
:class:`SmartHoleFormatError`.

How it maps onto tenexd conversations (lists of signed Nostr events):

- Messages cannot be signed by their original authors, so they are signed again: the person's
  messages with ``identities.user`` (the command uses the owner's key when the home has it, else
  the home's import key) and the assistant's with the chosen agent's key, so that agent sees its
  own messages as ``assistant``. An event's ``created_at`` is the message's time (seconds).
- The first message is a kind-11 root (``p`` the other side, the project's ``a`` when known), the
  others kind-1111 replies to the message before them (NIP-22 tags, ``p`` the other side). Each
  event carries ``["import", "smarthole", <conversation id>, <message id>]`` (the legacy history:
  ``["import", "smarthole-history", <entry id>]``), so its id is deterministic from the source and
  two equal texts sent in one second stay two events. The conversation's id is its root's id.
- Each SmartHole conversation becomes one conversation: its title (``title_source`` ``import``)
  and summary, ``created_at`` its ``startedAt``, ``activity_at`` its newest message, the tools of
  each assistant message in ``tools_used``. One with an ``endedAt`` is ended then (``ended_by``
  ``import``). One without is ended ``idle`` at its newest message plus the idle timeout when
  that moment has passed, else left active (the idle timeout ends it later). A conversation that
  has a title counts as described (``described_at`` = its activity), so no model retitles it.
  The chosen agent has seen all of it (its ``last_processed_index`` is the history's length).
  Every imported conversation holds its import record in ``metadata.extra["smarthole_import"]``: the
  description service reads it as "imported" (never on Nostr) and publishes no kind 513 for it
  (``tenex_daemon/services/descriptions.py``).
- The legacy history becomes one ended conversation titled "Migrated Conversation History": each
  entry's user message, then its assistant response when there is one, in order; the texts of the
  legacy summaries, joined, are its summary.
- Errors are per entry: a message or history entry that is not an object, has an unknown role, no
  text, text that is not valid Unicode (a lone surrogate such as ``"\\ud83d"``, half an emoji: it
  can be neither signed nor stored), or a bad timestamp is left out (a bad ``startedAt`` or
  ``endedAt`` is noted and replaced by the first or newest message's time), reported in
  ``rejected_events`` (its index and the conversation's source id) and kept, raw, in
  ``metadata.extra["smarthole_import"]["rejected"]``; the rest of its conversation is imported. A
  title or summary that is not valid Unicode is left out and noted (a legacy summary's text, left
  out); in an id, and in what is kept raw, such a character is written as its escape ``\\ud83d``. A
  conversation that is not an object, has no message list, or whose every message is rejected is
  skipped whole (``failed``). Each conversation is built fully in memory and stored in one
  ``store.create``, so none is ever half-written.
- Idempotent: the same events come out of the same source, so a conversation already stored is
  reported ``already_present``; and the import of a file is recorded in the store's small values
  under ``import.smarthole.<sha256 of the file>`` (when, from where, the counts): importing the
  same file again changes nothing and reports that record. The source file is only read.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog

from tenex_daemon.adapters.nostr.codec import build_reply_tags, project_address
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.core.conversation import (
    UNTITLED,
    AgentState,
    Conversation,
    ConversationMetadata,
    TitleSource,
)
from tenex_daemon.core.errors import ConversationExistsError
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.phases import Phase
from tenex_daemon.core.ports import Clock, Store
from tenex_daemon.core.vocabulary import (
    KIND_COMMENT,
    KIND_CONVERSATION_ROOT,
    TAG_ADDRESS,
    TAG_PUBKEY,
)

from .tenex_import import (
    NOT_UNICODE,
    ImportProblem,
    ImportReport,
    checked_ms,
    is_unicode,
    storable,
    storable_text,
    to_ms,
)

log = structlog.get_logger(__name__)

LEGACY_TITLE = "Migrated Conversation History"
META_PREFIX = "import.smarthole."
"""Small-value key prefix of an import's record; the file's sha256 follows."""
ENDED_BY_IMPORT = "import"
ENDED_BY_IDLE = "idle"
TAG_IMPORT = "import"
SOURCE_CONVERSATION = "smarthole"
SOURCE_HISTORY = "smarthole-history"
EXTRA_KEY = "smarthole_import"
MAX_DEPTH = 4
"""How deep in nested objects the lists are looked for."""
ROLES = ("user", "assistant")


class SmartHoleFormatError(ValueError):
    """The file is not JSON, or holds neither SmartHole conversations nor a legacy history list."""


@dataclass(frozen=True)
class SmartHoleIdentities:
    """Who the imported messages are signed by."""

    user: Signer
    """Signs the person's messages (must be neither an agent's nor the project's key)."""
    agent: Signer
    """Signs the assistant's messages: the key of the agent they are attributed to."""
    agent_slug: str
    project: tuple[str, str] | None = None
    """(owner pubkey, project ``d`` tag) for the roots' ``a`` tag; None writes none."""


@dataclass
class SmartHoleImportReport(ImportReport):
    """What :func:`import_smarthole_file` did (the counts and problems of :class:`ImportReport`)."""

    source: str = ""
    sha256: str = ""
    already_imported: dict[str, Any] | None = None
    """The record of an earlier import of this very file; when set, nothing was changed."""


@dataclass
class SmartHoleData:
    """The lists found in a SmartHole file."""

    conversations: list[Any] = field(default_factory=list)
    history: list[Any] = field(default_factory=list)
    summaries: list[Any] = field(default_factory=list)
    found: bool = False
    """Whether either kind of list was found (empty lists count)."""


# --- reading the file -------------------------------------------------------------------------


def _looks_like(items: list[Any], key: str) -> bool:
    """Whether the list's first object has ``key`` (the shape of a conversation or a history entry)."""
    first = next((item for item in items if isinstance(item, dict)), None)
    return first is not None and key in first


def _decoded(node: Any) -> Any:
    """A string holding a JSON object or list, decoded; anything else as it is."""
    if isinstance(node, str) and node.lstrip()[:1] in ("{", "["):
        try:
            return json.loads(node)
        except (ValueError, RecursionError):
            return node
    return node


def _collect(node: Any, found: SmartHoleData, depth: int) -> None:
    """Gather the conversation and history lists of ``node`` and the objects nested in it."""
    node = _decoded(node)
    if depth > MAX_DEPTH or not isinstance(node, dict):
        return
    for key, raw in node.items():
        value = _decoded(raw)
        if isinstance(value, list) and key == "conversations":
            found.conversations.extend(value)
            found.found = True
        elif isinstance(value, list) and (key == "recentConversations" or _looks_like(value, "userMessage")):
            found.history.extend(value)
            summaries = node.get("summaries")
            if isinstance(summaries, list):
                found.summaries.extend(summaries)
            found.found = True
        elif isinstance(value, dict):
            _collect(value, found, depth + 1)


def find_smarthole_data(data: Any) -> SmartHoleData:
    """Return the conversations and legacy history held by a SmartHole file's JSON.

    Raises :class:`SmartHoleFormatError` when it holds neither.
    """
    found = SmartHoleData()
    if isinstance(data, list):
        if _looks_like(data, "userMessage"):
            found.history, found.found = list(data), True
        elif _looks_like(data, "messages"):
            found.conversations, found.found = list(data), True
    else:
        _collect(data, found, 0)
    if not found.found:
        raise SmartHoleFormatError(
            "no SmartHole data found: expected a 'conversations' list or a legacy history list "
            "('recentConversations', entries with a 'userMessage'), at the top level or in nested objects"
        )
    return found


def parse_time_ms(value: Any, now_ms: int | None = None) -> int:
    """Return milliseconds since the epoch of an ISO 8601 time or a number of seconds or milliseconds.

    Raises ValueError for anything else, and for a time before 1970, past the year 9999 or (when
    ``now_ms`` is given) more than a day past it.
    """
    if isinstance(value, bool) or value is None:
        raise ValueError(f"bad timestamp {value!r}")
    if isinstance(value, int | float):
        try:
            ms = to_ms(value)
        except (ValueError, OverflowError):
            raise ValueError(f"bad timestamp {value!r}") from None
    elif isinstance(value, str):
        try:
            ms = to_ms(value)
        except OverflowError:
            raise ValueError(f"bad timestamp {value!r}") from None
        except ValueError:
            try:
                moment = datetime.fromisoformat(value.strip())
            except ValueError:
                raise ValueError(f"bad timestamp {value!r}") from None
            if moment.tzinfo is None:
                moment = moment.replace(tzinfo=UTC)
            ms = round(moment.timestamp() * 1000)
    else:
        raise ValueError(f"bad timestamp {value!r}")
    return checked_ms(ms, value, now_ms)


def _tools(value: Any) -> list[str] | None:
    """The tool names of a ``toolsUsed`` value; None when it is not a list of strings."""
    if value is None:
        return []
    if isinstance(value, list) and all(isinstance(name, str) for name in value) and is_unicode(value):
        return [name for name in value if name]
    return None


# --- building one conversation ----------------------------------------------------------------


class _Thread:
    """Signs one conversation's messages in order: a kind-11 root, then kind-1111 replies."""

    def __init__(self, identities: SmartHoleIdentities, source: list[str]) -> None:
        self.identities = identities
        self.source = source
        """The import tag's values after its name: the source kind and conversation id."""
        self.events: list[NostrEvent] = []
        self.times: list[int] = []
        self.tools: dict[str, list[str]] = {}
        self.duplicates = 0
        self._seen: set[str] = set()

    def add(self, role: str, content: str, ms: int, reference: str, tools: list[str]) -> None:
        """Sign and append one message (a duplicate of an earlier one is counted and dropped)."""
        ids = self.identities
        signer, other = (ids.agent, ids.user) if role == "assistant" else (ids.user, ids.agent)
        provenance = [TAG_IMPORT, *self.source, reference]
        if not self.events:
            kind = KIND_CONVERSATION_ROOT
            tags = [[TAG_PUBKEY, other.pubkey]]
            if ids.project is not None:
                tags.append([TAG_ADDRESS, project_address(*ids.project)])
        else:
            kind = KIND_COMMENT
            tags = build_reply_tags(self.events[-1], [other.pubkey], root=self.events[0])
        event = signer.sign(kind, content, [*tags, provenance], created_at=ms // 1000)
        if event.id in self._seen:
            self.duplicates += 1
            return
        self._seen.add(event.id)
        self.events.append(event)
        self.times.append(ms)
        if role == "assistant" and tools:
            self.tools[event.id] = tools

    def conversation(self, *, created_at: int, title: str | None, summary: str | None) -> Conversation:
        """The conversation of the messages added so far (at least one); not yet ended."""
        activity = max(self.times)
        conversation = Conversation(
            id=self.events[0].id,
            title=title or UNTITLED,
            title_source=TitleSource.IMPORT if title else None,
            root_kind=KIND_CONVERSATION_ROOT,
            phase=Phase.CHAT,
            phase_started_at=created_at,
            created_at=created_at,
            updated_at=activity,
            activity_at=activity,
            summary=summary,
            described_at=activity if title else None,
            tools_used=dict(self.tools),
            history=list(self.events),
        )
        conversation.agent_states[self.identities.agent_slug] = AgentState(
            last_processed_index=len(conversation.history)
        )
        return conversation


@dataclass
class _Run:
    """What every conversation's import needs: who signs, the report, the time and the idle timeout."""

    identities: SmartHoleIdentities
    report: SmartHoleImportReport
    now_ms: int
    idle_timeout_ms: int
    not_stored: int = 0
    """How many conversations the store refused (reported in ``failed``)."""

    def reject(self, conversation_id: str, index: int, reason: str, raw: Any) -> None:
        """Report one message or history entry left out."""
        self.report.rejected_events.append(
            ImportProblem(self.report.source, conversation_id, reason, index=index, raw=raw)
        )
        log.warning("smarthole_entry_rejected", conversation_id=conversation_id, index=index, reason=reason)

    def note(self, conversation_id: str | None, reason: str, notes: list[str]) -> None:
        """Report something repaired (kept in the conversation's import record too)."""
        notes.append(reason)
        self.report.notes.append(ImportProblem(self.report.source, conversation_id, reason))

    def fail(self, conversation_id: str | None, reason: str, raw: Any = None) -> None:
        """Report a conversation skipped whole."""
        self.report.failed.append(ImportProblem(self.report.source, conversation_id, reason, raw=raw))
        log.error("smarthole_conversation_failed", conversation_id=conversation_id, reason=reason)


def _message_fields(raw: Any, now_ms: int) -> tuple[str, str, int, list[str] | None]:
    """(role, content, ms, tools or None when malformed) of a SmartHole message; ValueError when unusable
    (a time more than a day past ``now_ms`` too)."""
    if not isinstance(raw, dict):
        raise ValueError("not an object")
    role = raw.get("role")
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}")
    content = raw.get("content")
    if not isinstance(content, str) or not content.strip():
        raise ValueError("no content")
    if not is_unicode(content):
        raise ValueError(f"content is {NOT_UNICODE}")
    return str(role), content, parse_time_ms(raw.get("timestamp"), now_ms), _tools(raw.get("toolsUsed"))


def _source_conversation(run: _Run, index: int, raw: Any) -> Conversation | None:
    """Build one SmartHole conversation; None (and reported) when there is nothing to import."""
    if not isinstance(raw, dict):
        run.fail(f"#{index}", f"conversation #{index} is not an object", raw)
        return None
    source_id = storable_text(str(raw.get("id") or f"#{index}"))
    messages = raw.get("messages")
    if not isinstance(messages, list):
        run.fail(source_id, "no 'messages' list", raw)
        return None
    notes: list[str] = []
    if not messages:
        run.note(source_id, "no messages: nothing to import", notes)
        return None
    thread = _Thread(run.identities, [SOURCE_CONVERSATION, source_id])
    rejected: list[Any] = []
    for position, message in enumerate(messages):
        try:
            role, content, ms, tools = _message_fields(message, run.now_ms)
        except ValueError as exc:
            rejected.append(message)
            run.reject(source_id, position, str(exc), message)
            continue
        if tools is None:
            run.note(source_id, f"message {position}: toolsUsed is not a list of names, ignored", notes)
        reference = storable_text(str(message.get("id") or f"#{position}"))
        thread.add(role, content, ms, reference, tools or [])
    run.report.duplicate_events += thread.duplicates
    if not thread.events:
        run.fail(source_id, "every message was rejected")
        return None
    return _finish_source(run, raw, source_id, thread, rejected, notes)


def _text_or_none(value: Any) -> str | None:
    """The stripped text of ``value``; None when it is no text, blank, or not valid Unicode."""
    return value.strip() if isinstance(value, str) and value.strip() and is_unicode(value) else None


def _side_text(run: _Run, raw: dict[str, Any], key: str, source_id: str, notes: list[str]) -> str | None:
    """The text of the conversation's ``key`` (title, summary); one that is not valid Unicode is noted."""
    value = raw.get(key)
    if isinstance(value, str) and not is_unicode(value):
        run.note(source_id, f"{key} is {NOT_UNICODE}, left out", notes)
    return _text_or_none(value)


def _finish_source(
    run: _Run, raw: dict[str, Any], source_id: str, thread: _Thread, rejected: list[Any], notes: list[str]
) -> Conversation:
    """The conversation of a SmartHole conversation's signed messages: times, description, end."""
    try:
        created = parse_time_ms(raw.get("startedAt"), run.now_ms)
    except ValueError as exc:
        created = min(thread.times)
        run.note(source_id, f"startedAt: {exc}; the first message's time is used", notes)
    title, summary = (_side_text(run, raw, key, source_id, notes) for key in ("title", "summary"))
    conversation = thread.conversation(created_at=created, title=title, summary=summary)
    ended = raw.get("endedAt")
    if ended is not None:
        try:
            conversation.ended_at = parse_time_ms(ended, run.now_ms)
        except ValueError as exc:
            conversation.ended_at = conversation.activity_at
            run.note(source_id, f"endedAt: {exc}; ended at its newest message", notes)
        conversation.ended_by, conversation.end_reason = ENDED_BY_IMPORT, "ended in SmartHole"
    elif run.now_ms - conversation.activity_at >= run.idle_timeout_ms:
        conversation.ended_at = conversation.activity_at + run.idle_timeout_ms
        conversation.ended_by, conversation.end_reason = ENDED_BY_IDLE, "idle in SmartHole"
    conversation.metadata = ConversationMetadata(extra={EXTRA_KEY: storable({
        "source": run.report.source, "id": source_id, "rejected": rejected, "notes": notes,
    })})
    return conversation


def _entry_fields(raw: Any, now_ms: int) -> tuple[str, str | None, int, list[str]]:
    """(user message, assistant response or None, ms, tools) of a legacy entry; ValueError when unusable
    (a time more than a day past ``now_ms`` too)."""
    if not isinstance(raw, dict):
        raise ValueError("not an object")
    user = raw.get("userMessage")
    if not isinstance(user, str) or not user.strip():
        raise ValueError("no userMessage")
    ms = parse_time_ms(raw.get("timestamp"), now_ms)
    answer = raw.get("assistantResponse")
    response = answer if isinstance(answer, str) and answer.strip() else None
    if not is_unicode([user, response]):
        raise ValueError(f"userMessage or assistantResponse is {NOT_UNICODE}")
    return user, response, ms, _tools(raw.get("toolsUsed")) or []


def _legacy_summary(summaries: list[Any]) -> str | None:
    """The texts of the legacy summaries, oldest first, as one summary (None when there are none)."""
    texts = [s.get("summary") for s in summaries if isinstance(s, dict)]
    return "\n\n".join(text for text in map(_text_or_none, texts) if text is not None) or None


def _legacy_conversation(run: _Run, entries: list[Any], summaries: list[Any]) -> Conversation | None:
    """Build the one "Migrated Conversation History" conversation; None when no entry is usable."""
    thread = _Thread(run.identities, [SOURCE_HISTORY])
    rejected: list[Any] = []
    for position, entry in enumerate(entries):
        try:
            user, answer, ms, tools = _entry_fields(entry, run.now_ms)
        except ValueError as exc:
            rejected.append(entry)
            run.reject(LEGACY_TITLE, position, str(exc), entry)
            continue
        reference = storable_text(str(entry.get("id") or f"#{position}"))
        thread.add("user", user, ms, reference, [])
        if answer is not None:
            thread.add("assistant", answer, ms, reference, tools)
    run.report.duplicate_events += thread.duplicates
    if not thread.events:
        if entries:
            run.fail(LEGACY_TITLE, "every legacy history entry was rejected")
        return None
    conversation = thread.conversation(
        created_at=min(thread.times), title=LEGACY_TITLE, summary=_legacy_summary(summaries)
    )
    conversation.ended_at = conversation.activity_at
    conversation.ended_by, conversation.end_reason = ENDED_BY_IMPORT, "legacy SmartHole history"
    conversation.metadata = ConversationMetadata(extra={EXTRA_KEY: storable({
        "source": run.report.source, "legacy_history": True, "entries": len(entries),
        "summaries": summaries, "rejected": rejected, "notes": [],
    })})
    return conversation


def _built(run: _Run, data: SmartHoleData) -> Iterator[Conversation]:
    """Every conversation to store, in source order, the legacy history last."""
    for index, raw in enumerate(data.conversations):
        conversation = _source_conversation(run, index, raw)
        if conversation is not None:
            yield conversation
    legacy = _legacy_conversation(run, data.history, data.summaries)
    if legacy is not None:
        yield legacy


# --- the import -------------------------------------------------------------------------------


async def _store_one(store: Store, conversation: Conversation, run: _Run) -> None:
    """Create the conversation in one call; an existing one is reported (with what it lacks), and one the
    store refuses is reported ``failed`` (the others are still stored). A store that cannot be written
    at all (an ``OSError``: its database does not answer, its disk is full) stops the import."""
    try:
        await store.create(conversation)
    except OSError:
        raise
    except ConversationExistsError:
        run.report.already_present.append(conversation.id)
        stored = await store.load(conversation.id)
        missing = 0 if stored is None else sum(not stored.contains_event(e.id) for e in conversation.history)
        if missing:
            reason = f"already stored; {missing} source message(s) not in it were not added"
            run.note(conversation.id, reason, [])
        return
    except Exception as exc:  # this conversation's data, refused by the store: the others go on
        run.not_stored += 1
        run.fail(conversation.id, f"not stored: {type(exc).__name__}: {exc}")
        return
    run.report.imported.append(conversation.id)
    run.report.events_imported += len(conversation.history)


def _record(report: SmartHoleImportReport, now_ms: int) -> dict[str, Any]:
    """What is kept in the store about this import."""
    return {
        "at": now_ms, "source": report.source, "imported": len(report.imported),
        "already_present": len(report.already_present), "events": report.events_imported,
        "failed": len(report.failed), "rejected": len(report.rejected_events),
    }


async def import_smarthole_file(
    path: str | Path,
    store: Store,
    identities: SmartHoleIdentities,
    *,
    clock: Clock,
    idle_timeout_ms: int,
) -> SmartHoleImportReport:
    """Import a SmartHole ``data.json`` into ``store`` (see the module's description); return the report.

    Raises FileNotFoundError for a missing file and :class:`SmartHoleFormatError` for one that is
    not JSON or holds no SmartHole data. A conversation the store refuses is reported in ``failed`` and
    the others are stored; the import is then not recorded, so a new run tries it again (reporting the
    others already present). A store that cannot be written at all (an ``OSError``) stops the import
    (conversations stored before stay stored, and a new run reports them already present).
    """
    file = Path(path)
    payload = await asyncio.to_thread(file.read_bytes)
    digest = hashlib.sha256(payload).hexdigest()
    report = SmartHoleImportReport(source=str(file), sha256=digest)
    previous = await store.get_meta(META_PREFIX + digest)
    if previous is not None:
        report.already_imported = json.loads(previous)
        log.info("smarthole_import_already_done", source=str(file), sha256=digest)
        return report
    try:
        data = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise SmartHoleFormatError(f"{file} is not a JSON file: {exc}") from None
    found = find_smarthole_data(data)
    now = clock.now_ms()
    run = _Run(identities, report, now, idle_timeout_ms)
    for conversation in _built(run, found):
        await _store_one(store, conversation, run)
    if run.not_stored:
        log.warning("smarthole_import_not_recorded", source=str(file), not_stored=run.not_stored)
    else:
        await store.set_meta(META_PREFIX + digest, json.dumps(_record(report, now)))
    log.info(
        "smarthole_import_done", imported=len(report.imported), already_present=len(report.already_present),
        failed=len(report.failed), rejected=len(report.rejected_events),
    )
    return report
