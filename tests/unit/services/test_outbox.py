"""The durable outbox: signed events are published until a relay accepts them, across failures and restarts."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import structlog

from tenex_daemon import MemoryStore
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.errors import EventRefusedError, UnknownAgentError
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.services.outbox import OUTBOX_KEY, Outbox, OutboxEntry
from tenex_daemon.testing.fakes import FakePublisher
from tests.conftest import Cast


class Observer:
    """Records the replies the outbox reports delivered."""

    def __init__(self) -> None:
        self.published: list[tuple[str, str]] = []

    def reply_published(self, agent_slug: str, trigger_id: str, sent_at: float) -> None:
        """Record (agent, trigger)."""
        self.published.append((agent_slug, trigger_id))


async def saved_reply(store: MemoryStore, cast: Cast) -> tuple[NostrEvent, NostrEvent]:
    """A conversation in ``store`` with a person's root and Alice's reply; return (root, reply)."""
    root = cast.user_says("Hello", kind=11, tags=[["p", cast.alice.pubkey]])
    conversation = Conversation(id=root.id, created_at=0, updated_at=0, phase_started_at=0)
    conversation.append(root)
    await store.create(conversation)
    reply = cast.alice_says("Hi!", tags=[["e", root.id]])
    await store.append_event(root.id, reply)
    return root, reply


async def stored_ids(store: MemoryStore) -> list[str]:
    """The event ids the stored outbox holds."""
    raw = await store.get_meta(OUTBOX_KEY)
    return [record["id"] for record in json.loads(raw or "[]")]


async def until(predicate: object, timeout_s: float = 5.0) -> None:
    """Wait until ``predicate()`` holds."""
    async with asyncio.timeout(timeout_s):
        while not predicate():  # type: ignore[operator]  # noqa: ASYNC110 - polls the outbox's counters
            await asyncio.sleep(0.005)


async def test_an_added_event_is_stored_until_a_relay_accepts_it(cast: Cast) -> None:
    """add() returns once the entry is stored; after the relay's OK the event is reported once and the
    stored outbox empties."""
    store, publisher, observer = MemoryStore(), FakePublisher(), Observer()
    root, reply = await saved_reply(store, cast)
    publisher.fail = True
    outbox = Outbox(store, publisher, backoff_start_s=0.01, backoff_cap_s=0.02, observer=observer)

    await outbox.add(root.id, reply, agent_slug="alice", trigger_id=root.id)

    assert await stored_ids(store) == [reply.id]
    assert outbox.depth == 1
    publisher.fail = False
    await until(lambda: outbox.depth == 0)
    assert [e.id for e in publisher.published] == [reply.id]
    assert observer.published == [("alice", root.id)]
    await outbox.close()
    assert await stored_ids(store) == []


async def test_failed_publishes_are_retried_with_backoff_and_nothing_is_dropped(cast: Cast) -> None:
    """A relay that refuses for a while is tried again and again (backoff capped); the event goes out once."""
    store, publisher = MemoryStore(), FakePublisher()
    root, reply = await saved_reply(store, cast)
    publisher.fail = True
    outbox = Outbox(store, publisher, backoff_start_s=0.005, backoff_cap_s=0.01)
    await outbox.add(root.id, reply, agent_slug="alice")

    await until(lambda: outbox.retries >= 5)
    assert outbox.depth == 1
    publisher.fail = False
    await until(lambda: outbox.depth == 0)

    assert [e.id for e in publisher.published] == [reply.id]
    await outbox.close()


async def test_a_relay_reconnecting_wakes_the_retry_at_once(cast: Cast) -> None:
    """wake() (a relay reconnected) retries a waiting event now, not after its backoff."""
    store, publisher = MemoryStore(), FakePublisher()
    root, reply = await saved_reply(store, cast)
    publisher.fail = True
    outbox = Outbox(store, publisher, backoff_start_s=30.0)
    await outbox.add(root.id, reply, agent_slug="alice")
    await until(lambda: outbox.retries == 1)

    publisher.fail = False
    outbox.wake()

    await until(lambda: outbox.depth == 0, timeout_s=2.0)
    assert [e.id for e in publisher.published] == [reply.id]
    await outbox.close()


async def test_what_waits_at_a_stop_is_delivered_after_the_restart(cast: Cast) -> None:
    """An event still waiting when the process stops stays stored; the next process reads it back from
    its conversation and delivers it."""
    store, publisher = MemoryStore(), FakePublisher()
    root, reply = await saved_reply(store, cast)
    publisher.fail = True
    first = Outbox(store, publisher, backoff_start_s=30.0)
    await first.add(root.id, reply, agent_slug="alice", trigger_id=root.id)
    await first.close()
    assert await stored_ids(store) == [reply.id]

    publisher.fail = False
    observer = Observer()
    second = Outbox(store, publisher, observer=observer)
    assert await second.recover(store.find_event) == 1
    await until(lambda: second.depth == 0)

    assert [e.id for e in publisher.published] == [reply.id]
    assert observer.published == [("alice", root.id)]
    await second.close()
    assert await stored_ids(store) == []


async def test_an_old_entry_is_logged_once_and_kept(cast: Cast) -> None:
    """An event older than warn_after_s is logged once (outbox_entry_old) and still tried, never dropped."""
    store, publisher = MemoryStore(), FakePublisher()
    root, reply = await saved_reply(store, cast)
    publisher.fail = True
    outbox = Outbox(store, publisher, warn_after_s=0.01, backoff_start_s=0.005, backoff_cap_s=0.005)

    with structlog.testing.capture_logs() as logs:
        await outbox.add(root.id, reply, agent_slug="alice")
        await asyncio.sleep(0.02)
        await until(lambda: outbox.retries >= 6)

    assert [entry["event"] for entry in logs].count("outbox_entry_old") == 1
    assert outbox.depth == 1
    await outbox.close()
    assert await stored_ids(store) == [reply.id]


async def test_a_waiting_entrys_age_counts_time_passed_not_steps_of_the_wall_clock(
    cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry's age (status's oldest age, the degraded check, ``outbox_entry_old``) is time that passed: a
    wall clock set an hour ahead after it was added leaves it young (it read as an hour old: degraded); one
    read back at a restart keeps the age it had (its stored first time)."""
    store, publisher = MemoryStore(), FakePublisher()
    root, reply = await saved_reply(store, cast)
    publisher.fail = True
    first = Outbox(store, publisher, backoff_start_s=30.0)
    await first.add(root.id, reply, agent_slug="alice", trigger_id=root.id)
    wall = time.time
    monkeypatch.setattr(time, "time", lambda: wall() + 3600)  # the clock set an hour ahead
    stepped = first.oldest_age_s()
    await first.close()
    monkeypatch.setattr(time, "time", lambda: wall() + 120)  # restarted two minutes later (set right again)
    second = Outbox(store, publisher, backoff_start_s=30.0)
    await second.recover(store.find_event)

    assert stepped is not None
    assert stepped < 60
    recovered = second.oldest_age_s()
    assert recovered is not None
    assert 120 <= recovered < 180
    await second.close()


