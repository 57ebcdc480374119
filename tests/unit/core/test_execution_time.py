"""Execution time: rounding, totals, and the stale-session reset of docs/ARCHITECTURE.md ("Execution time")."""

from __future__ import annotations

from tenex_daemon import ConversationManager
from tenex_daemon.core.execution_time import ExecutionTime
from tenex_daemon.testing import FakeClock
from tests.conftest import Cast

T0 = 1_700_000_000_000


def test_five_seconds_gives_five() -> None:
    """A 5 s session adds 5 seconds."""
    timer = ExecutionTime()
    timer.start(T0)
    assert timer.stop(T0 + 5_000) == 5
    assert timer.total_seconds == 5


def test_ten_plus_five_gives_fifteen() -> None:
    """Two sessions of 10 s and 5 s total 15."""
    timer = ExecutionTime()
    timer.start(T0)
    timer.stop(T0 + 10_000)
    timer.start(T0 + 20_000)
    timer.stop(T0 + 25_000)
    assert timer.total_seconds == 15


def test_stop_while_inactive_adds_nothing() -> None:
    """Stopping when no session is active returns 0 and changes nothing."""
    timer = ExecutionTime()
    assert timer.stop(T0) == 0
    assert timer.total_seconds == 0


def test_start_while_active_is_a_no_op() -> None:
    """A second start keeps the first session's start time."""
    timer = ExecutionTime()
    timer.start(T0)
    timer.start(T0 + 3_000)
    assert timer.stop(T0 + 4_000) == 4


def test_rounding_is_half_up() -> None:
    """1,499 ms adds 1; a further 1,500 ms adds 2, for a total of 3."""
    timer = ExecutionTime()
    timer.start(T0)
    assert timer.stop(T0 + 1_499) == 1
    timer.start(T0 + 10_000)
    assert timer.stop(T0 + 11_500) == 2
    assert timer.total_seconds == 3


def test_total_includes_the_live_session() -> None:
    """total() counts an active session up to now."""
    timer = ExecutionTime(total_seconds=10)
    timer.start(T0)
    assert timer.total(T0 + 7_000) == 17


def test_one_year_is_31_536_000_seconds() -> None:
    """A 365-day session adds 31,536,000 seconds."""
    timer = ExecutionTime()
    timer.start(T0)
    assert timer.stop(T0 + 365 * 24 * 3600 * 1000) == 31_536_000


def test_stale_session_is_reset_and_fresh_one_kept() -> None:
    """A session idle 45 minutes is dropped; one idle 10 minutes is kept."""
    stale = ExecutionTime()
    stale.start(T0)
    fresh = ExecutionTime()
    fresh.start(T0)

    assert stale.reset_if_stale(T0 + 45 * 60 * 1000) is True
    assert fresh.reset_if_stale(T0 + 10 * 60 * 1000) is False
    assert not stale.is_active
    assert stale.total_seconds == 0
    assert fresh.is_active


async def test_manager_resets_a_stale_session_on_load(
    manager: ConversationManager, cast: Cast, clock: FakeClock
) -> None:
    """Loading a conversation whose session was orphaned 45 minutes ago resets it; 10 minutes is kept."""
    stale_id = (await manager.create_conversation(cast.user_says("a", kind=11))).id
    await manager.start_execution(stale_id)
    clock.advance(45 * 60 * 1000)
    fresh_id = (await manager.create_conversation(cast.user_says("b", kind=11))).id
    await manager.start_execution(fresh_id)
    clock.advance(10 * 60 * 1000)

    stale = await manager.get_conversation(stale_id)
    fresh = await manager.get_conversation(fresh_id)

    assert stale is not None
    assert not stale.execution_time.is_active
    assert stale.execution_time.total_seconds == 0
    assert fresh is not None
    assert fresh.execution_time.is_active
    assert await manager.execution_seconds(fresh_id) == 600


async def test_manager_start_stop_adds_rounded_seconds(
    manager: ConversationManager, cast: Cast, clock: FakeClock
) -> None:
    """start_execution / stop_execution through the manager add the rounded elapsed seconds."""
    cid = (await manager.create_conversation(cast.user_says("a", kind=11))).id
    await manager.start_execution(cid)
    clock.advance(1_499)
    assert await manager.stop_execution(cid) == 1
    assert await manager.stop_execution(cid) == 0
    assert await manager.execution_seconds(cid) == 1
