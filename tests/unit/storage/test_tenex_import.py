"""Importing TENEX TypeScript-era homes: NDK arrays, states, transitions, turns, timestamps, bad events."""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenex_daemon.adapters.storage.filesystem import FileSystemStore
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.adapters.storage.tenex_import import import_tenex_home, parse_ndk_event, time_ms, to_ms
from tenex_daemon.core.conversation import UNTITLED, Conversation, TitleSource
from tenex_daemon.core.errors import StoreUnavailableError
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.phases import Phase
from tenex_daemon.core.search import SearchQuery
from tenex_daemon.services.descriptions import needs_description
from tenex_daemon.testing import FakeClock, KeyPair, sign_event
from tests.conftest import Cast


def ndk(event: NostrEvent, *, with_id: bool = True) -> str:
    """What NDK's ``serialize(true, true)`` (or ``(true, false)``) writes for ``event``."""
    payload: list[Any] = [0, event.pubkey, event.created_at, event.kind, event.tags, event.content, event.sig]
    if with_id:
        payload.append(event.id)
    return json.dumps(payload, ensure_ascii=False)


def write_home(tmp_path: Path, cast: Cast) -> tuple[Path, dict[str, Any]]:
    """A TENEX home with one live conversation (one forged event) and one archived conversation."""
    root = cast.user_says("Build me a relay", kind=11, tags=[["title", "Relay"]])
    reply = cast.alice_says("On it")
    no_id = cast.bob_says("Reviewing")
    forged = cast.user_says("original text")
    forged_raw = json.loads(ndk(forged))
    forged_raw[5] = "tampered text"
    second = cast.alice_says("done")
    conversations = tmp_path / "project" / ".tenex" / "conversations"
    (conversations / "archive").mkdir(parents=True)
    live = {
        "id": root.id,
        "title": "Relay",
        "phase": "EXECUTE",
        "history": [ndk(root), ndk(reply), json.dumps(forged_raw), ndk(no_id, with_id=False), ndk(second), ndk(reply)],
        "agentStates": {
            "alice": {"lastProcessedMessageIndex": 5, "claudeSessionId": "sess-A"},
            "bob": {"lastProcessedMessageIndex": 3, "claudeSessionsByPhase": {"EXECUTE": "sess-B"}},
        },
        "phaseStartedAt": 1_700_000_100,
        "metadata": {"summary": "relay work", "readFiles": ["a.py"], "custom": 1},
        "phaseTransitions": [{
            "from": "CHAT", "to": "EXECUTE", "message": "go", "timestamp": 1_700_000_002_500,
            "agentPubkey": cast.alice.pubkey, "agentName": "Alice", "reason": "ready",
        }],
        "orchestratorTurns": [{
            "turnId": "t1", "timestamp": 1_700_000_003, "phase": "execute", "agents": ["alice"],
            "completions": [{"agent": "alice", "message": "done", "timestamp": 1_700_000_004_000}],
            "isCompleted": True,
        }],
        "executionTime": {"totalSeconds": 42, "isActive": False, "lastUpdated": 1_700_000_005},
    }
    old_root = cast.user_says("Old question", kind=11)
    archived = {"id": old_root.id, "title": "Old", "phase": "chat", "history": [ndk(old_root)], "metadata": {}}
    (conversations / f"{root.id}.json").write_text(json.dumps(live))
    (conversations / "archive" / f"{old_root.id}.json").write_text(json.dumps(archived))
    (conversations / "broken.json").write_text("{not json")
    (conversations / "metadata.json").write_text(json.dumps({"conversations": [
        {"id": root.id, "title": "Relay", "createdAt": 1_700_000_000.5, "updatedAt": 1_700_000_009_000,
         "phase": "EXECUTE", "eventCount": 6, "agentCount": 2},
        {"id": old_root.id, "title": "Old", "createdAt": 1_600_000_000, "updatedAt": 1_600_000_001,
         "phase": "chat", "eventCount": 1, "agentCount": 0, "archived": True},
    ]}))
    return tmp_path / "project", {
        "root": root, "reply": reply, "no_id": no_id, "forged": forged, "second": second, "old": old_root,
    }


