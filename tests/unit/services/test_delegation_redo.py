"""A run redone after a crash does not ask another agent again what an earlier try of it already asked
(docs/ARCHITECTURE.md, "Delegation threads" and "Durability contract")."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from tenex_daemon import MemoryStore, NostrEvent
from tenex_daemon.adapters.nostr import signer
from tenex_daemon.core.llm import BackendError, CompletionRequest, CompletionResult, LLMBackend
from tenex_daemon.core.vocabulary import KIND_STOP, TAG_DELEGATION
from tenex_daemon.services.agent_runner import AgentProfile
from tenex_daemon.services.tools import SEND_MESSAGE
from tenex_daemon.testing import FakeClock
from tenex_daemon.testing.fakes import ScriptedBackend
from tests import pipeline
from tests.conftest import Cast
from tests.unit.services.test_tool_loop import calls, text

QUESTION = "What is 2+2?"


class SigningTime:
    """The signer's clock (``created_at``): ``step`` seconds later at each signature (0: standing still,
    so two identical requests are one event id); it starts after the people's messages are dated (a reply
    to a message dated later is dated just after it)."""

    def __init__(self) -> None:
        self.now = 1_700_100_000.0
        self.step = 1.0

    def time(self) -> float:
        """The next signature's time."""
        self.now += self.step
        return self.now


@pytest.fixture(autouse=True)
def signing_time(monkeypatch: pytest.MonkeyPatch) -> SigningTime:
    """Every event signed here a second after the one before (deterministic ids, no real waits)."""
    clock = SigningTime()
    monkeypatch.setattr(signer, "time", clock)
    return clock


def ask(call_id: str, message: str = QUESTION) -> CompletionResult:
    """A model answer calling send_message to Bob once."""
    return calls((call_id, SEND_MESSAGE, {"to": "bob", "message": message}))


class AskThenCrash:
    """Alice's first try: asks Bob (each of ``questions`` in turn), then hangs as if the process died
    before her reply was saved."""

    name = "ask-then-crash"

    def __init__(self, *questions: str) -> None:
        self.questions = list(questions)
        self.hanging = asyncio.Event()

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Ask the next question, then hang for ever."""
        if self.questions:
            return ask(f"c{len(self.questions)}", self.questions.pop(0))
        self.hanging.set()
        await asyncio.Event().wait()
        raise AssertionError("never answers")


class HoldBob:
    """Bob's first answer never comes: the process dies while he answers."""

    name = "held-bob"

    def __init__(self) -> None:
        self.requests: list[CompletionRequest] = []
        self.asked = asyncio.Event()

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Record the request and hang for ever."""
        self.requests.append(request)
        self.asked.set()
        await asyncio.Event().wait()
        raise AssertionError("never answers")


def profiles(cast: Cast, alice: LLMBackend, bob: LLMBackend) -> dict[str, AgentProfile]:
    """Alice and Bob thinking through the given backends (the orchestrator never runs here)."""
    return {
        "alice": AgentProfile(cast.alice, "", alice),
        "bob": AgentProfile(cast.bob, "", bob),
        "orchestrator": AgentProfile(cast.orchestrator, "", ScriptedBackend([])),
    }


@contextlib.asynccontextmanager
async def crashed(first: pipeline.Rig, *, run_journaled: bool = False) -> AsyncIterator[None]:
    """The first process is dead: its journal stays (with ``run_journaled``, once it names the run, not
    only the dispatch of its trigger), its hanging tasks are cancelled only at the end."""
    await first.scheduler.journaled()
    key = first.scheduler.journal_key
    async with asyncio.timeout(5):
        while run_journaled and "agent_slug" not in (await first.store.get_meta(key) or ""):  # noqa: ASYNC110 - polls a stored value
            await asyncio.sleep(0.05)
    zombies = first.scheduler._tasks.snapshot()
    try:
        yield
    finally:
        for task in zombies:
            task.cancel()
        for task in zombies:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def redo(cast: Cast, store: MemoryStore, clock: FakeClock, alice: LLMBackend, bob: LLMBackend) -> pipeline.Rig:
    """Start a second process over the same store and redo the journaled runs; wait for them."""
    clock.advance(60_000)
    restarted = pipeline.build_rig(
        cast, profiles=profiles(cast, alice, bob), store=store, clock=clock, composer=pipeline.real_composer(cast)
    )
    runs = await restarted.scheduler.recover()
    dispatches = await restarted.dispatcher.stored_dispatches(restarted.scheduler.dispatches_to_redo())
    for event_id in dispatches:
        await restarted.dispatcher.redispatch(event_id)
    assert runs or dispatches
    await restarted.settle()
    return restarted


async def start(cast: Cast, store: MemoryStore, clock: FakeClock, alice: LLMBackend, bob: LLMBackend) -> tuple[
    pipeline.Rig, NostrEvent
]:
    """The first process: the user asks Alice, whose run is journaled."""
    first = pipeline.build_rig(
        cast, profiles=profiles(cast, alice, bob), store=store, clock=clock, composer=pipeline.real_composer(cast)
    )
    root = cast.user_says("Alice, ask Bob.", kind=11, tags=[["p", cast.alice.pubkey]])
    await first.dispatcher.handle(root)
    return first, root


async def delegation_events(rig: pipeline.Rig, root: NostrEvent) -> list[tuple[str, str]]:
    """The (author, content) of every send_message event in the conversation's history."""
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    return [(e.pubkey, e.content) for e in conversation.history if e.tag_value(TAG_DELEGATION)]


