"""Delegation with `send_message`: agent A asks agent B in their own persisted thread, scripted backends."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tenex_daemon import ConversationManager, MemoryStore, NostrEvent
from tenex_daemon.adapters.llm.offline import OfflineBackend
from tenex_daemon.adapters.storage.filesystem import FileSystemStore
from tenex_daemon.core.agents import AgentDirectory
from tenex_daemon.core.budget import BudgetStrategy, TokenBudget
from tenex_daemon.core.context import ChatMessage
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.llm import (
    AssistantToolCalls,
    BackendError,
    CompletionRequest,
    CompletionResult,
    LLMBackend,
    ToolResult,
)
from tenex_daemon.core.ports import RunStatus, Store
from tenex_daemon.core.targeting import SkipReason, agent_chain_length, choose_target
from tenex_daemon.core.vocabulary import KIND_STOP, TAG_DELEGATION
from tenex_daemon.services import runs
from tenex_daemon.services.agent_runner import AgentProfile, AgentRunner
from tenex_daemon.services.delegation import DELEGATED_TOOLS
from tenex_daemon.services.dispatcher import EventDispatcher, Outcome
from tenex_daemon.services.runs import RunRequest, RunScheduler
from tenex_daemon.services.threads import META_PREFIX, ThreadManager
from tenex_daemon.services.tools import MAX_MESSAGES_SENT, SEND_MESSAGE
from tenex_daemon.testing.fakes import FakePublisher, RunLog, ScriptedBackend
from tests import pipeline
from tests.conftest import Cast
from tests.unit.services.test_live_status import StatusLog
from tests.unit.services.test_tool_loop import calls, text


@dataclass
class Rig:
    """The daemon's services over one store, with Alice and Bob thinking through their own scripted backends."""

    store: Store
    manager: ConversationManager
    threads: ThreadManager
    runner: AgentRunner
    scheduler: RunScheduler
    dispatcher: EventDispatcher
    publisher: FakePublisher
    alice: ScriptedBackend
    bob: ScriptedBackend
    runs: list[RunRequest]


def make_rig(
    cast: Cast,
    alice: ScriptedBackend,
    bob: ScriptedBackend | None = None,
    *,
    store: Store | None = None,
    delegation: bool = True,
    agents: list[str] | None = None,
    orchestrator: ScriptedBackend | None = None,
    budgets: dict[str, TokenBudget] | None = None,
    status: RunStatus | None = None,
) -> Rig:
    """The daemon's pipeline (build_pipeline); ``delegation=False`` runs a bare runner without threads
    (the one case production never builds: it is the runner's own option)."""
    store = MemoryStore() if store is None else store
    chosen = [a for a in cast.agents if agents is None or a.slug in agents]
    bob = bob or ScriptedBackend([text("Bob here.")])
    backends: dict[str, LLMBackend] = {
        "alice": alice,
        "bob": bob,
        "orchestrator": orchestrator or OfflineBackend(),
    }
    profiles = {
        a.slug: AgentProfile(
            a, f"Persona of {a.name}.", backends[a.slug], budget=(budgets or {}).get(a.slug)
        )
        for a in chosen
    }
    log = RunLog()
    base = pipeline.build_rig(
        cast,
        profiles=profiles,
        agents=chosen,
        store=store,
        composer=pipeline.real_composer(cast),
        observer=log,
        hop_limit=6,
        status=status,
    )
    runner = base.runner
    if not delegation:
        runner = AgentRunner(base.manager, profiles, pipeline.real_composer(cast), base.publisher)
    threads = base.pipeline.threads
    return Rig(
        store, base.manager, threads, runner, base.scheduler, base.dispatcher, base.publisher, alice, bob, log.runs
    )


async def settle(rig: Rig) -> None:
    """Wait for every scheduled run and every publication (the scheduler accepts no more runs after)."""
    await rig.scheduler.drain(10.0)
    await rig.runner.flush(10.0)


def ask(call_id: str, to: str, message: str) -> CompletionResult:
    """A backend answer calling send_message once."""
    return calls((call_id, SEND_MESSAGE, {"to": to, "message": message}))


async def start(rig: Rig, cast: Cast, content: str = "Alice, find out 2+2 from Bob.") -> NostrEvent:
    """The user starts a conversation addressed to Alice; wait for everything it causes."""
    root = cast.user_says(content, kind=11, tags=[["p", cast.alice.pubkey]])
    result = await rig.dispatcher.handle(root)
    assert result.outcome is Outcome.SCHEDULED
    await settle(rig)
    return root


