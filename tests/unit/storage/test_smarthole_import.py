"""Importing a SmartHole data.json: conversations, the legacy history, idempotence, per-entry errors."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.adapters.storage.filesystem import FileSystemStore
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.adapters.storage.smarthole_import import (
    LEGACY_TITLE,
    META_PREFIX,
    SmartHoleFormatError,
    SmartHoleIdentities,
    find_smarthole_data,
    import_smarthole_file,
    parse_time_ms,
)
from tenex_daemon.core.conversation import Conversation, TitleSource
from tenex_daemon.core.errors import StoreUnavailableError
from tenex_daemon.core.ports import Store
from tenex_daemon.core.search import SearchQuery
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.testing import FakeClock
from tests.conftest import Cast

NOW = 1_700_000_000_000
"""The FakeClock's time: 2023-11-14 22:13:20 UTC."""
MINUTE = 60_000
IDLE = 30 * MINUTE
T0 = NOW - 12 * 60 * MINUTE
"""When the ended conversation started."""
LEGACY_T = NOW - 5 * 24 * 60 * MINUTE


def iso(ms: int) -> str:
    """The ISO 8601 form SmartHole writes (``toISOString``) of a time in milliseconds."""
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def message(ms: int, role: str, content: str, tools: list[str] | None = None) -> dict[str, Any]:
    """One SmartHole conversation message."""
    data: dict[str, Any] = {"id": f"msg-{ms}-{role}", "timestamp": iso(ms), "role": role, "content": content}
    if tools is not None:
        data["toolsUsed"] = tools
    return data


def ended_conversation() -> dict[str, Any]:
    """An ended conversation with a title, a summary and tools on one answer."""
    return {
        "id": f"conv-{T0}", "startedAt": iso(T0), "endedAt": iso(T0 + 30 * MINUTE),
        "title": "Meeting notes creation", "summary": "The user asked for meeting notes; they were written.",
        "messages": [
            message(T0, "user", "Create a note about today's meeting"),
            message(T0 + 5_000, "assistant", "I've created 'Meeting Notes.md'.", ["write_file", "read_file"]),
            message(T0 + MINUTE, "user", "Thanks"),
            message(T0 + MINUTE + 2_000, "assistant", "You're welcome.", []),
        ],
    }


def open_conversation(start: int = NOW - 10 * MINUTE) -> dict[str, Any]:
    """A conversation with no endedAt, no title and no summary whose last message is ``start`` + 3 s."""
    return {
        "id": f"conv-{start}", "startedAt": iso(start), "endedAt": None, "title": None, "summary": None,
        "messages": [message(start, "user", "What is on my list?"), message(start + 3_000, "assistant", "Two tasks.")],
    }


def legacy_entries() -> list[dict[str, Any]]:
    """Two legacy HistoryEntry objects: one answered with a tool, one with no answer."""
    return [
        {"id": "h-1", "timestamp": iso(LEGACY_T), "userMessage": "Find my notes on tea",
         "assistantResponse": "Found 3 notes.", "toolsUsed": ["search_notes"], "source": "websocket"},
        {"id": "h-2", "timestamp": iso(LEGACY_T + MINUTE), "userMessage": "Just noting this",
         "assistantResponse": "", "toolsUsed": []},
    ]


def plugin_data(conversations: list[Any], history: list[Any]) -> dict[str, Any]:
    """A plugin's data.json: settings, conversations under conversationData, the legacy history beside it."""
    return {
        "enabled": True,
        "conversationIdleTimeoutMinutes": 30,
        "conversationData": {"conversations": conversations, "lastMigrated": None},
        "conversationHistory": {
            "recentConversations": history,
            "summaries": [{"startDate": iso(LEGACY_T - MINUTE), "endDate": iso(LEGACY_T),
                           "summary": "Earlier, notes about tea.", "conversationCount": 4}],
            "lastSummarized": iso(LEGACY_T),
        },
    }


