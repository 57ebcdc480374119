"""A crash between accepting an event and scheduling its runs: the next start finishes the dispatch.

Each test builds the services twice on one store: the first set is abandoned mid-dispatch (its
tasks cancelled, as a killed process leaves them), the second recovers as the daemon does at start.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tenex_daemon import ConversationManager, FileSystemStore, MemoryStore, NostrEvent
from tenex_daemon.adapters.llm.offline import OfflineBackend
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.llm import CompletionRequest, CompletionResult, LLMBackend
from tenex_daemon.core.phases import Phase
from tenex_daemon.core.ports import Store
from tenex_daemon.services import runs
from tenex_daemon.services.agent_runner import AgentProfile, AgentRunner
from tenex_daemon.services.dispatcher import EventDispatcher, HandleResult, Outcome
from tenex_daemon.services.orchestrator import LLMOrchestrator, RuleBasedOrchestrator
from tenex_daemon.services.retention import RetentionPolicy, Sweeper
from tenex_daemon.services.runs import PENDING_RUNS_KEY, RunRequest, RunScheduler
from tenex_daemon.testing import FakeClock
from tenex_daemon.testing.fakes import FakePublisher, ScriptedBackend, StuckBackend
from tests import pipeline
from tests.conftest import Cast
from tests.unit.services.test_orchestration import answers, completes
from tests.unit.services.test_run_lease import LeasePeers
from tests.unit.services.test_tool_loop import text


@dataclass
class Services:
    """One process's worth of services on a shared store."""

    manager: ConversationManager
    scheduler: RunScheduler
    dispatcher: EventDispatcher
    runner: AgentRunner
    publisher: FakePublisher


def start(
    cast: Cast,
    store: Store,
    model: Any,
    *,
    alice: LLMBackend | None = None,
    bob: LLMBackend | None = None,
    clock: FakeClock | None = None,
) -> Services:
    """The daemon's pipeline (build_pipeline) on ``store`` with the LLM orchestrator over ``model``."""
    backends: dict[str, LLMBackend] = {
        "alice": alice or ScriptedBackend([text("alice here")]),
        "bob": bob or ScriptedBackend([text("bob here")]),
        "orchestrator": OfflineBackend(),
    }
    profiles = {a.slug: AgentProfile(a, "", backends[a.slug]) for a in cast.agents}

    def orchestrator(manager: ConversationManager) -> LLMOrchestrator:
        return LLMOrchestrator(manager, model, RuleBasedOrchestrator(manager.agents, "alice"), default_agent="alice")

    base = pipeline.build_rig(
        cast,
        store=store,
        profiles=profiles,
        composer=pipeline.real_composer(cast),
        orchestrator=orchestrator,
        hop_limit=6,
        clock=clock,
    )
    return Services(base.manager, base.scheduler, base.dispatcher, base.runner, base.publisher)


async def restart(cast: Cast, store: Store, model: Any, **backends: Any) -> tuple[Services, list[HandleResult]]:
    """Start again on ``store`` and redo what the journal holds, as the daemon does at start."""
    services = start(cast, store, model, **backends)
    await services.scheduler.recover()
    redo = await services.dispatcher.stored_dispatches(services.scheduler.dispatches_to_redo())
    results = [await services.dispatcher.redispatch(e) for e in redo]
    return services, results


async def crash(services: Services, *tasks: asyncio.Task[Any]) -> None:
    """Cancel everything a killed process was doing: ``tasks``, its runs, journal writes and
    flush timer, its publications (nothing of it runs on into the next process)."""
    scheduler = services.scheduler
    outbox = services.runner.outbox
    doomed = [
        *tasks,
        *scheduler._tasks.snapshot(),
        *scheduler._writes.snapshot(),
        *services.runner._tasks.snapshot(),
        *outbox._deliveries.snapshot(),
        *outbox._writes.snapshot(),
    ]
    if scheduler._flush_task is not None:
        doomed.append(scheduler._flush_task)
    for task in doomed:
        task.cancel()
    await asyncio.gather(*doomed, return_exceptions=True)


async def settle(services: Services) -> None:
    """Wait until no run is scheduled and replies are published."""
    async with asyncio.timeout(10):
        while services.scheduler.in_flight:  # noqa: ASYNC110 - runs schedule runs; no idle event
            await asyncio.sleep(0.01)
    await services.runner.flush(5.0)


