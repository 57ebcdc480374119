"""The retention sweeper (docs/ARCHITECTURE.md, "Conversation lifecycle"): idle ending, archiving and
deleting at every time and count boundary, with a controllable clock."""

from __future__ import annotations

import asyncio
import json

import pytest

from tenex_daemon import ConversationManager, MemoryStore
from tenex_daemon.app.settings import ConversationSettings
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.search import ConversationSummary, SearchQuery
from tenex_daemon.services.outbox import every_outbox
from tenex_daemon.services.retention import RetentionPolicy, Sweeper, SweepReport
from tenex_daemon.services.threads import META_PREFIX, ThreadManager
from tenex_daemon.testing import FakeClock
from tenex_daemon.testing.fakes import WriteBeforeLease
from tests.conftest import Cast

MINUTE = 60_000
DAY = 24 * 60 * MINUTE


def make_manager(cast: Cast, clock: FakeClock, store: MemoryStore | None = None) -> ConversationManager:
    return ConversationManager(
        store or MemoryStore(), cast.agents, cast.project.pubkey, clock=clock, owner_pubkey=cast.user.pubkey
    )


def sweeper(manager: ConversationManager, **policy: float | None) -> Sweeper:
    """A sweeper that never archives or deletes unless the test says so."""
    settings: dict[str, float | None] = {"archive_after_days": None, "max_retained": 1_000_000}
    settings.update(policy)
    return Sweeper(manager, RetentionPolicy(**settings))  # type: ignore[arg-type]  # test values


async def start(manager: ConversationManager, cast: Cast, text: str) -> Conversation:
    return await manager.create_conversation(cast.user_says(text, kind=11))


async def stored(manager: ConversationManager, cid: str) -> Conversation:
    found = await manager.get_conversation(cid)
    assert found is not None
    return found


async def ended_one(manager: ConversationManager, clock: FakeClock, cast: Cast, text: str) -> str:
    """A conversation ended by its owner one minute after it started; the clock moves on a minute."""
    conversation = await start(manager, cast, text)
    clock.advance(MINUTE)
    assert await manager.end_conversation(conversation.id, by="owner")
    clock.advance(MINUTE)
    return conversation.id


async def kept_ids(manager: ConversationManager) -> set[str]:
    return {row.id for row in await manager.store.search(SearchQuery())}


# --- ending idle conversations --------------------------------------------------------------------


async def test_29_idle_minutes_stay_open_and_31_are_ended_by_idle(cast: Cast) -> None:
    """With a 30-minute idle timeout, a conversation idle 29 minutes stays active and one idle
    31 minutes is ended by "idle" for "idle_timeout" at the sweep's time."""
    clock = FakeClock()
    manager = make_manager(cast, clock)
    early = await start(manager, cast, "started first")
    clock.advance(2 * MINUTE)
    late = await start(manager, cast, "started two minutes later")
    clock.advance(29 * MINUTE)  # early: 31 idle minutes, late: 29

    report = await sweeper(manager, idle_timeout_min=30).sweep_once()

    assert report.ended_idle == 1
    ended = await stored(manager, early.id)
    assert (ended.ended_by, ended.end_reason, ended.ended_at) == ("idle", "idle_timeout", clock.now)
    assert not (await stored(manager, late.id)).is_ended


async def test_a_message_just_before_the_sweep_keeps_the_conversation_open(cast: Cast) -> None:
    """A conversation idle 31 minutes that gets a message just before the sweep is not ended."""
    clock = FakeClock()
    manager = make_manager(cast, clock)
    conversation = await start(manager, cast, "hello")
    clock.advance(31 * MINUTE)
    await manager.add_event(conversation.id, cast.user_says("still here"))

    report = await sweeper(manager, idle_timeout_min=30).sweep_once()

    assert report.ended_idle == 0
    assert not (await stored(manager, conversation.id)).is_ended


