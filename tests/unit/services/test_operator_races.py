"""The owner's delete and archive landing while work on the conversation is under way (a run waiting on its
model, the orchestrator deciding): what can no longer be saved is abandoned at once and quietly, not tried
again for 26 minutes as a store gone for a moment, with the model asked again at each try and the run
journal holding the conversation busy meanwhile."""

from __future__ import annotations

import asyncio

import structlog.testing

from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.llm import CompletionRequest, CompletionResult, ToolCall
from tenex_daemon.core.vocabulary import TOOL_COMPLETE
from tenex_daemon.services.agent_runner import AgentProfile
from tenex_daemon.services.orchestrator import RoutingDecision
from tenex_daemon.services.runs import PENDING_RUNS_KEY
from tenex_daemon.testing.fakes import ScriptedBackend
from tests import pipeline
from tests.conftest import Cast
from tests.unit.services.test_bursts import GatedBackend

RETRIED = {"run_failed", "run_retry", "run_dropped", "dispatch_retry", "run_time_not_saved"}
"""What a store gone for a moment logs: none of it is right for a conversation the owner deleted."""


class HeldRouting:
    """An orchestrator routing the person's first message to Alice at once, or (``hold_first``) only once
    released; any later decision (where Alice's completion goes) waits for ``release`` too, then names Bob."""

    def __init__(self, *, hold_first: bool) -> None:
        self.hold_first = hold_first
        self.routings = 0
        self.deciding = asyncio.Event()
        self.release = asyncio.Event()

    async def route(self, conversation: Conversation, trigger: NostrEvent) -> RoutingDecision:
        """Route as the class says."""
        self.routings += 1
        if self.routings == 1 and not self.hold_first:
            return RoutingDecision(("alice",), "first")
        self.deciding.set()
        await self.release.wait()
        return RoutingDecision(("alice",) if self.routings == 1 else ("bob",), "decided")