def test_timestamps_in_seconds_and_milliseconds_normalize() -> None:
    """Second and millisecond timestamps (ints, floats) both come out in milliseconds."""
    assert to_ms(1_700_000_000) == 1_700_000_000_000
    assert to_ms(1_700_000_000.25) == 1_700_000_000_250
    assert to_ms(1_700_000_000_123) == 1_700_000_000_123


def test_ndk_arrays_of_seven_and_eight_items_parse_and_verify(cast: Cast) -> None:
    """An NDK array with or without its id yields the verified event; a tampered one is refused."""
    event = cast.user_says("hello ✓")
    assert parse_ndk_event(ndk(event)) == event
    assert parse_ndk_event(ndk(event, with_id=False)) == event
    bad_sig = json.loads(ndk(event))
    bad_sig[6] = "0" * 128
    for raw in (bad_sig, [0, "x"], {"id": event.id}):
        try:
            parse_ndk_event(raw)
        except (ValueError, TypeError):
            continue
        raise AssertionError(f"{raw!r} was accepted")


async def test_import_rebuilds_conversations_and_reports_bad_events(tmp_path: Path, cast: Cast) -> None:
    """History, states, transitions, turns and timing are imported; the forged event is reported and kept aside."""
    src, events = write_home(tmp_path, cast)
    store = MemoryStore()
    report = await import_tenex_home(src, store)
    root = events["root"]
    assert sorted(report.imported) == sorted([root.id, events["old"].id])
    assert [p.path.endswith("broken.json") for p in report.failed] == [True]
    [rejected] = report.rejected_events
    assert (rejected.conversation_id, rejected.index) == (root.id, 2)
    assert "does not match" in rejected.reason
    assert report.duplicate_events == 1
    conversation = await store.load(root.id)
    assert conversation is not None
    assert [e.id for e in conversation.history] == [
        root.id, events["reply"].id, events["no_id"].id, events["second"].id,
    ]
    assert conversation.phase is Phase.EXECUTE
    assert conversation.created_at == 1_700_000_000_500
    assert conversation.updated_at == 1_700_000_009_000
    assert conversation.phase_started_at == 1_700_000_100_000
    assert conversation.agent_states["alice"].last_processed_index == 4
    assert conversation.agent_states["alice"].session_id == "sess-A"
    assert conversation.agent_states["bob"].last_processed_index == 2
    assert conversation.agent_states["bob"].session_id == "sess-B"
    [transition] = conversation.phase_transitions
    assert (transition.from_phase, transition.to_phase, transition.timestamp) == (
        Phase.CHAT, Phase.EXECUTE, 1_700_000_002_500,
    )
    assert transition.agent_slug == "alice"
    [turn] = conversation.orchestrator_turns
    assert turn.timestamp == 1_700_000_003_000
    assert turn.completions[0].timestamp == 1_700_000_004_000
    assert turn.is_completed
    assert conversation.execution_time.total_seconds == 42
    assert conversation.execution_time.last_updated == 1_700_000_005_000
    assert conversation.metadata.summary == "relay work"
    assert conversation.metadata.read_files == ["a.py"]
    assert conversation.metadata.extra["custom"] == 1
    assert conversation.metadata.extra["tenex_import"]["rejected"] == [json.dumps(
        [0, events["forged"].pubkey, events["forged"].created_at, events["forged"].kind, [],
         "tampered text", events["forged"].sig, events["forged"].id], ensure_ascii=False,
    )]
    old = await store.load(events["old"].id)
    assert old is not None
    assert old.archived
    assert old.created_at == 1_600_000_000_000


