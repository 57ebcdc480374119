"""Retention and a wall clock that jumps forward (docs/ARCHITECTURE.md, "Conversation lifecycle"): a step is
not time that passed, so the daemon's sweeps hold off for an hour after one; a machine waking from sleep
(the boot clock counts the sleep) is time that passed, and the sweep acts on it."""

from __future__ import annotations

import json
from collections.abc import Callable

from structlog.testing import capture_logs

from tenex_daemon import MemoryStore
from tenex_daemon.core.search import SearchQuery
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.services.retention import (
    STEP_HOLD_S,
    STEP_KEY,
    STEP_KEY_PREFIX,
    RetentionPolicy,
    Sweeper,
    WallClockSteps,
)
from tenex_daemon.testing import FakeClock
from tests.conftest import Cast

DAY_MS = 86_400_000


class BootClock:
    """Seconds since boot, moved on by hand."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        """The boot clock's reading."""
        return self.now


async def setting(cast: Cast) -> tuple[ConversationManager, FakeClock, BootClock, Sweeper]:
    """A manager holding one active and one ended conversation, and a sweeper deleting ended conversations
    inactive for a year (``delete_after_days``) and ending those idle for 30 minutes, that has swept once."""
    clock, boot = FakeClock(), BootClock()
    manager = ConversationManager(
        MemoryStore(), cast.agents, cast.project.pubkey, clock=clock, owner_pubkey=cast.user.pubkey
    )
    await manager.create_conversation(cast.user_says("still talking", kind=11))
    ended = await manager.create_conversation(cast.user_says("done", kind=11))
    await manager.end_conversation(ended.id, by="owner")
    policy = RetentionPolicy(archive_after_days=None, delete_after_days=365, max_retained=1000)
    sweeper = Sweeper(manager, policy, clock_steps=WallClockSteps(boot=boot))
    await sweeper.sweep_once()
    return manager, clock, boot, sweeper


async def test_a_clock_set_a_year_ahead_by_mistake_ends_and_deletes_nothing_for_an_hour(cast: Cast) -> None:
    """The wall clock jumps a year ahead while the machine counts a minute: the sweep ends nothing and deletes
    nothing (``wall_clock_step``, ``retention_held``), nor does the next one within the hour; once the hour
    has passed on the boot clock with the wall clock still ahead, the sweep acts by it."""
    manager, clock, boot, sweeper = await setting(cast)
    clock.advance(366 * DAY_MS)
    boot.now += 60

    with capture_logs() as logs:
        held = await sweeper.sweep_once()
    clock.advance(300_000)
    boot.now += 300
    again = await sweeper.sweep_once()

    assert (held.ended_idle, held.deleted, again.ended_idle, again.deleted) == (0, 0, 0, 0)
    assert {"wall_clock_step", "retention_held"} <= {entry["event"] for entry in logs}
    assert len(await manager.store.search(SearchQuery())) == 2
    clock.advance(int(STEP_HOLD_S * 1000))
    boot.now += STEP_HOLD_S
    later = await sweeper.sweep_once()
    assert (later.ended_idle, later.deleted) == (1, 2)  # both a year idle by it: ended, then deleted


async def test_a_machine_waking_after_hours_of_sleep_ends_its_idle_conversations(cast: Cast) -> None:
    """Eight hours pass on the wall clock and on the boot clock alike (a suspended machine wakes): no step,
    the sweep ends the conversation idle since."""
    _, clock, boot, sweeper = await setting(cast)
    clock.advance(8 * 3_600_000)
    boot.now += 8 * 3_600

    report = await sweeper.sweep_once()

    assert report.ended_idle == 1


async def test_a_daemon_restarted_on_the_same_boot_still_sees_a_step_and_a_hold_under_way() -> None:
    """The wall clock less the boot clock is kept per boot: a new daemon on the same boot compares its first
    sweep with the last one before (a year's step is seen), and one restarted during the hold keeps holding;
    on another boot (another id) the wall clock a year past every boot's last sweep holds too (below)."""
    store, boot = MemoryStore(), BootClock()
    first = WallClockSteps(store, boot=boot, read_boot_id=lambda: "boot-a")
    assert not await first.holding(1_800_000_000_000)

    boot.now += 60
    restarted = WallClockSteps(store, boot=boot, read_boot_id=lambda: "boot-a")
    assert await restarted.holding(1_800_000_000_000 + 366 * DAY_MS)
    boot.now += 600
    again = WallClockSteps(store, boot=boot, read_boot_id=lambda: "boot-a")
    assert await again.holding(1_800_000_000_000 + 366 * DAY_MS + 660_000)
    other_boot = WallClockSteps(store, boot=BootClock(), read_boot_id=lambda: "boot-b")
    assert await other_boot.holding(1_800_000_000_000 + 400 * DAY_MS)


