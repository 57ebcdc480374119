"""Stopping agents (kind 24134, docs/PROTOCOL.md): the owner's or a whitelisted person's stop cancels the
conversation's runs, nothing half-written goes out, the stop is recorded and answered, and a stopped run
is not redone after a restart."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest

from tenex_daemon import MemoryStore, NostrEvent
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.llm import CompletionRequest, CompletionResult, ToolCall
from tenex_daemon.core.stops import STOPPED_COMPLETION, STOPS_KEPT, STOPS_KEY, stopped_since, with_stop
from tenex_daemon.core.vocabulary import KIND_STOP, TOOL_COMPLETE
from tenex_daemon.services import agent_runner
from tenex_daemon.services.agent_runner import AgentProfile
from tenex_daemon.services.dispatcher import Outcome
from tenex_daemon.services.orchestrator import RoutingDecision
from tenex_daemon.services.outbox import OUTBOX_KEY
from tenex_daemon.services.runs import PENDING_RUNS_KEY, RunRequest, RunScheduler, saving_reply
from tenex_daemon.services.stopping import (
    PEER_ANSWER_WAIT_S,
    PeerOp,
    PeerStop,
    Routing,
    StopReport,
    stop_channel,
    stop_without_daemon,
)
from tenex_daemon.testing import FakeClock, KeyPair
from tenex_daemon.testing.fakes import PeerBus, ScriptedBackend
from tests import pipeline
from tests.conftest import Cast


class GatedBackend:
    """Streams "Thinking" and holds its first answer until released (or cancelled); answers "answer N"
    to the Nth call; records every request."""

    name = "gated"

    def __init__(self) -> None:
        self.requests: list[CompletionRequest] = []
        self.asked = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = False

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Answer; the first call streams a little, then waits for ``release``."""
        self.requests.append(request)
        number = len(self.requests)
        if number == 1:
            if request.on_chunk is not None:
                await request.on_chunk("Thinking")
            self.asked.set()
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled = True
                raise
        return CompletionResult(text=f"answer {number}", model="gated")


@dataclass
class Partials:
    """Records the partial texts a run streams (the kind-21111 publisher)."""

    texts: list[str] = field(default_factory=list)

    async def partial(
        self, agent_slug: str, conversation_id: str, trigger_id: str, text: str, sequence: int
    ) -> None:
        """Record the text."""
        self.texts.append(text)


def stop_request(cast: Cast, keys: KeyPair, root: NostrEvent, agents: Iterable[str] = ()) -> NostrEvent:
    """A signed kind-24134 stop request for the conversation rooted at ``root``."""
    tags = [["e", root.id], *(["p", pubkey] for pubkey in agents)]
    return cast.factory.event(keys, "", kind=KIND_STOP, tags=tags)


def thread_of(root: NostrEvent) -> list[list[str]]:
    """The NIP-22 tags of a reply in the conversation rooted at ``root``."""
    return [["E", root.id, "", root.pubkey], ["K", str(root.kind)], ["e", root.id]]


async def journaled_runs(rig: pipeline.Rig) -> list[dict[str, object]]:
    """The run entries of the stored run journal."""
    raw = await rig.store.get_meta(PENDING_RUNS_KEY)
    return [e for e in json.loads(raw or "[]") if "dispatch" not in e]