async def thread_items(rig: pipeline.Rig, root: NostrEvent) -> list[tuple[str, str]]:
    """The (from, content) of the pair thread's items, as a fresh process loads them."""
    thread = await rig.pipeline.threads.get_thread(root.id, "alice", "bob")
    return [(item["from"], item["content"]) for item in thread.items]


@pytest.mark.parametrize("run_journaled", [True, False], ids=["run-journaled", "dispatch-journaled"])
async def test_a_redone_run_gets_the_saved_answer_and_bob_is_not_asked_again(
    cast: Cast, run_journaled: bool
) -> None:
    """Alice's run asked Bob and died before her reply (the run journaled, or only its trigger's dispatch);
    redone, her model asks the same again: Bob's saved answer is the tool result, Bob's model is not run
    again, and history and thread hold the exchange once."""
    store, clock = MemoryStore(), FakeClock()
    bob = ScriptedBackend([text("4")])
    alice = AskThenCrash(QUESTION)
    first, root = await start(cast, store, clock, alice, bob)
    await asyncio.wait_for(alice.hanging.wait(), 5)
    async with crashed(first, run_journaled=run_journaled):
        alice_again = ScriptedBackend([ask("c1"), text("Bob says 4.")])
        restarted = await redo(cast, store, clock, alice_again, bob)

        assert len(bob.requests) == 1
        [result] = alice_again.tool_results()
        assert (result.content, result.is_error) == ("4", False)
        assert await delegation_events(restarted, root) == [(cast.alice.pubkey, QUESTION), (cast.bob.pubkey, "4")]
        assert await thread_items(restarted, root) == [("alice", QUESTION), ("bob", "4")]
        conversation = await restarted.manager.get_conversation(root.id)
        assert conversation is not None
        assert conversation.history[-1].content == "Bob says 4."


async def test_a_request_saved_without_its_answer_is_answered_without_a_second_request(cast: Cast) -> None:
    """The process died while Bob answered: redone, Bob is asked once more and his answer replies to the
    request saved before, which is not saved a second time."""
    store, clock = MemoryStore(), FakeClock()
    held = HoldBob()
    alice = AskThenCrash(QUESTION)
    first, root = await start(cast, store, clock, alice, held)
    await asyncio.wait_for(held.asked.wait(), 5)
    async with crashed(first):
        bob = ScriptedBackend([text("4")])
        alice_again = ScriptedBackend([ask("c1"), text("Bob says 4.")])
        restarted = await redo(cast, store, clock, alice_again, bob)

        assert len(bob.requests) == 1
        assert [m.content for m in bob.requests[0].messages] == [QUESTION]
        assert alice_again.tool_results()[0].content == "4"
        assert await delegation_events(restarted, root) == [(cast.alice.pubkey, QUESTION), (cast.bob.pubkey, "4")]
        conversation = await restarted.manager.get_conversation(root.id)
        assert conversation is not None
        request, answer = [e for e in conversation.history if e.tag_value(TAG_DELEGATION)]
        assert answer.tag_values("e") == [request.id]
        assert await thread_items(restarted, root) == [("alice", QUESTION), ("bob", "4")]