async def test_a_machine_booted_with_its_clock_a_year_ahead_deletes_nothing_at_its_first_sweep(cast: Cast) -> None:
    """The machine reboots five minutes after the last sweep, its wall clock a year ahead until NTP sets it:
    the new boot's first sweep has no sweep of its own to compare, but the wall clock is far past the last
    sweep any boot recorded, so it holds (``wall_clock_unchecked``) and ends, archives and deletes nothing
    (before, it deleted both conversations); NTP sets the clock back, and once the hour is over the sweeps act by
    the right clock (the active conversation an hour idle is ended; nothing is deleted)."""
    clock, store = FakeClock(), MemoryStore()
    manager = ConversationManager(store, cast.agents, cast.project.pubkey, clock=clock, owner_pubkey=cast.user.pubkey)
    await manager.create_conversation(cast.user_says("still talking", kind=11))
    ended = await manager.create_conversation(cast.user_says("done", kind=11))
    await manager.end_conversation(ended.id, by="owner")
    policy = RetentionPolicy(archive_after_days=30, delete_after_days=180, max_retained=1000)
    first_boot = Sweeper(manager, policy, clock_steps=WallClockSteps(store, boot=BootClock(), read_boot_id=boot_id("a")))
    await first_boot.sweep_once()

    clock.advance(300_000 + 365 * DAY_MS)
    boot = BootClock()
    second_boot = Sweeper(manager, policy, clock_steps=WallClockSteps(store, boot=boot, read_boot_id=boot_id("b")))
    with capture_logs() as logs:
        report = await second_boot.sweep_once()

    assert (report.ended_idle, report.archived, report.deleted) == (0, 0, 0)
    assert "wall_clock_unchecked" in {entry["event"] for entry in logs}
    clock.advance(-365 * DAY_MS + int(STEP_HOLD_S * 1000))
    boot.now += STEP_HOLD_S
    set_back = await second_boot.sweep_once()
    assert (set_back.ended_idle, set_back.deleted, len(await store.search(SearchQuery()))) == (1, 0, 2)


async def test_a_boot_minutes_after_the_last_sweep_sweeps_at_once() -> None:
    """A reboot that took minutes: the new boot's wall clock is close to the last sweep recorded, so its first
    sweep acts (no hold after every restart)."""
    store = MemoryStore()
    assert not await WallClockSteps(store, boot=BootClock(), read_boot_id=boot_id("a")).holding(1_800_000_000_000)

    rebooted = WallClockSteps(store, boot=BootClock(), read_boot_id=boot_id("b"))
    assert not await rebooted.holding(1_800_000_000_000 + 600_000)


async def test_a_sweep_that_did_nothing_is_logged_at_debug_one_that_did_at_info(cast: Cast) -> None:
    """A sweep with nothing to do is a debug line (not an info line every five minutes for months); one that
    ended a conversation is an info line."""
    _, clock, boot, sweeper = await setting(cast)
    with capture_logs() as logs:
        await sweeper.sweep_once()
        clock.advance(3_600_000)
        boot.now += 3_600
        await sweeper.sweep_once()

    assert [(e["log_level"], e["ended_idle"]) for e in logs if e["event"] == "retention_sweep"] == [
        ("debug", 0), ("info", 1)
    ]


def boot_id(name: str) -> Callable[[], str | None]:
    """A reading of the boot id that always gives ``name`` (one machine's boot)."""
    return lambda: name


async def test_the_records_of_boots_gone_are_dropped_where_one_per_boot_was_kept_for_good() -> None:
    """Three boots a week apart each sweep (a first sweep that holds, a week after the last, then one an hour
    later): the wall clock less the boot clock is kept in one small value (``retention.clock``) holding only the
    boots that swept in the last week, here the last one; before, each boot left a
    ``retention.clock.<boot id>`` value that nothing removed (one more a boot, for good)."""
    store = MemoryStore()
    wall_ms = 1_800_000_000_000
    for boot in ("boot-a", "boot-b", "boot-c"):
        clock = BootClock()
        steps = WallClockSteps(store, boot=clock, read_boot_id=boot_id(boot))
        await steps.holding(wall_ms)
        clock.now += STEP_HOLD_S
        assert not await steps.holding(wall_ms + int(STEP_HOLD_S * 1000))
        wall_ms += 8 * DAY_MS

    assert [await store.get_meta(f"{STEP_KEY_PREFIX}{boot}") for boot in ("boot-a", "boot-b")] == [None, None]
    records = json.loads(await store.get_meta(STEP_KEY) or "{}")
    assert list(records) == ["boot-c"]


async def test_machines_sharing_a_store_each_keep_their_record_in_the_one_value() -> None:
    """Two machines (two boots at once) sweeping into one store (a shared database): each keeps its record
    beside the other's, so a daemon restarted on either still sees a step; the step of one (a year ahead)
    does not make it drop the other's record as a week old."""
    store, boot = MemoryStore(), BootClock()
    wall_ms = 1_800_000_000_000
    for name in ("boot-a", "boot-b"):
        assert not await WallClockSteps(store, boot=boot, read_boot_id=boot_id(name)).holding(wall_ms)

    boot.now += 60
    for name in ("boot-a", "boot-b"):
        restarted = WallClockSteps(store, boot=boot, read_boot_id=boot_id(name))
        assert await restarted.holding(wall_ms + 60_000 + 366 * DAY_MS)


async def test_a_daemon_upgraded_on_the_same_boot_reads_the_record_its_predecessor_kept_per_boot() -> None:
    """A record kept the old way (``retention.clock.<boot id>``) by a daemon before on this boot is read when the
    one value has none for it: a step since is still seen."""
    store, boot = MemoryStore(), BootClock()
    offset = 1_800_000_000 - boot.now
    await store.set_meta(f"{STEP_KEY_PREFIX}boot-a", json.dumps({"offset": offset, "held_until": None}))

    upgraded = WallClockSteps(store, boot=boot, read_boot_id=lambda: "boot-a")
    assert await upgraded.holding(1_800_000_000_000 + 366 * DAY_MS)