@pytest.mark.parametrize("times", [1, 2])
async def test_adding_the_same_event_again_changes_nothing(cast: Cast, times: int) -> None:
    """A republished reply (a recovered run) already waiting is not added twice."""
    store, publisher = MemoryStore(), FakePublisher()
    root, reply = await saved_reply(store, cast)
    publisher.fail = True
    outbox = Outbox(store, publisher, backoff_start_s=30.0)
    for _ in range(times + 1):
        await outbox.add(root.id, reply, agent_slug="alice")

    assert outbox.depth == 1
    assert await stored_ids(store) == [reply.id]
    await outbox.close()


async def refused_reply(cast: Cast) -> tuple[MemoryStore, FakePublisher, NostrEvent, NostrEvent]:
    """A saved conversation and Alice's reply in it that every relay refuses for its size: (store, publisher
    refusing over 100 characters, root, that reply)."""
    store, publisher = MemoryStore(), FakePublisher(refuse_over=100)
    root, _ = await saved_reply(store, cast)
    too_long = cast.alice_says("x" * 500, tags=[["e", root.id]])
    await store.append_event(root.id, too_long)
    return store, publisher, root, too_long


async def test_an_event_every_relay_refuses_for_good_leaves_the_outbox_and_the_person_is_told(cast: Cast) -> None:
    """A reply every relay refuses for good (over a relay's size limit: ``blocked:``) is not tried again: it
    leaves the stored outbox, is counted as refused (no retries), and the notice ``on_refused`` gives is
    added and delivered in its place."""
    store, publisher, root, too_long = await refused_reply(cast)
    told: list[tuple[str, tuple[str, ...]]] = []

    async def on_refused(entry: OutboxEntry, refusal: EventRefusedError) -> NostrEvent | None:
        told.append((entry.event.id, refusal.reasons))
        return cast.alice_says("the notice", tags=[["e", root.id], ["error", "system"]])

    outbox = Outbox(store, publisher, backoff_start_s=0.005, backoff_cap_s=0.01, on_refused=on_refused)
    await outbox.add(root.id, too_long, agent_slug="alice", trigger_id=root.id)
    await until(lambda: outbox.depth == 0 and len(publisher.published) == 1)
    await outbox.close()

    assert [e.content for e in publisher.published] == ["the notice"]
    assert [event_id for event_id, _ in told] == [too_long.id]
    assert told[0][1] == ("blocked: event size (500 chars) exceeds 100",)
    assert (outbox.refused, outbox.retries, outbox.delivered) == (1, 0, 1)
    assert await stored_ids(store) == []


