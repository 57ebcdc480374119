"""Runs tried again after an error (a store gone for a moment): a reply saved by the failed try goes out once,
no message is answered twice, with bursts, stops and crashes in between (docs/ARCHITECTURE.md, "Durability
contract"; docs/CONTEXT.md, "Bursts")."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import structlog.testing

from tenex_daemon import MemoryStore, NostrEvent
from tenex_daemon.core.llm import CompletionResult, ToolCall
from tenex_daemon.services import runs
from tenex_daemon.services.retention import RetentionPolicy, Sweeper
from tenex_daemon.services.runs import RunRequest
from tenex_daemon.testing import FakeClock
from tenex_daemon.testing.fakes import ScriptedBackend
from tests import pipeline
from tests.conftest import Cast
from tests.unit.services.test_bursts import GatedBackend


def numbered(*, gated: bool = False) -> GatedBackend:
    """A backend answering "answer <n>" to its n-th request; the first waits for ``release`` when gated."""
    backend = GatedBackend()
    if not gated:
        backend.release.set()
    return backend


def outbox_fails_once_for(rig: pipeline.Rig, content: str, monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Make the outbox's write of the reply ``content`` fail once (the store gone for a moment, after the reply
    was saved); the event is set when it failed."""
    outbox = rig.runner.outbox
    add = outbox.add
    failed = asyncio.Event()

    async def failing(conversation_id: str, reply: NostrEvent, **options: Any) -> Any:
        if reply.content == content and not failed.is_set():
            failed.set()
            raise ConnectionResetError("the store went away for a moment")
        return await add(conversation_id, reply, **options)

    monkeypatch.setattr(outbox, "add", failing)
    return failed