def write(tmp_path: Path, data: Any, name: str = "data.json") -> Path:
    """Write ``data`` as a JSON file and return its path."""
    path = tmp_path / name
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def identities(cast: Cast) -> SmartHoleIdentities:
    """The cast's user signs the person's messages; Alice the assistant's."""
    return SmartHoleIdentities(
        user=Signer(bytes.fromhex(cast.user.secret), label="user"),
        agent=Signer(bytes.fromhex(cast.alice_keys.secret), label="alice"),
        agent_slug="alice",
        project=(cast.user.pubkey, "notes"),
    )


async def by_title(store: Store) -> dict[str, Conversation]:
    """Every stored conversation, by title (source id for untitled ones)."""
    found: dict[str, Conversation] = {}
    for row in await store.search(SearchQuery()):
        conversation = await store.load(row.id)
        assert conversation is not None
        key = conversation.title
        if conversation.title_source is None:
            key = str(conversation.metadata.extra["smarthole_import"]["id"])
        found[key] = conversation
    return found


def test_times_in_iso_seconds_and_milliseconds_parse() -> None:
    """ISO 8601 with Z, an offset or no zone (UTC), and numbers in seconds or ms all give milliseconds."""
    assert parse_time_ms("2023-11-14T22:13:20.000Z") == NOW
    assert parse_time_ms("2023-11-15T00:13:20+02:00") == NOW
    assert parse_time_ms("2023-11-14T22:13:20") == NOW
    assert parse_time_ms(NOW // 1000) == NOW
    assert parse_time_ms(str(NOW)) == NOW
    bad_values: tuple[Any, ...] = ("yesterday", None, True, [], "inf", -5)
    for bad in bad_values:
        with pytest.raises(ValueError, match="bad timestamp"):
            parse_time_ms(bad)


def test_the_lists_are_found_nested_in_json_strings_and_at_the_top() -> None:
    """Conversations and the legacy list are found at the top level, nested, inside a JSON string, or as a list."""
    conversations = [ended_conversation()]
    entries = legacy_entries()
    nested = {"plugin": {"conversationData": json.dumps({"conversations": conversations})}, "old": entries}
    found = find_smarthole_data(nested)
    assert (found.conversations, found.history) == (conversations, entries)
    assert find_smarthole_data({"conversations": []}).found
    assert find_smarthole_data(entries).history == entries
    assert find_smarthole_data(conversations).conversations == conversations


@pytest.mark.parametrize("data", [{"settings": {"enabled": True}}, [], {"conversations": "none"}, 42])
def test_a_file_with_neither_list_is_refused(data: Any) -> None:
    """Data holding neither a conversations list nor a legacy history list raises a clear format error."""
    with pytest.raises(SmartHoleFormatError, match="no SmartHole data found"):
        find_smarthole_data(data)


async def test_import_maps_conversations_and_the_legacy_history(tmp_path: Path, cast: Cast) -> None:
    """Titles, summaries, times, ends, roles as the agent sees them and tools come over from the source."""
    path = write(tmp_path, plugin_data([ended_conversation(), open_conversation()], legacy_entries()))
    store = MemoryStore()
    clock = FakeClock(NOW)
    report = await import_smarthole_file(path, store, identities(cast), clock=clock, idle_timeout_ms=IDLE)
    assert report.clean
    assert report.failed == []
    assert len(report.imported) == 3
    assert report.events_imported == 4 + 2 + 3
    found = await by_title(store)
    assert set(found) == {"Meeting notes creation", f"conv-{NOW - 10 * MINUTE}", LEGACY_TITLE}

    ended = found["Meeting notes creation"]
    assert ended.title_source is TitleSource.IMPORT
    assert ended.summary == "The user asked for meeting notes; they were written."
    assert (ended.created_at, ended.activity_at, ended.ended_at) == (T0, T0 + MINUTE + 2_000, T0 + 30 * MINUTE)
    assert ended.ended_by == "import"
    assert ended.described_at == ended.activity_at
    assert [e.created_at for e in ended.history] == [(T0 + d) // 1000 for d in (0, 5_000, MINUTE, MINUTE + 2_000)]
    assert [e.kind for e in ended.history] == [11, 1111, 1111, 1111]
    assert ended.id == ended.history[0].id
    for event in ended.history:
        event.require_valid_id()
    assert ended.tools_used == {ended.history[1].id: ["write_file", "read_file"]}
    assert ended.agent_states["alice"].last_processed_index == 4

    manager = ConversationManager(store, cast.agents, cast.project.pubkey, clock=clock)
    context = await manager.preview_agent_messages(ended.id, "alice")
    assert [(m.role, m.content) for m in context.messages] == [
        ("user", "Create a note about today's meeting"), ("assistant", "I've created 'Meeting Notes.md'."),
        ("user", "Thanks"), ("system", "[Alice]: You're welcome."),  # her answer, the newest, as the trigger
    ]

    active = found[f"conv-{NOW - 10 * MINUTE}"]
    assert (active.title, active.title_source, active.summary) == ("Untitled Conversation", None, None)
    assert active.ended_at is None
    assert active.described_at is None

    legacy = found[LEGACY_TITLE]
    assert legacy.title_source is TitleSource.IMPORT
    assert legacy.summary == "Earlier, notes about tea."
    assert (legacy.created_at, legacy.ended_at) == (LEGACY_T, LEGACY_T + MINUTE)
    assert legacy.ended_by == "import"
    assert legacy.tools_used == {legacy.history[1].id: ["search_notes"]}
    context = await manager.preview_agent_messages(legacy.id, "alice")
    assert [(m.role, m.content) for m in context.messages] == [
        ("user", "Find my notes on tea"), ("assistant", "Found 3 notes."), ("user", "Just noting this"),
    ]


async def test_a_conversation_idle_longer_than_the_timeout_is_ended_idle(tmp_path: Path, cast: Cast) -> None:
    """A source conversation with no endedAt whose last message is older than the idle timeout ends then."""
    start = NOW - 2 * 60 * MINUTE
    path = write(tmp_path, {"conversations": [open_conversation(start)]})
    store = MemoryStore()
    report = await import_smarthole_file(path, store, identities(cast), clock=FakeClock(NOW), idle_timeout_ms=IDLE)
    conversation = await store.load(report.imported[0])
    assert conversation is not None
    assert (conversation.ended_at, conversation.ended_by) == (start + 3_000 + IDLE, "idle")


async def test_a_second_run_imports_nothing_and_reports_the_first(tmp_path: Path, cast: Cast) -> None:
    """The same file again is reported already imported and changes nothing; a reformatted copy finds every
    conversation already present (its event ids are the same)."""
    data = plugin_data([ended_conversation(), open_conversation()], legacy_entries())
    path = write(tmp_path, data)
    store = MemoryStore()
    clock = FakeClock(NOW)
    first = await import_smarthole_file(path, store, identities(cast), clock=clock, idle_timeout_ms=IDLE)
    record = await store.get_meta(META_PREFIX + first.sha256)
    assert record is not None
    assert json.loads(record) | {"source": None} == {
        "at": NOW, "source": None, "imported": 3, "already_present": 0, "events": 9, "failed": 0, "rejected": 0,
    }
    before = {c.id: c.model_dump_json() for c in (await by_title(store)).values()}
    clock.advance(60 * MINUTE)
    again = await import_smarthole_file(path, store, identities(cast), clock=clock, idle_timeout_ms=IDLE)
    assert again.already_imported is not None
    assert again.already_imported["at"] == NOW
    assert (again.imported, again.already_present, again.events_imported) == ([], [], 0)
    assert {c.id: c.model_dump_json() for c in (await by_title(store)).values()} == before

    copy = tmp_path / "copy.json"
    copy.write_text(json.dumps(data, indent=1), encoding="utf-8")
    third = await import_smarthole_file(copy, store, identities(cast), clock=clock, idle_timeout_ms=IDLE)
    assert third.already_imported is None
    assert third.imported == []
    assert sorted(third.already_present) == sorted(first.imported)


class RefusingStore(MemoryStore):
    """A memory store whose ``create`` of one conversation raises ``error`` (none: it refuses none)."""

    def __init__(self, refused: str, error: Exception) -> None:
        super().__init__()
        self.refused: str | None = refused
        self.error = error

    async def create(self, conversation: Conversation) -> None:
        """Raise for the refused conversation, store the others."""
        if conversation.id == self.refused:
            raise self.error
        await super().create(conversation)


async def test_a_conversation_the_store_refuses_fails_alone_and_the_import_is_not_recorded(
    tmp_path: Path, cast: Cast
) -> None:
    """A conversation the store refuses is reported failed with the store's error, the others are stored,
    and the import is not recorded, so the next run stores it (the others already present); before, the
    error stopped the import there. A store that does not answer (an OSError) stops the import."""
    path = write(tmp_path, plugin_data([ended_conversation(), open_conversation()], legacy_entries()))
    clock = FakeClock(NOW)
    every = await import_smarthole_file(path, MemoryStore(), identities(cast), clock=clock, idle_timeout_ms=IDLE)
    refused, *others = every.imported
    store = RefusingStore(refused, RuntimeError("the database refused a value"))

    report = await import_smarthole_file(path, store, identities(cast), clock=clock, idle_timeout_ms=IDLE)

    assert report.imported == others
    assert [(p.conversation_id, p.reason) for p in report.failed] == [
        (refused, "not stored: RuntimeError: the database refused a value"),
    ]
    assert await store.get_meta(META_PREFIX + report.sha256) is None
    store.refused = None
    again = await import_smarthole_file(path, store, identities(cast), clock=clock, idle_timeout_ms=IDLE)
    assert (again.imported, again.already_present, again.failed) == ([refused], others, [])
    assert await store.get_meta(META_PREFIX + report.sha256) is not None

    down = RefusingStore(others[0], StoreUnavailableError("the PostgreSQL store does not answer: refused"))
    with pytest.raises(StoreUnavailableError):
        await import_smarthole_file(path, down, identities(cast), clock=clock, idle_timeout_ms=IDLE)
    assert await down.load(refused) is not None
    assert await down.get_meta(META_PREFIX + report.sha256) is None


async def test_bad_entries_are_reported_each_and_the_rest_imported_whole(tmp_path: Path, cast: Cast) -> None:
    """Bad messages and entries are reported with their index and kept raw; bad conversations are skipped whole."""
    good = ended_conversation()
    messages = good["messages"]
    messages.insert(1, {"id": "m-robot", "timestamp": iso(T0), "role": "robot", "content": "beep"})
    messages.insert(2, {"id": "m-empty", "timestamp": iso(T0), "role": "user", "content": "  "})
    messages.insert(3, {"id": "m-when", "timestamp": "yesterday", "role": "user", "content": "when?"})
    messages.insert(4, "not a message")
    conversations: list[Any] = [
        good, "not a conversation", {"id": "conv-empty", "messages": []},
        {"id": "conv-allbad", "messages": [{"role": "user"}]}, {"id": "conv-nolist", "title": "x"},
    ]
    entries: list[Any] = [{"id": "h-0", "timestamp": iso(LEGACY_T), "userMessage": ""}, *legacy_entries()]
    path = write(tmp_path, plugin_data(conversations, entries))
    store = MemoryStore()
    report = await import_smarthole_file(path, store, identities(cast), clock=FakeClock(NOW), idle_timeout_ms=IDLE)

    assert [(p.conversation_id, p.index, p.reason) for p in report.rejected_events] == [
        (good["id"], 1, "unknown role 'robot'"), (good["id"], 2, "no content"),
        (good["id"], 3, "bad timestamp 'yesterday'"), (good["id"], 4, "not an object"),
        ("conv-allbad", 0, "no content"), (LEGACY_TITLE, 0, "no userMessage"),
    ]
    assert [(p.conversation_id, p.reason) for p in report.failed] == [
        ("#1", "conversation #1 is not an object"), ("conv-allbad", "every message was rejected"),
        ("conv-nolist", "no 'messages' list"),
    ]
    assert [(p.conversation_id, p.reason) for p in report.notes] == [("conv-empty", "no messages: nothing to import")]
    assert len(report.imported) == 2
    found = await by_title(store)
    imported = found["Meeting notes creation"]
    assert [e.content for e in imported.history] == [
        "Create a note about today's meeting", "I've created 'Meeting Notes.md'.", "Thanks", "You're welcome.",
    ]
    assert imported.metadata.extra["smarthole_import"]["rejected"] == messages[1:5]
    assert len(found[LEGACY_TITLE].history) == 3
    assert found[LEGACY_TITLE].metadata.extra["smarthole_import"]["rejected"] == [entries[0]]


async def test_a_file_that_is_not_smarthole_data_changes_nothing(tmp_path: Path, cast: Cast) -> None:
    """A JSON file without the lists, or a file that is not JSON, raises a format error and records nothing."""
    store = MemoryStore()
    for name, text in (("settings.json", json.dumps({"enabled": True})), ("broken.json", "{not json")):
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        with pytest.raises(SmartHoleFormatError):
            await import_smarthole_file(path, store, identities(cast), clock=FakeClock(NOW), idle_timeout_ms=IDLE)
    assert await store.search(SearchQuery()) == []


MICROSECONDS = (T0 + 9_000) * 1000
"""A message time written in microseconds: read as milliseconds, the year 55,840."""


def test_times_past_the_year_9999_or_more_than_a_day_ahead_are_bad_timestamps() -> None:
    """A microsecond count, an absurd number and (given now) a time more than a day ahead are bad timestamps,
    while a time an hour ahead is read."""
    assert parse_time_ms(iso(NOW + 60 * MINUTE), NOW) == NOW + 60 * MINUTE
    for bad in (MICROSECONDS, 1e25, str(MICROSECONDS)):
        with pytest.raises(ValueError, match=r"bad timestamp .* \(after the year 9999\)"):
            parse_time_ms(bad)
    for ahead in (iso(NOW + 2 * 24 * 60 * MINUTE), (NOW + 2 * 24 * 60 * MINUTE) // 1000):
        with pytest.raises(ValueError, match=r"bad timestamp .* \(more than a day in the future\)"):
            parse_time_ms(ahead, NOW)


async def test_far_future_times_are_rejected_per_entry_and_the_conversation_ends_by_age(
    tmp_path: Path, cast: Cast
) -> None:
    """A message in microseconds or two days ahead is rejected with its index, a far startedAt and endedAt are
    noted and replaced by the messages' times, so the conversation keeps its real dates: before, it was dated
    in the year 55,840 and never ended or deleted by age."""
    days_ahead = iso(NOW + 2 * 24 * 60 * MINUTE)
    conversation = ended_conversation()
    conversation["startedAt"], conversation["endedAt"] = MICROSECONDS, days_ahead
    conversation["messages"][1]["timestamp"] = MICROSECONDS
    conversation["messages"][3]["timestamp"] = days_ahead
    entries = legacy_entries()
    entries[1]["timestamp"] = 1e25
    path = write(tmp_path, plugin_data([conversation, open_conversation(T0)], entries))
    store = MemoryStore()

    report = await import_smarthole_file(path, store, identities(cast), clock=FakeClock(NOW), idle_timeout_ms=IDLE)

    assert [(p.conversation_id, p.index, p.reason) for p in report.rejected_events] == [
        (conversation["id"], 1, f"bad timestamp {MICROSECONDS} (after the year 9999)"),
        (conversation["id"], 3, f"bad timestamp {days_ahead!r} (more than a day in the future)"),
        (LEGACY_TITLE, 1, "bad timestamp 1e+25 (after the year 9999)"),
    ]
    assert [n.reason.split(";")[0] for n in report.notes] == [
        f"startedAt: bad timestamp {MICROSECONDS} (after the year 9999)",
        f"endedAt: bad timestamp {days_ahead!r} (more than a day in the future)",
    ]
    found = await by_title(store)
    imported = found["Meeting notes creation"]
    assert (imported.created_at, imported.activity_at, imported.ended_at) == (T0, T0 + MINUTE, T0 + MINUTE)
    assert found[LEGACY_TITLE].activity_at == LEGACY_T
    assert all(c.last_activity <= NOW and c.created_at <= NOW for c in found.values())


BROKEN = "broken \ud83d emoji"
"""Text holding a lone surrogate (half an emoji, ``\\ud83d`` in JSON): it can be neither signed nor stored."""


async def test_a_message_or_history_entry_that_is_not_valid_unicode_is_rejected_alone(
    tmp_path: Path, cast: Cast
) -> None:
    """A message and a legacy entry holding a lone surrogate are each rejected as not valid Unicode and kept
    (escaped) in a store that writes files, and the rest is imported and the import recorded: before, signing
    it raised and stopped the whole import, which could never be completed."""
    conversation = ended_conversation()
    conversation["messages"][2]["content"] = BROKEN
    entries = legacy_entries()
    entries[1]["assistantResponse"] = BROKEN
    path = write(tmp_path, plugin_data([conversation], entries))
    store = FileSystemStore(tmp_path / "home")
    await store.open()

    report = await import_smarthole_file(path, store, identities(cast), clock=FakeClock(NOW), idle_timeout_ms=IDLE)

    assert report.failed == []
    assert [(p.conversation_id, p.index, p.reason) for p in report.rejected_events] == [
        (conversation["id"], 2, "content is not valid Unicode (a lone surrogate)"),
        (LEGACY_TITLE, 1, "userMessage or assistantResponse is not valid Unicode (a lone surrogate)"),
    ]
    found = await by_title(store)
    imported = found["Meeting notes creation"]
    assert [e.content for e in imported.history] == [
        "Create a note about today's meeting", "I've created 'Meeting Notes.md'.", "You're welcome.",
    ]
    assert imported.metadata.extra["smarthole_import"]["rejected"][0]["content"] == "broken \\ud83d emoji"
    assert [e.content for e in found[LEGACY_TITLE].history] == ["Find my notes on tea", "Found 3 notes."]
    assert await store.get_meta(META_PREFIX + report.sha256) is not None
    await store.close()


async def test_a_title_summary_or_id_that_is_not_valid_unicode_does_not_stop_the_import(
    tmp_path: Path, cast: Cast
) -> None:
    """A title and summary holding a lone surrogate are left out and noted, and ids holding one are written
    escaped, so the conversation is stored whole in a store that writes files: before, signing or storing it
    raised."""
    conversation = ended_conversation()
    conversation.update(id=f"conv {BROKEN}", title=BROKEN, summary=BROKEN)
    conversation["messages"][0]["id"] = BROKEN
    conversation["messages"][1]["toolsUsed"] = [BROKEN]
    path = write(tmp_path, {"conversations": [conversation]})
    store = FileSystemStore(tmp_path / "home")
    await store.open()

    report = await import_smarthole_file(path, store, identities(cast), clock=FakeClock(NOW), idle_timeout_ms=IDLE)

    assert (report.failed, report.rejected_events) == ([], [])
    assert [n.reason for n in report.notes] == [
        "message 1: toolsUsed is not a list of names, ignored",
        "title is not valid Unicode (a lone surrogate), left out",
        "summary is not valid Unicode (a lone surrogate), left out",
    ]
    [stored] = (await by_title(store)).values()
    assert (stored.title_source, stored.summary, len(stored.history)) == (None, None, 4)
    assert stored.metadata.extra["smarthole_import"]["id"] == "conv broken \\ud83d emoji"
    assert stored.history[0].tags[-1] == ["import", "smarthole", "conv broken \\ud83d emoji", "broken \\ud83d emoji"]
    await store.close()