async def test_import_into_filesystem_store_is_durable_and_rerunnable(tmp_path: Path, cast: Cast) -> None:
    """Imported conversations survive a reopen; running the import again changes nothing."""
    src, events = write_home(tmp_path, cast)
    store = FileSystemStore(tmp_path / "home")
    await store.open()
    first = await import_tenex_home(src / ".tenex", store)
    assert len(first.imported) == 2
    await store.close()
    store = FileSystemStore(tmp_path / "home")
    await store.open()
    again = await import_tenex_home(src, store)
    assert again.imported == []
    assert sorted(again.already_present) == sorted(first.imported)
    assert [r.id for r in await store.search(SearchQuery(archived=True))] == [events["old"].id]
    assert await store.is_processed(events["reply"].id)
    assert not await store.is_processed(events["forged"].id)
    await store.close()


@pytest.mark.parametrize("given", [5, "zzzz", "../../../escaped", "A" * 64])
async def test_a_conversation_whose_id_is_not_an_event_id_is_reported_and_the_rest_imported(
    tmp_path: Path, cast: Cast, given: object
) -> None:
    """A conversation file whose id is not 64 lowercase hex (a number, a word, a path, upper case) is one
    failed file in the report, and the other conversations are imported: before, a number or a word was
    imported under an id no command could name, and a path stopped the whole import."""
    src, events = write_home(tmp_path, cast)
    (src / ".tenex" / "conversations" / "odd.json").write_text(json.dumps({"id": given, "history": []}))

    report = await import_tenex_home(src, MemoryStore())

    assert sorted(report.imported) == sorted([events["root"].id, events["old"].id])
    odd = [p for p in report.failed if p.path.endswith("odd.json")]
    assert len(odd) == 1
    assert "64 lowercase hex" in odd[0].reason


NOW = 1_800_000_000_000
"""The FakeClock's time in the tests of odd shapes and times (2027): the cast's events are before it."""
FUTURE_S = NOW // 1000 + 2 * 86_400
"""Two days past NOW, in seconds."""
MICROSECONDS = 1_700_000_000_000_000
"""2023-11-14 in microseconds: read as milliseconds, the year 55,840."""
BASE_FILE_KEYS = KeyPair.from_seed(903)
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)


def full_conversation(root: NostrEvent) -> dict[str, Any]:
    """A well-formed conversation with every optional part: states, transitions, turns, timing, metadata."""
    return {
        "id": root.id, "title": "Full", "phase": "execute", "history": [ndk(root)], "phaseStartedAt": 1_700_000_100,
        "agentStates": {"alice": {"lastProcessedMessageIndex": 1, "claudeSessionId": "s",
                                  "claudeSessionsByPhase": {"EXECUTE": "s2"}}},
        "phaseTransitions": [{"from": "chat", "to": "execute", "message": "go", "timestamp": 1_700_000_002,
                              "agentName": "Alice", "reason": "ready", "summary": "s"}],
        "orchestratorTurns": [{"turnId": "t1", "timestamp": 1_700_000_003, "phase": "execute", "agents": ["alice"],
                               "completions": [{"agent": "alice", "message": "ok", "timestamp": 1_700_000_004}],
                               "reason": "r", "isCompleted": True}],
        "executionTime": {"totalSeconds": 3, "currentSessionStart": 1_700_000_005, "isActive": True,
                          "lastUpdated": 1_700_000_006},
        "metadata": {"summary": "sum", "readFiles": ["a.py"]},
    }


def three_files(folder: Path, odd: dict[str, Any], row: dict[str, Any] | None = None) -> list[str]:
    """Write a good conversation, ``odd`` (its metadata.json row ``row``) and another good one, in that order;
    return the three ids."""
    folder.mkdir(parents=True, exist_ok=True)
    good = [sign_event(BASE_FILE_KEYS, f"good {n}", kind=11, created_at=1_700_000_000 + n) for n in (0, 2)]
    files = [full_conversation(good[0]), odd, full_conversation(good[1])]
    for n, data in enumerate(files):
        (folder / f"{n:02d}.json").write_text(json.dumps(data))
    rows = [{"id": odd["id"], **row}] if row is not None else []
    (folder / "metadata.json").write_text(json.dumps({"conversations": rows}))
    return [good[0].id, str(odd["id"]), good[1].id]