async def test_the_owners_stop_cancels_the_run_and_only_the_notice_is_published(cast: Cast) -> None:
    """A stop from the owner while Alice thinks cancels her run: her answer is never saved or published, its
    partial texts and typing stop, the run leaves the journal, the stop is recorded (who, which agents, the
    request) and answered by one notice from Alice, tagged as a system error and addressed to the person."""
    backend = GatedBackend()
    partials = Partials()
    rig = pipeline.build_rig(cast, backend=backend, partials=partials, partial_interval_s=0.01)
    root = cast.user_says("Write the report", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(backend.asked.wait(), 5)
    await asyncio.sleep(0.05)  # a partial goes out
    stop = stop_request(cast, cast.user, root)

    result = await rig.dispatcher.handle(stop)
    streamed = len(partials.texts)
    await rig.quiet()
    backend.release.set()
    await asyncio.sleep(0.05)
    await rig.settle()

    assert result.outcome is Outcome.STORED
    assert result.agents == ("alice",)
    assert backend.cancelled
    assert streamed >= 1
    assert len(partials.texts) == streamed  # nothing streamed after the stop
    assert [(e.pubkey, e.content) for e in rig.publisher.published] == [(cast.alice.pubkey, "Stopped: Alice.")]
    notice = rig.publisher.published[0]
    assert notice.has_tag("error", "system")
    assert notice.tag_values("p") == [cast.user.pubkey]
    assert rig.publisher.typing_events == [("alice", True), ("alice", False)]
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert [e.id for e in conversation.history] == [root.id, notice.id]
    stops = conversation.metadata.extra[STOPS_KEY]
    assert [(s["by"], s["agents"], s["event_id"]) for s in stops] == [(cast.user.pubkey, ["alice"], stop.id)]
    assert await journaled_runs(rig) == []
    assert rig.scheduler.completed == 0
    assert len(backend.requests) == 1


async def test_only_the_owner_and_whitelisted_people_may_stop(cast: Cast) -> None:
    """A stranger's stop is refused before anything (author not allowed) and an agent's is refused as not
    allowed to stop: the run goes on and answers; a whitelisted person's stop is carried out in a
    conversation the owner p-tagged them in."""
    backend, rig, root = await alice_thinking(cast)

    stranger = await rig.dispatcher.handle(stop_request(cast, cast.other_user, root))
    agent = await rig.dispatcher.handle(stop_request(cast, cast.bob_keys, root))
    backend.release.set()
    await rig.settle()

    assert (stranger.outcome, stranger.reason) == (Outcome.IGNORED, "author_not_allowed")
    assert (agent.outcome, agent.reason) == (Outcome.IGNORED, "stop_not_allowed")
    assert [e.content for e in rig.publisher.published] == ["answer 1"]
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert STOPS_KEY not in conversation.metadata.extra

    backend = GatedBackend()
    rig = pipeline.build_rig(cast, backend=backend, whitelist=[cast.other_user.pubkey])
    invited = cast.user_says(
        "Write the report", kind=11, tags=[["p", cast.alice.pubkey], ["p", cast.other_user.pubkey]]
    )
    await rig.dispatcher.handle(invited)
    await asyncio.wait_for(backend.asked.wait(), 5)
    whitelisted = await rig.dispatcher.handle(stop_request(cast, cast.other_user, invited))
    await rig.settle()
    assert whitelisted.agents == ("alice",)
    assert [e.content for e in rig.publisher.published] == ["Stopped: Alice."]


@pytest.mark.parametrize("may_join", [False, True])
async def test_a_whitelisted_person_stops_only_where_they_may_write(cast: Cast, may_join: bool) -> None:
    """A whitelisted person who may not write into the owner's conversation (not its author, not p-tagged in
    it by the owner) may not stop its runs either: the stop is refused as ``not_a_participant``, nothing is
    recorded, and the run answers; with ``whitelist_may_join`` on, the same stop is carried out."""
    backend = GatedBackend()
    rig = pipeline.build_rig(
        cast, backend=backend, whitelist=[cast.other_user.pubkey], whitelist_may_join=may_join
    )
    root = cast.user_says("Write the report", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(backend.asked.wait(), 5)

    result = await rig.dispatcher.handle(stop_request(cast, cast.other_user, root))
    backend.release.set()
    await rig.settle()

    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    if may_join:
        assert (result.outcome, result.agents) == (Outcome.STORED, ("alice",))
        assert [e.content for e in rig.publisher.published] == ["Stopped: Alice."]
    else:
        assert (result.outcome, result.reason) == (Outcome.IGNORED, "not_a_participant")
        assert [e.content for e in rig.publisher.published] == ["answer 1"]
        assert STOPS_KEY not in conversation.metadata.extra


async def test_a_stop_naming_one_agent_stops_only_that_agent(cast: Cast) -> None:
    """With Alice running and Bob waiting in one conversation, a stop p-tagging Alice cancels her run only:
    Bob then runs and answers; the notice names Alice alone."""
    _, rig, root = await alice_thinking(cast)
    to_bob = cast.user_says("Bob, check the numbers", tags=[*thread_of(root), ["p", cast.bob.pubkey]])
    await rig.dispatcher.handle(to_bob)

    result = await rig.dispatcher.handle(stop_request(cast, cast.user, root, [cast.alice.pubkey]))
    await rig.settle()

    assert result.agents == ("alice",)
    assert {(e.pubkey, e.content) for e in rig.publisher.published} == {
        (cast.alice.pubkey, "Stopped: Alice."),
        (cast.bob.pubkey, "answer 2"),
    }


async def test_a_stop_drops_waiting_runs_and_every_agent_by_default(cast: Cast) -> None:
    """A stop naming nobody cancels Alice's running run and drops Bob's waiting one: nobody answers, and one
    notice (from the orchestrator, several agents being stopped) names both."""
    backend, rig, root = await alice_thinking(cast)
    await rig.dispatcher.handle(cast.user_says("Bob too", tags=[*thread_of(root), ["p", cast.bob.pubkey]]))

    result = await rig.dispatcher.handle(stop_request(cast, cast.user, root))
    await rig.settle()

    assert result.agents == ("alice", "bob")
    assert [(e.pubkey, e.content) for e in rig.publisher.published] == [
        (cast.orchestrator.pubkey, "Stopped: Alice, Bob.")
    ]
    assert len(backend.requests) == 1


async def test_a_stop_for_someone_elses_agents_stops_nothing_and_one_naming_the_project_stops_all(
    cast: Cast,
) -> None:
    """A stop whose p-tags name neither one of our agents nor the project is for another backend's agents:
    it is ignored as addressed elsewhere and Alice goes on thinking; one p-tagging only its author stops every
    agent, as one naming nobody does (Alice is stopped); one p-tagging the project is carried out for every
    agent too (nothing left to stop: no second notice)."""
    backend, rig, root = await alice_thinking(cast)
    someone_else = KeyPair.from_seed(99).pubkey

    elsewhere = await rig.dispatcher.handle(stop_request(cast, cast.user, root, [someone_else]))
    await asyncio.sleep(0)
    assert (elsewhere.outcome, elsewhere.reason) == (Outcome.IGNORED, "addressed_elsewhere")
    assert not backend.cancelled

    own = await rig.dispatcher.handle(stop_request(cast, cast.user, root, [cast.user.pubkey]))
    await rig.settle()
    assert (own.outcome, own.agents, backend.cancelled) == (Outcome.STORED, ("alice",), True)
    await rig.settle()

    project = await rig.dispatcher.handle(stop_request(cast, cast.user, root, [someone_else, cast.project.pubkey]))
    assert project.outcome is Outcome.STORED
    assert [e.content for e in rig.publisher.published] == ["Stopped: Alice."]
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert [s["named"] for s in conversation.metadata.extra[STOPS_KEY]] == [None, None]


async def test_a_stop_with_nothing_running_is_recorded_without_a_notice(cast: Cast) -> None:
    """A stop for a conversation where nothing runs publishes nothing and is recorded with no agents; a stop
    naming an unknown conversation is ignored."""
    rig = pipeline.build_rig(cast)
    root = cast.user_says("Hello", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await rig.quiet()
    published = len(rig.publisher.published)

    result = await rig.dispatcher.handle(stop_request(cast, cast.user, root))
    unknown = await rig.dispatcher.handle(
        cast.factory.event(cast.user, "", kind=KIND_STOP, tags=[["e", "f" * 64]])
    )
    await rig.settle()

    assert (result.outcome, result.reason, result.agents) == (Outcome.STORED, "nothing_to_stop", ())
    assert (unknown.outcome, unknown.reason) == (Outcome.IGNORED, "unknown_conversation")
    assert len(rig.publisher.published) == published
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert [s["agents"] for s in conversation.metadata.extra[STOPS_KEY]] == [[]]


async def test_a_stopped_run_is_not_redone_after_a_restart(cast: Cast) -> None:
    """A daemon stops a run and dies before its runs finish (no drain): the next one, on the same store,
    finds neither the stopped run nor the dropped waiting one in the journal and asks no model."""
    store = MemoryStore()
    backend = GatedBackend()
    rig = pipeline.build_rig(cast, backend=backend, store=store)
    root = cast.user_says("Write the report", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(backend.asked.wait(), 5)
    await rig.dispatcher.handle(cast.user_says("Bob too", tags=[*thread_of(root), ["p", cast.bob.pubkey]]))
    await rig.scheduler.journaled()
    assert await journaled_runs(rig) != []

    await rig.dispatcher.handle(stop_request(cast, cast.user, root))

    assert await journaled_runs(rig) == []
    after = GatedBackend()
    restarted = pipeline.build_rig(cast, backend=after, store=store)
    assert await restarted.scheduler.recover() == []
    assert restarted.scheduler.dispatches_to_redo() == []
    await restarted.settle()
    assert after.requests == []
    await rig.settle()


async def test_the_scheduler_lets_a_run_that_is_saving_its_reply_finish() -> None:
    """A run that said it is saving its reply (``saving_reply``) is not cancelled by a stop and is not
    reported as stopped; a waiting run of the same conversation is dropped."""
    gate = asyncio.Event()
    ran: list[str] = []

    async def run(request: RunRequest) -> None:
        ran.append(request.trigger_id)
        saving_reply()
        await gate.wait()

    scheduler = RunScheduler(MemoryStore(), run)
    await scheduler.submit(RunRequest("c", "t1", "alice"))
    await asyncio.sleep(0.01)
    await scheduler.submit(RunRequest("c", "t2", "bob"))

    stopped = await scheduler.cancel("c")
    gate.set()
    await scheduler.drain(5.0)

    assert [(r.trigger_id, r.agent_slug) for r in stopped] == [("t2", "bob")]
    assert ran == ["t1"]
    assert scheduler.completed == 1


@pytest.mark.parametrize("agent", [None, "alice"])
async def test_the_scheduler_cancels_a_burst_with_the_run_that_answers_it(agent: str | None) -> None:
    """Messages waiting to be answered together with a running run (a burst) are dropped with it: none of
    them runs afterwards."""
    started = asyncio.Event()
    ran: list[str] = []

    async def run(request: RunRequest) -> None:
        ran.append(request.trigger_id)
        started.set()
        await asyncio.Event().wait()

    scheduler = RunScheduler(MemoryStore(), run)
    await scheduler.submit(RunRequest("c", "t0", "alice"))
    await started.wait()
    for trigger in ("t1", "t2"):
        await scheduler.submit(RunRequest("c", trigger, "alice"))

    stopped = await scheduler.cancel("c", agent)
    await scheduler.drain(1.0)

    assert [r.trigger_id for r in stopped] == ["t0", "t1", "t2"]
    assert ran == ["t0"]
    assert scheduler.in_flight == 0


async def test_a_stopped_run_leaves_nothing_behind_in_the_scheduler() -> None:
    """A hundred runs stopped while running, one of them after journaling its reply as being dispatched:
    the scheduler keeps nothing of them (before, one entry per stop stayed for good, a few hundred bytes each
    for months), and the journaled reply's entry leaves the stored journal."""
    started = asyncio.Event()

    async def run(request: RunRequest) -> None:
        if request.trigger_id == "t0":
            await scheduler.accept("reply-of-t0")
            RunScheduler.reply_journaled("reply-of-t0")
        started.set()
        await asyncio.Event().wait()

    store = MemoryStore()
    scheduler = RunScheduler(store, run)
    for n in range(100):
        started.clear()
        await scheduler.submit(RunRequest(f"c{n}", f"t{n}", "alice"))
        await started.wait()
        assert [r.trigger_id for r in await scheduler.cancel(f"c{n}")] == [f"t{n}"]
    await scheduler.drain(1.0)

    assert scheduler._unsaved == {}
    assert "reply-of-t0" not in (await store.get_meta(PENDING_RUNS_KEY) or "")


async def test_a_stopped_routed_agent_no_longer_holds_the_orchestrators_turn_open(cast: Cast) -> None:
    """When the agent the orchestrator routed a message to is stopped, its turn counts the agent as done
    ("Stopped before answering."), so no turn stays open waiting for an answer that will not come."""
    backend = GatedBackend()
    rig = pipeline.build_rig(cast, backend=backend)
    root = cast.user_says("Write the report", kind=11)  # nobody p-tagged: the orchestrator routes it
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(backend.asked.wait(), 5)

    await rig.dispatcher.handle(stop_request(cast, cast.user, root))
    await rig.settle()

    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert conversation.open_turn() is None
    turn = conversation.orchestrator_turns[-1]
    assert [(c.agent, c.message) for c in turn.completions] == [("alice", "Stopped before answering.")]


class HeldRouting:
    """An orchestrator that routes the person's message to Alice at once, and holds its routing of her
    completion (a model's call, in a daemon) until released, then sends Bob."""

    def __init__(self) -> None:
        self.routings = 0
        self.deciding = asyncio.Event()
        self.release = asyncio.Event()

    async def route(self, conversation: Conversation, trigger: NostrEvent) -> RoutingDecision:
        """Alice first; then, once released, Bob."""
        self.routings += 1
        if self.routings == 1:
            return RoutingDecision(("alice",), "first")
        self.deciding.set()
        await self.release.wait()
        return RoutingDecision(("bob",), "then bob")


async def test_a_stop_while_the_orchestrator_routes_a_saved_reply_keeps_the_next_agent_from_running(
    cast: Cast,
) -> None:
    """A stop that comes after Alice's completion is saved, while the orchestrator is still deciding who works
    next, stops that routing: Bob never runs, nothing of his is saved or published, and no turn is started
    for him (none waits for him)."""
    completes = CompletionResult(text="", tool_calls=(ToolCall("c1", TOOL_COMPLETE, {"summary": "done"}),))
    alice = ScriptedBackend([completes, CompletionResult(text="done")])
    bob = ScriptedBackend([CompletionResult(text="bob ran after the stop")])
    routing = HeldRouting()
    profiles = {"alice": AgentProfile(cast.alice, "", alice), "bob": AgentProfile(cast.bob, "", bob)}
    composer = pipeline.real_composer(cast)  # a completion reaches the orchestrator by its tags
    rig = pipeline.build_rig(cast, profiles=profiles, composer=composer, orchestrator=lambda m: routing, hop_limit=6)
    root = cast.user_says("Build it", kind=11)  # nobody p-tagged: the orchestrator routes it
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(routing.deciding.wait(), 5)

    await rig.dispatcher.handle(stop_request(cast, cast.user, root))
    routing.release.set()
    await rig.quiet()  # Alice's run ends once her completion is routed (Bob's run, scheduled then, too)
    await rig.settle()

    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert bob.requests == []
    assert cast.bob.pubkey not in {e.pubkey for e in conversation.history}
    assert cast.bob.pubkey not in {e.pubkey for e in rig.publisher.published}
    assert conversation.open_turn() is None
    assert all("bob" not in turn.agents for turn in conversation.orchestrator_turns)  # the routing stopped
    assert len(conversation.orchestrator_turns) == 1


def hold_while_saving(monkeypatch: pytest.MonkeyPatch) -> tuple[asyncio.Event, asyncio.Event]:
    """Hold a run's first reply between "saving" (a stop lets it finish) and its save: return (set when a run
    is held there, set it to let the run go on)."""
    entered, release = asyncio.Event(), asyncio.Event()
    stop_typing = agent_runner.AgentRunner._stop_typing

    async def held(*args: Any) -> None:  # the moment between "saving" and the reply's save
        await stop_typing(*args)
        if not release.is_set():
            entered.set()
            await release.wait()

    monkeypatch.setattr(agent_runner.AgentRunner, "_stop_typing", staticmethod(held))
    return entered, release


async def test_a_stop_while_a_reply_is_being_saved_keeps_the_agent_routed_after_it_from_running(
    cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop that comes after Alice's answer is in but before her reply reaches history (it is being saved:
    the stop lets it finish) still stops the agent the orchestrator then routes it to: the record counts her
    reply as said before the stop, so Bob never runs."""
    entered, release = hold_while_saving(monkeypatch)
    completes = CompletionResult(text="", tool_calls=(ToolCall("c1", TOOL_COMPLETE, {"summary": "done"}),))
    alice = ScriptedBackend([completes, CompletionResult(text="done")])
    bob = ScriptedBackend([CompletionResult(text="bob ran after the stop")])
    routing = HeldRouting()
    routing.release.set()  # it decides at once here
    profiles = {"alice": AgentProfile(cast.alice, "", alice), "bob": AgentProfile(cast.bob, "", bob)}
    composer = pipeline.real_composer(cast)
    rig = pipeline.build_rig(cast, profiles=profiles, composer=composer, orchestrator=lambda m: routing, hop_limit=6)
    root = cast.user_says("Build it", kind=11)
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(entered.wait(), 5)

    stopping = asyncio.create_task(rig.dispatcher.handle(stop_request(cast, cast.user, root)))
    await asyncio.sleep(0.05)  # the stop is recorded and waits for the reply being saved
    release.set()
    await stopping
    await rig.quiet()
    await rig.settle()

    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert bob.requests == []
    assert cast.bob.pubkey not in {e.pubkey for e in conversation.history}
    record = conversation.metadata.extra[STOPS_KEY][-1]
    assert (record["history"], record["finished"]) == (1, [conversation.history[1].id])  # the root; Alice's reply


async def test_a_message_written_while_a_stop_waits_for_a_reply_being_saved_is_answered(
    cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A person stops Alice while her reply is being saved, then writes again before that reply is in history:
    the new message stands before her reply but came after the stop, so Alice answers it."""
    entered, release = hold_while_saving(monkeypatch)
    alice = ScriptedBackend([CompletionResult(text="the long draft"), CompletionResult(text="the short one")])
    profiles = {"alice": AgentProfile(cast.alice, "", alice)}
    rig = pipeline.build_rig(cast, profiles=profiles, composer=pipeline.real_composer(cast))
    root = cast.user_says("Draft the report", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(entered.wait(), 5)

    stopping = asyncio.create_task(rig.dispatcher.handle(stop_request(cast, cast.user, root)))
    await asyncio.sleep(0.05)  # the stop is recorded and waits for the reply being saved
    again = cast.user_says("Make it short instead", tags=[*thread_of(root), ["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(again)
    release.set()
    await stopping
    await rig.quiet()
    await rig.settle()

    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert [e.content for e in conversation.history] == [
        "Draft the report", "Make it short instead", "the long draft", "the short one"
    ]
    assert len(alice.requests) == 2


async def test_a_stop_through_one_daemon_stops_the_run_another_daemon_holds(cast: Cast) -> None:
    """Two daemons share a store: Alice thinks on the second when the owner stops the conversation through
    the first (the CLI and the API): the first tells the second, which cancels the run and publishes the
    notice; the first reports Alice stopped, and the record holds the stop once, with her."""
    store, bus = MemoryStore(), PeerBus()
    backend = GatedBackend()
    idle = pipeline.build_rig(cast, store=store, messages=bus, instance="a")
    busy = pipeline.build_rig(cast, backend=backend, store=store, messages=bus, instance="b")
    root = cast.user_says("Write the report", kind=11, tags=[["p", cast.alice.pubkey]])
    async with idle.pipeline.stopper.hearing(idle.scheduler), busy.pipeline.stopper.hearing(busy.scheduler):
        await busy.dispatcher.handle(root)
        await asyncio.wait_for(backend.asked.wait(), 5)

        report = await idle.dispatcher.stop(root.id, None, by="owner")
        await busy.quiet()
    backend.release.set()
    await busy.settle()
    await idle.settle()

    assert report.agents == ("alice",)
    assert backend.cancelled
    assert idle.publisher.published == []
    assert [(e.pubkey, e.content) for e in busy.publisher.published] == [(cast.alice.pubkey, "Stopped: Alice.")]
    told = [PeerStop.decode(message) for channel, message in bus.told if channel == stop_channel(cast.project.pubkey)]
    assert [(t.op, t.sender, t.agents) for t in told if t is not None] == [
        ("stop", "a", None), ("stopped", "b", ("alice",)),
    ]
    conversation = await busy.manager.get_conversation(root.id)
    assert conversation is not None
    stops = conversation.metadata.extra[STOPS_KEY]
    assert [(s["by"], s["agents"], s["event_id"], s.get("stop_id")) for s in stops] == [
        ("owner", ["alice"], None, told[0].stop_id if told[0] is not None else None),
    ]


async def test_a_run_a_dead_daemon_left_is_not_redone_once_a_person_stopped_it(cast: Cast) -> None:
    """Alice's run is journaled by a daemon that dies (no drain); the owner stops the conversation through
    the other daemon, which has nothing of its own to stop. When that daemon takes the dead one's journal
    over, it does not redo the stopped run: no model is asked, nothing is published or saved."""
    store, bus = MemoryStore(), PeerBus()
    root = cast.user_says("Write the report", kind=11, tags=[["p", cast.alice.pubkey]])
    dead_backend, live_backend = GatedBackend(), GatedBackend()
    dead = pipeline.build_rig(cast, backend=dead_backend, store=store, messages=bus, instance="b",
                              journal_key=f"{PENDING_RUNS_KEY}.b")
    await dead.dispatcher.handle(root)
    await asyncio.wait_for(dead_backend.asked.wait(), 5)
    await dead.scheduler.journaled()
    live = pipeline.build_rig(cast, backend=live_backend, store=store, messages=bus, instance="a",
                              clock=FakeClock((root.created_at + 5) * 1000))

    report = await live.dispatcher.stop(root.id, None, by="owner")
    for event_id in await live.dispatcher.stored_dispatches(await live.scheduler.adopt(dead.scheduler.journal_key)):
        await live.dispatcher.redispatch(event_id)  # as the daemon does with what it took over
    await live.settle()

    assert report.agents == ()
    assert live_backend.requests == []
    assert live.publisher.published == []
    conversation = await live.manager.get_conversation(root.id)
    assert conversation is not None
    assert [e.id for e in conversation.history] == [root.id]
    assert [(s["agents"], s["named"]) for s in conversation.metadata.extra[STOPS_KEY]] == [([], None)]
    dead_backend.release.set()  # the dead daemon's process, gone: its run ends unseen
    await dead.settle()


async def test_a_stop_through_a_home_whose_daemon_is_down_stops_the_runs_of_the_daemons_running(
    cast: Cast,
) -> None:
    """The CLI on a shared database while its own home's daemon is down: the stop is told to the daemons
    running, which cancel their run and publish the notice; the CLI reports the agent they stopped (it
    said nothing was running, and the run answered in full), and the record holds the stop once."""
    store, bus = MemoryStore(), PeerBus()
    backend = GatedBackend()
    busy = pipeline.build_rig(cast, backend=backend, store=store, messages=bus, instance="b")
    root = cast.user_says("Write the report", kind=11, tags=[["p", cast.alice.pubkey]])
    async with busy.pipeline.stopper.hearing(busy.scheduler):
        await busy.dispatcher.handle(root)
        await asyncio.wait_for(backend.asked.wait(), 5)

        report = await stop_without_daemon(busy.manager, root.id, None, by="owner", messages=bus, wait_s=5)
        await busy.quiet()
    backend.release.set()
    await busy.settle()

    assert report.agents == ("alice",)
    assert backend.cancelled
    assert [(e.pubkey, e.content) for e in busy.publisher.published] == [(cast.alice.pubkey, "Stopped: Alice.")]
    conversation = await busy.manager.get_conversation(root.id)
    assert conversation is not None
    stops = conversation.metadata.extra[STOPS_KEY]
    assert [(s["by"], s["agents"], s["named"]) for s in stops] == [("owner", ["alice"], None)]
    assert stops[0]["stop_id"] is not None


async def test_a_run_left_journaled_is_redone_unless_a_stop_naming_its_agent_came_after_its_trigger(
    cast: Cast,
) -> None:
    """stopped_since: a stop recorded after the trigger came covers the agents it named (every agent when
    it named none; a record from before ``named`` was kept: the agents it stopped); a stop recorded before
    the trigger came, or naming only others, does not. "After" is by position in history when the record
    keeps the history's length, else by time (the trigger's created_at), for a run redone after a crash
    only."""
    conversation = Conversation(id="c" * 64)
    trigger = cast.user_says("Write the report")
    after, before = (trigger.created_at + 1) * 1000, (trigger.created_at - 1) * 1000

    def stopped(*stops: object) -> bool:
        conversation.metadata.extra[STOPS_KEY] = list(stops)
        return stopped_since(conversation, trigger, "alice")

    assert stopped({"at": after, "agents": [], "named": None})
    assert stopped({"at": after, "agents": [], "named": ["bob", "alice"]})
    assert stopped({"at": after, "agents": ["alice"]})  # recorded before "named" was kept
    assert not stopped({"at": after, "agents": [], "named": ["bob"]})
    assert not stopped({"at": before, "agents": ["alice"], "named": None})
    assert not stopped({"at": after, "agents": []}, "junk")
    conversation.metadata.extra.clear()
    assert not stopped_since(conversation, trigger, "alice")
    # a record that keeps the history's length compares positions, whatever the clocks say
    conversation.append(trigger)
    assert stopped({"at": before, "history": 1, "agents": [], "named": None})
    assert not stopped({"at": after, "history": 0, "agents": [], "named": None})
    # a live run (not redone after a crash) trusts no clock: a record without the history's length is no stop
    # for it (a person's new message from a client whose clock lags is answered)
    conversation.metadata.extra[STOPS_KEY] = [{"at": after, "agents": [], "named": None}]
    assert not stopped_since(conversation, trigger, "alice", recovered=False)
    assert stopped_since(conversation, trigger, "alice", recovered=True)


async def alice_thinking(cast: Cast) -> tuple[GatedBackend, pipeline.Rig, NostrEvent]:
    """A pipeline whose Alice is asked to write a report and thinks until released: (her backend, the rig,
    the person's root)."""
    backend = GatedBackend()
    rig = pipeline.build_rig(cast, backend=backend)
    root = cast.user_says("Write the report", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(backend.asked.wait(), 5)
    return backend, rig, root


async def timed_stop(rig: pipeline.Rig, root: NostrEvent) -> tuple[StopReport, float]:
    """Stop the conversation as the owner through the CLI's and API's path; return the report and how
    long the stop took (seconds)."""
    started = asyncio.get_running_loop().time()
    report = await rig.dispatcher.stop(root.id, None, by="owner")
    return report, asyncio.get_running_loop().time() - started


async def test_a_daemon_alone_stops_without_telling_anyone(cast: Cast) -> None:
    """Without daemons sharing its store, a stop through the CLI or the API waits for nobody and records no
    stop id: the record is as it always was."""
    rig = pipeline.build_rig(cast)
    root = cast.user_says("Hello", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await rig.quiet()

    report, waited = await timed_stop(rig, root)
    await rig.settle()

    assert report.agents == ()
    assert waited < PEER_ANSWER_WAIT_S
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    stops = conversation.metadata.extra[STOPS_KEY]
    assert [(s["by"], s["agents"], s["event_id"], "stop_id" in s) for s in stops] == [("owner", [], None, False)]


async def test_a_daemon_alone_on_a_shared_store_tells_nobody_and_waits_for_nobody(cast: Cast) -> None:
    """A daemon that is the only one hearing its project's stops (alone on its database) does not tell a
    stop through the CLI or the API nor wait for answers: it stops its own runs at once."""
    bus = PeerBus()
    rig = pipeline.build_rig(cast, messages=bus, instance="a")
    root = cast.user_says("Hello", kind=11, tags=[["p", cast.alice.pubkey]])
    async with rig.pipeline.stopper.hearing(rig.scheduler):
        await rig.dispatcher.handle(root)
        await rig.quiet()
        report, waited = await timed_stop(rig, root)
    await rig.settle()

    assert report.agents == ()
    assert bus.told == []
    assert waited < PEER_ANSWER_WAIT_S


def test_peer_stop_messages_read_back_and_others_are_refused() -> None:
    """A stop told between daemons reads back as written; a message that is not one is refused (None)."""
    asked = PeerStop(PeerOp.STOP, "a", "id1", "c" * 64, ("alice",), "owner")
    every = PeerStop(PeerOp.STOPPED, "a", "id2", "c" * 64, None, "owner")

    assert PeerStop.decode(asked.encode()) == asked
    assert PeerStop.decode(every.encode()) == every
    assert PeerStop.decode("not json") is None
    assert PeerStop.decode('{"op": "stop"}') is None
    assert PeerStop.decode(asked.encode().replace('"stop"', '"go"', 1)) is None


def test_a_stop_told_between_daemons_is_recorded_once_with_every_daemons_agents() -> None:
    """A stop through the CLI or the API carried out by several daemons is one entry (its stop id) that
    gains each daemon's agents; another told stop is an entry of its own."""
    here = {"by": "owner", "at": 1, "agents": [], "event_id": None, "stop_id": "s1"}
    there = {"by": "owner", "at": 2, "agents": ["alice"], "event_id": None, "stop_id": "s1"}
    other = {"by": "owner", "at": 3, "agents": [], "event_id": None, "stop_id": "s2"}

    assert with_stop(with_stop(None, here), there) == [{**here, "agents": ["alice"]}]
    assert [s["stop_id"] for s in with_stop([here], other)] == ["s1", "s2"]


def test_each_daemons_finished_replies_join_the_requests_record_and_count_as_before_the_stop(
    cast: Cast,
) -> None:
    """Two daemons carry one stop out and each lets a reply finish: the record holds both replies' ids, and
    a run for either reply counts as stopped, though the record's ``history`` came before them."""
    root = cast.user_says("Build it", kind=11)
    alice, bob = cast.alice_says("done"), cast.bob_says("done too")
    first = {"by": "p", "at": 1, "history": 1, "agents": [], "named": None, "event_id": "e1", "finished": [alice.id]}
    again = {**first, "at": 2, "finished": [bob.id]}
    conversation = Conversation(id=root.id)
    for event in (root, alice, bob):
        conversation.append(event)
    conversation.metadata.extra[STOPS_KEY] = with_stop(with_stop(None, first), again)

    assert conversation.metadata.extra[STOPS_KEY] == [{**first, "finished": [alice.id, bob.id]}]
    assert stopped_since(conversation, alice, "carol", recovered=False)
    assert stopped_since(conversation, bob, "carol", recovered=False)


def test_a_request_carried_out_again_joins_its_record_rather_than_adding_one() -> None:
    """Daemons sharing a database each carry a stop request out for their own runs: the second to record it
    adds the agents it stopped to the request's entry; another request, or one from the CLI (no event), is
    a new entry, and the record keeps the newest STOPS_KEPT."""
    first = {"by": "p", "at": 1, "agents": [], "event_id": "e1"}
    again = {"by": "p", "at": 2, "agents": ["alice"], "event_id": "e1"}
    cli = {"by": "owner", "at": 3, "agents": ["bob"], "event_id": None}
    many = [{"event_id": f"x{n}", "agents": []} for n in range(STOPS_KEPT)]

    assert with_stop(with_stop(None, first), again) == [{**first, "agents": ["alice"]}]
    assert with_stop(["junk", again], {**first, "agents": ["bob", "alice"]}) == [
        "junk", {**again, "agents": ["alice", "bob"]},
    ]
    assert [s["at"] for s in with_stop(with_stop([first], cli), {**cli, "at": 4})] == [1, 3, 4]
    assert [s["event_id"] for s in with_stop(many, first)] == [f"x{n}" for n in range(1, STOPS_KEPT)] + ["e1"]


async def test_the_stop_is_recorded_before_any_run_is_cancelled(cast: Cast, monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner's stop is in the conversation's record when the scheduler is asked to cancel its runs, so a
    run a dead daemon left, taken over while the stop is carried out, reads it before it starts; once Alice's
    run is cancelled the same entry (one, not two) names her."""
    backend, rig, root = await alice_thinking(cast)
    seen_at_cancel: list[list[dict[str, object]]] = []
    cancel = rig.scheduler.cancel

    async def cancel_and_look(conversation_id: str, agent_slug: str | None) -> list[RunRequest]:
        conversation = await rig.manager.get_conversation(conversation_id)
        assert conversation is not None
        seen_at_cancel.append(list(conversation.metadata.extra.get(STOPS_KEY) or []))
        return await cancel(conversation_id, agent_slug)

    monkeypatch.setattr(rig.scheduler, "cancel", cancel_and_look)
    report, _ = await timed_stop(rig, root)
    await rig.settle()

    assert report.agents == ("alice",)
    assert backend.cancelled
    assert [[(s["by"], s["agents"]) for s in stops] for stops in seen_at_cancel] == [[("owner", [])]]
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert [(s["by"], s["agents"], s["named"]) for s in conversation.metadata.extra[STOPS_KEY]] == [
        ("owner", ["alice"], None)
    ]


async def test_a_stops_notice_is_in_the_stored_outbox_before_it_is_saved(
    cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No run journal covers a stop's notice, so its outbox entry, holding the notice itself, is stored
    before the notice is saved in the conversation: a crash between the two leaves the next start an entry to
    save and publish it from (before, a crash after the save left it in history, never published)."""
    backend, rig, root = await alice_thinking(cast)
    outbox_at_save: list[list[dict[str, object]]] = []
    add_event = rig.manager.add_event

    async def add_and_look(conversation_id: str, event: NostrEvent, **options: bool) -> bool:
        if event.has_tag("error", "system"):
            outbox_at_save.append(json.loads(await rig.store.get_meta(OUTBOX_KEY) or "[]"))
        return await add_event(conversation_id, event, **options)

    monkeypatch.setattr(rig.manager, "add_event", add_and_look)
    await rig.dispatcher.handle(stop_request(cast, cast.user, root))
    backend.release.set()
    await rig.settle()

    [notice] = rig.publisher.published
    assert notice.content == "Stopped: Alice."
    [stored] = outbox_at_save
    assert [(entry["id"], entry.get("e")) for entry in stored] == [(notice.id, notice.to_dict())]


async def test_a_stops_notice_a_crash_left_unsaved_is_saved_and_published_at_the_next_start(
    cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's own wiring recovers a stop's notice whose process ended right before saving it: the next
    start (a pipeline built again on the same store) saves the notice in the conversation from its outbox
    entry and publishes it once."""
    backend, rig, root = await alice_thinking(cast)
    left: list[str | None] = []

    async def crash_before_saving(conversation_id: str, event: NostrEvent, **options: bool) -> bool:
        left.append(await rig.store.get_meta(OUTBOX_KEY))  # what the disk holds when the process ends
        raise asyncio.CancelledError

    monkeypatch.setattr(rig.manager, "add_event", crash_before_saving)
    with pytest.raises(asyncio.CancelledError):
        await rig.dispatcher.stop(root.id, None, by="owner")
    monkeypatch.undo()
    backend.release.set()
    await rig.settle()
    assert rig.publisher.published == []
    [stored] = left
    assert stored is not None
    await rig.store.set_meta(OUTBOX_KEY, stored)

    restarted = pipeline.build_rig(cast, store=rig.store)
    assert await restarted.pipeline.outbox.recover(restarted.store.find_event) == 1
    await restarted.settle()

    [notice] = restarted.publisher.published
    assert (notice.pubkey, notice.content) == (cast.alice.pubkey, "Stopped: Alice.")
    conversation = await restarted.manager.get_conversation(root.id)
    assert conversation is not None
    assert [e.id for e in conversation.history] == [root.id, notice.id]



class RoutesBothOnce:
    """An orchestrator that routes the person's message to two agents, in the order given, and counts every
    routing after."""

    def __init__(self, agents: tuple[str, str]) -> None:
        self.agents = agents
        self.routings = 0

    async def route(self, conversation: Conversation, trigger: NostrEvent) -> RoutingDecision:
        """Both agents first; Alice alone for anything later (which a stopped turn never asks for)."""
        self.routings += 1
        return RoutingDecision(self.agents if self.routings == 1 else ("alice",), "both")


class SlowCompletion:
    """Bob: completes once released (a model that takes a while)."""

    name = "slow-completion"

    def __init__(self, released: bool) -> None:
        self.requests = 0
        self.release = asyncio.Event()
        if released:
            self.release.set()

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Wait for the release, then complete."""
        self.requests += 1
        await self.release.wait()
        return CompletionResult(text="", tool_calls=(ToolCall("c1", TOOL_COMPLETE, {"summary": "ok"}),))


@pytest.mark.parametrize("bob_first", [False, True])
async def test_a_turn_a_stop_closed_routes_nothing_whether_the_stop_or_the_others_completion_came_first(
    cast: Cast, bob_first: bool
) -> None:
    """The orchestrator routes to Alice and Bob (they run one after the other); the person stops Alice while
    she thinks. Whether Bob completed before the stop or completes after it, the turn closes and nothing
    more is routed (the orchestrator is asked once): a stop hands the conversation back to the person.
    Bob's completion is still saved and published."""
    alice, bob = GatedBackend(), SlowCompletion(released=bob_first)
    routing = RoutesBothOnce(("bob", "alice") if bob_first else ("alice", "bob"))
    profiles = {"alice": AgentProfile(cast.alice, "", alice), "bob": AgentProfile(cast.bob, "", bob)}
    composer = pipeline.real_composer(cast)  # a completion reaches the orchestrator by its tags
    rig = pipeline.build_rig(cast, profiles=profiles, composer=composer, orchestrator=lambda m: routing, hop_limit=6)
    root = cast.user_says("Build it", kind=11)  # nobody p-tagged: the orchestrator routes it
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(alice.asked.wait(), 5)

    await rig.dispatcher.handle(stop_request(cast, cast.user, root, [cast.alice.pubkey]))
    bob.release.set()  # after the stop: Bob's completion closes the turn
    await rig.quiet()
    await rig.settle()

    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert bob.requests == 1
    assert routing.routings == 1
    assert conversation.open_turn() is None
    assert len(conversation.orchestrator_turns) == 1
    completions = {c.agent: c.message for c in conversation.orchestrator_turns[0].completions}
    assert completions["alice"] == STOPPED_COMPLETION
    assert completions["bob"] == "ok"
    assert cast.bob.pubkey in {e.pubkey for e in rig.publisher.published}


class DecidesSlowly:
    """An orchestrator whose first routing waits until released (a model thinking), then sends Alice; it
    notes a decision cancelled."""

    def __init__(self) -> None:
        self.deciding = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = False

    async def route(self, conversation: Conversation, trigger: NostrEvent) -> RoutingDecision:
        """Wait for the release, then route to Alice."""
        self.deciding.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return RoutingDecision(("alice",), "alice")


@pytest.mark.parametrize("named", [(), ("alice",)])
async def test_a_stop_while_the_orchestrator_decides_stops_the_routing_and_says_so(
    cast: Cast, named: tuple[str, ...]
) -> None:
    """A stop that comes while the orchestrator decides where a message goes, naming every agent or only
    the one it is about to pick, reports the orchestrator stopped and publishes the notice (it said
    nothing was running, and the message then went unanswered without a word); the model's call is
    cancelled (the next message would wait behind it), no turn starts and nobody runs."""
    alice = ScriptedBackend([CompletionResult(text="alice ran after the stop")])
    routing = DecidesSlowly()
    rig = pipeline.build_rig(
        cast, backend=alice, composer=pipeline.real_composer(cast), orchestrator=lambda m: routing
    )
    root = cast.user_says("Build it", kind=11)  # nobody p-tagged: the orchestrator routes it
    handling = asyncio.create_task(rig.dispatcher.handle(root))
    await asyncio.wait_for(routing.deciding.wait(), 5)

    pubkeys = [cast.alice.pubkey for slug in named if slug == "alice"]
    stop = await rig.dispatcher.handle(stop_request(cast, cast.user, root, pubkeys))
    routed = await asyncio.wait_for(handling, 5)  # never released: the stop gave the decision up
    await rig.settle()

    assert stop.reason == "stopped"
    assert "orchestrator" in stop.agents
    assert routed.reason == "turn_stopped"
    assert routing.cancelled
    assert alice.requests == []
    notices = [e for e in rig.publisher.published if e.content.startswith("Stopped")]
    assert len(notices) == 1
    assert notices[0].pubkey == cast.orchestrator.pubkey
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert conversation.orchestrator_turns == []


class RoutesToAlice:
    """An orchestrator that sends Alice at once."""

    async def route(self, conversation: Conversation, trigger: NostrEvent) -> RoutingDecision:
        """Alice."""
        return RoutingDecision(("alice",), "alice")


@pytest.mark.parametrize(("named", "alice_runs"), [("bob", True), ("alice", False)])
async def test_a_stop_after_the_decision_stops_only_the_agents_it_names_of_those_decided(
    cast: Cast, named: str, alice_runs: bool
) -> None:
    """A stop that lands once the orchestrator decided on Alice, while her turn is being saved, no longer
    stops the routing: naming Bob it stops nothing (no notice; Alice answers), naming Alice it reports her
    stopped with its notice, and her run skips the message."""
    alice = ScriptedBackend([CompletionResult(text="alice answered")])
    rig = pipeline.build_rig(
        cast, backend=alice, composer=pipeline.real_composer(cast), orchestrator=lambda m: RoutesToAlice()
    )
    gate, inside = asyncio.Event(), asyncio.Event()
    start_turn = rig.manager.start_orchestrator_turn

    async def slow_turn(*args: Any, **options: Any) -> Any:
        inside.set()
        await gate.wait()
        return await start_turn(*args, **options)

    rig.manager.start_orchestrator_turn = slow_turn  # type: ignore[method-assign]
    root = cast.user_says("Build it", kind=11)
    handling = asyncio.create_task(rig.dispatcher.handle(root))
    await asyncio.wait_for(inside.wait(), 5)
    who = cast.bob if named == "bob" else cast.alice
    stop = await rig.dispatcher.handle(stop_request(cast, cast.user, root, [who.pubkey]))
    gate.set()
    await asyncio.wait_for(handling, 5)
    await rig.settle()

    notices = [e.content for e in rig.publisher.published if e.content.startswith("Stopped")]
    if alice_runs:
        assert stop.agents == ()
        assert notices == []
        assert len(alice.requests) == 1
    else:
        assert stop.agents == ("alice",)
        assert notices == ["Stopped: Alice."]
        assert alice.requests == []


async def test_a_routings_wait_gives_up_at_a_stop_and_never_swallows_its_callers_cancellation() -> None:
    """``unless_stopped``: a stop first gives None and cancels the work; the work's result or error comes
    back otherwise; the caller cancelled (a shutdown) while the stopped work winds down is still cancelled."""

    async def slow(winding_down: float = 0.0) -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await asyncio.sleep(winding_down)  # a model call being killed and reaped
            raise
        return "late"

    async def fails() -> str:
        raise RuntimeError("backend down")

    stopped = Routing("t")
    waiting = asyncio.create_task(stopped.unless_stopped(slow()))
    await asyncio.sleep(0)
    stopped.stop()
    assert await waiting is None

    async def quick() -> str:
        return "decided"

    assert await Routing("t").unless_stopped(quick()) == "decided"
    with pytest.raises(RuntimeError, match="backend down"):
        await Routing("t").unless_stopped(fails())

    routing = Routing("t")
    caller = asyncio.create_task(routing.unless_stopped(slow(winding_down=0.05)))
    await asyncio.sleep(0)
    routing.stop()
    await asyncio.sleep(0.01)  # the work winds down
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller


async def test_a_stop_also_stops_a_routing_waiting_for_its_turn(cast: Cast) -> None:
    """A second message of the conversation waits for the first's routing; a stop meanwhile stops both: the
    orchestrator is asked once (then cancelled), and neither message runs anybody."""
    alice = ScriptedBackend([CompletionResult(text="alice ran after the stop")])
    routing = DecidesSlowly()
    asked: list[str] = []
    decide = routing.route

    async def counting(conversation: Conversation, trigger: NostrEvent) -> RoutingDecision:
        asked.append(trigger.content)
        return await decide(conversation, trigger)

    routing.route = counting  # type: ignore[method-assign]
    rig = pipeline.build_rig(
        cast, backend=alice, composer=pipeline.real_composer(cast), orchestrator=lambda m: routing
    )
    root = cast.user_says("Build it", kind=11)
    first = asyncio.create_task(rig.dispatcher.handle(root))
    await asyncio.wait_for(routing.deciding.wait(), 5)
    second = asyncio.create_task(rig.dispatcher.handle(cast.user_says("And test it", tags=thread_of(root))))
    await asyncio.sleep(0.05)  # stored, waiting for the first's routing

    stop = await rig.dispatcher.handle(stop_request(cast, cast.user, root))
    results = await asyncio.wait_for(asyncio.gather(first, second), 5)
    await rig.settle()

    assert stop.agents == ("orchestrator",)
    assert [r.reason for r in results] == ["turn_stopped", "turn_stopped"]
    assert asked == ["Build it"]
    assert alice.requests == []


class RoutesNobody:
    """An orchestrator that routes nothing (the test starts the turn itself)."""

    async def route(self, conversation: Conversation, trigger: NostrEvent) -> None:
        """Nobody."""
        return None


async def test_a_stop_before_a_redone_routing_resumes_its_turn_reports_only_the_turns_agents_it_names(
    cast: Cast,
) -> None:
    """A routing redone after a crash, whose turn (Alice) was started, waits for the conversation's routing
    lock when a stop naming Bob comes: it is decided already, so the stop stops nothing, no notice says the
    orchestrator stopped, and Alice answers."""
    alice = ScriptedBackend([CompletionResult(text="alice answered")])
    rig = pipeline.build_rig(
        cast, backend=alice, composer=pipeline.real_composer(cast), orchestrator=lambda m: RoutesNobody()
    )
    root = cast.user_says("Build it", kind=11)
    await rig.dispatcher.handle(root)
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    await rig.manager.start_orchestrator_turn(root.id, conversation.phase, ("alice",), "r", trigger_id=root.id)
    release, held = asyncio.Event(), asyncio.Event()

    async def hold_the_routing_lock() -> None:
        async with rig.dispatcher._routing.hold(root.id):
            held.set()
            await release.wait()

    holder = asyncio.create_task(hold_the_routing_lock())
    await held.wait()
    redo = asyncio.create_task(rig.dispatcher._target(root.id, root, recovered=True))
    await asyncio.sleep(0.05)  # registered, waiting for the lock
    stop = await rig.dispatcher.handle(stop_request(cast, cast.user, root, [cast.bob.pubkey]))
    release.set()
    result = await asyncio.wait_for(redo, 5)
    await holder
    await rig.settle()

    assert stop.agents == ()
    assert result.reason == "turn resumed"
    assert [e.content for e in rig.publisher.published if e.content.startswith("Stopped")] == []
    assert len(alice.requests) == 1


async def test_a_message_written_after_the_stop_was_recorded_is_routed(cast: Cast) -> None:
    """A person's message stored after a stop recorded how many messages it came after (while the record is
    written) is not stopped with the earlier ones: its routing goes on and Alice answers it."""
    alice = ScriptedBackend([CompletionResult(text="alice answered")])
    routing = DecidesSlowly()
    rig = pipeline.build_rig(
        cast, backend=alice, composer=pipeline.real_composer(cast), orchestrator=lambda m: routing
    )
    root = cast.user_says("Build it", kind=11)
    first = asyncio.create_task(rig.dispatcher.handle(root))
    await asyncio.wait_for(routing.deciding.wait(), 5)
    record, writing = rig.manager.update_extra, asyncio.Event()

    async def slow_record(conversation_id: str, key: str, update: Callable[[Any], Any]) -> None:
        if key == STOPS_KEY and not writing.is_set():
            writing.set()
            await asyncio.sleep(0.2)  # the record's write, a database round trip, stretched
        await record(conversation_id, key, update)

    rig.manager.update_extra = slow_record  # type: ignore[method-assign]
    stop = asyncio.create_task(rig.dispatcher.stop(root.id, None, by="owner"))
    await writing.wait()
    later = cast.user_says("Now do this instead", tags=thread_of(root))
    second = asyncio.create_task(rig.dispatcher.handle(later))
    report = await stop
    routing.release.set()
    results = await asyncio.wait_for(asyncio.gather(first, second), 5)
    await rig.settle()

    assert report.agents == ("orchestrator",)  # the first message's routing
    assert [r.reason for r in results] == ["turn_stopped", "alice"]
    assert len(alice.requests) == 1