async def reply_saved_then_retry_waiting(
    cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> tuple[pipeline.Rig, NostrEvent]:
    """A person's message to Alice whose run saved "answer 1", then failed writing it to the outbox; the run
    now waits 0.3 s to try again. Returns the pipeline and the message."""
    monkeypatch.setattr(runs, "RUN_RETRY_S", (0.3, 0.3, 0.3))
    rig = pipeline.build_rig(cast, backend=numbered())
    failed = outbox_fails_once_for(rig, "answer 1", monkeypatch)
    root = cast.user_says("first", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(failed.wait(), 5)
    return rig, root


def thread_of(cast: Cast, root: NostrEvent) -> list[list[str]]:
    """Tags of a person's reply to Alice in ``root``'s conversation."""
    return [["E", root.id, "", root.pubkey], ["K", "11"], ["e", root.id], ["p", cast.alice.pubkey]]


def answers(rig: pipeline.Rig, cast: Cast, names: dict[str, str]) -> list[tuple[str, str]]:
    """(content, name of the message it answers) of Alice's published replies."""
    return [
        (e.content, names.get(e.tag_value("e") or "", "?")) for e in rig.publisher.published
        if e.pubkey == cast.alice.pubkey
    ]


async def test_a_burst_whose_reply_was_saved_before_it_failed_is_not_answered_again(
    cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two messages wait behind Alice's first run and are answered by one burst run, whose reply is saved and
    then its outbox write fails: whichever request tries again publishes that saved reply; the model is not
    asked again and the newest message gets one answer."""
    monkeypatch.setattr(runs, "RUN_RETRY_S", (0.05, 0.05, 0.05))
    backend = numbered(gated=True)
    rig = pipeline.build_rig(cast, backend=backend)
    outbox_fails_once_for(rig, "answer 2", monkeypatch)
    root = cast.user_says("first", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(backend.asked.wait(), 5)
    second = cast.user_says("second", tags=thread_of(cast, root))
    third = cast.user_says("third", tags=thread_of(cast, root))
    await rig.dispatcher.handle(second)
    await rig.dispatcher.handle(third)
    backend.release.set()
    await rig.settle()

    assert len(backend.requests) == 2
    assert answers(rig, cast, {root.id: "first", second.id: "second", third.id: "third"}) == [
        ("answer 1", "first"), ("answer 2", "third")
    ]


async def test_a_reply_saved_before_its_run_failed_goes_out_when_a_new_message_takes_its_turn(
    cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alice's reply is saved, then its outbox write fails; a new message to her comes while the run waits to
    try again, and its run takes the failed one into a burst: the saved reply is published, and the new
    message answered."""
    rig, root = await reply_saved_then_retry_waiting(cast, monkeypatch)
    second = cast.user_says("second", tags=thread_of(cast, root))
    await rig.dispatcher.handle(second)
    await rig.settle()

    assert answers(rig, cast, {root.id: "first", second.id: "second"}) == [
        ("answer 1", "first"), ("answer 2", "second")
    ]


async def test_a_stop_while_a_run_with_a_saved_reply_waits_to_try_again_lets_that_reply_out(
    cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alice's reply is saved, then its outbox write fails; the owner's stop comes while the run waits to try
    again: the run is let finish as a run saving its reply is, and the saved reply is published (it was in
    no outbox, and the stop would have dropped its only journal entry)."""
    rig, root = await reply_saved_then_retry_waiting(cast, monkeypatch)

    report = await rig.dispatcher.stop(root.id, None, by="owner")
    await rig.settle()

    assert report.agents == ()
    assert [e.content for e in rig.publisher.published] == ["answer 1"]


async def test_a_message_answered_in_a_burst_leaves_the_journal_at_once_and_a_crash_does_not_answer_it_again(
    cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B's run fails before saving anything; while it waits to try again, C comes and C's run answers C and B
    together. A crash then (B still waiting for its turn): the journal no longer holds B, so the next start
    does not answer it a second time."""
    monkeypatch.setattr(runs, "RUN_RETRY_S", (30.0, 30.0))
    backend = numbered()
    rig = pipeline.build_rig(cast, backend=backend)
    run: Callable[..., Awaitable[NostrEvent | None]] = rig.runner.run
    failed = asyncio.Event()

    async def failing_once(request: RunRequest, routing: Any = None) -> NostrEvent | None:
        if not failed.is_set():
            failed.set()
            raise ConnectionResetError("the store went away for a moment")
        return await run(request, routing)

    monkeypatch.setattr(rig.runner, "run", failing_once)
    root = cast.user_says("B", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(failed.wait(), 5)
    c = cast.user_says("C", tags=thread_of(cast, root))
    await rig.dispatcher.handle(c)
    async with asyncio.timeout(5):
        while len(backend.requests) < 1 or not rig.publisher.published:  # noqa: ASYNC110 - C's burst run
            await asyncio.sleep(0.01)
    await rig.scheduler.journaled()

    stored = json.loads(await rig.store.get_meta(runs.PENDING_RUNS_KEY) or "[]")
    assert [entry.get("trigger_id") for entry in stored] == []
    restarted = pipeline.build_rig(cast, backend=backend, store=rig.store)  # the crash: B's task never ends
    await restarted.scheduler.recover()
    await restarted.settle()
    assert len(backend.requests) == 1
    await rig.scheduler.drain(0.1)


async def test_a_journal_entry_another_version_wrote_or_a_broken_one_does_not_drop_the_others(cast: Cast) -> None:
    """The run journal holds a run with a field this version does not know (another version of the daemon
    wrote it), a broken entry and a dispatch: the run is redone as recovered, the dispatch is kept, and only
    the broken entry is left out (the whole journal was dropped)."""
    rig = pipeline.build_rig(cast, backend=numbered())
    root = cast.user_says("first", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.manager.create_conversation(root)
    entries = [
        {"dispatch": "ab" * 32},
        {"conversation_id": root.id, "trigger_id": root.id, "agent_slug": "alice", "via_orchestrator": False,
         "recovered": False, "burst": [], "priority": 3},
        {"conversation_id": root.id, "agent_slug": "alice"},
    ]
    await rig.store.set_meta(runs.PENDING_RUNS_KEY, json.dumps(entries))

    recovered = await rig.scheduler.recover()
    await rig.settle()

    assert recovered == [RunRequest(root.id, root.id, "alice", recovered=True)]
    assert rig.scheduler.dispatches_to_redo() == ["ab" * 32]
    assert [e.content for e in rig.publisher.published] == ["answer 1"]


async def test_a_journaled_run_of_an_agent_no_longer_configured_is_parked_not_tried(cast: Cast) -> None:
    """A run journaled for an agent the configuration no longer has is not run nor tried again (holding its
    conversation busy for half an hour): it is logged as parked and stays in the journal through later
    writes, until a stop of its conversation."""
    rig = pipeline.build_rig(cast, backend=numbered())
    root = cast.user_says("first", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.manager.create_conversation(root)
    gone = {"conversation_id": root.id, "trigger_id": root.id, "agent_slug": "carol"}
    await rig.store.set_meta(runs.PENDING_RUNS_KEY, json.dumps([gone]))

    with structlog.testing.capture_logs() as logs:
        await rig.scheduler.recover()
        other = cast.user_says("to bob", kind=11, tags=[["p", cast.bob.pubkey]])
        await rig.dispatcher.handle(other)  # a run of its own: the journal is written again
        await rig.settle()

    journal = json.loads(await rig.store.get_meta(runs.PENDING_RUNS_KEY) or "[]")
    assert not rig.scheduler.has_runs(root.id)
    assert rig.scheduler.holds(root.id)  # a run is to come: retention leaves the conversation alone
    assert [e["agent"] for e in logs if e["event"] == "run_parked"] == ["carol"]
    assert not [e for e in logs if e["event"] in ("run_retry", "run_agent_unknown")]
    assert [(e["conversation_id"], e["agent_slug"]) for e in journal] == [(root.id, "carol")]
    assert rig.scheduler.parked == {"carol": 1}  # what status shows
    await rig.scheduler.cancel(root.id)  # a stop of the conversation takes it out too
    assert json.loads(await rig.store.get_meta(runs.PENDING_RUNS_KEY) or "[]") == []
    assert rig.scheduler.parked == {}


async def test_a_parked_run_is_answered_once_its_agent_is_configured_again(cast: Cast) -> None:
    """Alice removed from the configuration while a message to her waited in the run journal: the daemon
    started without her keeps the run; the next one started with her again answers the message, once."""
    store = MemoryStore()
    without_alice = [agent for agent in cast.agents if agent.slug != "alice"]
    first = pipeline.build_rig(cast, backend=numbered(), agents=without_alice, store=store, default_agent="bob")
    root = cast.user_says("are you there?", kind=11, tags=[["p", cast.alice.pubkey]])
    await first.manager.create_conversation(root)
    waiting = {"conversation_id": root.id, "trigger_id": root.id, "agent_slug": "alice"}
    await store.set_meta(runs.PENDING_RUNS_KEY, json.dumps([waiting]))
    await first.scheduler.recover()
    await first.settle()
    assert first.publisher.published == []

    again = pipeline.build_rig(cast, backend=numbered(), store=store)
    await again.scheduler.recover()
    await again.settle()

    alice = [e for e in again.publisher.published if e.pubkey == cast.alice.pubkey]
    assert [(e.content, e.tag_value("e")) for e in alice] == [("answer 1", root.id)]


async def test_retention_leaves_the_conversation_of_a_parked_run_alone(cast: Cast) -> None:
    """A conversation whose run waits parked (its agent not configured at this start) is the oldest, yet a
    sweep over the retention limit neither ends nor deletes it: once the agent is configured again, the
    person's message is answered."""
    store, clock = MemoryStore(), FakeClock()
    without_alice = [agent for agent in cast.agents if agent.slug != "alice"]
    first = pipeline.build_rig(
        cast, backend=numbered(), agents=without_alice, store=store, default_agent="bob", clock=clock
    )
    root = cast.user_says("are you there?", kind=11, tags=[["p", cast.alice.pubkey]])
    await first.manager.create_conversation(root)
    waiting = {"conversation_id": root.id, "trigger_id": root.id, "agent_slug": "alice"}
    await store.set_meta(runs.PENDING_RUNS_KEY, json.dumps([waiting]))
    await first.scheduler.recover()
    for number in range(3):
        clock.advance(60_000)
        await first.manager.create_conversation(cast.user_says(f"other {number}", kind=11))
    clock.advance(2 * 3600_000)
    sweeper = Sweeper(first.manager, RetentionPolicy(max_retained=2), busy=first.scheduler.holds)

    swept = await sweeper.sweep_once()

    kept = await first.manager.get_conversation(root.id)
    assert kept is not None
    assert kept.ended_at is None
    assert swept.deleted == 2  # the two oldest of the others
    again = pipeline.build_rig(cast, backend=numbered(), store=store, clock=clock)
    await again.scheduler.recover()
    await again.settle()
    alice = [e for e in again.publisher.published if e.pubkey == cast.alice.pubkey]
    assert [(e.content, e.tag_value("e")) for e in alice] == [("answer 1", root.id)]


async def test_runs_taken_over_while_draining_are_journaled_here_and_not_started(cast: Cast) -> None:
    """A dead daemon's run journal taken over while this one drains (stopping): its runs start nothing now,
    after the drain counted what it waits for, and stay in this daemon's journal for its next start."""
    rig = pipeline.build_rig(cast, backend=numbered())
    root = cast.user_says("first", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.manager.create_conversation(root)
    dead = {"conversation_id": root.id, "trigger_id": root.id, "agent_slug": "alice"}
    await rig.store.set_meta("runs:dead", json.dumps([dead]))
    await rig.scheduler.drain(1.0)

    await rig.scheduler.adopt("runs:dead")
    await asyncio.sleep(0.05)

    assert rig.scheduler.in_flight == 0
    assert rig.publisher.published == []
    stored = json.loads(await rig.store.get_meta(rig.scheduler.journal_key) or "[]")
    assert [(e["trigger_id"], e["agent_slug"]) for e in stored] == [(root.id, "alice")]


async def test_a_stop_while_a_run_whose_save_failed_waits_to_try_again_stops_it(
    cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alice's answer is in but saving her reply fails (the store gone for a moment), so no reply is saved;
    the owner's stop comes while the run waits to try again: the run is stopped and reported so, and no
    reply is made (only a run whose failed try had saved its reply is let finish)."""
    monkeypatch.setattr(runs, "RUN_RETRY_S", (0.3, 0.3, 0.3))
    rig = pipeline.build_rig(cast, backend=numbered())
    append_reply = rig.manager.append_reply
    failed = asyncio.Event()

    async def failing_once(*arguments: Any, **options: Any) -> Any:
        if not failed.is_set():
            failed.set()
            raise ConnectionResetError("the store went away for a moment")
        return await append_reply(*arguments, **options)

    monkeypatch.setattr(rig.manager, "append_reply", failing_once)
    root = cast.user_says("first", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(failed.wait(), 5)

    report = await rig.dispatcher.stop(root.id, None, by="owner")
    await rig.settle()

    assert report.agents == ("alice",)
    assert [e.content for e in rig.publisher.published] == ["Stopped: Alice."]


async def test_typing_stops_when_a_run_fails_after_its_answer_is_in(
    cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alice's reply is saved, then its outbox write fails: her typing indicator, started, is stopped as the
    failed try ends (the try again finds the reply saved and sends no stop of its own)."""
    monkeypatch.setattr(runs, "RUN_RETRY_S", (0.05, 0.05))
    rig = pipeline.build_rig(cast, backend=numbered(), typing_delay_s=0.0)
    outbox_fails_once_for(rig, "answer 1", monkeypatch)
    root = cast.user_says("hi", kind=11, tags=[["p", cast.alice.pubkey]])

    await rig.dispatcher.handle(root)
    await rig.settle()

    assert rig.publisher.typing_events == [("alice", True), ("alice", False)]
    assert [e.content for e in rig.publisher.published] == ["answer 1"]


async def test_a_routed_reply_whose_save_failed_leaves_the_journal_once_a_later_try_answers(
    cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alice's reply completing to the orchestrator is journaled as being dispatched, then its save fails
    (a full disk): once her retry's reply (another event) is saved and routed, the first reply, never stored,
    is no longer journaled, in memory or in the store (it was kept there until the next start)."""
    monkeypatch.setattr(runs, "RUN_RETRY_S", (1.05, 1.05))  # a new second: the retry's reply is another event
    answer = CompletionResult(text="Done.", tool_calls=(ToolCall("c1", "complete", {}),))
    rig = pipeline.build_rig(cast, backend=ScriptedBackend([answer]))
    append = rig.store.append_event
    failed: list[str] = []

    async def full_once(conversation_id: str, event: NostrEvent, **options: Any) -> Any:
        if event.pubkey == cast.alice.pubkey and not failed:
            failed.append(event.id)
            raise OSError(28, "No space left on device")
        return await append(conversation_id, event, **options)

    monkeypatch.setattr(rig.store, "append_event", full_once)
    root = cast.user_says("do it", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await rig.quiet(timeout_s=20)
    await rig.scheduler.journaled()
    await asyncio.sleep(runs.FINISHED_FLUSH_S + 0.2)  # the flush of finished entries
    await rig.scheduler.journaled()

    journal = json.loads(await rig.store.get_meta(rig.scheduler.journal_key) or "[]")
    alice = [e for e in rig.publisher.published if e.pubkey == cast.alice.pubkey]
    assert len(failed) == 1
    assert [e.content for e in alice] == ["Done."]
    assert alice[0].id != failed[0]
    assert await rig.store.find_event(failed[0]) is None
    assert failed[0] not in rig.scheduler._dispatching
    assert {"dispatch": failed[0]} not in journal
