"""The service tests' pipeline: built by the daemon's own composition root (``build_pipeline``) with the
fakes of ``tenex_daemon.testing.fakes`` at the Nostr edge and scripted language models."""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from tenex_daemon import ConversationManager, MemoryStore
from tenex_daemon.adapters.llm.offline import OfflineBackend
from tenex_daemon.adapters.nostr.classifier import classify_event
from tenex_daemon.adapters.nostr.composer import SignedReplyComposer
from tenex_daemon.app.wiring import (
    OrchestratorFactory,
    Pipeline,
    PipelineOptions,
    PipelinePorts,
    build_pipeline,
)
from tenex_daemon.core.agents import Agent
from tenex_daemon.core.llm import LLMBackend
from tenex_daemon.core.phases import PhaseRules
from tenex_daemon.core.ports import (
    EventFetcher,
    EventResolver,
    PartialTextPublisher,
    PeerMessages,
    Peers,
    ProfileNames,
    ReplyComposer,
    RunStatus,
    Store,
)
from tenex_daemon.services.agent_runner import (
    DEFAULT_PARTIAL_INTERVAL_S,
    AgentProfile,
    AgentRunner,
    RunObserver,
)
from tenex_daemon.services.conversation_manager import DEFAULT_TASK_SESSION_TTL_H
from tenex_daemon.services.dispatcher import EventDispatcher, ReplyObserver
from tenex_daemon.services.lifecycle import DEFAULT_IDLE_TIMEOUT_MIN
from tenex_daemon.services.routing_limits import DEFAULT_TURN_LIMIT
from tenex_daemon.services.runs import PENDING_RUNS_KEY, RunScheduler
from tenex_daemon.services.tools import ToolRegistry
from tenex_daemon.testing import FakeClock, KeyPair
from tenex_daemon.testing.fakes import FakePublisher, PlainComposer, signers_for
from tests.conftest import Cast


@dataclass(frozen=True)
class Rig:
    """The production pipeline over a store, with the fakes a test inspects."""

    pipeline: Pipeline
    store: Store
    publisher: FakePublisher
    clock: FakeClock

    @property
    def manager(self) -> ConversationManager:
        """The pipeline's conversation manager."""
        return self.pipeline.manager

    @property
    def runner(self) -> AgentRunner:
        """The pipeline's agent runner."""
        return self.pipeline.runner

    @property
    def dispatcher(self) -> EventDispatcher:
        """The pipeline's event dispatcher."""
        return self.pipeline.dispatcher

    @property
    def scheduler(self) -> RunScheduler:
        """The dispatcher's run scheduler."""
        return self.pipeline.scheduler

    async def settle(self, timeout_s: float = 10.0) -> None:
        """Wait for every scheduled run to finish and its reply to be published (the scheduler then
        accepts no more runs: the end of a test)."""
        await self.scheduler.drain(timeout_s)
        await self.runner.flush(timeout_s)

    async def quiet(self, timeout_s: float = 10.0) -> None:
        """Wait until no run is scheduled or running and the replies are published; runs are still
        accepted afterwards (a test that goes on)."""
        async with asyncio.timeout(timeout_s):
            while self.scheduler.in_flight:  # noqa: ASYNC110 (a test helper polling a counter)
                await asyncio.sleep(0.002)
        await self.runner.flush(timeout_s)


def cast_keys(cast: Cast) -> dict[str, KeyPair]:
    """The cast's agent key pairs by slug."""
    return {"alice": cast.alice_keys, "bob": cast.bob_keys, "orchestrator": cast.orchestrator_keys}


def real_composer(cast: Cast) -> ReplyComposer:
    """The daemon's reply composer (every tag of a real reply) over the cast's agent keys."""
    return SignedReplyComposer(signers_for(cast_keys(cast)), None)


def build_rig(
    cast: Cast,
    *,
    backend: LLMBackend | None = None,
    profiles: Mapping[str, AgentProfile] | None = None,
    agents: list[Agent] | None = None,
    store: Store | None = None,
    composer: ReplyComposer | None = None,
    publisher: FakePublisher | None = None,
    partials: PartialTextPublisher | None = None,
    resolver: EventResolver | None = None,
    names: ProfileNames | None = None,
    fetcher: EventFetcher | None = None,
    observer: RunObserver | None = None,
    reply_observer: ReplyObserver | None = None,
    status: RunStatus | None = None,
    clock: FakeClock | None = None,
    orchestrator: OrchestratorFactory | None = None,
    tools: ToolRegistry | None = None,
    owner: str | None = None,
    whitelist: Collection[str] = (),
    whitelist_may_join: bool = False,
    default_agent: str | None = "alice",
    hop_limit: int = 3,
    turn_limit: int = DEFAULT_TURN_LIMIT,
    max_concurrent_runs: int = 4,
    journal_key: str = PENDING_RUNS_KEY,
    typing_delay_s: float = 0.0,
    partial_interval_s: float = DEFAULT_PARTIAL_INTERVAL_S,
    max_tool_rounds: int = 8,
    phase_rules: PhaseRules | None = None,
    idle_timeout_min: float = DEFAULT_IDLE_TIMEOUT_MIN,
    task_session_ttl_h: float = DEFAULT_TASK_SESSION_TTL_H,
    messages: PeerMessages | None = None,
    peers: Peers | None = None,
    instance: str = "",
) -> Rig:
    """Build the daemon's pipeline for the cast (every agent thinks through ``backend`` unless
    ``profiles`` are given), with fake Nostr I/O; the user is the owner unless ``owner`` says otherwise."""
    chosen_agents = agents if agents is not None else cast.agents
    if profiles is None:
        model: LLMBackend = backend if backend is not None else OfflineBackend()
        profiles = {a.slug: AgentProfile(a, f"You are {a.name}.", model) for a in chosen_agents}
    the_store = store if store is not None else MemoryStore()
    the_publisher = publisher if publisher is not None else FakePublisher()
    the_clock = clock if clock is not None else FakeClock()
    ports = PipelinePorts(
        store=the_store,
        composer=composer if composer is not None else PlainComposer(cast_keys(cast)),
        publisher=the_publisher,
        classify=classify_event,
        partials=partials,
        resolver=resolver,
        names=names,
        fetcher=fetcher,
        clock=the_clock,
        observer=observer,
        reply_observer=reply_observer,
        status=status,
        messages=messages,
        peers=peers,
    )
    options = PipelineOptions(
        owner=owner if owner is not None else cast.user.pubkey,
        project_pubkey=cast.project.pubkey,
        whitelist=whitelist,
        whitelist_may_join=whitelist_may_join,
        default_agent=default_agent,
        hop_limit=hop_limit,
        turn_limit=turn_limit,
        max_concurrent_runs=max_concurrent_runs,
        journal_key=journal_key,
        typing_delay_s=typing_delay_s,
        partial_interval_s=partial_interval_s,
        max_tool_rounds=max_tool_rounds,
        phase_rules=phase_rules,
        idle_timeout_min=idle_timeout_min,
        task_session_ttl_h=task_session_ttl_h,
        instance=instance,
    )
    pipeline = build_pipeline(chosen_agents, profiles, ports, options, orchestrator=orchestrator, tools=tools)
    return Rig(pipeline, the_store, the_publisher, the_clock)