async def journal_entries(store: Store) -> list[dict[str, Any]]:
    """The stored run journal."""
    raw = await store.get_meta(PENDING_RUNS_KEY)
    entries: list[dict[str, Any]] = json.loads(raw) if raw else []
    return entries


async def test_an_event_whose_routing_a_crash_interrupted_is_routed_at_the_next_start(cast: Cast) -> None:
    """A person's message stored while the orchestrator was deciding is routed after the restart, and answered once."""
    store = MemoryStore()
    stuck = StuckBackend()
    first = start(cast, store, stuck)
    root = cast.user_says("Build a bridge", kind=11)
    handling = asyncio.create_task(first.dispatcher.handle(root))
    await asyncio.wait_for(stuck.asked.wait(), 5)
    await crash(first, handling)
    assert await store.find_event(root.id) is not None  # accepted: stored before the crash
    assert {"dispatch": root.id} in await journal_entries(store)

    model = answers('{"agents": ["alice"], "phase": "execute", "reason": "build it"}')
    second, results = await restart(cast, store, model)
    await settle(second)

    assert [(r.outcome, r.agents) for r in results] == [(Outcome.SCHEDULED, ("alice",))]
    assert len(model.requests) == 1
    assert [e.content for e in second.publisher.published] == ["alice here"]
    conversation = await second.manager.get_conversation(root.id)
    assert conversation is not None
    assert conversation.phase is Phase.EXECUTE
    await second.scheduler.drain(1.0)
    assert not [e for e in await journal_entries(store) if "dispatch" in e]


async def test_a_direct_event_stored_before_the_crash_runs_its_agent_once(cast: Cast) -> None:
    """An event p-tagging an agent, stored but with no run journaled yet, gets its run at the next start."""
    store = MemoryStore()
    first = start(cast, store, StuckBackend())
    root = cast.user_says("Hello Alice", kind=11, tags=[["p", cast.alice.pubkey]])
    await first.scheduler.accept(root.id)
    await first.manager.create_conversation(root)  # the crash comes here, before the run is submitted
    await crash(first)

    alice = ScriptedBackend([text("alice here")])
    second, results = await restart(cast, store, StuckBackend(), alice=alice)
    await settle(second)

    assert [(r.outcome, r.agents) for r in results] == [(Outcome.SCHEDULED, ("alice",))]
    assert [e.content for e in second.publisher.published] == ["alice here"]
    # killed again before the entry left the journal: the dispatch is redone, Alice is not run
    # again, her saved reply goes out again (relays keep one copy per id)
    await crash(second)
    third, again = await restart(cast, store, StuckBackend(), alice=alice)
    await settle(third)
    assert [(r.outcome, r.agents) for r in again] == [(Outcome.SCHEDULED, ("alice",))]
    assert len(alice.requests) == 1
    assert [e.id for e in third.publisher.published] == [e.id for e in second.publisher.published]
    await third.scheduler.drain(1.0)  # a clean stop empties the journal: nothing to redo
    fourth, nothing = await restart(cast, store, StuckBackend(), alice=alice)
    assert nothing == []
    assert fourth.scheduler.in_flight == 0


async def test_a_turn_started_before_the_crash_is_resumed_without_asking_again(cast: Cast) -> None:
    """When the turn was recorded before the crash, its agents run and the orchestrator is not asked twice."""
    store = MemoryStore()
    first = start(cast, store, StuckBackend())
    root = cast.user_says("Build a bridge", kind=11)
    await first.scheduler.accept(root.id)
    await first.manager.create_conversation(root)
    await first.manager.start_orchestrator_turn(root.id, Phase.CHAT, ("bob",), "review", trigger_id=root.id)
    await crash(first)

    model = answers('{"agents": ["alice"], "reason": "would be a second routing"}')
    second, results = await restart(cast, store, model)
    await settle(second)

    assert [(r.outcome, r.reason, r.agents) for r in results] == [(Outcome.SCHEDULED, "turn resumed", ("bob",))]
    assert model.requests == []
    assert [e.content for e in second.publisher.published] == ["bob here"]


async def test_an_entry_for_an_event_never_stored_is_dropped(cast: Cast) -> None:
    """A crash between journaling an event and storing it leaves nothing to do: the relays deliver it again."""
    store = MemoryStore()
    first = start(cast, store, StuckBackend())
    root = cast.user_says("Hello", kind=11, tags=[["p", cast.alice.pubkey]])
    await first.scheduler.accept(root.id)
    await crash(first)

    second, results = await restart(cast, store, StuckBackend())
    await second.scheduler.journaled()

    assert results == []
    assert await journal_entries(store) == []
    assert second.publisher.published == []