def odd_conversation(part: str, value: Any) -> dict[str, Any]:
    """A full conversation whose ``part`` (a dotted path; a number indexes a list) is set to ``value``."""
    data = full_conversation(sign_event(BASE_FILE_KEYS, f"odd {part}", kind=11, created_at=1_700_000_001))
    *parents, last = part.split(".")
    node: Any = data
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[int(last) if isinstance(node, list) else last] = value
    return data


@pytest.mark.parametrize(("part", "value", "dropped", "reason"), [
    ("agentStates", [["alice", {"lastProcessedMessageIndex": 1}]], "agentStates", "it is a list, not an object"),
    ("executionTime", 42, "executionTime", "it is a number, not an object"),
    ("phaseTransitions.0", "chat->execute", "phaseTransitions[0]", "it is a string, not an object"),
    ("phaseTransitions", {"from": "chat"}, "phaseTransitions", "it is an object, not a list"),
    ("agentStates.alice", 7, "agentStates.alice", "it is a number, not an object"),
    ("agentStates.alice.claudeSessionsByPhase", ["s"], "agentStates.alice",
     "claudeSessionsByPhase is a list, not an object"),
    ("orchestratorTurns.0.completions.0", "done", "orchestratorTurns[0]", "a completion is a string, not an object"),
    ("orchestratorTurns.0.agents", "alice", "orchestratorTurns[0]", "agents is a string, not a list"),
    ("executionTime.totalSeconds", "lots", "executionTime", "invalid literal for int()"),
    ("metadata", "notes", "metadata", "it is a string, not an object"),
])
async def test_a_malformed_optional_part_is_left_out_kept_raw_and_every_file_imported(
    tmp_path: Path, part: str, value: Any, dropped: str, reason: str
) -> None:
    """A conversation whose optional part has an unexpected JSON type is imported with its history, that part
    left out, noted by name and kept raw, and the files after it are imported too: before, an AttributeError
    (or a failed file) stopped it, and the AttributeError every later file."""
    odd = odd_conversation(part, value)
    ids = three_files(tmp_path / "conversations", odd)
    store = MemoryStore()

    report = await import_tenex_home(tmp_path, store, clock=FakeClock(NOW))

    assert report.imported == ids
    assert report.failed == []
    [note] = [n for n in report.notes if n.conversation_id == odd["id"]]
    assert note.reason.startswith(f"{dropped} left out: ")
    assert reason in note.reason
    conversation = await store.load(odd["id"])
    assert conversation is not None
    assert [e.id for e in conversation.history] == [odd["id"]]
    record = conversation.metadata.extra["tenex_import"]
    assert dropped in record["dropped"]
    assert record["notes"] == [note.reason]


async def test_a_file_that_cannot_be_read_as_a_conversation_fails_alone(tmp_path: Path) -> None:
    """A history that is not a list, and a folder named like a conversation file, are each one failed file
    naming the reason, and the other files are imported: before, a string history was imported as an empty
    conversation and the folder stopped the import."""
    folder = tmp_path / "conversations"
    odd = odd_conversation("history", "not a list")
    ids = three_files(folder, odd)
    (folder / "01b-folder.json").mkdir()

    report = await import_tenex_home(tmp_path, MemoryStore(), clock=FakeClock(NOW))

    assert report.imported == [ids[0], ids[2]]
    assert [(Path(p.path).name, p.reason.split(":")[0]) for p in report.failed] == [
        ("01.json", "ValueError"), ("01b-folder.json", "IsADirectoryError"),
    ]
    assert report.failed[0].reason == "ValueError: history is a string, not a list"


class RefusingStore(MemoryStore):
    """A memory store whose ``create`` of one conversation raises ``error``."""

    def __init__(self, refused: str, error: Exception) -> None:
        super().__init__()
        self.refused, self.error = refused, error

    async def create(self, conversation: Conversation) -> None:
        """Raise for the refused conversation, store the others."""
        if conversation.id == self.refused:
            raise self.error
        await super().create(conversation)


