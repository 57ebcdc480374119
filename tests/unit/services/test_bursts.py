"""Bursts: messages that wait while an agent is busy are answered together by its next run (docs/CONTEXT.md)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tenex_daemon.core.context import NEW_INTERACTION
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.llm import CompletionRequest, CompletionResult
from tenex_daemon.core.nip19 import bech32_encode
from tenex_daemon.services.runs import RunRequest
from tenex_daemon.testing import sign_event
from tests import pipeline
from tests.conftest import Cast


class GatedBackend:
    """Holds its first answer until released, answers "answer N" to the Nth call, records every request."""

    name = "gated"

    def __init__(self) -> None:
        self.requests: list[CompletionRequest] = []
        self.asked = asyncio.Event()
        self.release = asyncio.Event()

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Answer; the first call waits for ``release``."""
        self.requests.append(request)
        number = len(self.requests)
        if number == 1:
            self.asked.set()
            await self.release.wait()
        return CompletionResult(text=f"answer {number}", model="gated")


@pytest.mark.parametrize("addressed", [True, False], ids=["p-tagging the agent", "routed by the orchestrator"])
async def test_a_burst_is_answered_once_by_a_run_that_sees_every_message_and_its_earlier_answer(
    cast: Cast, addressed: bool
) -> None:
    """Two messages sent while the agent answers a first one cost one more call, not two, whether they
    p-tag the agent or the orchestrator routes them to it: its trigger is the newest, it shows both
    messages in order and the agent's answer to the first, and nothing is answered twice."""
    backend = GatedBackend()
    rig = pipeline.build_rig(cast, backend=backend)
    to_alice = [["p", cast.alice.pubkey]] if addressed else []
    root = cast.user_says("first", kind=11, tags=to_alice)
    thread = [["E", root.id, "", root.pubkey], ["K", "11"], ["e", root.id], *to_alice]
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(backend.asked.wait(), 5)
    second = cast.user_says("second", tags=thread)
    third = cast.user_says("third", tags=thread)
    await rig.dispatcher.handle(second)
    await rig.dispatcher.handle(third)

    backend.release.set()
    await rig.settle()

    assert len(backend.requests) == 2
    shown = [(m.role, m.content) for m in backend.requests[1].messages]
    assert shown[:3] == [("user", "first"), ("user", "second"), ("assistant", "answer 1")]
    assert shown[-2:] == [("system", NEW_INTERACTION), ("user", "third")]
    assert "second" in shown[-3][1]  # the while-away block holds what came since the first answer
    replies = rig.publisher.published
    assert [(r.content, r.tag_value("e")) for r in replies] == [("answer 1", root.id), ("answer 2", third.id)]
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert [e.content for e in conversation.history] == ["first", "second", "third", "answer 1", "answer 2"]
    assert conversation.agent_states["alice"].last_processed_index == 4


async def test_a_message_that_arrives_during_a_run_gets_the_next_run_which_sees_the_reply(cast: Cast) -> None:
    """One message waiting alone is not a burst: it gets its own run, after the busy one, shown the reply."""
    backend = GatedBackend()
    rig = pipeline.build_rig(cast, backend=backend)
    root = cast.user_says("first", kind=11, tags=[["p", cast.alice.pubkey]])
    thread = [["E", root.id, "", root.pubkey], ["K", "11"], ["e", root.id], ["p", cast.alice.pubkey]]
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(backend.asked.wait(), 5)
    second = cast.user_says("second", tags=thread)
    await rig.dispatcher.handle(second)

    backend.release.set()
    await rig.settle()

    shown = [(m.role, m.content) for m in backend.requests[1].messages]
    assert ("assistant", "answer 1") in shown
    assert shown[-1] == ("user", "second")
    assert len(rig.publisher.published) == 2