async def test_a_completion_saved_before_the_crash_is_routed_at_the_next_start(cast: Cast) -> None:
    """An agent's completion saved just before the crash is still routed on: the next agent runs once."""
    store = MemoryStore()
    gate = asyncio.Event()

    class DiesWhileRoutingTheCompletion(ScriptedBackend):
        """Routes the person's message, then the process dies before the completion is routed."""

        async def complete(self, request: CompletionRequest) -> CompletionResult:
            if self.requests:
                gate.set()
                await asyncio.Event().wait()
            return await super().complete(request)

    first = start(
        cast,
        store,
        DiesWhileRoutingTheCompletion(
            [CompletionResult(text='{"agents": ["alice"], "phase": "execute", "reason": "build it"}')]
        ),
        alice=completes("alice built"),
    )
    root = cast.user_says("Build a bridge", kind=11)
    await first.dispatcher.handle(root)
    await asyncio.wait_for(gate.wait(), 5)
    await crash(first)
    conversation = await first.manager.get_conversation(root.id)
    assert conversation is not None
    completion = conversation.history[-1]
    assert completion.pubkey == cast.alice.pubkey

    model = answers('{"agents": ["bob"], "phase": "verification", "reason": "check it"}')
    second, results = await restart(cast, store, model)
    await settle(second)

    assert [(r.outcome, r.agents) for r in results] == [(Outcome.SCHEDULED, ("bob",))]
    published = [(e.pubkey, e.content) for e in second.publisher.published]
    # Alice's recovered run finds her saved completion and sends it again (relays keep one copy)
    assert sorted(published) == sorted([(cast.alice.pubkey, "alice built"), (cast.bob.pubkey, "bob here")])
    conversation = await second.manager.get_conversation(root.id)
    assert conversation is not None
    assert [e.pubkey for e in conversation.history].count(cast.alice.pubkey) == 1


@pytest.mark.parametrize("fsync", ["batch", "always"])
async def test_the_journal_entry_is_on_disk_once_the_event_is(tmp_path: Path, cast: Cast, fsync: str) -> None:
    """With either fsync policy, once the event's write (after accept()) returns, the entry is on disk:
    a copy of the home taken at that instant (a crash) opens with it in the pending-runs value. (The
    order at a crash: test_accept_hands_the_entry_to_the_store_before_... here, and the store's group
    commit in test_journal.py.)"""
    store = FileSystemStore(tmp_path / "home", fsync=fsync)  # type: ignore[arg-type]
    await store.open()
    try:
        scheduler = RunScheduler(store, _never_run)
        manager = ConversationManager(store, cast.agents, cast.project.pubkey, clock=FakeClock())
        assert store.commits_in_order is (fsync == "batch")
        root = cast.user_says("Hello", kind=11, tags=[["p", cast.alice.pubkey]])
        earlier = asyncio.create_task(scheduler.accept("0" * 64))
        await asyncio.sleep(0)  # that entry's write is with the store: this one waits its turn
        await scheduler.accept(root.id)
        await manager.create_conversation(root)
        await earlier
        copy = tmp_path / "crashed"
        shutil.copytree(store.home, copy)  # what a kill now leaves: files and the store's journal
    finally:
        await store.close()
    reopened = FileSystemStore(copy, fsync=fsync)  # type: ignore[arg-type]
    await reopened.open()
    try:
        on_disk = await reopened.get_meta(PENDING_RUNS_KEY)
        assert on_disk is not None
        assert {"dispatch": root.id} in json.loads(on_disk)
    finally:
        await reopened.close()


async def _never_run(request: RunRequest) -> None:
    raise AssertionError("no run is scheduled here")