async def test_a_conversation_the_store_refuses_fails_alone_and_a_store_that_does_not_answer_stops(
    tmp_path: Path,
) -> None:
    """A file whose conversation the store refuses is one failed file naming the store's error, and the files
    after it are imported (before, the error stopped the import there); a store that does not answer
    (an OSError) stops the import, the conversations stored before it kept."""
    odd = full_conversation(sign_event(BASE_FILE_KEYS, "refused", kind=11, created_at=1_700_000_001))
    ids = three_files(tmp_path / "conversations", odd)
    store = RefusingStore(ids[1], RuntimeError("the database refused a value"))

    report = await import_tenex_home(tmp_path, store, clock=FakeClock(NOW))

    assert report.imported == [ids[0], ids[2]]
    assert [(Path(p.path).name, p.conversation_id, p.reason) for p in report.failed] == [
        ("01.json", ids[1], "not stored: RuntimeError: the database refused a value"),
    ]
    down = RefusingStore(ids[1], StoreUnavailableError("the PostgreSQL store does not answer: refused"))
    with pytest.raises(StoreUnavailableError):
        await import_tenex_home(tmp_path, down, clock=FakeClock(NOW))
    assert await down.load(ids[0]) is not None
    assert await down.load(ids[2]) is None


@FUZZ
@given(
    st.sampled_from([
        "title", "phase", "history", "history.0", "agentStates", "agentStates.alice",
        "agentStates.alice.lastProcessedMessageIndex", "agentStates.alice.claudeSessionId",
        "agentStates.alice.claudeSessionsByPhase", "phaseStartedAt", "phaseTransitions", "phaseTransitions.0",
        "phaseTransitions.0.timestamp", "phaseTransitions.0.reason", "phaseTransitions.0.agentName",
        "orchestratorTurns", "orchestratorTurns.0", "orchestratorTurns.0.timestamp", "orchestratorTurns.0.agents",
        "orchestratorTurns.0.completions", "orchestratorTurns.0.completions.0",
        "orchestratorTurns.0.completions.0.timestamp", "executionTime", "executionTime.totalSeconds",
        "executionTime.currentSessionStart", "executionTime.lastUpdated", "metadata", "metadata.readFiles",
    ]),
    json_values,
    st.none() | st.dictionaries(st.sampled_from(["createdAt", "updatedAt", "archived"]), json_values),
)
def test_no_json_value_anywhere_in_a_file_stops_the_import_of_the_others(
    part: str, value: Any, row: dict[str, Any] | None
) -> None:
    """Any JSON value in any part of a conversation (or its metadata.json row) leaves that file imported or
    failed with a reason, never raises, and the files after it are imported."""
    with tempfile.TemporaryDirectory() as folder:
        odd = odd_conversation(part, value)
        ids = three_files(Path(folder) / "conversations", odd, row)

        report = asyncio.run(import_tenex_home(folder, MemoryStore(), clock=FakeClock(NOW)))

    assert [ids[0], ids[2]] == [i for i in report.imported if i != odd["id"]]
    assert (odd["id"] in report.imported) != any(p.path.endswith("01.json") for p in report.failed)
    assert all(p.reason for p in [*report.failed, *report.notes, *report.rejected_events])


def test_a_time_is_refused_before_1970_past_9999_or_more_than_a_day_ahead() -> None:
    """time_ms reads seconds and milliseconds but refuses microseconds, absurd numbers, non-numbers and
    times more than a day past now."""
    assert time_ms(1_700_000_000, NOW) == 1_700_000_000_000
    assert time_ms(NOW + 3_600_000, NOW) == NOW + 3_600_000
    bad_values: tuple[Any, ...] = (MICROSECONDS, 1e25, float("inf"), float("nan"), -5, True, None, [], "soon")
    for bad in bad_values:
        with pytest.raises(ValueError, match="bad timestamp"):
            time_ms(bad, NOW)
    with pytest.raises(ValueError, match="more than a day in the future"):
        time_ms(FUTURE_S, NOW)