async def test_a_conversation_deleted_while_its_agent_answers_ends_the_run_quietly(cast: Cast) -> None:
    """Deleted while Alice's model is answering: her run ends when the answer comes (nothing published, the
    journal empty), with no failure, retry or traceback logged."""
    backend = GatedBackend()
    rig = pipeline.build_rig(cast, backend=backend)
    root = cast.user_says("first", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(backend.asked.wait(), 5)

    with structlog.testing.capture_logs() as logs:
        assert await rig.manager.delete_conversation(root.id)
        backend.release.set()
        await rig.quiet(timeout_s=5)
        await rig.scheduler.journaled()

    assert rig.publisher.published == []
    assert len(backend.requests) == 1
    assert not [e["event"] for e in logs if e["event"] in RETRIED or e.get("log_level") == "error"]
    assert [e["reason"] for e in logs if e["event"] == "run_abandoned"] == [f"conversation {root.id} not found"]


async def test_a_conversation_archived_while_the_orchestrator_decides_runs_nobody(cast: Cast) -> None:
    """The owner archives a conversation while the orchestrator decides who answers its first message: the
    run it asks for is abandoned before the model is asked (its answer could not be saved), nothing is
    tried again and the journal holds nothing."""
    routing = HeldRouting(hold_first=True)
    alice = ScriptedBackend([CompletionResult(text="never")])
    profiles = {"alice": AgentProfile(cast.alice, "", alice), "bob": AgentProfile(cast.bob, "", alice)}
    rig = pipeline.build_rig(cast, profiles=profiles, orchestrator=lambda manager: routing, hop_limit=6)
    root = cast.user_says("Build it", kind=11)
    handled = asyncio.create_task(rig.dispatcher.handle(root))
    await asyncio.wait_for(routing.deciding.wait(), 5)

    with structlog.testing.capture_logs() as logs:
        assert await rig.manager.archive_conversation(root.id, ending_by="owner")
        routing.release.set()
        await handled
        await rig.quiet(timeout_s=5)
        await asyncio.sleep(1.2)  # the run journal's flush of finished runs
        await rig.scheduler.journaled()

    assert alice.requests == []
    assert await rig.store.get_meta(PENDING_RUNS_KEY) == "[]"
    assert not [e["event"] for e in logs if e["event"] in RETRIED]
    assert [e["reason"] for e in logs if e["event"] == "run_abandoned"] == ["archived"]


async def test_a_conversation_deleted_while_a_completion_is_routed_is_not_dispatched_again(cast: Cast) -> None:
    """Deleted while the orchestrator decides where Alice's completion goes: the dispatch ends at once as
    the conversation deleted (it was tried again for 26 minutes on an AssertionError, holding a lane and the
    run), Bob is not run, and the journal ends empty."""
    routing = HeldRouting(hold_first=False)
    completes = CompletionResult(text="", tool_calls=(ToolCall("c1", TOOL_COMPLETE, {"summary": "done"}),))
    alice = ScriptedBackend([completes])
    bob = ScriptedBackend([CompletionResult(text="bob answers")])
    profiles = {"alice": AgentProfile(cast.alice, "", alice), "bob": AgentProfile(cast.bob, "", bob)}
    rig = pipeline.build_rig(
        cast, profiles=profiles, composer=pipeline.real_composer(cast), orchestrator=lambda manager: routing,
        hop_limit=6,
    )
    root = cast.user_says("Build it", kind=11)
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(routing.deciding.wait(), 5)

    with structlog.testing.capture_logs() as logs:
        assert await rig.manager.delete_conversation(root.id)
        routing.release.set()
        await rig.quiet(timeout_s=5)
        await asyncio.sleep(1.2)
        await rig.scheduler.journaled()

    assert bob.requests == []
    assert await rig.store.get_meta(PENDING_RUNS_KEY) == "[]"
    assert not [e["event"] for e in logs if e["event"] in RETRIED]
    assert [e["reason"] for e in logs if e["event"] == "dispatch_abandoned"] == ["conversation_deleted"]


class SessionBackend:
    """Answers "answer N" to its Nth call with session ``session-N``; call number ``held`` (the second by
    default) waits for ``release``."""

    name = "sessions"

    def __init__(self, held: int = 2) -> None:
        self.held = held
        self.requests: list[CompletionRequest] = []
        self.asked_second = asyncio.Event()
        self.release = asyncio.Event()

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Answer, holding the second call until released."""
        self.requests.append(request)
        number = len(self.requests)
        if number == self.held:
            self.asked_second.set()
            await self.release.wait()
        return CompletionResult(text=f"answer {number}", model="sessions", session_id=f"session-{number}")


async def test_a_reset_while_the_agent_answers_stands_when_that_answer_is_saved(cast: Cast) -> None:
    """The owner resets the agents while Alice answers a second message: saving that answer keeps the reset
    (no index, session or transitions written back over it), so her next run starts a fresh session, where
    it used to continue the session from before the reset."""
    backend = SessionBackend()
    rig = pipeline.build_rig(cast, backend=backend)
    root = cast.user_says("secret plan A", kind=11, tags=[["p", cast.alice.pubkey]])
    thread = [["E", root.id, "", root.pubkey], ["K", "11"], ["e", root.id], ["p", cast.alice.pubkey]]
    await rig.dispatcher.handle(root)
    await rig.quiet()
    await rig.dispatcher.handle(cast.user_says("second", tags=thread))
    await asyncio.wait_for(backend.asked_second.wait(), 5)

    assert await rig.manager.reset_agent_states(root.id) == ["alice"]
    backend.release.set()
    await rig.quiet()
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    state = conversation.agent_states["alice"]
    after_the_save = (state.last_processed_index, state.session_id, conversation.agent_resets)
    await rig.dispatcher.handle(cast.user_says("third", tags=thread))
    await rig.quiet()

    assert after_the_save == (0, None, 1)
    assert [request.session_id for request in backend.requests] == [None, "session-1", None]
    assert [e.content for e in rig.publisher.published] == ["answer 1", "answer 2", "answer 3"]


async def test_a_reset_during_an_agents_first_run_stands_too(cast: Cast) -> None:
    """The owner resets the agents while Alice answers her first message in the conversation (she has no
    state yet, so the reset names nobody): saving that answer keeps the reset all the same, and her next run
    starts a fresh session."""
    backend = SessionBackend(held=1)
    rig = pipeline.build_rig(cast, backend=backend)
    root = cast.user_says("secret plan A", kind=11, tags=[["p", cast.alice.pubkey]])
    thread = [["E", root.id, "", root.pubkey], ["K", "11"], ["e", root.id], ["p", cast.alice.pubkey]]
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(backend.asked_second.wait(), 5)

    assert await rig.manager.reset_agent_states(root.id) == []
    backend.release.set()
    await rig.quiet()
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    state = conversation.agent_states["alice"]
    after_the_save = (state.last_processed_index, state.session_id)
    await rig.dispatcher.handle(cast.user_says("second", tags=thread))
    await rig.quiet()

    assert after_the_save == (0, None)
    assert [request.session_id for request in backend.requests] == [None, None]