class MessageAfterSearch(MemoryStore):
    """A store whose next search is followed at once by a message in every conversation it found."""

    def __init__(self) -> None:
        super().__init__()
        self.reply: tuple[ConversationManager, Cast] | None = None

    async def search(self, query: SearchQuery) -> list[ConversationSummary]:
        rows = await super().search(query)
        if self.reply is not None and query.ended is False:
            manager, cast = self.reply
            self.reply = None
            for row in rows:
                await manager.add_event(row.id, cast.user_says(f"just arrived in {row.id}"))
        return rows


async def test_a_message_between_the_search_and_the_end_wins(cast: Cast) -> None:
    """A message accepted after the sweep found the conversation idle, but before it ends it, keeps it
    open: the idle check is made again under the conversation's lock."""
    clock = FakeClock()
    store = MessageAfterSearch()
    manager = make_manager(cast, clock, store)
    conversation = await start(manager, cast, "hello")
    clock.advance(31 * MINUTE)
    store.reply = (manager, cast)

    report = await sweeper(manager, idle_timeout_min=30).sweep_once()

    assert report.ended_idle == 0
    assert report.errors == 0
    found = await stored(manager, conversation.id)
    assert not found.is_ended
    assert len(found.history) == 2


async def test_a_conversation_with_a_run_under_way_is_left_alone_until_the_run_is_over(cast: Cast) -> None:
    """A conversation whose last message is 40 days old but whose run is scheduled or under way (a slow run,
    one recovered after downtime) is neither ended, archived nor deleted; once the run is over, the next
    sweep ends and archives it."""
    clock = FakeClock()
    manager = make_manager(cast, clock)
    conversation = await start(manager, cast, "answered after a long downtime")
    await ended_one(manager, clock, cast, "newer, ended")
    clock.advance(40 * DAY)
    busy = {conversation.id}
    sweep = Sweeper(manager, RetentionPolicy(archive_after_days=30, max_retained=1), busy=busy.__contains__)

    first = await sweep.sweep_once()
    found = await stored(manager, conversation.id)
    left_alone = (found.is_ended, found.archived, first.deleted)
    busy.clear()
    second = await sweep.sweep_once()

    assert left_alone == (False, False, 1)  # the other conversation went: the limit is one
    assert (second.ended_idle, second.archived) == (1, 1)


# --- archiving ------------------------------------------------------------------------------------


async def test_archive_happens_just_after_archive_after_days_not_before(cast: Cast) -> None:
    """With archive_after_days = 30, a conversation inactive 30 days less a minute is ended (idle) but not
    archived; two minutes later (30 days and a minute) it is archived."""
    clock = FakeClock()
    manager = make_manager(cast, clock)
    conversation = await start(manager, cast, "old talk")
    clock.advance(30 * DAY - MINUTE)
    sweep = sweeper(manager, idle_timeout_min=30, archive_after_days=30)

    before = await sweep.sweep_once()
    clock.advance(2 * MINUTE)
    after = await sweep.sweep_once()

    assert (before.ended_idle, before.archived) == (1, 0)
    assert (after.ended_idle, after.archived) == (0, 1)
    found = await stored(manager, conversation.id)
    assert found.archived
    assert found.is_ended


async def test_an_active_conversation_is_ended_before_it_is_archived(cast: Cast) -> None:
    """When the idle timeout is longer than archive_after_days, the archive step ends the conversation
    first (by "idle"), so every archived conversation counts as ended for retention."""
    clock = FakeClock()
    manager = make_manager(cast, clock)
    conversation = await start(manager, cast, "long idle timeout")
    clock.advance(2 * DAY)

    report = await sweeper(manager, idle_timeout_min=10 * 24 * 60, archive_after_days=1).sweep_once()

    assert (report.ended_idle, report.archived) == (1, 1)
    found = await stored(manager, conversation.id)
    assert found.archived
    assert found.ended_by == "idle"


async def test_a_conversation_archived_by_hand_is_ended_once_idle(cast: Cast) -> None:
    """A conversation the owner archived without ending it is ended by the idle step once idle, so it
    counts as ended (and may be deleted) for retention."""
    clock = FakeClock()
    manager = make_manager(cast, clock)
    conversation = await start(manager, cast, "archived by hand")
    await manager.archive_conversation(conversation.id)
    clock.advance(31 * MINUTE)

    report = await sweeper(manager, idle_timeout_min=30).sweep_once()

    assert report.ended_idle == 1
    found = await stored(manager, conversation.id)
    assert found.archived
    assert found.is_ended