async def alice_busy(cast: Cast, backend: GatedBackend) -> tuple[pipeline.Rig, NostrEvent, list[list[str]]]:
    """A rig whose Alice is answering the person's first message (held by ``backend``): the rig, that
    root, and the tags of a reply in its thread addressing nobody."""
    rig = pipeline.build_rig(cast, backend=backend)
    root = cast.user_says("first", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(backend.asked.wait(), 5)
    return rig, root, [["E", root.id, "", root.pubkey], ["K", "11"], ["e", root.id]]


async def test_a_message_that_came_after_the_trigger_is_never_shown_before_it(cast: Cast) -> None:
    """A run whose trigger waited shows, after the history before its trigger, only the agent's own later
    answers: a person's later message (here a direct one, behind a routed trigger) is not shown at all
    (it gets the next run, which shows both answers before it), never before the trigger, which comes last."""
    backend = GatedBackend()
    rig, _, thread = await alice_busy(cast, backend)
    routed = cast.user_says("second, to whoever", tags=thread)
    direct = cast.user_says("third, to alice", tags=[*thread, ["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(routed)
    await rig.dispatcher.handle(direct)

    backend.release.set()
    await rig.settle()

    second_run = [(m.role, m.content) for m in backend.requests[1].messages]
    assert second_run == [("user", "first"), ("assistant", "answer 1"), ("user", "second, to whoever")]
    third_run = [(m.role, m.content) for m in backend.requests[2].messages]
    assert third_run == [
        ("user", "first"),
        ("user", "second, to whoever"),
        ("assistant", "answer 1"),
        ("assistant", "answer 2"),
        ("user", "third, to alice"),
    ]


async def test_the_scheduler_runs_the_newest_waiting_request_once_for_a_burst(cast: Cast) -> None:
    """Three requests for one agent waiting behind a busy run become one run (the newest trigger, the
    other two named as answered with it); the other agent's request still gets its own run."""
    from tenex_daemon import MemoryStore
    from tenex_daemon.services.runs import RunRequest, RunScheduler

    ran: list[RunRequest] = []
    gate = asyncio.Event()

    async def run(request: RunRequest) -> None:
        ran.append(request)
        if len(ran) == 1:
            await gate.wait()

    scheduler = RunScheduler(MemoryStore(), run)
    await scheduler.submit(RunRequest("c", "t0", "alice"))
    await asyncio.sleep(0)
    for trigger in ("t1", "t2", "t3"):
        await scheduler.submit(RunRequest("c", trigger, "alice"))
    await scheduler.submit(RunRequest("c", "t4", "bob"))
    gate.set()
    await scheduler.drain(5.0)

    assert [(r.trigger_id, r.agent_slug, r.burst) for r in ran] == [
        ("t0", "alice", ()),
        ("t3", "alice", ("t1", "t2")),
        ("t4", "bob", ()),
    ]
    assert scheduler.completed == 3


async def test_a_recovered_burst_publishes_the_saved_answer_to_its_earlier_message(cast: Cast) -> None:
    """After a crash that came between saving the answer to a first message and publishing it, with a
    second message waiting: the redone runs coalesce, the saved answer goes out again and the second
    message is answered; nothing is lost."""
    from tenex_daemon.core.llm import CompletionResult as Result
    from tenex_daemon.services.runs import PENDING_RUNS_KEY
    from tenex_daemon.testing.fakes import ScriptedBackend

    backend = ScriptedBackend([Result(text="answer to second", model="s")])
    rig = pipeline.build_rig(cast, backend=backend)
    root = cast.user_says("first", kind=11, tags=[["p", cast.alice.pubkey]])
    thread = [["E", root.id, "", root.pubkey], ["K", "11"], ["e", root.id], ["p", cast.alice.pubkey]]
    await rig.manager.create_conversation(root)
    second = cast.user_says("second", tags=thread)
    await rig.manager.add_event(root.id, second)
    saved = cast.alice_says("answer to first", tags=[["e", root.id], ["p", cast.user.pubkey]])
    await rig.manager.add_event(root.id, saved)  # saved before the crash, never published
    journal = [
        {"conversation_id": root.id, "trigger_id": root.id, "agent_slug": "alice"},
        {"conversation_id": root.id, "trigger_id": second.id, "agent_slug": "alice"},
    ]
    import json

    await rig.store.set_meta(PENDING_RUNS_KEY, json.dumps(journal))

    await rig.scheduler.recover()
    await rig.settle()

    published = [(e.content, e.tag_value("e")) for e in rig.publisher.published]
    assert ("answer to first", root.id) in published
    assert ("answer to second", second.id) in published
    assert len(published) == 2
    assert len(backend.requests) == 1


async def test_a_burst_run_that_fails_leaves_each_covered_message_its_own_turn(cast: Cast) -> None:
    """When the run answering a burst fails, the messages it covered are not taken as answered: the next
    run answers them, and the failed request, tried again (as any run that failed with an error is),
    finds its message answered and runs nothing."""
    from tenex_daemon import MemoryStore
    from tenex_daemon.services.runs import RunRequest, RunScheduler

    ran: list[str] = []
    failed: list[str] = []
    gate = asyncio.Event()

    async def run(request: RunRequest) -> None:
        ran.append(request.trigger_id)
        if len(ran) == 1:
            await gate.wait()
        elif request.burst and not failed:
            failed.append(request.trigger_id)
            raise RuntimeError("the burst run fails")

    scheduler = RunScheduler(MemoryStore(), run)
    await scheduler.submit(RunRequest("c", "t0", "alice"))
    await asyncio.sleep(0)
    for trigger in ("t1", "t2"):
        await scheduler.submit(RunRequest("c", trigger, "alice"))
    gate.set()
    await scheduler.drain(5.0)

    assert ran == ["t0", "t2", "t2"]
    assert scheduler.failed == 1


async def test_a_run_that_fails_with_an_error_is_tried_again_as_recovered(cast: Cast) -> None:
    """A run that fails with an error (a store gone for a moment) is not dropped: it is tried again after
    the first retry wait, as recovered (a reply it saved is not made twice), and counted as failed once."""
    from tenex_daemon import MemoryStore
    from tenex_daemon.services.runs import RunRequest, RunScheduler

    tries: list[RunRequest] = []

    async def run(request: RunRequest) -> None:
        tries.append(request)
        if len(tries) == 1:
            raise ConnectionResetError("the database went away")

    scheduler = RunScheduler(MemoryStore(), run)
    await scheduler.submit(RunRequest("c", "t0", "alice"))
    await scheduler.drain(5.0)

    assert [(r.trigger_id, r.recovered) for r in tries] == [("t0", False), ("t0", True)]
    assert scheduler.failed == 1
    assert scheduler.completed == 1


async def test_a_run_for_an_older_message_shows_what_a_run_for_a_later_one_showed(cast: Cast) -> None:
    """When a routed burst for a later message runs before a direct run for an older one, the older one's
    run still shows the later message the agent was shown (and answered) before its trigger: no message
    the agent answered is missing from its view."""
    backend = GatedBackend()
    rig, _, thread = await alice_busy(cast, backend)
    for event in (
        cast.user_says("second, routed", tags=thread),
        cast.user_says("third, to alice", tags=[*thread, ["p", cast.alice.pubkey]]),
        cast.user_says("fourth, routed", tags=thread),
    ):
        await rig.dispatcher.handle(event)

    backend.release.set()
    await rig.settle()

    runs = [[m.content for m in request.messages] for request in backend.requests]
    assert [run[-1] for run in runs] == ["first", "fourth, routed", "third, to alice"]
    assert "fourth, routed" in runs[2][:-1]


async def test_a_burst_run_answers_the_newest_message_whatever_order_its_requests_came_in(cast: Cast) -> None:
    """A burst whose request names an older trigger than one it covers (a request taken in from a dead
    daemon's journal comes after this daemon's own) is run for the newest message, the older one standing
    before it."""
    backend = GatedBackend()
    backend.release.set()
    rig = pipeline.build_rig(cast, backend=backend)
    root = cast.user_says("first", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.manager.create_conversation(root)
    later = cast.user_says("second", tags=[["E", root.id, "", root.pubkey], ["p", cast.alice.pubkey]])
    await rig.manager.add_event(root.id, later)

    reply = await rig.runner.run(RunRequest(root.id, root.id, "alice", burst=(later.id,)))

    assert reply is not None
    assert reply.tag_value("e") == later.id
    shown = [(m.role, m.content) for m in backend.requests[0].messages]
    assert (shown[0], shown[-1]) == (("user", "first"), ("user", "second"))


class HeldResolver:
    """Resolves no reference; the first lookup waits until released (a relay slow to answer)."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.release = asyncio.Event()

    async def resolve(self, entity: object) -> NostrEvent | None:
        """Find nothing, after ``release``."""
        self.asked.set()
        await self.release.wait()
        return None


async def test_a_message_that_arrives_while_the_run_builds_its_context_waits_for_the_next_run(
    cast: Cast,
) -> None:
    """A person's second message saved while the run for the first is still building its context (here
    resolving a reference) is not shown to that run (its first call is exactly the first message), and
    the next run answers it, shown the first answer: one answer per message, in order."""
    backend = GatedBackend()
    backend.release.set()
    resolver = HeldResolver()
    rig = pipeline.build_rig(cast, backend=backend, resolver=resolver)
    note = "nostr:" + bech32_encode("note", bytes.fromhex("ab" * 32))
    root = cast.user_says(f"first, see {note}", kind=11, tags=[["p", cast.alice.pubkey]])
    thread = [["E", root.id, "", root.pubkey], ["K", "11"], ["e", root.id], ["p", cast.alice.pubkey]]
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(resolver.asked.wait(), 5)
    second = cast.user_says("second", tags=thread)
    await rig.dispatcher.handle(second)

    resolver.release.set()
    await rig.settle()

    calls = [[(m.role, m.content) for m in request.messages] for request in backend.requests]
    assert calls == [
        [("user", root.content)],
        [("user", root.content), ("assistant", "answer 1"), ("user", "second")],
    ]
    replies = rig.publisher.published
    assert [(r.content, r.tag_value("e")) for r in replies] == [("answer 1", root.id), ("answer 2", second.id)]


async def test_a_burst_from_two_people_is_addressed_to_both(cast: Cast) -> None:
    """Two people writing to a busy agent are answered by one run: its reply p-tags each of them (the
    newest message's author first), since it counts as the answer to both messages."""
    backend = GatedBackend()
    rig = pipeline.build_rig(
        cast, backend=backend, whitelist=[cast.other_user.pubkey], whitelist_may_join=True,
        composer=pipeline.real_composer(cast),
    )
    root = cast.user_says("first", kind=11, tags=[["p", cast.alice.pubkey]])
    thread = [["E", root.id, "", root.pubkey], ["K", "11"], ["e", root.id], ["p", cast.alice.pubkey]]
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(backend.asked.wait(), 5)
    await rig.dispatcher.handle(cast.user_says("question one", tags=thread))
    second = cast.factory.event(cast.other_user, "question two", tags=thread)
    await rig.dispatcher.handle(second)

    backend.release.set()
    await rig.settle()

    last = rig.publisher.published[-1]
    assert (last.content, last.tag_value("e")) == ("answer 2", second.id)
    assert [tag[1] for tag in last.tags if tag[0] == "p"] == [cast.other_user.pubkey, cast.user.pubkey]


async def test_a_bursts_reply_is_dated_after_every_message_it_answers(cast: Cast) -> None:
    """A burst whose earlier message is dated ahead of its trigger (the person's phone three minutes fast,
    then the laptop): its reply is dated after that message too, as a reply to it alone would be, so
    clients sorting by date show the answer below both questions."""
    backend = GatedBackend()
    rig = pipeline.build_rig(cast, backend=backend, composer=pipeline.real_composer(cast))
    now = int(time.time())
    root = sign_event(cast.user, "first", kind=11, tags=[["p", cast.alice.pubkey]], created_at=now - 60)
    thread = [["E", root.id, "", root.pubkey], ["K", "11"], ["e", root.id], ["p", cast.alice.pubkey]]
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(backend.asked.wait(), 5)
    phone = sign_event(cast.user, "from the phone", tags=thread, created_at=now + 180)
    laptop = sign_event(cast.user, "from the laptop", tags=thread, created_at=now + 1)
    await rig.dispatcher.handle(phone)
    await rig.dispatcher.handle(laptop)

    backend.release.set()
    await rig.settle()

    last = rig.publisher.published[-1]
    assert last.tag_value("e") == laptop.id
    assert last.created_at > phone.created_at
