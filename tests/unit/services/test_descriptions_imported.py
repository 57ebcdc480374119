"""Conversations brought in by an importer (``tenexd migrate``) came from a file (a SmartHole one never was
on Nostr): the description service may describe them locally but never publishes their title and summary as
a kind 513."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from tenex_daemon import MemoryStore, NostrEvent
from tenex_daemon.adapters.storage.smarthole_import import EXTRA_KEY as SMARTHOLE_RECORD
from tenex_daemon.adapters.storage.smarthole_import import import_smarthole_file
from tenex_daemon.adapters.storage.tenex_import import EXTRA_KEY as TENEX_RECORD
from tenex_daemon.adapters.storage.tenex_import import import_tenex_home
from tenex_daemon.core.conversation import Conversation, TitleSource
from tenex_daemon.core.vocabulary import KIND_CONVERSATION_METADATA
from tenex_daemon.services.descriptions import IMPORT_RECORDS, DescriptionJobs
from tenex_daemon.services.retention import RetentionPolicy, Sweeper
from tenex_daemon.testing import sign_event
from tenex_daemon.testing.fakes import FakePublisher, ScriptedBackend
from tests.conftest import Cast
from tests.pipeline import Rig, build_rig
from tests.unit.services.test_descriptions import ANSWER, jobs_for, said
from tests.unit.storage.test_smarthole_import import identities, iso, write
from tests.unit.storage.test_tenex_import import ndk

MINUTE = 60_000
IDLE = 30 * MINUTE


async def settled(rig: Rig, conversation_id: str, *, ended: bool = True) -> Conversation:
    """Wait until the conversation is described and its description marked published (ended, when
    ``ended``); return it."""
    async with asyncio.timeout(5):
        while True:
            conversation = await rig.manager.get_conversation(conversation_id)
            assert conversation is not None
            if (
                conversation.described_at is not None
                and conversation.description_published
                and conversation.is_ended == ended
            ):
                return conversation
            await asyncio.sleep(0.002)


def descriptions_published(publisher: FakePublisher) -> list[NostrEvent]:
    """Every kind-513 event published."""
    return [e for e in publisher.published if e.kind == KIND_CONVERSATION_METADATA]


async def smarthole(rig: Rig, cast: Cast, tmp_path: Path, conversation: dict[str, Any]) -> str:
    """Import one SmartHole conversation into the rig's store; return its id."""
    path = write(tmp_path, {"conversations": [conversation]})
    report = await import_smarthole_file(
        path, rig.manager.store, identities(cast), clock=rig.clock, idle_timeout_ms=IDLE
    )
    [imported] = report.imported
    return imported


def smarthole_conversation(first_ms: int, **fields: Any) -> dict[str, Any]:
    """A SmartHole conversation of a question at ``first_ms`` and its answer a second later."""
    return {"id": f"c-{first_ms}", "startedAt": iso(first_ms), **fields, "messages": [
        {"id": "m1", "role": "user", "content": "My blood test shows high cholesterol", "timestamp": iso(first_ms)},
        {"id": "m2", "role": "assistant", "content": "Eat more fibre.", "timestamp": iso(first_ms + 1_000)},
    ]}


async def tenex(rig: Rig, cast: Cast, tmp_path: Path, first_s: int, *, archived: bool, **fields: Any) -> str:
    """Import one TENEX conversation (a question at ``first_s`` and Alice's answer) into the rig's store."""
    root = sign_event(cast.user, "My blood test shows high cholesterol", kind=11,
                      tags=[["p", cast.alice.pubkey]], created_at=first_s)
    reply = sign_event(cast.alice_keys, "Eat more fibre.", tags=[["e", root.id]], created_at=first_s + 1)
    folder = tmp_path / "conversations" / ("archive" if archived else "")
    folder.mkdir(parents=True, exist_ok=True)
    data = {"id": root.id, "history": [ndk(root), ndk(reply)], **fields}
    (folder / f"{root.id}.json").write_text(json.dumps(data))
    report = await import_tenex_home(tmp_path, rig.manager.store, clock=rig.clock, idle_timeout_ms=IDLE)
    assert report.imported == [root.id]
    return root.id


def test_the_service_knows_both_importers_records() -> None:
    """The import records the description service looks for are the ones both importers write."""
    assert set(IMPORT_RECORDS) == {TENEX_RECORD, SMARTHOLE_RECORD}


async def describe_at_start(rig: Rig, cast: Cast, conversation_id: str) -> tuple[Conversation, DescriptionJobs]:
    """Start the description service as a daemon start does (a model answering ``ANSWER``); wait until the
    conversation's description is made and settled."""
    jobs = jobs_for(rig, cast, summarizer=ScriptedBackend([said(ANSWER)] * 3))
    assert await jobs.recover() >= 1
    return await settled(rig, conversation_id), jobs


async def test_an_untitled_ended_smarthole_conversation_is_described_locally_and_never_published(
    tmp_path: Path, cast: Cast
) -> None:
    """An imported untitled SmartHole conversation with an end is described at the next start, its title and
    summary stored but no kind 513 published, and no later start finds it waiting: before, its title and
    summary went out publicly, signed by the project key."""
    rig = build_rig(cast, store=MemoryStore())
    start = rig.clock.now_ms() - 3 * 24 * 60 * MINUTE
    conversation_id = await smarthole(
        rig, cast, tmp_path, smarthole_conversation(start, endedAt=iso(start + MINUTE))
    )

    conversation, jobs = await describe_at_start(rig, cast, conversation_id)

    assert (conversation.title, conversation.title_source) == ("Planning the spring product launch", TitleSource.MODEL)
    assert conversation.summary == "The person asked for a plan."
    assert descriptions_published(rig.publisher) == []
    assert jobs.published == 0
    assert await jobs.recover() == 0
    await jobs.stop()