async def test_a_message_between_the_archive_search_and_the_archive_wins(cast: Cast) -> None:
    """An ended conversation inactive past archive_after_days gets a person's message, which reopens it,
    after the sweep found it and just before the archive: it is not archived (checked again under its
    lock), so no archived conversation is left open, and its run can save the reply."""
    clock = FakeClock()
    store = WriteBeforeLease()
    manager = make_manager(cast, clock, store)
    cid = await ended_one(manager, clock, cast, "ended long ago")
    clock.advance(2 * DAY)
    store.write_before(cid, cast.user_says("I'm back, one more question"), clock.now, reopens=True)

    report = await sweeper(manager, archive_after_days=1).sweep_once()

    found = await stored(manager, cid)
    assert (report.archived, report.errors) == (0, 0)
    assert (found.archived, found.is_ended, len(found.history)) == (False, False, 2)


# --- deleting -------------------------------------------------------------------------------------


async def test_max_retained_keeps_n_and_deletes_the_oldest_ended_beyond(cast: Cast) -> None:
    """With max_retained = 3, three ended conversations are all kept; a fourth makes the sweep delete the
    one that ended first (not the one created first), whose event ids stay processed."""
    clock = FakeClock()
    manager = make_manager(cast, clock)
    first = await start(manager, cast, "created first, ended second")
    second = await start(manager, cast, "created second, ended first")
    clock.advance(MINUTE)
    await manager.end_conversation(second.id, by="owner")
    clock.advance(MINUTE)
    await manager.end_conversation(first.id, by="owner")
    clock.advance(MINUTE)
    third = await ended_one(manager, clock, cast, "third")
    sweep = sweeper(manager, max_retained=3)

    at_limit = await sweep.sweep_once()
    fourth = await ended_one(manager, clock, cast, "fourth")
    beyond = await sweep.sweep_once()

    assert at_limit.deleted == 0
    assert beyond.deleted == 1
    assert await kept_ids(manager) == {first.id, third, fourth}
    assert await manager.store.is_processed(second.id)


async def test_a_conversation_whose_reply_still_waits_for_a_relay_is_not_deleted(cast: Cast) -> None:
    """Beyond max_retained, the oldest ended conversation is kept while the outbox still holds an event of
    it (a reply is never lost to retention: a newer one goes instead), and deleted once it was delivered."""
    clock = FakeClock()
    manager = make_manager(cast, clock)
    oldest = await ended_one(manager, clock, cast, "reply still on its way")
    await ended_one(manager, clock, cast, "newer")
    waiting = {oldest}
    sweep = Sweeper(
        manager, RetentionPolicy(archive_after_days=None, max_retained=1), undelivered=waiting.__contains__
    )

    await sweep.sweep_once()
    kept_while_waiting = oldest in await kept_ids(manager)
    waiting.clear()
    await ended_one(manager, clock, cast, "newest")
    await sweep.sweep_once()

    assert kept_while_waiting
    assert oldest not in await kept_ids(manager)


async def test_a_reply_saved_just_before_the_deletion_keeps_the_conversation(cast: Cast) -> None:
    """Beyond max_retained, the ended conversation the sweep chose gets its agent's reply just before the
    deletion takes its lock: it is kept (its last activity moved), not deleted with the reply."""
    clock = FakeClock()
    store = WriteBeforeLease()
    manager = make_manager(cast, clock, store)
    oldest = await ended_one(manager, clock, cast, "its reply comes late")
    await ended_one(manager, clock, cast, "newer")
    store.write_before(oldest, cast.alice_says("the reply, saved at last"), clock.now)

    report = await sweeper(manager, max_retained=1).sweep_once()

    assert report.errors == 0
    assert oldest in await kept_ids(manager)
    assert [event.content for event in (await stored(manager, oldest)).history][-1] == "the reply, saved at last"