class DeadlockDetectedError(Exception):
    """A database's error that is no OSError and passes (as asyncpg's DeadlockDetectedError, DiskFullError)."""


@pytest.mark.parametrize("error", [OSError("database restarting"), DeadlockDetectedError("deadlock detected")])
async def test_a_refused_events_notice_that_could_not_be_saved_is_tried_again_not_lost(
    cast: Cast, error: Exception
) -> None:
    """When the notice of a reply every relay refused cannot be saved (the store gone for a moment, or a
    database's passing error that is no OSError), the entry stays in the outbox: after a wait the reply is
    refused again and its notice saved and delivered, so the person is told once the store is back."""
    store, publisher, root, too_long = await refused_reply(cast)
    tries: list[str] = []

    async def on_refused(entry: OutboxEntry, refusal: EventRefusedError) -> NostrEvent | None:
        tries.append(entry.event.id)
        if len(tries) == 1:
            raise error
        return cast.alice_says("the notice", tags=[["e", root.id], ["error", "system"]])

    outbox = Outbox(store, publisher, backoff_start_s=0.005, backoff_cap_s=0.01, on_refused=on_refused)
    await outbox.add(root.id, too_long, agent_slug="alice", trigger_id=root.id)
    await until(lambda: outbox.depth == 0 and len(publisher.published) == 1)
    await outbox.close()

    assert [e.content for e in publisher.published] == ["the notice"]
    assert tries == [too_long.id, too_long.id]
    assert (outbox.refused, outbox.retries, outbox.delivered) == (1, 1, 1)
    assert await stored_ids(store) == []


async def test_a_refused_events_notice_that_cannot_be_made_leaves_with_it_rather_than_looping(cast: Cast) -> None:
    """A notice that fails for a reason other than the store (its agent no longer configured) would fail at
    every try: the refused entry leaves the outbox after one, counted refused, instead of being sent to the
    relays again forever."""
    store, publisher, root, too_long = await refused_reply(cast)
    tries: list[str] = []

    async def on_refused(entry: OutboxEntry, refusal: EventRefusedError) -> NostrEvent | None:
        tries.append(entry.event.id)
        raise UnknownAgentError("alice")

    outbox = Outbox(store, publisher, backoff_start_s=0.005, backoff_cap_s=0.01, on_refused=on_refused)
    await outbox.add(root.id, too_long, agent_slug="alice", trigger_id=root.id)
    await until(lambda: outbox.depth == 0)
    await asyncio.sleep(0.05)
    await outbox.close()

    assert tries == [too_long.id]
    assert (outbox.refused, outbox.retries, outbox.delivered) == (1, 0, 0)
    assert await stored_ids(store) == []


class CrashError(Exception):
    """The process ends here (the test stops the call where a crash would)."""


