"""The owner's delete and archive landing while work on the conversation is under way (a run waiting on its
model, the orchestrator deciding): what can no longer be saved is abandoned at once and quietly, not tried
again for 26 minutes as a store gone for a moment, with the model asked again at each try and the run
journal holding the conversation busy meanwhile."""

from __future__ import annotations

import asyncio

import structlog.testing

from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.llm import CompletionResult, ToolCall
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