class RecordingStore(MemoryStore):
    """A store whose journal writes take a while, recording the order writes are handed to it."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[str] = []

    async def set_meta(self, key: str, value: str) -> None:
        """Record the entries written, then take a while."""
        self.order.append("journal " + " ".join(e.get("dispatch", "run")[:4] for e in json.loads(value)))
        await super().set_meta(key, value)
        await asyncio.sleep(0.01)

    async def create(self, conversation: Conversation) -> None:
        """Record the new conversation."""
        self.order.append("create " + conversation.id[:4])
        await super().create(conversation)


async def test_accept_hands_the_entry_to_the_store_before_the_caller_stores_the_event(cast: Cast) -> None:
    """With a journal write in flight, accept() returns only once its own write is with the store."""
    store = RecordingStore()
    scheduler = RunScheduler(store, _never_run)
    manager = ConversationManager(store, cast.agents, cast.project.pubkey, clock=FakeClock())
    root = cast.user_says("Hello", kind=11, tags=[["p", cast.alice.pubkey]])
    earlier = asyncio.create_task(scheduler.accept("0" * 64))
    while not store.order:  # noqa: ASYNC110 - until that entry's write is with the store
        await asyncio.sleep(0)
    await scheduler.accept(root.id)
    await manager.create_conversation(root)
    await earlier

    assert store.order == ["journal 0000", f"journal 0000 {root.id[:4]}", f"create {root.id[:4]}"]


async def test_only_replies_that_target_an_agent_are_journaled(cast: Cast) -> None:
    """A reply to the person targets nobody and costs no journal entry; a completion to the orchestrator does."""
    store = RecordingStore()
    alice = ScriptedBackend([text("hi there"), *completes("alice built").script])
    services = start(cast, store, answers('{"agents": ["END"], "reason": "done"}'), alice=alice)
    hello = cast.user_says("Hello Alice", kind=11, tags=[["p", cast.alice.pubkey]])
    build = cast.user_says("Build a bridge", kind=11)
    await services.dispatcher.handle(hello)
    await settle(services)
    await services.dispatcher.handle(build)
    await settle(services)
    await services.scheduler.drain(1.0)

    replies = {e.content: e.id[:4] for e in services.publisher.published}
    assert set(replies) == {"hi there", "alice built"}
    journaled = " ".join(store.order)
    assert replies["hi there"] not in journaled
    assert replies["alice built"] in journaled
    assert await journal_entries(store) == []


async def test_an_event_whose_run_was_refused_at_shutdown_stays_journaled(
    cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An event handled while the scheduler drains (its run refused) keeps its entry: the next start runs it."""
    monkeypatch.setattr(runs, "FINISHED_FLUSH_S", 0.01)
    store = MemoryStore()
    first = start(cast, store, StuckBackend())
    await first.scheduler.drain(1.0)  # SIGTERM: runs are no longer accepted
    root = cast.user_says("Hello Alice", kind=11, tags=[["p", cast.alice.pubkey]])
    await first.dispatcher.handle(root)  # an intake lane still busy when the drain began
    await asyncio.sleep(0.1)  # any flush of finished entries has run
    await first.scheduler.journaled()
    assert {"dispatch": root.id} in await journal_entries(store)
    assert first.publisher.published == []

    second, results = await restart(cast, store, StuckBackend())
    await settle(second)
    assert [(r.outcome, r.agents) for r in results] == [(Outcome.SCHEDULED, ("alice",))]
    assert [e.content for e in second.publisher.published] == ["alice here"]


async def test_daemons_sharing_a_store_keep_their_journals_apart(cast: Cast) -> None:
    """Two daemons on one store (PostgreSQL) journal under their own keys and recover only their own."""
    store = MemoryStore()
    one = RunScheduler(store, _never_run, journal_key=runs.journal_key_for("one"))
    two = RunScheduler(store, _never_run, journal_key=runs.journal_key_for("two"))
    await one.accept("b" * 64)
    await two.accept("c" * 64)
    await one.journaled()
    await two.journaled()

    assert json.loads(await store.get_meta(one.journal_key) or "") == [{"dispatch": "b" * 64}]
    assert json.loads(await store.get_meta(two.journal_key) or "") == [{"dispatch": "c" * 64}]
    again = RunScheduler(store, _never_run, journal_key=runs.journal_key_for("two"))
    await again.recover()
    assert again.dispatches_to_redo() == ["c" * 64]


