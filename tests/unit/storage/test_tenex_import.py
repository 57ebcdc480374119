"""Importing TENEX TypeScript-era homes: NDK arrays, states, transitions, turns, timestamps, bad events."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tenex_daemon.adapters.storage.filesystem import FileSystemStore
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.adapters.storage.tenex_import import import_tenex_home, parse_ndk_event, to_ms
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.phases import Phase
from tenex_daemon.core.search import SearchQuery
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