async def test_times_in_the_far_future_are_refused_and_the_conversation_dated_by_its_events(
    tmp_path: Path, cast: Cast
) -> None:
    """An event dated two days ahead is rejected, microsecond createdAt/updatedAt are noted and replaced by
    the events' times, and a transition dated so is left out: before, the conversation was dated in the year
    55,840 and never archived or deleted by age."""
    root = cast.user_says("question", kind=11)
    reply = cast.alice_says("answer")
    ahead = sign_event(cast.user, "from the future", created_at=FUTURE_S)
    data = full_conversation(root)
    data["history"] = [ndk(root), ndk(ahead), ndk(reply)]
    data["phaseTransitions"][0]["timestamp"] = MICROSECONDS
    folder = tmp_path / "conversations"
    folder.mkdir()
    (folder / "c.json").write_text(json.dumps(data))
    (folder / "metadata.json").write_text(json.dumps({"conversations": [
        {"id": root.id, "createdAt": MICROSECONDS, "updatedAt": MICROSECONDS + 1},
    ]}))
    store = MemoryStore()

    report = await import_tenex_home(tmp_path, store, clock=FakeClock(NOW))

    assert report.imported == [root.id]
    assert [(p.index, p.reason) for p in report.rejected_events] == [
        (1, f"created_at {FUTURE_S} is more than a day in the future"),
    ]
    notes = [n.reason for n in report.notes]
    assert f"metadata.json createdAt: bad timestamp {MICROSECONDS} (after the year 9999), ignored" in notes
    assert any(n.startswith("phaseTransitions[0] left out: bad timestamp") for n in notes)
    conversation = await store.load(root.id)
    assert conversation is not None
    assert [e.id for e in conversation.history] == [root.id, reply.id]
    assert (conversation.created_at, conversation.updated_at) == (root.created_at * 1000, reply.created_at * 1000)
    assert conversation.phase_transitions == []


IDLE = 30 * 60_000