async def test_a_redone_run_takes_each_saved_request_once_and_asks_anew_past_them(cast: Cast) -> None:
    """The first try asked Bob the same question twice (two requests, two answers); the redo asking it three
    times gets the two saved answers in order and asks Bob only the third time."""
    store, clock = MemoryStore(), FakeClock()
    bob = ScriptedBackend([text("first 4"), text("second 4")])
    alice = AskThenCrash(QUESTION, QUESTION)
    first, root = await start(cast, store, clock, alice, bob)
    await asyncio.wait_for(alice.hanging.wait(), 5)
    async with crashed(first):
        bob.script = [text("third 4")]
        alice_again = ScriptedBackend([ask("c1"), ask("c2"), ask("c3"), text("4, thrice.")])
        restarted = await redo(cast, store, clock, alice_again, bob)

        assert [r.content for r in alice_again.tool_results()] == ["first 4", "second 4", "third 4"]
        assert len(bob.requests) == 3
        contents = [content for _, content in await delegation_events(restarted, root)]
        assert contents == [QUESTION, "first 4", QUESTION, "second 4", QUESTION, "third 4"]
        assert [content for _, content in await thread_items(restarted, root)] == contents


async def test_a_live_run_asking_the_same_twice_asks_twice(cast: Cast) -> None:
    """A run (not redone) whose model asks Bob the same question twice, a second apart, runs Bob twice: an
    exchange the run itself made is never taken for a later call."""
    bob = ScriptedBackend([text("4"), text("still 4")])
    alice = ScriptedBackend([ask("c1"), ask("c2"), text("Done.")])
    rig = pipeline.build_rig(cast, profiles=profiles(cast, alice, bob), composer=pipeline.real_composer(cast))
    root = cast.user_says("Alice, ask Bob twice.", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await rig.settle()

    assert len(bob.requests) == 2
    assert [r.content for r in alice.tool_results()] == ["4", "still 4"]
    assert len(await delegation_events(rig, root)) == 4


async def test_two_identical_requests_in_one_second_are_one_exchange_in_history_and_thread(
    cast: Cast, signing_time: SigningTime
) -> None:
    """Alice's model asks Bob the same question twice within one second (the same event id): Bob is asked
    once, both calls get his answer, and history and thread both hold the exchange once."""
    signing_time.step = 0
    bob = ScriptedBackend([text("4"), text("unused")])
    alice = ScriptedBackend([calls(("c1", SEND_MESSAGE, {"to": "bob", "message": QUESTION}),
                                   ("c2", SEND_MESSAGE, {"to": "bob", "message": QUESTION})), text("Done.")])
    rig = pipeline.build_rig(cast, profiles=profiles(cast, alice, bob), composer=pipeline.real_composer(cast))
    root = cast.user_says("Alice, ask Bob.", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await rig.settle()

    assert len(bob.requests) == 1
    assert [(r.content, r.is_error) for r in alice.tool_results()] == [("4", False), ("4", False)]
    assert await delegation_events(rig, root) == [(cast.alice.pubkey, QUESTION), (cast.bob.pubkey, "4")]
    assert await thread_items(rig, root) == [("alice", QUESTION), ("bob", "4")]


async def test_a_crash_just_after_bobs_answer_is_saved_keeps_his_tokens_counted_once(cast: Cast) -> None:
    """The process dies right after Bob's answer is saved in history: his token usage was saved before it, so
    the redo, which takes the saved answer without asking him again, leaves his tokens counted once."""
    store, clock = MemoryStore(), FakeClock()
    bob = ScriptedBackend([text("4")])
    alice = AskThenCrash(QUESTION)
    first, root = await start(cast, store, clock, alice, bob)
    add_event = first.manager.add_event
    died = asyncio.Event()

    async def die_after_bobs_answer(conversation_id: str, event: NostrEvent, **options: bool) -> bool:
        added = await add_event(conversation_id, event, **options)
        if event.pubkey == cast.bob.pubkey:
            died.set()
            await asyncio.Event().wait()  # the process is gone: nothing after this write happens
        return added

    first.manager.add_event = die_after_bobs_answer  # type: ignore[method-assign]
    await asyncio.wait_for(died.wait(), 5)
    async with crashed(first):
        alice_again = ScriptedBackend([ask("c1"), text("Bob says 4.")])
        restarted = await redo(cast, store, clock, alice_again, bob)

        assert len(bob.requests) == 1
        conversation = await restarted.manager.get_conversation(root.id)
        assert conversation is not None
        bob_state = conversation.agent_states["bob"]
        assert (bob_state.prompt_tokens, bob_state.completion_tokens) == (10, 5)


async def test_an_exchange_a_crash_kept_out_of_the_thread_is_in_the_next_ones_context(cast: Cast) -> None:
    """The process dies after Bob's answer is saved and before the pair's thread is; the redo of Alice's run,
    shown his answer, replies without asking again; a later exchange shows Bob the lost one first, and the
    stored thread holds both, in order."""
    store, clock = MemoryStore(), FakeClock()
    alice = AskThenCrash(QUESTION)
    first, root = await start(cast, store, clock, alice, ScriptedBackend([text("4")]))
    add_event = first.manager.add_event
    died = asyncio.Event()

    async def die_after_bobs_answer(conversation_id: str, event: NostrEvent, **options: bool) -> bool:
        added = await add_event(conversation_id, event, **options)
        if event.pubkey == cast.bob.pubkey:
            died.set()
            await asyncio.Event().wait()  # the process is gone: the thread is never saved
        return added

    first.manager.add_event = die_after_bobs_answer  # type: ignore[method-assign]
    await asyncio.wait_for(died.wait(), 5)
    async with crashed(first):
        await redo(cast, store, clock, ScriptedBackend([text("Bob says 4.")]), ScriptedBackend([]))
    clock.advance(1_000)
    bob = ScriptedBackend([text("6")])
    alice_later = ScriptedBackend([ask("c2", "And 3+3?"), text("6")])
    later = pipeline.build_rig(
        cast, profiles=profiles(cast, alice_later, bob), store=store, clock=clock,
        composer=pipeline.real_composer(cast),
    )
    again = cast.user_says("Now 3+3.", tags=[["E", root.id, "", root.pubkey], ["p", cast.alice.pubkey]])
    await later.dispatcher.handle(again)
    await later.settle()

    [request] = bob.requests
    assert [(m.role, m.content) for m in request.messages] == [
        ("user", QUESTION), ("assistant", "4"), ("user", "And 3+3?")
    ]
    assert await thread_items(later, root) == [
        ("alice", QUESTION), ("bob", "4"), ("alice", "And 3+3?"), ("bob", "6")
    ]


class FailsThenHolds:
    """Bob: his first answer fails (the backend's error), his second hangs until a stop cancels it, later
    ones say ``6``."""

    name = "fails-then-holds"

    def __init__(self) -> None:
        self.requests: list[CompletionRequest] = []
        self.holding = asyncio.Event()

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Fail, then hang, then answer."""
        self.requests.append(request)
        if len(self.requests) == 1:
            raise BackendError("rate_limit", "429 Too Many Requests")
        if len(self.requests) == 2:
            self.holding.set()
            await asyncio.Event().wait()
        return text("6")


async def test_a_failed_or_stopped_exchange_is_not_taken_into_the_thread(cast: Cast) -> None:
    """A request whose answer failed (an error reply saved) and one whose answer a stop cancelled (none
    saved) stay out of the thread: the next exchange, in a later run, shows Bob only its own request."""
    bob = FailsThenHolds()
    alice = ScriptedBackend(
        [ask("c1", "Fails?"), ask("c2", "Hangs?"), text("Without Bob."), ask("c3", "And 3+3?"), text("6")]
    )
    rig = pipeline.build_rig(cast, profiles=profiles(cast, alice, bob), composer=pipeline.real_composer(cast))
    root = cast.user_says("Alice, ask Bob.", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(bob.holding.wait(), 5)
    await rig.dispatcher.handle(
        cast.factory.event(cast.user, "", kind=KIND_STOP, tags=[["e", root.id], ["p", cast.bob.pubkey]])
    )
    await rig.quiet()
    await rig.dispatcher.handle(
        cast.user_says("Try again.", tags=[["E", root.id, "", root.pubkey], ["p", cast.alice.pubkey]])
    )
    await rig.settle()

    assert len(bob.requests) == 3
    assert [m.content for m in bob.requests[-1].messages] == ["And 3+3?"]
    assert [content for _, content in await delegation_events(rig, root)][-2:] == ["And 3+3?", "6"]
    assert await thread_items(rig, root) == [("alice", "And 3+3?"), ("bob", "6")]