class LostCommitStore(MemoryStore):
    """A store whose next write of a new conversation or an event is made, then answered with a broken
    connection: a commit whose answer is lost (PostgreSQL restarting between COMMIT and its reply)."""

    def __init__(self) -> None:
        super().__init__()
        self.lose_next = False
        self.find_fails = 0

    async def find_event(self, event_id: str) -> tuple[str, NostrEvent] | None:
        """Find, unless told to fail (the database still restarting)."""
        if self.find_fails:
            self.find_fails -= 1
            raise ConnectionError("the database is starting up")
        return await super().find_event(event_id)

    def _lost(self) -> None:
        if self.lose_next:
            self.lose_next = False
            raise ConnectionError("connection was closed in the middle of operation")

    async def create(self, conversation: Conversation) -> None:
        """Create, then maybe lose the answer."""
        await super().create(conversation)
        self._lost()

    async def append_event(
        self, conversation_id: str, event: NostrEvent, *, state: Conversation | None = None
    ) -> bool:
        """Append, then maybe lose the answer."""
        appended = await super().append_event(conversation_id, event, state=state)
        self._lost()
        return appended


@pytest.mark.parametrize("first", ["root", "reply"])
async def test_an_event_whose_commit_answer_was_lost_is_answered_when_it_comes_again(
    cast: Cast, first: str
) -> None:
    """The store keeps an event but the daemon is told the write failed (its handling raises, and the relay
    pool hands the event over again): when it comes again it is found stored, and it is dispatched then,
    as after a crash, rather than dropped as a duplicate; the agent answers it once."""
    store = LostCommitStore()
    rig = pipeline.build_rig(cast, store=store)
    root = cast.user_says("Plan it", kind=11, tags=[["p", cast.alice.pubkey]])
    event = root
    if first == "reply":
        await rig.dispatcher.handle(root)
        await rig.quiet()
        event = cast.user_says("And now?", tags=[["E", root.id], ["e", root.id], ["p", cast.alice.pubkey]])
    answered_before = len(rig.publisher.published)
    store.lose_next = True

    with pytest.raises(ConnectionError):
        await rig.dispatcher.handle(event)
    again = await rig.dispatcher.handle(event)
    await rig.settle()

    assert again.outcome is Outcome.SCHEDULED
    answers = [e for e in rig.publisher.published[answered_before:] if e.pubkey == cast.alice.pubkey]
    assert len(answers) == 1
    assert answers[0].tag_values("e")[-1] == event.id
    assert await rig.store.get_meta(PENDING_RUNS_KEY) in (None, "[]")