async def say_to_alice(rig: Rig, cast: Cast, root: NostrEvent, content: str) -> NostrEvent:
    """The user replies in the conversation, addressing Alice; wait for everything it causes."""
    event = cast.user_says(content, tags=[["E", root.id, "", root.pubkey], ["p", cast.alice.pubkey]])
    result = await rig.dispatcher.handle(event)
    assert result.outcome is Outcome.SCHEDULED
    await settle(rig)
    return event


def tool_result(backend: ScriptedBackend, request: int = -1) -> ToolResult:
    """The single tool result in one of the backend's requests."""
    [result] = [m for m in backend.requests[request].messages if isinstance(m, ToolResult)]
    return result


def offered(request: CompletionRequest) -> set[str]:
    """The names of the tools offered in a request."""
    return {spec.name for spec in request.tools}


async def test_asked_agent_sees_only_the_pair_thread_and_its_answer_is_the_tool_result(cast: Cast) -> None:
    """B's backend gets B's persona and only A's request, none of the conversation; its answer is A's tool result right after A's call."""
    rig = make_rig(
        cast,
        ScriptedBackend([ask("c1", "bob", "What is 2+2?"), text("Bob says 4.")]),
        ScriptedBackend([text("4, of course.")]),
    )
    root = cast.user_says("SECRET-ROOT question for Alice", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.manager.create_conversation(root)
    await rig.manager.add_event(root.id, cast.user_says("SECRET-NOTE from the user", tags=[["E", root.id]]))
    await rig.manager.add_event(root.id, cast.bob_says("SECRET-BOB said in the chat", tags=[["E", root.id]]))
    trigger = cast.user_says("Ask Bob, please.", tags=[["E", root.id], ["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(trigger)
    await settle(rig)

    [bob_request] = rig.bob.requests
    assert list(bob_request.messages) == [ChatMessage("user", "What is 2+2?")]
    assert bob_request.system_prompt.startswith(
        AgentProfile(cast.bob, "Persona of Bob.", rig.bob).system_prompt
    )
    assert "Alice (alice)" in bob_request.system_prompt
    seen = bob_request.system_prompt + json.dumps([str(m) for m in bob_request.messages])
    assert "SECRET" not in seen
    assert "Ask Bob" not in seen
    assert offered(bob_request) == set(DELEGATED_TOOLS)
    first, second = rig.alice.requests
    assert SEND_MESSAGE in offered(first)
    added = list(second.messages[len(first.messages) :])
    assert len(added) == 2
    call, result = added
    assert isinstance(call, AssistantToolCalls)
    assert [c.id for c in call.tool_calls] == ["c1"]
    assert isinstance(result, ToolResult)
    assert (result.tool_call_id, result.content, result.is_error) == ("c1", "4, of course.", False)
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert conversation.history[-1].content == "Bob says 4."


async def test_exchange_is_published_signed_and_addressed_and_runs_nobody(cast: Cast) -> None:
    """A's request (signed by A, p-tagging B) and B's answer (signed by B, p-tagging A) are saved and published, tagged with the thread; B's tokens count as B's, only A's run happened and the relay echoes are duplicates."""
    rig = make_rig(
        cast,
        ScriptedBackend([ask("c1", "bob", "What is 2+2?"), text("Bob says 4.")]),
        ScriptedBackend([text("4")]),
    )

    root = await start(rig, cast)

    thread_id = ThreadManager.key(root.id, "alice", "bob")
    request, answer, reply = rig.publisher.published
    assert (request.pubkey, request.content) == (cast.alice.pubkey, "What is 2+2?")
    assert request.tag_values("p") == [cast.bob.pubkey]
    assert request.tag_values("e") == [root.id]
    assert (answer.pubkey, answer.content) == (cast.bob.pubkey, "4")
    assert answer.tag_values("p") == [cast.alice.pubkey]
    assert answer.tag_values("e") == [request.id]
    assert request.tag_values("delegation") == answer.tag_values("delegation") == [thread_id]
    assert not answer.has_tag("error", "system")
    assert (reply.pubkey, reply.content) == (cast.alice.pubkey, "Bob says 4.")
    assert reply.tag_values("p") == [cast.user.pubkey]
    assert reply.tag_values("delegation") == []
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert [e.id for e in conversation.history] == [root.id, request.id, answer.id, reply.id]
    bob_state = conversation.agent_states["bob"]
    assert (bob_state.prompt_tokens, bob_state.completion_tokens) == (10, 5)  # B's usage counts as B's
    assert [(r.agent_slug, r.trigger_id) for r in rig.runs] == [("alice", root.id)]
    assert len(rig.bob.requests) == 1
    for echo in (request, answer, reply):
        assert (await rig.dispatcher.handle(echo)).outcome is Outcome.DUPLICATE
    await settle(rig)
    assert len(rig.runs) == 1


async def test_a_delegation_event_never_targets_an_agent_even_when_new(cast: Cast) -> None:
    """An event tagged ["delegation", id] that is new to this daemon is stored with reason `delegation`, and runs nobody."""
    first = make_rig(
        cast, ScriptedBackend([ask("c1", "bob", "Hi Bob"), text("done")]), ScriptedBackend([text("Hi Alice")])
    )
    root = await start(first, cast)
    request, answer, _ = first.publisher.published
    other = make_rig(cast, ScriptedBackend([text("unused")]), ScriptedBackend([text("unused")]))
    await other.manager.create_conversation(root)

    outcomes = [await other.dispatcher.handle(event) for event in (request, answer)]
    await settle(other)

    assert [(o.outcome, o.reason) for o in outcomes] == [(Outcome.STORED, SkipReason.DELEGATION.value)] * 2
    assert choose_target(answer, other.manager.agents).skip is SkipReason.DELEGATION
    assert other.runs == []
    assert other.alice.requests == other.bob.requests == []


async def test_the_thread_survives_a_restart_and_the_second_exchange_sees_the_first(
    cast: Cast, tmp_path: Path
) -> None:
    """After a restart (new store, manager, threads and runner over the same files) B's context holds the first exchange, then the new request."""
    store = FileSystemStore(tmp_path / "home")
    await store.open()
    rig = make_rig(
        cast,
        ScriptedBackend([ask("c1", "bob", "First question"), text("ok")]),
        ScriptedBackend([text("First answer")]),
        store=store,
    )
    root = await start(rig, cast)
    await store.close()

    reopened = FileSystemStore(tmp_path / "home")
    await reopened.open()
    again = make_rig(
        cast,
        ScriptedBackend([ask("c2", "bob", "Second question"), text("ok again")]),
        ScriptedBackend([text("Second answer")]),
        store=reopened,
    )
    await say_to_alice(again, cast, root, "Ask Bob again.")

    [bob_request] = again.bob.requests
    assert list(bob_request.messages) == [
        ChatMessage("user", "First question"),
        ChatMessage("assistant", "First answer"),
        ChatMessage("user", "Second question"),
    ]
    assert tool_result(again.alice).content == "Second answer"
    thread_id = ThreadManager.key(root.id, "alice", "bob")
    stored = json.loads(await reopened.get_meta(META_PREFIX + thread_id) or "{}")
    assert [(i["from"], i["content"]) for i in stored["items"]] == [
        ("alice", "First question"),
        ("bob", "First answer"),
        ("alice", "Second question"),
        ("bob", "Second answer"),
    ]
    await reopened.close()


async def test_the_pair_shares_one_thread_whichever_side_asks(cast: Cast) -> None:
    """When B later asks A, A sees the same thread with the roles turned: B's messages as user, its own as assistant."""
    rig = make_rig(
        cast,
        ScriptedBackend([ask("c1", "bob", "Alice asks"), text("ok")]),
        ScriptedBackend([text("Bob answers")]),
    )
    root = await start(rig, cast)
    rig.alice.script = [text("Alice answers back")]
    rig.alice.requests.clear()
    rig.bob.requests.clear()
    rig.bob.script = [ask("c2", "alice", "Bob asks"), text("thanks")]
    event = cast.user_says("Bob, check with Alice.", tags=[["E", root.id], ["p", cast.bob.pubkey]])
    await rig.manager.add_event(root.id, event)
    await rig.runner.run(RunRequest(root.id, event.id, "bob"))
    await rig.runner.flush(5.0)

    [alice_request] = rig.alice.requests
    assert list(alice_request.messages) == [
        ChatMessage("assistant", "Alice asks"),
        ChatMessage("user", "Bob answers"),
        ChatMessage("user", "Bob asks"),
    ]
    assert tool_result(rig.bob).content == "Alice answers back"


async def test_unknown_agent_oneself_orchestrator_and_blank_message_are_refused(cast: Cast) -> None:
    """Asking an unknown slug (the error lists who can be asked), oneself, the orchestrator or with a blank message is an error result; nothing is published or run."""
    rig = make_rig(
        cast,
        ScriptedBackend(
            [
                calls(
                    ("u", SEND_MESSAGE, {"to": "carol", "message": "hi"}),
                    ("s", SEND_MESSAGE, {"to": "alice", "message": "hi"}),
                    ("o", SEND_MESSAGE, {"to": "orchestrator", "message": "hi"}),
                    ("b", SEND_MESSAGE, {"to": "bob", "message": "   "}),
                ),
                text("I will answer myself."),
            ]
        ),
    )

    await start(rig, cast)

    results = [m for m in rig.alice.requests[-1].messages if isinstance(m, ToolResult)]
    assert [(r.tool_call_id, r.is_error) for r in results] == [
        ("u", True),
        ("s", True),
        ("o", True),
        ("b", True),
    ]
    unknown, itself, orchestrator, blank = (r.content for r in results)
    assert "carol" in unknown
    assert "bob (Bob)" in unknown
    assert "orchestrator" not in unknown.split("you can ask:")[1]
    assert "yourself" in itself
    assert "routes the conversation" in orchestrator
    assert "message" in blank
    assert rig.bob.requests == []
    [reply] = rig.publisher.published
    assert reply.content == "I will answer myself."


async def test_a_failing_backend_is_a_tool_error_and_the_thread_is_unchanged(cast: Cast) -> None:
    """When B's backend fails, A's tool result is an error saying what failed, B's error answer is published, and the thread stays empty."""

    class Failing(ScriptedBackend):
        async def complete(self, request: CompletionRequest) -> CompletionResult:
            self.requests.append(request)
            raise BackendError("rate_limit", "429 Too Many Requests")

    rig = make_rig(
        cast, ScriptedBackend([ask("c1", "bob", "Help?"), text("Bob is unavailable.")]), Failing([])
    )

    root = await start(rig, cast)

    result = tool_result(rig.alice)
    assert result.is_error
    assert "bob could not answer (rate_limit)" in result.content
    assert "429 Too Many Requests" in result.content
    request, answer, reply = rig.publisher.published
    assert answer.pubkey == cast.bob.pubkey
    assert answer.has_tag("error", "system")
    assert answer.tag_values("e") == [request.id]
    assert reply.content == "Bob is unavailable."
    thread = await ThreadManager(store=rig.store).get_thread(root.id, "alice", "bob")
    assert thread.items == []
    assert len(rig.runs) == 1


async def test_the_asked_agent_is_not_offered_send_message_and_calling_it_is_refused(cast: Cast) -> None:
    """A delegated run has no send_message: B's attempt is an unknown-tool error, so delegation never recurses."""
    rig = make_rig(
        cast,
        ScriptedBackend([ask("c1", "bob", "Ask Alice for me"), text("ok")]),
        ScriptedBackend([ask("c2", "alice", "Looping back"), text("I cannot ask others here.")]),
    )

    await start(rig, cast)

    first, _ = rig.bob.requests
    assert SEND_MESSAGE not in offered(first)
    refused = tool_result(rig.bob)
    assert refused.is_error
    assert "unknown tool 'send_message'" in refused.content
    assert tool_result(rig.alice).content == "I cannot ask others here."
    assert len(rig.alice.requests) == 2  # Alice's run only: the loop-back never reached her backend


async def test_send_message_is_offered_only_when_someone_can_be_asked(cast: Cast) -> None:
    """No ThreadManager, a lone agent, or the orchestrator: send_message is not offered; with Alice and Bob it is."""
    without = make_rig(cast, ScriptedBackend([text("hi")]), delegation=False)
    lone_root = cast.user_says("Hi", kind=11, tags=[["p", cast.alice.pubkey]])
    await without.manager.create_conversation(lone_root)
    await without.runner.run(RunRequest(lone_root.id, lone_root.id, "alice"))  # the bare runner
    alone = make_rig(cast, ScriptedBackend([text("hi")]), agents=["alice", "orchestrator"])
    await start(alone, cast)
    orchestrator_backend = ScriptedBackend([text("routing")])
    both = make_rig(cast, ScriptedBackend([text("hi")]), orchestrator=orchestrator_backend)
    await start(both, cast)
    root = cast.user_says("Route me", kind=11)
    await both.manager.create_conversation(root)
    await both.runner.run(RunRequest(root.id, root.id, "orchestrator"))
    await both.runner.flush(5.0)

    assert SEND_MESSAGE not in offered(without.alice.requests[0])
    assert SEND_MESSAGE not in offered(alone.alice.requests[0])
    assert SEND_MESSAGE in offered(both.alice.requests[0])
    assert SEND_MESSAGE not in offered(orchestrator_backend.requests[0])


def test_delegation_events_are_not_hops(cast: Cast) -> None:
    """The agent chain behind the hop limit passes over delegation events without counting them."""
    directory = AgentDirectory(cast.agents, cast.project.pubkey)
    tag = ["delegation", "c__alice__bob"]
    history = [
        cast.user_says("start"),
        cast.alice_says("asks", tags=[tag]),
        cast.bob_says("answers", tags=[tag]),
        cast.alice_says("reply"),
    ]

    assert agent_chain_length(history, directory) == 1
    assert agent_chain_length([*history, cast.bob_says("more")], directory) == 2


def test_a_persons_delegation_tag_does_not_silence_the_agents(cast: Cast) -> None:
    """Only an agent's event tagged ["delegation", id] runs nobody; a person's message with the tag is answered."""
    directory = AgentDirectory(cast.agents, cast.project.pubkey)
    tagged = cast.user_says("hi", tags=[["p", cast.bob.pubkey], ["delegation", "x__alice__bob"]])
    assert choose_target(tagged, directory).agent == cast.bob


async def test_a_delegated_run_over_budget_keeps_the_request_and_the_conversation_summary(cast: Cast) -> None:
    """Bob, asked over a summarizing budget, slides the window of his thread instead (his conversation
    summary is never replaced by one of the thread) and always keeps Alice's request."""
    long = "words " * 120
    alice = ScriptedBackend([ask("c1", "bob", long), ask("c2", "bob", long), ask("c3", "bob", "Last one?"), text("ok")])
    bob = ScriptedBackend([text("Answer " + long)])
    rig = make_rig(cast, alice, bob, budgets={"bob": TokenBudget(200, BudgetStrategy.SUMMARIZE)})

    root = await start(rig, cast)

    last = bob.requests[-1]
    assert isinstance(last.messages[-1], ChatMessage)
    assert last.messages[-1].content == "Last one?"
    assert any(
        isinstance(m, ChatMessage) and m.content.startswith("[Note:") for m in last.messages
    ), "the thread was cut with the sliding window's note"
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert conversation.agent_state("bob").summary is None


class HeldBackend(ScriptedBackend):
    """Holds every answer until it is cancelled; says whether it was."""

    def __init__(self) -> None:
        super().__init__([])
        self.asked = asyncio.Event()
        self.cancelled = False

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Wait for ever (until cancelled)."""
        self.requests.append(request)
        self.asked.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        raise AssertionError("never answers")


async def test_a_stop_naming_the_asked_agent_cancels_its_answer_and_the_asker_goes_on(cast: Cast) -> None:
    """While Bob answers Alice's send_message, the live status names him too; a stop (24134) naming Bob
    cancels his answer: nothing of it is saved or published, the stop names Bob, the person is told
    "Stopped: Bob.", and Alice's tool call is refused, so she answers without him."""
    bob = HeldBackend()
    status = StatusLog()
    alice = ScriptedBackend([ask("c1", "bob", "What is 2+2?"), text("Bob was stopped; it is 4.")])
    rig = make_rig(cast, alice, bob, status=status)
    root = cast.user_says("Alice, find out 2+2 from Bob.", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(bob.asked.wait(), 5)
    for _ in range(100):
        if any(cast.bob.pubkey in agents for *_, agents in status.sent):
            break
        await asyncio.sleep(0.01)
    assert any(set(agents) == {cast.alice.pubkey, cast.bob.pubkey} for *_, agents in status.sent)

    stop = cast.factory.event(cast.user, "", kind=KIND_STOP, tags=[["e", root.id], ["p", cast.bob.pubkey]])
    result = await rig.dispatcher.handle(stop)
    await settle(rig)

    assert result.agents == ("bob",)
    assert bob.cancelled
    assert tool_result(rig.alice).is_error
    assert "bob was stopped" in tool_result(rig.alice).content
    request, notice, reply = rig.publisher.published
    assert request.tag_value("delegation") is not None
    assert (notice.pubkey, notice.content) == (cast.bob.pubkey, "Stopped: Bob.")
    assert (reply.pubkey, reply.content) == (cast.alice.pubkey, "Bob was stopped; it is 4.")
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert [e.pubkey for e in conversation.history if e.has_tag("delegation")] == [cast.alice.pubkey]
    assert status.sent[-1][3] == ()  # nobody works once it is over



async def test_an_agent_stopped_while_answering_is_not_asked_again_in_the_same_run(cast: Cast) -> None:
    """Bob is stopped while he answers Alice; her model asks him again in the same run: the call is refused
    (he was stopped), his model is not run again and nothing more of his is saved or published after the
    notice (a person's later message is a trigger after the stop: stopped_since lets it through)."""
    bob = HeldBackend()
    alice = ScriptedBackend([
        ask("c1", "bob", "What is 2+2?"), ask("c2", "bob", "What is 2+2? Again."), text("Without Bob: 4."),
    ])
    rig = make_rig(cast, alice, bob)
    root = cast.user_says("Alice, find out 2+2 from Bob.", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(bob.asked.wait(), 5)
    stop = cast.factory.event(cast.user, "", kind=KIND_STOP, tags=[["e", root.id], ["p", cast.bob.pubkey]])
    await rig.dispatcher.handle(stop)
    await settle(rig)

    assert len(bob.requests) == 1
    results = [m for m in rig.alice.requests[-1].messages if isinstance(m, ToolResult)]
    assert [r.is_error for r in results] == [True, True]
    assert "bob was stopped" in results[1].content
    bobs = [e.content for e in rig.publisher.published if e.pubkey == cast.bob.pubkey]
    assert bobs == ["Stopped: Bob."]


async def test_a_stop_does_not_name_an_answer_already_in(cast: Cast) -> None:
    """An answer whose model call is over (the asker about to get it) is not stopped: the stop neither
    cancels nor names it, so it is never both delivered and reported stopped."""
    from tenex_daemon.services.delegation import _Answering

    rig = make_rig(cast, ScriptedBackend([text("unused")]))
    delegation = rig.runner.delegation
    assert delegation is not None
    done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    done.set_result((text("4"), None))
    working: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    delegation._answering.extend([
        _Answering(RunRequest("c", "t", "bob"), done), _Answering(RunRequest("c", "t", "bob"), working)
    ])

    stopped = delegation.stop_answers("c", "bob")

    assert stopped == [RunRequest("c", "t", "bob")]
    assert working.cancelled()
    assert not done.cancelled()


async def test_one_reply_asks_other_agents_at_most_max_messages_sent_times(cast: Cast) -> None:
    """A model asking Bob MAX_MESSAGES_SENT + 2 times in one round runs Bob MAX_MESSAGES_SENT times; the
    calls past the cap are refused with why, and the run still answers."""
    many = MAX_MESSAGES_SENT + 2
    questions: list[tuple[str, str, dict[str, object]]] = [
        (f"c{i}", SEND_MESSAGE, {"to": "bob", "message": f"Question {i}?"}) for i in range(many)
    ]
    asked = calls(*questions)
    bob = ScriptedBackend([text(f"Answer {i}.") for i in range(MAX_MESSAGES_SENT)])
    rig = make_rig(cast, ScriptedBackend([asked, text("Done asking.")]), bob)
    await start(rig, cast)

    assert len(bob.requests) == MAX_MESSAGES_SENT
    results = [m for m in rig.alice.requests[-1].messages if isinstance(m, ToolResult)]
    assert [r.is_error for r in results] == [False] * MAX_MESSAGES_SENT + [True, True]
    assert f"already asked other agents {MAX_MESSAGES_SENT} times" in results[-1].content
    alices = [e.content for e in rig.publisher.published if e.pubkey == cast.alice.pubkey]
    assert alices[-1] == "Done asking."


async def test_calls_refused_before_anyone_is_asked_do_not_count_toward_the_cap(cast: Cast) -> None:
    """MAX_MESSAGES_SENT calls naming an unknown agent, refused before anyone is asked, leave the reply's
    whole cap: the next call asks Bob and gets his answer."""
    refused: list[tuple[str, str, dict[str, object]]] = [
        (f"x{i}", SEND_MESSAGE, {"to": "bobb", "message": "hi"}) for i in range(MAX_MESSAGES_SENT)
    ]
    unknown = calls(*refused)
    bob = ScriptedBackend([text("4")])
    rig = make_rig(cast, ScriptedBackend([unknown, ask("g", "bob", "2+2?"), text("done")]), bob)

    await start(rig, cast)

    assert len(bob.requests) == 1
    results = [m for m in rig.alice.requests[-1].messages if isinstance(m, ToolResult)]
    assert [r.is_error for r in results] == [True] * MAX_MESSAGES_SENT + [False]
    assert (results[-1].tool_call_id, results[-1].content) == ("g", "4")


class GatedAsker(ScriptedBackend):
    """Alice: her first model call waits until the test releases it, then asks Bob; then she answers."""

    def __init__(self) -> None:
        super().__init__([ask("c1", "bob", "2+2?"), text("done")])
        self.waiting = asyncio.Event()
        self.release = asyncio.Event()

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Hold the first call until released."""
        if not self.requests:
            self.waiting.set()
            await self.release.wait()
        return await super().complete(request)


async def test_an_exchange_during_a_run_does_not_reopen_a_conversation_the_owner_ended(cast: Cast) -> None:
    """The owner ends the conversation while Alice thinks; her send_message exchange is then saved but does
    not reopen it: it stays ended by the owner."""
    alice = GatedAsker()
    rig = make_rig(cast, alice, ScriptedBackend([text("4")]))
    root = cast.user_says("hi", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(alice.waiting.wait(), 5)
    await rig.manager.end_conversation(root.id, by="owner", reason="done for today")
    alice.release.set()
    await settle(rig)

    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert [e.content for e in conversation.history if e.has_tag("delegation")] == ["2+2?", "4"]
    assert conversation.is_ended
    assert conversation.ended_by == "owner"


class FailsAlicesReplyOnce(MemoryStore):
    """A store that fails the first save of a reply of Alice's (not a delegation's side) as a full disk does."""

    def __init__(self, alice: str) -> None:
        super().__init__()
        self.alice = alice
        self.failed = asyncio.Event()

    async def append_event(
        self, conversation_id: str, event: NostrEvent, *, state: Conversation | None = None
    ) -> bool:
        """Fail once for Alice's reply."""
        if event.pubkey == self.alice and event.tag_value(TAG_DELEGATION) is None and not self.failed.is_set():
            self.failed.set()
            raise OSError("No space left on device")
        return await super().append_event(conversation_id, event, state=state)


async def test_a_run_retried_with_a_message_that_came_meanwhile_does_not_ask_bob_again(
    cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alice asked Bob, then her reply failed to save; the person wrote again before the retry, which takes
    that message in (a burst: its trigger is the newer message). Asking Bob the same, the retry gets his
    saved answer: Bob is asked once, and the exchange is once in history and in the pair's thread."""
    monkeypatch.setattr(runs, "RUN_RETRY_S", (0.5,))
    store = FailsAlicesReplyOnce(cast.alice.pubkey)
    alice = ScriptedBackend([ask("c1", "bob", "What is 2+2?"), text("It is 4."),
                             ask("c2", "bob", "What is 2+2?"), text("It is 4. Hi!")])
    rig = make_rig(cast, alice, ScriptedBackend([text("4"), text("4 again")]), store=store)
    root = cast.user_says("Alice, find out 2+2 from Bob.", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(store.failed.wait(), 5)
    later = cast.user_says("Also, hi.", tags=[["E", root.id, "", root.pubkey], ["p", cast.alice.pubkey]])

    await rig.dispatcher.handle(later)
    await settle(rig)

    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    exchange = [e.content for e in conversation.history if e.tag_value(TAG_DELEGATION) is not None]
    thread = await rig.threads.get_thread(root.id, "alice", "bob")
    assert len(rig.bob.requests) == 1
    assert exchange == ["What is 2+2?", "4"]
    assert [item["content"] for item in thread.items] == ["What is 2+2?", "4"]
    assert conversation.history[-1].content == "It is 4. Hi!"