class OtherDaemonsOutboxes:
    """The keys of the small values a store holds, as the ``Peers`` port lists them (daemons sharing a
    database); nothing else of the port is used here."""

    def __init__(self, store: MemoryStore, keys: list[str]) -> None:
        self.store = store
        self.keys = keys

    async def keys_with_prefix(self, prefix: str) -> list[str]:
        return [key for key in self.keys if key.startswith(prefix)]


async def test_a_conversation_whose_reply_waits_in_another_daemons_outbox_is_not_deleted(cast: Cast) -> None:
    """Daemons sharing a database: beyond max_retained, the oldest ended conversation is kept while another
    daemon's stored outbox holds a reply of it (a newer one goes instead); an outbox that cannot be read
    deletes nothing and counts an error."""
    clock = FakeClock()
    store = MemoryStore()
    manager = make_manager(cast, clock, store)
    oldest = await ended_one(manager, clock, cast, "its reply waits in another daemon's outbox")
    newer = await ended_one(manager, clock, cast, "newer")
    await store.set_meta("outbox.pending.project.b", json.dumps([{"id": "e" * 64, "c": oldest, "a": "alice"}]))
    peers = OtherDaemonsOutboxes(store, ["outbox.pending.project.b", "outbox.pending.other.c"])
    held = every_outbox(store, peers, "project")  # type: ignore[arg-type]  # only keys_with_prefix is used
    assert held is not None
    policy = RetentionPolicy(archive_after_days=None, max_retained=1)

    kept = await Sweeper(manager, policy, held_elsewhere=held).sweep_once()
    await store.set_meta("outbox.pending.project.b", "not an outbox")
    unread = await Sweeper(manager, policy, held_elsewhere=held).sweep_once()

    assert (kept.deleted, unread.deleted, unread.errors) == (1, 0, 1)
    assert await kept_ids(manager) == {oldest}
    assert newer not in await kept_ids(manager)


async def test_the_default_limit_1000_deletes_one_of_1001(cast: Cast) -> None:
    """At the default max_retained (1000), 1000 ended conversations are kept and the 1001st ended makes
    the sweep delete exactly the oldest one (memory store)."""
    clock = FakeClock()
    manager = make_manager(cast, clock)
    ids = []
    for number in range(1001):
        conversation = await start(manager, cast, f"conversation {number}")
        await manager.end_conversation(conversation.id, by="owner")
        clock.advance(1000)
        ids.append(conversation.id)
    sweep = Sweeper(manager, RetentionPolicy(archive_after_days=None))
    assert sweep.policy.max_retained == 1000

    report = await sweep.sweep_once()

    assert report.deleted == 1
    kept = await kept_ids(manager)
    assert len(kept) == 1000
    assert ids[0] not in kept


async def test_many_beyond_the_limit_are_deleted_oldest_first(cast: Cast) -> None:
    """With max_retained = 5 and 40 ended conversations, one sweep deletes the 35 that ended first
    (deleted in batches) and keeps the 5 that ended last."""
    clock = FakeClock()
    manager = make_manager(cast, clock)
    ids = [await ended_one(manager, clock, cast, f"conversation {n}") for n in range(40)]

    report = await sweeper(manager, max_retained=5).sweep_once()

    assert report.deleted == 35
    assert await kept_ids(manager) == set(ids[35:])



class TickingClock(FakeClock):
    """A clock that moves one millisecond each time it is read, as a real one does through a sweep."""

    def now_ms(self) -> int:
        """Return the time, then move on."""
        self.now += 1
        return self.now


async def test_conversations_a_sweep_ends_together_are_deleted_least_recently_active_first(cast: Cast) -> None:
    """30 conversations last active 1 to 30 days ago, none ended (as after an import): the sweep that ends
    them all by idle, newest first as the search lists them, keeps the 10 most recently active (not the
    10 it happened to end last)."""
    clock = TickingClock()
    manager = make_manager(cast, clock)
    by_age: dict[int, str] = {}
    for days in range(30, 0, -1):
        by_age[days] = (await start(manager, cast, f"last said {days} days ago")).id
        clock.advance(DAY)

    report = await sweeper(manager, idle_timeout_min=30, max_retained=10).sweep_once()

    assert (report.ended_idle, report.deleted) == (30, 20)
    assert await kept_ids(manager) == {by_age[days] for days in range(1, 11)}

