"""A run's working time is added with its reply (``ExecutionTime.add_run``), not by marking the conversation
active in the store: a run longer than the 30-minute stale window keeps its time, and a crash followed by a
quick restart does not count the downtime (docs/ARCHITECTURE.md, "Execution time")."""

from __future__ import annotations

import asyncio
import contextlib

from tenex_daemon import MemoryStore
from tenex_daemon.core.llm import CompletionRequest, CompletionResult, LLMBackend
from tenex_daemon.services.agent_runner import AgentProfile
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.testing import FakeClock
from tenex_daemon.testing.fakes import StuckBackend
from tests import pipeline
from tests.conftest import Cast

MINUTE_MS = 60_000


class SlowModel:
    """A model that takes ``minutes`` of the fake clock to answer."""

    name = "slow"

    def __init__(self, clock: FakeClock, minutes: int) -> None:
        self.clock = clock
        self.minutes = minutes

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Move the clock on by the time the answer takes, then answer."""
        self.clock.advance(self.minutes * MINUTE_MS)
        return CompletionResult(text=f"Took {self.minutes} minutes.", model="slow")


def rig_with(cast: Cast, model: LLMBackend, store: MemoryStore, clock: FakeClock) -> pipeline.Rig:
    """The daemon's pipeline on ``store`` and ``clock``; every agent thinks through ``model``."""
    profiles = {a.slug: AgentProfile(a, "", model) for a in cast.agents}
    return pipeline.build_rig(cast, profiles=profiles, store=store, clock=clock)


async def test_a_45_minute_run_adds_2700_seconds(cast: Cast) -> None:
    """A run longer than the 30-minute stale window adds all of its 45 minutes (2,700 s) with its reply."""
    store, clock = MemoryStore(), FakeClock()
    rig = rig_with(cast, SlowModel(clock, 45), store, clock)
    root = cast.user_says("Think hard", kind=11, tags=[["p", cast.alice.pubkey]])

    await rig.dispatcher.handle(root)
    await rig.settle()

    assert await rig.manager.execution_seconds(root.id) == 2700
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert [e.pubkey for e in conversation.history] == [cast.user.pubkey, cast.alice.pubkey]


class SteppedClockModel:
    """A model that takes two minutes to answer, while the wall clock is set by ``step_ms``."""

    name = "stepped"

    def __init__(self, clock: FakeClock, step_ms: int) -> None:
        self.clock = clock
        self.step_ms = step_ms

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Two minutes pass; the wall clock is set meanwhile; then answer."""
        self.clock.advance(MINUTE_MS)
        self.clock.step(self.step_ms)
        self.clock.advance(MINUTE_MS)
        return CompletionResult(text="Done.", model="stepped")


async def test_a_wall_clock_set_during_a_run_neither_adds_nor_takes_off_working_time(cast: Cast) -> None:
    """Two-minute runs during which the wall clock is set a day ahead, then an hour back (NTP, a person),
    add 120 s each: a run's time is measured on the monotonic clock, not the wall clock."""
    store, clock = MemoryStore(), FakeClock()
    ahead = rig_with(cast, SteppedClockModel(clock, 24 * 60 * MINUTE_MS), store, clock)
    root = cast.user_says("Think", kind=11, tags=[["p", cast.alice.pubkey]])
    await ahead.dispatcher.handle(root)
    await ahead.settle()
    after_ahead = await ahead.manager.execution_seconds(root.id)
    back = rig_with(cast, SteppedClockModel(clock, -60 * MINUTE_MS), store, clock)
    await back.dispatcher.handle(cast.user_says("Again", kind=1111, tags=[["E", root.id], ["p", cast.alice.pubkey]]))
    await back.settle()

    assert after_ahead == 120
    assert await back.manager.execution_seconds(root.id) == 240


async def test_a_crashed_run_redone_after_a_restart_counts_only_the_redone_run(cast: Cast) -> None:
    """A run cut off by a crash counts nothing; after a restart 20 minutes later (within the stale window)
    the redone 1-minute run adds 60 s: neither the lost run nor the downtime is counted."""
    store, clock = MemoryStore(), FakeClock()
    stuck = StuckBackend()
    first = rig_with(cast, stuck, store, clock)
    root = cast.user_says("Think hard", kind=11, tags=[["p", cast.alice.pubkey]])
    await first.dispatcher.handle(root)
    await asyncio.wait_for(stuck.asked.wait(), 5)
    await first.scheduler.journaled()
    # The crash: the first process writes nothing more (its stuck run is left as it is until the end).
    zombies = first.scheduler._tasks.snapshot()
    try:
        clock.advance(20 * MINUTE_MS)
        restarted = rig_with(cast, SlowModel(clock, 1), store, clock)
        await restarted.scheduler.recover()  # as the daemon starts: journaled runs, then dispatches
        redo = await restarted.dispatcher.stored_dispatches(restarted.scheduler.dispatches_to_redo())
        results = [await restarted.dispatcher.redispatch(event_id) for event_id in redo]
        await restarted.settle()

        assert [r.agents for r in results] == [("alice",)]
        assert await restarted.manager.execution_seconds(root.id) == 60
    finally:
        for task in zombies:
            task.cancel()
        for task in zombies:
            with contextlib.suppress(asyncio.CancelledError):
                await task


class WallOnlyClock:
    """A library user's clock from before ``Clock.monotonic_ms``: the wall clock alone."""

    def now_ms(self) -> int:
        """The wall clock in milliseconds."""
        return 1_700_000_000_000


async def test_a_clock_without_a_monotonic_reading_still_times_runs(cast: Cast) -> None:
    """A manager given a clock with ``now_ms`` alone (written before the monotonic reading existed) times a
    run that failed on the system's monotonic clock instead of failing: its time is counted (0 s here)."""
    manager = ConversationManager(MemoryStore(), cast.agents, cast.project.pubkey, clock=WallOnlyClock())  # type: ignore[arg-type]
    root = cast.user_says("Think", kind=11, tags=[["p", cast.alice.pubkey]])
    await manager.create_conversation(root)

    await manager.add_run_time(root.id, manager.run_clock_ms())

    assert await manager.execution_seconds(root.id) == 0