async def saving_notice(
    store: MemoryStore, cast: Cast, *, crash: bool
) -> tuple[NostrEvent, NostrEvent, str | None, str | None]:
    """Alice's notice in a saved conversation, through ``add_saving``; return (root, notice, the stored outbox
    as ``save`` began, the stored outbox once ``add_saving`` returned). With ``crash`` the process ends
    before the notice is saved."""
    root = cast.user_says("Hello", kind=11, tags=[["p", cast.alice.pubkey]])
    conversation = Conversation(id=root.id, created_at=0, updated_at=0, phase_started_at=0)
    conversation.append(root)
    await store.create(conversation)
    notice = cast.alice_says("Stopped: Alice.", tags=[["e", root.id], ["error", "system"]])
    outbox = Outbox(store, FakePublisher(), backoff_start_s=30.0)
    stored: list[str | None] = []

    async def save() -> bool:
        stored.append(await store.get_meta(OUTBOX_KEY))
        if crash:
            raise CrashError
        await store.append_event(root.id, notice)
        return True

    if crash:
        with pytest.raises(CrashError):
            await outbox.add_saving(root.id, notice, save, agent_slug="alice", trigger_id=root.id)
        return root, notice, stored[0], None
    assert await outbox.add_saving(root.id, notice, save, agent_slug="alice", trigger_id=root.id)
    after = await store.get_meta(OUTBOX_KEY)
    await outbox.close()
    return root, notice, stored[0], after


@pytest.mark.parametrize("crash", [True, False], ids=["before the save", "after the save"])
async def test_a_notice_no_run_covers_is_lost_by_no_crash(cast: Cast, crash: bool) -> None:
    """add_saving stores the entry, the event itself in it, before the event is saved: a process ending
    before the save leaves an entry from which the next start saves the notice in its conversation and
    publishes it; one ending after the save (the entry still holding the event) publishes it once, not saving
    it twice."""
    store = MemoryStore()
    root, notice, before_save, after = await saving_notice(store, cast, crash=crash)
    assert before_save is not None
    assert json.loads(before_save)[0]["e"] == notice.to_dict()
    left = before_save if crash else after
    assert left is not None
    restarted_store = MemoryStore()  # the home as the crash left it: the conversation, and that outbox
    for event_id in ((root.id,) if crash else (root.id, notice.id)):
        found = await store.find_event(event_id)
        assert found is not None
    conversation = await store.load(root.id)
    assert conversation is not None
    if crash:
        assert notice.id not in [e.id for e in conversation.history]
    await restarted_store.create(conversation)
    await restarted_store.set_meta(OUTBOX_KEY, left)
    saved: list[str] = []

    async def save_missing(conversation_id: str, event: NostrEvent) -> bool:
        saved.append(event.id)
        await restarted_store.append_event(conversation_id, event)
        return True

    publisher = FakePublisher()
    restarted = Outbox(restarted_store, publisher, save_missing=save_missing)
    assert await restarted.recover(restarted_store.find_event) == 1
    await until(lambda: restarted.depth == 0)

    assert saved == ([notice.id] if crash else [])
    assert [e.id for e in publisher.published] == [notice.id]
    reloaded = await restarted_store.load(root.id)
    assert reloaded is not None
    assert [e.id for e in reloaded.history].count(notice.id) == 1
    await restarted.close()
    assert await stored_ids(restarted_store) == []


async def test_a_notice_its_conversation_refuses_leaves_no_entry(cast: Cast) -> None:
    """When the save answers False (the conversation is archived or gone), add_saving returns False and the
    entry goes: nothing is delivered, and the stored outbox forgets it."""
    store, publisher = MemoryStore(), FakePublisher()
    root, _ = await saved_reply(store, cast)
    notice = cast.alice_says("Stopped: Alice.", tags=[["e", root.id], ["error", "system"]])
    outbox = Outbox(store, publisher)

    async def refuse() -> bool:
        return False

    assert await outbox.add_saving(root.id, notice, refuse, agent_slug="alice") is False
    assert outbox.depth == 0
    await outbox.close()
    assert publisher.published == []
    assert await stored_ids(store) == []