async def test_active_conversations_are_never_deleted_even_beyond_the_limit(cast: Cast) -> None:
    """With max_retained = 2 and four active conversations plus one ended, only the ended one is deleted;
    the four active ones stay although they are still beyond the limit."""
    clock = FakeClock()
    manager = make_manager(cast, clock)
    ended = await ended_one(manager, clock, cast, "the ended one")
    active = [(await start(manager, cast, f"active {n}")).id for n in range(4)]

    report = await sweeper(manager, max_retained=2).sweep_once()
    again = await sweeper(manager, max_retained=2).sweep_once()

    assert report.deleted == 1
    assert again.deleted == 0
    assert await kept_ids(manager) == set(active)
    assert ended not in await kept_ids(manager)


async def test_delete_after_days_deletes_ended_conversations_just_past_the_age(cast: Cast) -> None:
    """With delete_after_days = 7, an ended conversation inactive 7 days less a minute is kept, and two
    minutes later it is deleted; an active conversation as old (a 10-day idle timeout) is not."""
    clock = FakeClock()
    manager = make_manager(cast, clock)
    active = await start(manager, cast, "active and as old")
    ended = await ended_one(manager, clock, cast, "ended early")
    clock.advance(7 * DAY - 3 * MINUTE)  # its last activity (the root) was 2 minutes before the clock
    sweep = sweeper(manager, idle_timeout_min=10 * 24 * 60, delete_after_days=7)

    before = await sweep.sweep_once()
    clock.advance(2 * MINUTE)
    after = await sweep.sweep_once()

    assert before.deleted == 0
    assert after.deleted == 1
    assert await kept_ids(manager) == {active.id}
    assert ended not in await kept_ids(manager)


class FailingStore(MemoryStore):
    """A memory store whose writes fail for some conversations."""

    def __init__(self, failing: set[str]) -> None:
        super().__init__()
        self.failing = failing

    async def save_state(self, conversation: Conversation) -> None:
        if conversation.id in self.failing:
            raise OSError("disk full")
        await super().save_state(conversation)

    async def delete(self, conversation_id: str) -> bool:
        if conversation_id in self.failing:
            raise OSError("disk full")
        return await super().delete(conversation_id)


async def test_errors_are_counted_and_the_sweep_goes_on(cast: Cast) -> None:
    """A conversation whose end or deletion fails is counted as an error, and the sweep still ends,
    and deletes, the others."""
    clock = FakeClock()
    store = FailingStore(set())
    manager = make_manager(cast, clock, store)
    broken_ended = await ended_one(manager, clock, cast, "ended, cannot be deleted")
    other_ended = await ended_one(manager, clock, cast, "ended, deletable")
    broken_active = await start(manager, cast, "active, cannot be ended")
    other_active = await start(manager, cast, "active, endable")
    store.failing = {broken_ended, broken_active.id}
    clock.advance(31 * MINUTE)

    report = await sweeper(manager, idle_timeout_min=30, max_retained=2).sweep_once()

    assert report.errors == 2
    assert report.ended_idle == 1
    assert report.deleted == 2  # the deletable ended one, then the one just ended by idle
    assert (await stored(manager, broken_active.id)).ended_at is None
    assert await kept_ids(manager) == {broken_ended, broken_active.id}
    assert other_ended not in await kept_ids(manager)
    assert other_active.id not in await kept_ids(manager)


class FailingSearch(MemoryStore):
    """A memory store whose search fails for active conversations."""

    async def search(self, query: SearchQuery) -> list[ConversationSummary]:
        if query.ended is False:
            raise OSError("index unreadable")
        return await super().search(query)


