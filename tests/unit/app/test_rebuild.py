"""Rebuilding conversations from the relays: history order, idempotent merging, verification, the endpoint."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tenex_daemon import ConversationManager, NostrEvent
from tenex_daemon.adapters.nostr.relay_pool import Filter
from tenex_daemon.app.control_api import create_app
from tenex_daemon.app.metrics import Metrics
from tenex_daemon.app.rebuild import Rebuilder, RebuildRequest, history_order
from tenex_daemon.app.settings import Settings
from tenex_daemon.core.errors import ConversationNotFoundError
from tenex_daemon.services.lifecycle import (
    IDLE,
    IDLE_TIMEOUT,
    ConversationLifecycle,
    adopted_root_key,
    channel_meta_key,
)
from tenex_daemon.services.retention import RetentionPolicy, Sweeper
from tenex_daemon.testing import FakeClock, sign_event
from tests.conftest import Cast


def _matches(event: NostrEvent, f: Filter) -> bool:
    """NIP-01 filter matching, for the fields a rebuild uses."""
    checks = [
        "ids" not in f or event.id in f["ids"],
        "kinds" not in f or event.kind in f["kinds"],
        "authors" not in f or event.pubkey in f["authors"],
        "since" not in f or event.created_at >= f["since"],
        "until" not in f or event.created_at <= f["until"],
    ]
    for key, values in f.items():
        if key.startswith("#"):
            checks.append(any(t[0] == key[1:] and t[1] in values for t in event.tags if len(t) > 1))
    return all(checks)


@dataclass
class FakeRelays:
    """An EventSource over fixed events; ``cap`` limits each answer to the newest events, as relays do (of
    each filter's answer, with ``per_filter``, as NIP-01's ``limit`` and relays' caps do)."""

    events: list[NostrEvent]
    cap: int | None = None
    per_filter: bool = False
    refuse_once: str | None = None
    """A reason the relays refuse one frame for during the first fetch (counted in ``rejects``)."""
    rejects: dict[str, int] = field(default_factory=dict)

    async def fetch(self, filters: Sequence[Filter], *, timeout: float | None = None) -> list[NostrEvent]:  # noqa: ASYNC109 - the EventSource signature
        """Return the matching events, newest first (at most ``cap``)."""
        if self.refuse_once is not None:
            self.rejects[self.refuse_once] = self.rejects.get(self.refuse_once, 0) + 1
            self.refuse_once = None
        if self.per_filter:
            answers = {e.id: e for f in filters for e in self._newest([e for e in self.events if _matches(e, f)])}
            return sorted(answers.values(), key=lambda e: (-e.created_at, e.id))
        return self._newest([e for e in self.events if any(_matches(e, f) for f in filters)])

    async def fetch_each(self, filters: Sequence[Filter], *, timeout: float | None = None) -> list[list[NostrEvent]]:  # noqa: ASYNC109 - the EventSource signature
        """One relay's answer."""
        return [await self.fetch(filters, timeout=timeout)]

    def _newest(self, found: list[NostrEvent]) -> list[NostrEvent]:
        """The events newest first, at most ``cap``."""
        found.sort(key=lambda e: (-e.created_at, e.id))
        return found[: self.cap] if self.cap is not None else found

    def rejects_by_reason(self) -> dict[str, int]:
        """Frames refused so far (a test sets them)."""
        return dict(self.rejects)


@dataclass
class Thread:
    """A conversation on the relays: a root, the alice/user/bob chain, and a stranger's reply."""

    root: NostrEvent
    replies: list[NostrEvent]
    stranger: NostrEvent

    @property
    def allowed(self) -> list[NostrEvent]:
        """The events the daemon would have taken in, in history order."""
        return [self.root, *self.replies]


def _reply(cast: Cast, say: Any, parent: NostrEvent, root: NostrEvent, text: str, p: str) -> NostrEvent:
    tags = [["E", root.id, "", root.pubkey], ["K", str(root.kind)], ["P", root.pubkey],
            ["e", parent.id, "", parent.pubkey], ["p", p]]
    event: NostrEvent = say(text, tags=tags)
    return event


@pytest.fixture
def thread(cast: Cast) -> Thread:
    """A kind-11 root to Alice, Alice's answer, the user's follow-up to Bob, Bob's answer."""
    root = cast.user_says("Plan the trip", kind=11, tags=[["title", "Trip"], ["p", cast.alice.pubkey]])
    alice = _reply(cast, cast.alice_says, root, root, "A plan", cast.user.pubkey)
    user = _reply(cast, cast.user_says, alice, root, "Bob, check it", cast.bob.pubkey)
    bob = _reply(cast, cast.bob_says, user, root, "Checked", cast.user.pubkey)
    stranger = cast.factory.event(cast.other_user, "spam", tags=[["E", root.id], ["p", cast.alice.pubkey]])
    return Thread(root, [alice, user, bob], stranger)


async def _history(manager: ConversationManager, conversation_id: str) -> list[str]:
    conversation = await manager.get_conversation(conversation_id)
    assert conversation is not None
    return [e.id for e in conversation.history]


def test_history_order_puts_each_reply_after_its_parent_then_orders_by_time_then_id(cast: Cast) -> None:
    """A reply comes after the event it replies to even when dated earlier; the rest go by
    created_at, then id, whatever order they came in."""
    root = sign_event(cast.user, "root", kind=11, created_at=1_000)
    late = sign_event(cast.alice_keys, "late answer", tags=[["E", root.id], ["e", root.id]], created_at=1_009)
    early_child = sign_event(cast.bob_keys, "child", tags=[["E", root.id], ["e", late.id]], created_at=1_001)
    twins = [
        sign_event(cast.user, f"twin {n}", tags=[["E", root.id], ["e", root.id]], created_at=1_002)
        for n in range(2)
    ]
    events = [root, late, early_child, *twins]
    expected = [root, *sorted(twins, key=lambda e: e.id), late, early_child]

    for seed in range(5):
        random.Random(seed).shuffle(events)
        assert history_order(events) == expected


def _rebuilder(manager: ConversationManager, relays: FakeRelays) -> Rebuilder:
    return Rebuilder(manager, relays)


async def test_rebuilding_twice_adds_nothing_the_second_time(manager: ConversationManager, thread: Thread) -> None:
    """A rebuild into an empty store creates the conversation in history order; a second one adds
    nothing and finds every event already present."""
    relays = FakeRelays([*reversed(thread.allowed), thread.stranger])

    first = await _rebuilder(manager, relays).rebuild(RebuildRequest(all_=True))
    second = await _rebuilder(manager, relays).rebuild(RebuildRequest(all_=True))

    assert await _history(manager, thread.root.id) == [e.id for e in thread.allowed]
    assert first.to_dict()["conversations"] == {"found": 1, "created": 1, "updated": 0}
    assert (first.events_added, first.events_present) == (4, 0)
    assert second.to_dict()["conversations"] == {"found": 1, "created": 0, "updated": 0}
    assert (second.events_added, second.events_present) == (0, 4)
    assert await _history(manager, thread.root.id) == [e.id for e in thread.allowed]


async def test_a_partial_conversation_gets_only_what_it_lacks(manager: ConversationManager, thread: Thread) -> None:
    """A stored conversation holding its root and first reply gets the two later replies appended,
    in order, and counts as updated."""
    await manager.create_conversation(thread.root)
    await manager.add_event(thread.root.id, thread.replies[0])

    report = await _rebuilder(manager, FakeRelays(thread.allowed)).rebuild(RebuildRequest(thread.root.id))

    assert await _history(manager, thread.root.id) == [e.id for e in thread.allowed]
    assert report.to_dict()["conversations"] == {"found": 1, "created": 0, "updated": 1}
    assert (report.events_added, report.events_present) == (2, 2)


async def test_invalid_events_and_strangers_are_skipped_and_counted(
    manager: ConversationManager, thread: Thread
) -> None:
    """An event whose content no longer matches its id is counted invalid, one by an author the daemon
    would not take in is skipped with that reason, and neither is stored; relay refusals count as invalid."""
    tampered = thread.replies[2].model_copy(update={"content": "forged"})
    relays = FakeRelays([*thread.allowed[:3], tampered, thread.stranger], refuse_once="bad_signature")
    relays.rejects = {"bad_signature": 4, "unknown_subscription": 7}

    report = await _rebuilder(manager, relays).rebuild(RebuildRequest(all_=True))

    assert report.events_invalid == 2
    assert report.events_skipped["author_not_allowed"] == 1
    assert await _history(manager, thread.root.id) == [e.id for e in thread.allowed[:3]]


async def test_pages_are_read_until_nothing_new_comes(manager: ConversationManager, thread: Thread) -> None:
    """A relay that answers at most two events per request still gives the whole conversation."""
    relays = FakeRelays(thread.allowed, cap=2)

    report = await _rebuilder(manager, relays).rebuild(RebuildRequest(thread.root.id))

    assert report.events_added == 4
    assert await _history(manager, thread.root.id) == [e.id for e in thread.allowed]



async def test_a_cap_on_each_filters_answer_skips_nothing(cast: Cast, manager: ConversationManager) -> None:
    """A relay that answers each filter's newest ten only: a conversation of 31 events, every fifth
    commenting on the root (so the `e` filter's ten reach further back than the `E` filter's), is rebuilt
    whole."""
    t = 1_700_000_000
    root = sign_event(cast.user, "Plan the trip", kind=11, tags=[["p", cast.alice.pubkey]], created_at=t)
    events, parent = [root], root
    for n in range(1, 31):
        keys = cast.user if n % 2 else cast.alice_keys
        replied = root if n % 5 == 1 else parent
        tags = [["E", root.id, "", root.pubkey], ["K", "11"], ["e", replied.id], ["p", cast.alice.pubkey]]
        parent = sign_event(keys, f"message {n}", tags=tags, created_at=t + n)
        events.append(parent)

    await _rebuilder(manager, FakeRelays(events, cap=10, per_filter=True)).rebuild(RebuildRequest(root.id))

    assert sorted(await _history(manager, root.id)) == sorted(e.id for e in events)



@dataclass
class SeveralRelays:
    """An EventSource over several relays, each answering on its own (each with its own cap)."""

    relays: list[FakeRelays]

    async def fetch_each(self, filters: Sequence[Filter], *, timeout: float | None = None) -> list[list[NostrEvent]]:  # noqa: ASYNC109 - the EventSource signature
        """Each relay's answer."""
        return [await relay.fetch(filters, timeout=timeout) for relay in self.relays]

    def rejects_by_reason(self) -> dict[str, int]:
        """None refused."""
        return {}


async def test_a_relay_with_a_smaller_cap_is_paged_to_its_end(cast: Cast, manager: ConversationManager) -> None:
    """Two relays answer ten and fifty events per request; the person's messages only the first one holds (an
    older part of the conversation) all come back though the other relay's answers reach further back."""
    t = 1_700_000_000
    root = sign_event(cast.user, "Plan the trip", kind=11, tags=[["p", cast.alice.pubkey]], created_at=t)
    events = [root]
    for n in range(1, 41):
        keys = cast.user if n % 2 else cast.alice_keys
        tags = [["E", root.id, "", root.pubkey], ["K", "11"], ["e", events[-1].id], ["p", cast.alice.pubkey]]
        events.append(sign_event(keys, f"message {n}", tags=tags, created_at=t + n))
    only_first = [e for e in events[1:31] if e.pubkey == cast.user.pubkey]
    second = [e for e in events if e not in only_first]
    relays = SeveralRelays([FakeRelays(events, cap=10), FakeRelays(second, cap=50)])

    await Rebuilder(manager, relays).rebuild(RebuildRequest(root.id))

    assert sorted(await _history(manager, root.id)) == sorted(e.id for e in events)

def _channel(cast: Cast, t: int, *, joined: bool = True) -> list[NostrEvent]:
    """A person's kind-1 channel with Alice as the relays keep it: a note and Alice's answer, a second note
    five minutes later (top-level, as clients write them) and her answer under the first note's thread
    (``joined``, else its own), then a third note two hours later and its answer."""
    events: list[NostrEvent] = []
    for note_at, root_of in ((t, None), (t + 300, 0 if joined else None), (t + 7_500, None)):
        note = sign_event(cast.user, f"note at {note_at}", kind=1, tags=[["p", cast.alice.pubkey]], created_at=note_at)
        root = note if root_of is None else events[root_of]
        threading = [["e", root.id, "", "root"], *([["e", note.id, "", "reply"]] if root is not note else [])]
        answer = sign_event(cast.alice_keys, f"answer to {note_at}", kind=1,
                            tags=[*threading, ["p", cast.user.pubkey]], created_at=note_at + 5)
        events += [note, answer]
    return events


async def test_a_kind_1_channel_comes_back_as_the_daemon_grouped_it(cast: Cast, manager: ConversationManager) -> None:
    """Rebuilt into an empty home, a person's later note within the idle timeout joins the channel's
    conversation (with its answer), a note after the timeout starts the next one, both keep their channel,
    and the newest becomes the channel's current conversation."""
    events = _channel(cast, 1_700_000_000)

    report = await _rebuilder(manager, FakeRelays(events)).rebuild(RebuildRequest(all_=True))

    assert (report.conversations_found, report.conversations_created) == (2, 2)
    assert await _history(manager, events[0].id) == [e.id for e in events[:4]]
    assert await _history(manager, events[4].id) == [e.id for e in events[4:]]
    channel = f"alice:{cast.user.pubkey}"
    for cid in (events[0].id, events[4].id):
        conversation = await manager.get_conversation(cid)
        assert conversation is not None
        assert conversation.channel == channel
    assert await manager.store.get_meta(channel_meta_key(channel)) == events[4].id


async def test_a_note_the_store_holds_as_its_own_conversation_stays_one(
    cast: Cast, manager: ConversationManager
) -> None:
    """A later note the home already keeps as a conversation of its own (the owner had ended the one before)
    is not merged into the earlier one by a rebuild, and the channel's current conversation stays."""
    events = _channel(cast, 1_700_000_000, joined=False)
    await manager.create_conversation(events[2], channel=f"alice:{cast.user.pubkey}")
    await manager.store.set_meta(channel_meta_key(f"alice:{cast.user.pubkey}"), events[2].id)

    await _rebuilder(manager, FakeRelays(events)).rebuild(RebuildRequest(all_=True))

    assert await _history(manager, events[0].id) == [e.id for e in events[:2]]
    assert await _history(manager, events[2].id) == [e.id for e in events[2:4]]
    assert await manager.store.get_meta(channel_meta_key(f"alice:{cast.user.pubkey}")) == events[2].id

async def test_a_late_note_the_store_holds_in_the_running_conversation_gets_its_thread_there(
    cast: Cast, manager: ConversationManager
) -> None:
    """A note the daemon took into the channel's conversation though it came after the idle timeout (a run was
    still under way) gets the reply under it that the store lost merged into that conversation, not counted
    deleted, and that conversation becomes the channel's current one."""
    events = _channel(cast, 1_700_000_000)
    late_note, lost_answer = events[4], events[5]  # two hours after the last message; the answer is under it
    channel = f"alice:{cast.user.pubkey}"
    await manager.create_conversation(events[0], channel=channel)
    for event in events[1:5]:
        await manager.add_event(events[0].id, event)

    report = await _rebuilder(manager, FakeRelays(events)).rebuild(RebuildRequest(all_=True))

    assert await _history(manager, events[0].id) == [e.id for e in events]
    assert await manager.get_conversation(late_note.id) is None
    assert await manager.find_conversation_of_event(lost_answer.id) == events[0].id
    assert report.events_skipped["conversation_deleted"] == 0
    assert (report.conversations_created, report.conversations_updated) == (0, 1)
    assert (report.events_added, report.events_present) == (1, 5)
    assert await manager.store.get_meta(channel_meta_key(channel)) == events[0].id


async def test_a_deleted_channel_conversation_stays_deleted_beside_the_one_before_it(
    cast: Cast, manager: ConversationManager
) -> None:
    """A channel's later conversation deleted from the store (its note processed, held by none) is neither
    brought back nor merged into the channel's earlier conversation; its events count as deleted."""
    events = _channel(cast, 1_700_000_000)
    channel = f"alice:{cast.user.pubkey}"
    await manager.create_conversation(events[0], channel=channel)
    for event in events[1:4]:
        await manager.add_event(events[0].id, event)
    await manager.create_conversation(events[4], channel=channel)
    assert await manager.delete_conversation(events[4].id)

    report = await _rebuilder(manager, FakeRelays(events)).rebuild(RebuildRequest(all_=True))

    assert await _history(manager, events[0].id) == [e.id for e in events[:4]]
    assert await manager.get_conversation(events[4].id) is None
    assert await manager.find_conversation_of_event(events[5].id) is None
    assert report.events_skipped["conversation_deleted"] == 2


async def test_since_leaves_older_events_out_but_fetches_the_root(
    manager: ConversationManager, thread: Thread
) -> None:
    """With since after the first reply, the root (whatever its date) and the later replies are merged."""
    since = thread.replies[1].created_at

    await _rebuilder(manager, FakeRelays(thread.allowed)).rebuild(RebuildRequest(thread.root.id, since=since))

    assert await _history(manager, thread.root.id) == [thread.root.id, thread.replies[1].id, thread.replies[2].id]


async def test_a_deleted_conversation_stays_deleted(manager: ConversationManager, thread: Thread) -> None:
    """A conversation deleted from the store (its ids still processed) is not brought back."""
    await manager.create_conversation(thread.root)
    assert await manager.delete_conversation(thread.root.id)

    report = await _rebuilder(manager, FakeRelays(thread.allowed)).rebuild(RebuildRequest(all_=True))

    assert await manager.get_conversation(thread.root.id) is None
    assert report.events_skipped["conversation_deleted"] == 4


async def test_an_archived_conversation_gets_its_events_and_stays_archived(
    manager: ConversationManager, thread: Thread
) -> None:
    """Missing events are merged into an archived conversation, which is archived again afterwards."""
    await manager.create_conversation(thread.root)
    await manager.archive_conversation(thread.root.id)

    await _rebuilder(manager, FakeRelays(thread.allowed)).rebuild(RebuildRequest(thread.root.id))

    conversation = await manager.get_conversation(thread.root.id)
    assert conversation is not None
    assert conversation.archived
    assert [e.id for e in conversation.history] == [e.id for e in thread.allowed]


async def test_an_archived_conversation_a_message_reopens_during_the_merge_stays_restored(
    manager: ConversationManager, thread: Thread, cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owner archived the conversation; while a rebuild merges what the relays kept, the person writes
    in it again (restored for the merge, the message reopens it, as any new message restores it): the merge
    leaves it restored and active, not archived again over that message (whose run could then never save
    its answer)."""
    await manager.create_conversation(thread.root)
    await manager.archive_conversation(thread.root.id, ending_by="owner")
    again = _reply(cast, cast.user_says, thread.root, thread.root, "Picking this up again", cast.alice.pubkey)
    merge = manager.add_event
    came: list[bool] = []

    async def a_message_comes_first(conversation_id: str, event: NostrEvent, **options: Any) -> bool:
        if options.get("backfill") and not came:
            came.append(await merge(conversation_id, again))  # the person's, live, during the merge
        return await merge(conversation_id, event, **options)

    monkeypatch.setattr(manager, "add_event", a_message_comes_first)
    await _rebuilder(manager, FakeRelays(thread.allowed)).rebuild(RebuildRequest(thread.root.id))

    conversation = await manager.get_conversation(thread.root.id)
    assert conversation is not None
    assert came == [True]
    assert (conversation.archived, conversation.is_ended) == (False, False)
    assert conversation.contains_event(again.id)


async def test_events_older_than_the_end_leave_an_ended_conversation_ended(
    manager: ConversationManager, thread: Thread, clock: FakeClock
) -> None:
    """Events a rebuild merges that were written before the conversation ended keep it ended (nothing
    reopens it, its end is unchanged); its last activity moves to the newest event's time, not the
    rebuild's, and its latest person message is the newest one."""
    clock.now = thread.root.created_at * 1000
    await manager.create_conversation(thread.root)
    clock.now = thread.replies[2].created_at * 1000 + 60_000
    assert await manager.end_conversation(thread.root.id, by="owner")
    ended_at = clock.now
    clock.advance(3_600_000)  # the rebuild comes an hour later

    report = await _rebuilder(manager, FakeRelays(thread.allowed)).rebuild(RebuildRequest(thread.root.id))

    conversation = await manager.get_conversation(thread.root.id)
    assert conversation is not None
    assert report.events_added == 3
    assert [e.id for e in conversation.history] == [e.id for e in thread.allowed]
    assert (conversation.ended_at, conversation.ended_by) == (ended_at, "owner")
    assert conversation.activity_at == thread.replies[2].created_at * 1000
    assert conversation.metadata.last_user_message == thread.replies[1].content


async def test_a_merged_person_message_is_the_latest_only_when_no_persons_message_is_newer(
    manager: ConversationManager, thread: Thread, cast: Cast
) -> None:
    """A rebuild merging the person's follow-up makes it the latest person message though an agent's
    answer in history is newer; merged into a conversation holding a newer message of the person's, it
    leaves that one the latest."""
    await manager.create_conversation(thread.root)
    await manager.add_event(thread.root.id, thread.replies[2])  # Bob's answer, newer than the follow-up

    await _rebuilder(manager, FakeRelays(thread.allowed)).rebuild(RebuildRequest(thread.root.id))

    conversation = await manager.get_conversation(thread.root.id)
    assert conversation is not None
    assert conversation.metadata.last_user_message == thread.replies[1].content
    later = _reply(cast, cast.user_says, thread.replies[2], thread.root, "One more thing", cast.alice.pubkey)
    other = await manager.create_conversation(
        cast.user_says("Plan the trip again", kind=11, tags=[["p", cast.alice.pubkey]])
    )
    await manager.add_event(other.id, later)
    await manager.add_event(other.id, thread.replies[1], backfill=True)
    again = await manager.get_conversation(other.id)
    assert again is not None
    assert again.metadata.last_user_message == "One more thing"


async def test_an_event_written_after_the_end_reopens_the_conversation(
    manager: ConversationManager, thread: Thread, clock: FakeClock
) -> None:
    """An event a rebuild merges that was written after the conversation ended reopens it, as it would
    have had the daemon taken it in live."""
    clock.now = thread.root.created_at * 1000
    await manager.create_conversation(thread.root)
    await manager.add_event(thread.root.id, thread.replies[0])
    clock.now = thread.replies[0].created_at * 1000 + 500  # before the person's follow-up was written
    assert await manager.end_conversation(thread.root.id, by="idle")
    clock.advance(3_600_000)

    await _rebuilder(manager, FakeRelays(thread.allowed)).rebuild(RebuildRequest(thread.root.id))

    conversation = await manager.get_conversation(thread.root.id)
    assert conversation is not None
    assert not conversation.is_ended
    assert conversation.activity_at == thread.replies[2].created_at * 1000


async def test_one_conversation_no_relay_has_is_not_found(manager: ConversationManager) -> None:
    """Asking for a conversation no relay has any event of raises ConversationNotFoundError."""
    with pytest.raises(ConversationNotFoundError):
        await _rebuilder(manager, FakeRelays([])).rebuild(RebuildRequest("ab" * 32))


def test_a_request_names_one_conversation_or_all() -> None:
    """A request with both an id and all, or with neither, is refused."""
    with pytest.raises(ValueError, match="not both"):
        RebuildRequest("ab" * 32, all_=True)
    with pytest.raises(ValueError, match="not both"):
        RebuildRequest()


@dataclass
class RelayTargetFake:
    """A daemon for the control API: the manager, metrics, a status, relays and settings."""

    manager: ConversationManager
    pool: FakeRelays | None
    settings: Settings = field(default_factory=lambda: Settings.model_construct(home=Path("unused"), whitelist=[]))
    metrics: Metrics = field(default_factory=Metrics)

    def status(self) -> dict[str, Any]:
        """A fixed status."""
        return {"state": "running"}


async def test_the_rebuild_endpoint_merges_and_reports(manager: ConversationManager, thread: Thread) -> None:
    """POST /api/v1/conversations/rebuild merges through the daemon's manager and answers the report;
    a bad body is 400, an unknown conversation 404, a daemon without relays 503."""
    target = RelayTargetFake(manager, FakeRelays(thread.allowed))
    async with TestClient(TestServer(create_app(target))) as client:
        ok = await client.post("/api/v1/conversations/rebuild", json={"id": thread.root.id, "since": "0"})
        report = await ok.json()
        bad = await client.post("/api/v1/conversations/rebuild", json={"id": thread.root.id, "all": True})
        unknown = await client.post("/api/v1/conversations/rebuild", json={"id": "cd" * 32})
        target.pool = None
        offline = await client.post("/api/v1/conversations/rebuild", json={"all": True})

    assert ok.status == 200
    assert report["conversations"] == {"found": 1, "created": 1, "updated": 0}
    assert report["events"]["added"] == 4
    assert await _history(manager, thread.root.id) == [e.id for e in thread.allowed]
    assert (bad.status, unknown.status, offline.status) == (400, 404, 503)


async def test_a_thread_whose_root_the_relays_lack_keeps_its_later_replies_joining(
    manager: ConversationManager, thread: Thread
) -> None:
    """Rebuilt without its root (the relays lack it), a thread starts its conversation at its first reply and
    records the root's id as leading there, as the daemon does, so the thread's next reply joins it."""
    relays = FakeRelays(thread.replies)  # no root

    await _rebuilder(manager, relays).rebuild(RebuildRequest(all_=True))

    first = thread.replies[0]
    assert await _history(manager, first.id) == [e.id for e in thread.replies]
    assert await manager.store.get_meta(adopted_root_key(thread.root.id)) == first.id


THREE_DAYS_MS = 3 * 24 * 3_600_000


def _dated_thread(cast: Cast, t: int) -> list[NostrEvent]:
    """A kind-11 root to Alice written at ``t`` (seconds), her answer a minute later, the person's follow-up
    two minutes later."""
    root = sign_event(cast.user, "Plan the trip", kind=11, tags=[["p", cast.alice.pubkey]], created_at=t)
    events = [root]
    for n, keys in ((1, cast.alice_keys), (2, cast.user)):
        tags = [["E", root.id, "", root.pubkey], ["K", "11"], ["e", events[-1].id], ["p", cast.alice.pubkey]]
        events.append(sign_event(keys, f"message {n}", tags=tags, created_at=t + 60 * n))
    return events


async def test_a_rebuilt_conversation_is_dated_by_its_events_not_by_the_rebuild(
    cast: Cast, manager: ConversationManager, clock: FakeClock
) -> None:
    """Rebuilt three days after its events, a conversation was created when its root was written and was last
    active and updated when its newest event was, not when the rebuild ran."""
    events = _dated_thread(cast, (clock.now - THREE_DAYS_MS) // 1000)

    await _rebuilder(manager, FakeRelays(events)).rebuild(RebuildRequest(all_=True))

    conversation = await manager.get_conversation(events[0].id)
    assert conversation is not None
    assert (conversation.created_at, conversation.phase_started_at) == (events[0].created_at * 1000,) * 2
    assert (conversation.activity_at, conversation.updated_at) == (events[-1].created_at * 1000,) * 2
    assert conversation.last_activity < clock.now - THREE_DAYS_MS + 3 * 60_000


async def test_a_rebuilt_conversations_dates_are_never_ahead_of_the_clock(
    cast: Cast, manager: ConversationManager, clock: FakeClock
) -> None:
    """A rebuilt conversation whose root is dated ahead of the rebuild's clock was created, updated and last
    active at the rebuild's time, never later."""
    events = _dated_thread(cast, clock.now // 1000 + 3_600)

    await _rebuilder(manager, FakeRelays(events)).rebuild(RebuildRequest(all_=True))

    conversation = await manager.get_conversation(events[0].id)
    assert conversation is not None
    assert [e.id for e in conversation.history] == [e.id for e in events]
    assert (conversation.created_at, conversation.updated_at, conversation.activity_at) == (clock.now,) * 3


async def test_a_note_today_starts_a_new_conversation_beside_a_rebuilt_channel_idle_for_days(
    cast: Cast, manager: ConversationManager, clock: FakeClock
) -> None:
    """A person's kind-1 note today does not join the channel's rebuilt conversation, idle for three days by
    its events (the channel's current one after the rebuild): that one is ended by the idle timeout and the
    note starts the next conversation."""
    lifecycle = ConversationLifecycle(manager)
    events = _channel(cast, (clock.now - THREE_DAYS_MS) // 1000)
    await Rebuilder(manager, FakeRelays(events), lifecycle=lifecycle).rebuild(RebuildRequest(all_=True))
    channel = f"alice:{cast.user.pubkey}"
    assert await manager.store.get_meta(channel_meta_key(channel)) == events[4].id
    note = sign_event(cast.user, "hello", kind=1, tags=[["p", cast.alice.pubkey]], created_at=clock.now // 1000)

    joined = await lifecycle.join_channel(channel, note)

    assert joined.created
    assert joined.conversation.id == note.id
    rebuilt = await manager.get_conversation(events[4].id)
    assert rebuilt is not None
    assert (rebuilt.ended_by, rebuilt.end_reason) == (IDLE, IDLE_TIMEOUT)
    assert note.id not in [e.id for e in rebuilt.history]


async def test_the_sweep_at_the_daemons_start_ends_rebuilt_conversations_idle_past_the_timeout(
    cast: Cast, manager: ConversationManager, clock: FakeClock
) -> None:
    """The retention sweep the daemon makes at its start ends every rebuilt conversation whose newest event is
    older than the idle timeout (by ``idle``, for the idle timeout), as it ends any idle conversation, and
    leaves one whose newest event is younger active."""
    three_days_ago = (clock.now - THREE_DAYS_MS) // 1000
    old = [*_dated_thread(cast, three_days_ago), *_channel(cast, three_days_ago)]
    recent = _dated_thread(cast, (clock.now - 10 * 60_000) // 1000 - 120)
    await _rebuilder(manager, FakeRelays([*old, *recent])).rebuild(RebuildRequest(all_=True))
    clock.advance(60_000)  # the daemon starts a minute after the rebuild

    report = await Sweeper(manager, RetentionPolicy()).sweep_once()

    assert report.ended_idle == 3
    for cid in (old[0].id, old[3].id, old[7].id):
        conversation = await manager.get_conversation(cid)
        assert conversation is not None
        assert (conversation.ended_by, conversation.end_reason) == (IDLE, IDLE_TIMEOUT)
    fresh = await manager.get_conversation(recent[0].id)
    assert fresh is not None
    assert not fresh.is_ended