async def test_an_untitled_archived_tenex_conversation_is_described_locally_and_never_published(
    tmp_path: Path, cast: Cast
) -> None:
    """An imported untitled TENEX conversation from the archive is described at the next start, its title and
    summary stored but no kind 513 published: before, it came in active and unended, and once ended its
    description went out publicly."""
    rig = build_rig(cast, store=MemoryStore())
    first_s = rig.clock.now_ms() // 1000 - 3 * 24 * 3600
    conversation_id = await tenex(rig, cast, tmp_path, first_s, archived=True)

    conversation, jobs = await describe_at_start(rig, cast, conversation_id)

    assert (conversation.ended_by, conversation.title_source) == ("import", TitleSource.MODEL)
    assert conversation.summary == "The person asked for a plan."
    assert descriptions_published(rig.publisher) == []
    assert await jobs.recover() == 0
    await jobs.stop()


async def end_by_sweeper(rig: Rig, cast: Cast, conversation_id: str) -> tuple[Conversation, DescriptionJobs]:
    """Start the description service, let the conversation go idle until the retention sweeper ends it, and
    wait until its description is settled again."""
    jobs = jobs_for(rig, cast)
    await jobs.recover()
    rig.clock.advance(IDLE + MINUTE)
    assert (await Sweeper(rig.manager, RetentionPolicy()).sweep_once()).ended_idle == 1
    return await settled(rig, conversation_id), jobs


async def test_a_titled_smarthole_conversation_ended_later_is_never_published(tmp_path: Path, cast: Cast) -> None:
    """An imported titled SmartHole conversation still active, ended later by the idle sweeper, gets no kind
    513 and is marked published, so no start finds it waiting: before, its end marked its description
    unpublished and the title and summary went out publicly."""
    rig = build_rig(cast, store=MemoryStore())
    conversation_id = await smarthole(rig, cast, tmp_path, smarthole_conversation(
        rig.clock.now_ms() - MINUTE, title="Divorce lawyer questions", summary="Asked about custody.",
    ))

    conversation, jobs = await end_by_sweeper(rig, cast, conversation_id)

    assert (conversation.title, conversation.summary) == ("Divorce lawyer questions", "Asked about custody.")
    assert descriptions_published(rig.publisher) == []
    assert jobs.published == 0
    assert await jobs.recover() == 0
    await jobs.stop()


async def test_a_titled_tenex_conversation_ended_later_is_never_published(tmp_path: Path, cast: Cast) -> None:
    """An imported titled TENEX conversation still active, ended later by the idle sweeper, keeps its title
    and summary and gets no kind 513: before, it read as untitled, was described when it ended and the
    description went out publicly."""
    rig = build_rig(cast, store=MemoryStore())
    conversation_id = await tenex(
        rig, cast, tmp_path, rig.clock.now_ms() // 1000 - 60, archived=False,
        title="Divorce lawyer questions", metadata={"summary": "Asked about custody."},
    )

    conversation, jobs = await end_by_sweeper(rig, cast, conversation_id)

    assert (conversation.title, conversation.title_source) == ("Divorce lawyer questions", TitleSource.IMPORT)
    assert conversation.summary == "Asked about custody."
    assert descriptions_published(rig.publisher) == []
    assert await jobs.recover() == 0
    await jobs.stop()


async def test_a_tenex_conversation_that_goes_on_after_its_import_is_published_as_any_other(
    tmp_path: Path, cast: Cast
) -> None:
    """A TENEX conversation was on Nostr: once a person writes in it after its import, it is a live
    conversation again, and its end is published as a kind 513 (what it held before the import is not)."""
    rig = build_rig(cast, store=MemoryStore())
    conversation_id = await tenex(
        rig, cast, tmp_path, rig.clock.now_ms() // 1000 - 60, archived=False,
        title="Cholesterol", metadata={"summary": "Asked about diet."},
    )
    rig.clock.advance(MINUTE)
    await rig.manager.add_event(conversation_id, cast.user_says("And exercise?", tags=[["e", conversation_id]]))

    _, jobs = await end_by_sweeper(rig, cast, conversation_id)
    await jobs.stop()

    published = descriptions_published(rig.publisher)
    assert published
    assert published[-1].tag_value("e") == conversation_id
    assert ["status", "ended"] in published[-1].tags


async def test_a_tenex_backlog_dated_ahead_of_the_importing_clock_stays_local(tmp_path: Path, cast: Cast) -> None:
    """A TENEX conversation whose events a skewed clock dated an hour after the import (the importer takes
    times up to a day ahead) is still backlog: ended later, it publishes no kind 513."""
    rig = build_rig(cast, store=MemoryStore())
    conversation_id = await tenex(
        rig, cast, tmp_path, rig.clock.now_ms() // 1000 + 3600, archived=False,
        title="Cholesterol", metadata={"summary": "Asked about diet."},
    )
    rig.clock.advance(3_600_000)

    _, jobs = await end_by_sweeper(rig, cast, conversation_id)
    await jobs.stop()

    assert descriptions_published(rig.publisher) == []