def conversation_file(folder: Path, root: NostrEvent, reply: NostrEvent, **fields: Any) -> None:
    """Write a conversation of ``root`` and ``reply`` with ``fields`` into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    data = {"id": root.id, "phase": "chat", "history": [ndk(root), ndk(reply)], **fields}
    (folder / f"{root.id}.json").write_text(json.dumps(data))


async def test_a_conversation_comes_in_described_and_ended_as_it_was(tmp_path: Path) -> None:
    """The title's source (the root's tag, or the file), the summary, the activity and the end (archived:
    ended by the import; idle past the timeout: ended idle) are imported, so a titled conversation counts as
    described and no start retitles it: before, the title read as a fallback, the summary stayed in the
    metadata only, and an archived conversation came in active."""
    keys = KeyPair.from_seed(904)
    folder = tmp_path / "conversations"
    recent = NOW // 1000 - 60
    tagged = sign_event(keys, "tagged", kind=11, tags=[["title", "Relay"]], created_at=recent)
    named = sign_event(keys, "named", kind=11, tags=[["title", "Tag"]], created_at=recent + 1)
    archived = sign_event(keys, "archived", kind=11, created_at=1_700_000_000)
    idle = sign_event(keys, "idle", kind=11, created_at=NOW // 1000 - 3_600)
    conversation_file(folder, tagged, sign_event(keys, "ok", created_at=recent + 5), title="Relay",
                      metadata={"summary": "Relay work."})
    conversation_file(folder, named, sign_event(keys, "ok", created_at=recent + 6), title="From the file")
    conversation_file(folder / "archive", archived, sign_event(keys, "ok", created_at=1_700_000_009))
    conversation_file(folder, idle, sign_event(keys, "ok", created_at=NOW // 1000 - 3_000), title="Idle")
    store = MemoryStore()

    report = await import_tenex_home(tmp_path, store, clock=FakeClock(NOW), idle_timeout_ms=IDLE)

    assert len(report.imported) == 4
    loaded = {root.id: await store.load(root.id) for root in (tagged, named, archived, idle)}
    got = {
        root_id: (c.title, c.title_source, c.summary, c.activity_at, c.described_at, c.ended_at, c.ended_by)
        for root_id, c in loaded.items() if c is not None
    }
    assert got == {
        tagged.id: ("Relay", TitleSource.TAG, "Relay work.", (recent + 5) * 1000, (recent + 5) * 1000, None, None),
        named.id: ("From the file", TitleSource.IMPORT, None, (recent + 6) * 1000, (recent + 6) * 1000, None, None),
        archived.id: (UNTITLED, None, None, 1_700_000_009_000, None, 1_700_000_009_000, "import"),
        idle.id: ("Idle", TitleSource.IMPORT, None, NOW - 3_000_000, NOW - 3_000_000, NOW - 3_000_000 + IDLE, "idle"),
    }
    for conversation in loaded.values():
        assert conversation is not None
        assert conversation.metadata.extra["tenex_import"]["source"].endswith(".json")
        if conversation.title_source is not None:
            assert not needs_description(conversation, exchanges=99, after_exchanges=3)


BROKEN = "broken \ud83d emoji"
"""Text holding a lone surrogate (half an emoji, ``\\ud83d`` in JSON): it can be neither signed nor stored."""


@pytest.mark.parametrize(("part", "dropped"), [
    ("title", "title"),
    ("metadata.summary", "metadata.summary"),
    ("metadata.readFiles", "metadata.readFiles"),
    ("agentStates.alice.claudeSessionId", "agentStates.alice"),
    ("phaseTransitions.0.message", "phaseTransitions[0]"),
    ("orchestratorTurns.0.completions.0.message", "orchestratorTurns[0]"),
    ("executionTime.isActive", "executionTime"),
])
async def test_text_that_is_not_valid_unicode_leaves_its_part_out_and_the_conversation_stored(
    tmp_path: Path, part: str, dropped: str
) -> None:
    """A part holding a lone surrogate is left out, noted and kept raw (escaped), and the conversation is
    stored with its history in a store that writes files: before, the store refused it and the whole
    conversation was reported failed."""
    odd = odd_conversation(part, BROKEN)
    ids = three_files(tmp_path / "conversations", odd)
    store = FileSystemStore(tmp_path / "home")
    await store.open()

    report = await import_tenex_home(tmp_path, store, clock=FakeClock(NOW))

    assert (report.imported, report.failed) == (ids, [])
    assert [n.reason for n in report.notes if n.conversation_id == odd["id"]] == [
        f"{dropped} left out: it is not valid Unicode (a lone surrogate)",
    ]
    conversation = await store.load(odd["id"])
    assert conversation is not None
    assert [e.id for e in conversation.history] == [odd["id"]]
    assert "broken \\\\ud83d emoji" in json.dumps(conversation.metadata.extra["tenex_import"]["dropped"][dropped])
    await store.close()


async def test_an_agent_name_or_event_that_is_not_valid_unicode_is_left_out_and_the_rest_stored(
    tmp_path: Path,
) -> None:
    """An agent state under a name holding a lone surrogate is left out, and a history entry holding one is
    rejected as not valid Unicode and kept escaped, the conversation stored in a store that writes files:
    before, the store refused it and the whole conversation was reported failed."""
    odd = odd_conversation("agentStates", {BROKEN: {"lastProcessedMessageIndex": 1}})
    root = json.loads(odd["history"][0])
    odd["history"].append(json.dumps([0, root[1], root[2] + 1, 1111, [], BROKEN, root[6]]))
    ids = three_files(tmp_path / "conversations", odd)
    store = FileSystemStore(tmp_path / "home")
    await store.open()

    report = await import_tenex_home(tmp_path, store, clock=FakeClock(NOW))

    assert (report.imported, report.failed) == (ids, [])
    assert [(p.index, p.reason) for p in report.rejected_events] == [
        (1, "its text is not valid Unicode (a lone surrogate)"),
    ]
    assert [n.reason for n in report.notes if n.conversation_id == odd["id"]] == [
        "agentStates.broken \\ud83d emoji left out: its agent's name is not valid Unicode (a lone surrogate)",
    ]
    conversation = await store.load(odd["id"])
    assert conversation is not None
    assert conversation.agent_states == {}
    assert "broken \\ud83d emoji" in conversation.metadata.extra["tenex_import"]["rejected"][0]
    await store.close()