async def test_a_failing_search_is_an_error_and_the_other_steps_still_run(cast: Cast) -> None:
    """When finding idle conversations fails, the error is counted and the deletion step still runs."""
    clock = FakeClock()
    manager = make_manager(cast, clock, FailingSearch())
    await ended_one(manager, clock, cast, "one")
    await ended_one(manager, clock, cast, "two")

    report = await sweeper(manager, max_retained=1).sweep_once()

    assert (report.errors, report.deleted) == (1, 1)


async def test_deleting_forgets_the_conversations_delegation_threads(cast: Cast) -> None:
    """The sweeper's deletion erases the conversation's stored threads (the store) and drops the cached
    ones (the thread manager); another conversation's thread stays."""
    clock = FakeClock()
    store = MemoryStore()
    manager = make_manager(cast, clock, store)
    threads = ThreadManager(store=store)
    doomed = await ended_one(manager, clock, cast, "doomed")
    kept = await ended_one(manager, clock, cast, "kept")
    for cid in (doomed, kept):
        await threads.add_item_and_save(await threads.get_thread(cid, "alice", "bob"), {"content": cid})
    sweep = Sweeper(manager, RetentionPolicy(archive_after_days=None, max_retained=1), threads=threads)

    report = await sweep.sweep_once()

    assert report.deleted == 1
    assert threads.cached() == [ThreadManager.key(kept, "alice", "bob")]
    assert await store.get_meta(META_PREFIX + ThreadManager.key(doomed, "alice", "bob")) is None
    assert await store.get_meta(META_PREFIX + ThreadManager.key(kept, "alice", "bob")) is not None


# --- reports, the loop and the policy -------------------------------------------------------------


async def test_each_sweep_is_reported_and_added_to_the_totals(cast: Cast) -> None:
    """Every sweep's report goes to on_sweep, becomes ``last`` and is added to the totals."""
    clock = FakeClock()
    manager = make_manager(cast, clock)
    reports: list[SweepReport] = []
    sweep = Sweeper(
        manager, RetentionPolicy(idle_timeout_min=30, archive_after_days=None, max_retained=1),
        on_sweep=reports.append,
    )
    await start(manager, cast, "one")
    await start(manager, cast, "two")
    clock.advance(31 * MINUTE)

    first = await sweep.sweep_once()
    second = await sweep.sweep_once()

    assert reports == [first, second]
    assert sweep.last == second
    assert (first.started_at, first.ended_idle, first.deleted) == (clock.now, 2, 1)
    assert (sweep.totals.sweeps, sweep.totals.ended_idle, sweep.totals.deleted) == (2, 2, 1)
    assert first.duration_s >= 0


async def test_run_forever_sweeps_at_start_and_then_every_interval(cast: Cast) -> None:
    """The daemon's loop sweeps at once and again after each interval until it is cancelled."""
    manager = make_manager(cast, FakeClock())
    three = asyncio.Event()

    def swept(report: SweepReport) -> None:
        if sweep.totals.sweeps >= 3:
            three.set()

    sweep = Sweeper(manager, RetentionPolicy(archive_after_days=None), on_sweep=swept)
    task = asyncio.create_task(sweep.run_forever(0.01))
    await asyncio.wait_for(three.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sweep.totals.sweeps >= 3


def test_the_policy_comes_from_the_conversations_settings() -> None:
    """RetentionPolicy.of takes the [conversations] values; the defaults are 30 min, 30 days, 1000, none."""
    policy = RetentionPolicy.of(ConversationSettings())
    assert policy == RetentionPolicy(
        idle_timeout_min=30.0, archive_after_days=30.0, max_retained=1000, delete_after_days=None
    )
    assert policy.idle_ms == 30 * MINUTE
    assert policy.archive_after_ms == 30 * DAY
    assert policy.delete_after_ms is None
    tiny = RetentionPolicy.of(ConversationSettings(idle_timeout_min=0.02, sweep_interval_min=0.01))
    assert tiny.idle_ms == 1200
    with pytest.raises(ValueError, match="max_retained"):
        RetentionPolicy(max_retained=0)