async def test_with_daemons_sharing_a_store_an_event_dispatched_twice_is_answered_once(cast: Cast) -> None:
    """Daemons sharing a database may both dispatch one event (one after its store write's answer was
    lost): there any run, not only a recovered one, whose agent answered its trigger already saves and
    asks nothing, and its answer goes out again (the same event: relays keep one copy)."""
    backend = ScriptedBackend([text("once"), text("twice")])
    rig = pipeline.build_rig(cast, backend=backend, peers=LeasePeers())
    root = cast.user_says("Plan it", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await rig.quiet()

    again = await rig.runner.run(RunRequest(root.id, root.id, "alice"))
    await rig.settle()

    assert again is None
    assert len(backend.requests) == 1
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert [e.content for e in conversation.history] == ["Plan it", "once"]


async def test_an_event_whose_dispatch_after_a_lost_commit_answer_fails_is_tried_again(cast: Cast) -> None:
    """The store keeps an event but answers with an error; when the event comes again, the dispatch that
    follows fails too (the database still restarting): the third time it comes it is dispatched and
    answered once (it was taken for a plain duplicate then, its journal entry dropped: never answered)."""
    store = LostCommitStore()
    rig = pipeline.build_rig(cast, store=store)
    root = cast.user_says("Plan it", kind=11, tags=[["p", cast.alice.pubkey]])
    store.lose_next = True
    with pytest.raises(ConnectionError):
        await rig.dispatcher.handle(root)
    store.find_fails = 1
    with pytest.raises(ConnectionError):
        await rig.dispatcher.handle(root)

    third = await rig.dispatcher.handle(root)
    await rig.settle()

    assert third.outcome is Outcome.SCHEDULED
    assert len([e for e in rig.publisher.published if e.pubkey == cast.alice.pubkey]) == 1
    assert await rig.store.get_meta(PENDING_RUNS_KEY) in (None, "[]")


async def test_with_daemons_sharing_a_store_a_message_shown_in_a_later_answer_is_not_answered_again(
    cast: Cast,
) -> None:
    """Daemons sharing a database each take in part of a burst: when one daemon's run answers the newest
    message with the earlier one shown before it, the other daemon's run for that earlier message saves and
    asks nothing (it answered it late, after the newer one: out of order, and twice in effect)."""
    backend = ScriptedBackend([text("first answer"), text("answer to both"), text("late answer")])
    rig = pipeline.build_rig(cast, backend=backend, peers=LeasePeers())
    root = cast.user_says("Plan it", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await rig.quiet()
    tags = [["E", root.id], ["e", root.id], ["p", cast.alice.pubkey]]
    earlier, newer = cast.user_says("and the budget?", tags=tags), cast.user_says("and the dates?", tags=tags)
    for event in (earlier, newer):  # taken in by two daemons: each schedules its own run
        assert await rig.manager.add_event(root.id, event)

    await rig.runner.run(RunRequest(root.id, newer.id, "alice"))
    late = await rig.runner.run(RunRequest(root.id, earlier.id, "alice"))
    await rig.settle()

    assert late is None
    assert len(backend.requests) == 2
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert [e.content for e in conversation.history] == [
        "Plan it", "first answer", "and the budget?", "and the dates?", "answer to both",
    ]


async def test_with_daemons_sharing_a_store_an_index_past_a_message_with_no_answer_after_it_answers_it(
    cast: Cast,
) -> None:
    """A store written by an earlier tenexd, which saved the agent's last processed index as it built the
    context, holds the index past a person's message whose run a crash cut short, and no answer after it:
    on a shared store the redone run answers it (it is not taken as shown in another daemon's later answer)."""
    backend = ScriptedBackend([text("first answer"), text("the answer at last")])
    rig = pipeline.build_rig(cast, backend=backend, peers=LeasePeers())
    root = cast.user_says("Plan it", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await rig.quiet()
    cut_short = cast.user_says("and the budget?", tags=[["E", root.id], ["e", root.id], ["p", cast.alice.pubkey]])
    assert await rig.manager.add_event(root.id, cut_short)
    await rig.manager.update_agent_state(root.id, "alice", last_processed_index=3)  # as the earlier build did

    answer = await rig.runner.run(RunRequest(root.id, cut_short.id, "alice", recovered=True))
    await rig.settle()

    assert answer is not None
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert [e.content for e in conversation.history] == [
        "Plan it", "first answer", "and the budget?", "the answer at last",
    ]


class HeldModel:
    """An orchestrator model that answers ``text`` once ``release`` is set; ``asked`` is set on the first call."""

    name = "held"

    def __init__(self, text: str) -> None:
        self.text = text
        self.asked, self.release = asyncio.Event(), asyncio.Event()

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Wait for ``release``, then answer."""
        self.asked.set()
        await self.release.wait()
        return CompletionResult(text=self.text, model="held")


async def test_a_sweep_while_a_crashed_dispatch_is_done_again_leaves_its_conversation_open(cast: Cast) -> None:
    """A sweep that comes while the start dispatches again an event a crash left (its conversation idle past
    the timeout after a long downtime) counts the conversation busy and does not end it, so the agent's answer goes
    into an open conversation; once the dispatch and its run are over it is no longer busy."""
    store, stuck, clock = MemoryStore(), StuckBackend(), FakeClock()
    first = start(cast, store, stuck, clock=clock)
    root = cast.user_says("Please plan my week", kind=11)
    handling = asyncio.create_task(first.dispatcher.handle(root))
    await asyncio.wait_for(stuck.asked.wait(), 5)
    await crash(first, handling)

    clock.advance(2 * 3_600_000)  # the daemon was down two hours
    model = HeldModel('{"agents": ["alice"], "reason": "planning"}')
    second = start(cast, store, model, clock=clock)
    await second.scheduler.recover()
    redo = await second.dispatcher.stored_dispatches(second.scheduler.dispatches_to_redo())
    redoing = asyncio.create_task(second.dispatcher.redispatch(redo[0]))
    await asyncio.wait_for(model.asked.wait(), 5)
    sweeper = Sweeper(second.manager, RetentionPolicy(), busy=second.scheduler.has_runs)
    report = await sweeper.sweep_once()
    model.release.set()
    await redoing
    await settle(second)

    conversation = await second.manager.get_conversation(root.id)
    assert conversation is not None
    assert report.ended_idle == 0
    assert not conversation.is_ended
    assert [e.content for e in conversation.history] == ["Please plan my week", "alice here"]
    assert not second.scheduler.has_runs(root.id)
