"""A relay connection's catch-up against a relay that sends at most a few stored events per REQ, newest
first: every filter is paged through, each event handed over once, and the subscription's cursor moves only
once the catch-up is complete; one cut short (a stop, a page without EOSE) leaves the cursor held for the
next catch-up to ask again from there."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Coroutine
from typing import Any

from tenex_daemon.adapters.nostr.codec import EventMessage, PublicKeyCache
from tenex_daemon.adapters.nostr.relay_pool.connection import RelayConnection, _Fetch
from tenex_daemon.adapters.nostr.relay_pool.delivery import Delivery
from tenex_daemon.adapters.nostr.relay_pool.subscriptions import Subscription, Subscriptions
from tenex_daemon.adapters.nostr.relay_pool.types import Filter, PoolSettings, ReceivedEvent, RelaySpec
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.testing import KeyPair, sign_event

URL = "ws://capped.test"
CAP = 10
CURSOR = 1_000
PERSON = KeyPair.from_seed(21)


class CappedRelay:
    """Stored events, answered as a relay that sends the newest ``CAP`` matching a filter (kinds, since,
    until); ``answer`` False makes every page end without EOSE (a timeout)."""

    def __init__(self, events: list[NostrEvent], refused: list[tuple[str, int]] = ()) -> None:  # type: ignore[assignment]
        self.events = events
        self.refused = list(refused)
        """(id, created_at) of stored events the connection refuses (they match every filter)."""
        self.answer = True
        self.pages = 0
        self.until_excluded = False
        """Read ``until`` as "before" (the PyPI nostr-relay does; NIP-01's is "at or before")."""

    async def fetch(self, fetch_id: str, filters: list[Filter], wait_s: float) -> _Fetch:
        """One page: the newest CAP events matching the (one) filter, refused ones among them."""
        (flt,) = filters
        self.pages += 1

        def within(created_at: int) -> bool:
            until = flt.get("until", 10**10) - (1 if self.until_excluded else 0)
            return bool(flt.get("since", 0) <= created_at <= until)

        matching: list[tuple[int, str, NostrEvent | None]] = [
            (e.created_at, e.id, e) for e in self.events if e.kind in flt["kinds"] and within(e.created_at)
        ]
        matching += [(created_at, event_id, None) for event_id, created_at in self.refused if within(created_at)]
        newest = sorted(matching, key=lambda item: -item[0])[:CAP]
        page = _Fetch(
            events=[event for _, _, event in newest if event is not None],
            refused=[(event_id, created_at) for created_at, event_id, event in newest if event is None],
        )
        page.done = asyncio.get_running_loop().create_future()
        if self.answer:
            page.done.set_result("eose")
        return page


class Rig:
    """A connection (no socket) whose fetches the capped relay answers, its pool's delivery to a consumer
    that records what it is handed, and the subscription ``live`` with a cursor at ``CURSOR``."""

    def __init__(self, relay: CappedRelay, filters: list[Filter], cursor_on: str = URL) -> None:
        """``cursor_on``: the relay the cursor is on (another: this one was added to the settings)."""
        self.relay = relay
        self.handed: list[str] = []
        self.stopping = False
        self.tasks: list[asyncio.Task[Any]] = []
        self.subscriptions = Subscriptions(since_window=0)
        self.subscriptions.advance("live", cursor_on, CURSOR)
        self.sub = Subscription("live", filters)
        self.delivery = Delivery(
            PoolSettings(), self.subscriptions.advance, on_event=self.consume, store=MemoryStore(), lane_key=None
        )
        self.connection = RelayConnection(
            RelaySpec(URL), PoolSettings(), subscriptions=self.subscriptions, sink=self.delivery,
            key_cache=PublicKeyCache(), auth_signer=None, spawn=self.spawn,
        )
        self.connection._fetch = relay.fetch  # type: ignore[method-assign]
        self.delivery.start()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        self.tasks.append(asyncio.get_running_loop().create_task(coro, name=name))

    async def consume(self, received: ReceivedEvent) -> None:
        if self.stopping:
            raise RuntimeError("shutting down")
        await asyncio.sleep(0)
        self.handed.append(received.event.id)

    async def catch_up(self) -> None:
        """Subscribe (the catch-up from the cursor), take the relay's first answer, EOSE, let paging run."""
        await self.subscriptions.add(self.sub, [URL], None)
        await self.connection.send_req(self.sub)  # no socket: nothing is sent, the catch-up starts
        first = await self.relay.fetch("first", [self.subscriptions.filters_for(self.sub, URL)[0]], 1.0)
        for event in first.events:
            self.connection._caught("live")
            await self.delivery.intake(event, URL, "live")
        for event_id, created_at in first.refused:
            self.connection._note_refused("live", event_id, created_at)
        await self.connection._end_of_stored("live")
        await asyncio.gather(*self.tasks)

    def cursor(self) -> int | None:
        return self.subscriptions.cursor("live", URL)


def stored(kind: int, count: int, start: int, per_second: int) -> list[NostrEvent]:
    """``count`` events of ``kind`` dated from ``start`` on, ``per_second`` a second."""
    return [
        sign_event(PERSON, f"{kind}/{n}", kind=kind, created_at=start + n // per_second) for n in range(count)
    ]


async def test_every_event_of_every_filter_is_handed_over_once_and_then_the_cursor_moves() -> None:
    """35 events of one kind and 4 of another since the cursor, 10 a page: all 39 are handed over once (a
    sparse filter's older events do not make the dense one skip its own), and the cursor moves to the newest."""
    dense, sparse = stored(11, 35, CURSOR + 10, 3), stored(1, 4, CURSOR + 1, 1)
    rig = Rig(CappedRelay(dense + sparse), [{"kinds": [11]}, {"kinds": [1]}])

    await rig.catch_up()
    await rig.delivery.stop()

    assert sorted(rig.handed) == sorted(e.id for e in dense + sparse)
    assert rig.cursor() == max(e.created_at for e in dense)
    assert not rig.subscriptions.is_held("live", URL)


async def test_a_catch_up_stopped_before_its_events_are_handed_over_keeps_the_cursor_held() -> None:
    """The daemon stops while the catch-up's events are still on their way: they are left to the relay and
    the cursor stays where it was, so the next start asks for them again."""
    rig = Rig(CappedRelay(stored(11, 35, CURSOR + 10, 3)), [{"kinds": [11]}])
    rig.stopping = True
    rig.delivery.leave_to_relays()

    await rig.catch_up()
    await rig.delivery.stop()

    assert rig.handed == []
    assert (rig.cursor(), rig.subscriptions.is_held("live", URL)) == (CURSOR, True)


async def test_a_page_without_eose_leaves_the_cursor_held_until_a_later_catch_up_completes() -> None:
    """A page that times out cuts the catch-up short: events handed over meanwhile do not move the cursor,
    live ones neither; the next catch-up (a reconnect) completes and moves it to the newest."""
    events = stored(11, 35, CURSOR + 10, 3)
    relay = CappedRelay(events)
    relay.answer = False
    rig = Rig(relay, [{"kinds": [11]}])

    await rig.catch_up()
    await rig.delivery.settled()
    live = sign_event(PERSON, "live", kind=11, created_at=events[-1].created_at + 5)
    await rig.delivery.intake(live, URL, "live")
    await rig.delivery.settled()
    held = rig.cursor()
    relay.answer = True
    rig.tasks.clear()
    await rig.catch_up()
    await rig.delivery.stop()

    assert held == CURSOR
    assert sorted(set(rig.handed)) == sorted(e.id for e in [*events, live])
    assert rig.cursor() == live.created_at


async def test_a_page_of_nothing_but_refused_events_does_not_end_the_catch_up() -> None:
    """Fifteen events dated two days ahead (the connection refuses them) stand newest on the relay: the
    catch-up pages past them by their dates, and the 25 events missed behind them are handed over."""
    missed = stored(11, 25, CURSOR + 10, 2)
    ahead = [(f"{n:064x}", CURSOR + 200_000 + n) for n in range(15)]
    rig = Rig(CappedRelay(missed, refused=ahead), [{"kinds": [11]}])

    await rig.catch_up()
    await rig.delivery.stop()

    assert sorted(rig.handed) == sorted(e.id for e in missed)
    assert not rig.subscriptions.is_held("live", URL)


async def test_refused_frames_of_the_first_answer_and_of_pages_take_the_catch_up_past_them() -> None:
    """The relay's first answer is nothing but events dated two days ahead, which the codec refuses (each
    counted as refused): their frames still start the paging and date its pages, and the 25 events missed
    behind them are handed over."""
    missed = stored(11, 25, CURSOR + 10, 2)
    now = int(time.time())
    ahead = [sign_event(PERSON, f"ahead {n}", kind=11, created_at=now + 2 * 86_400 + n) for n in range(15)]
    relay = CappedRelay(missed, refused=[(e.id, e.created_at) for e in ahead])
    rig = Rig(relay, [{"kinds": [11]}])
    by_id = {e.id: e for e in missed + ahead}
    await rig.subscriptions.add(rig.sub, [URL], None)
    await rig.connection.send_req(rig.sub)

    first = await relay.fetch("first", [rig.subscriptions.filters_for(rig.sub, URL)[0]], 1.0)
    shown = [e.id for e in first.events] + [event_id for event_id, _ in first.refused]
    for event_id in shown:
        await rig.connection._on_frame(json.dumps(["EVENT", "live", by_id[event_id].model_dump()]))
    await rig.connection._on_frame('["EOSE","live"]')
    await asyncio.gather(*rig.tasks)
    await rig.delivery.stop()

    assert first.events == []
    assert len(first.refused) == CAP
    assert rig.connection.rejects["bad_created_at"] == CAP
    assert sorted(rig.handed) == sorted(e.id for e in missed)
    assert not rig.subscriptions.is_held("live", URL)


async def test_more_events_in_one_second_than_a_page_holds_do_not_hide_the_older_ones() -> None:
    """Anyone may publish, all dated one second, more events p-tagging an agent than the relay sends at once:
    the catch-up still pages past that second, and the 25 messages written before it are handed over (before,
    the page of that second came back unchanged, the catch-up counted itself complete and the cursor moved
    past them for good)."""
    older = stored(11, 25, CURSOR + 10, 2)
    flood = stored(11, CAP + 5, CURSOR + 500, CAP + 5)
    rig = Rig(CappedRelay(older + flood), [{"kinds": [11]}])

    await rig.catch_up()
    await rig.delivery.stop()

    assert set(rig.handed) >= {e.id for e in older}
    assert len(set(rig.handed) & {e.id for e in flood}) >= CAP
    assert rig.cursor() == CURSOR + 500


async def test_a_relay_that_reads_until_as_before_still_hands_over_every_event() -> None:
    """A relay that takes ``until`` as "before" (the PyPI nostr-relay): the page after a page cut in the middle
    of a second would skip the rest of that second; the connection sees that the page before's own events at
    ``until`` did not come, and asks with ``until`` one later from then on: all 35 events are handed over
    (before, 30)."""
    relay = CappedRelay(stored(11, 35, CURSOR + 10, 3))
    relay.until_excluded = True
    rig = Rig(relay, [{"kinds": [11]}])

    await rig.catch_up()
    await rig.delivery.stop()

    assert sorted(set(rig.handed)) == sorted(e.id for e in relay.events)
    assert not rig.subscriptions.is_held("live", URL)


async def test_an_event_deleted_between_two_pages_does_not_cut_the_catch_up_short() -> None:
    """On a relay that keeps to NIP-01, the one event at the first page's oldest second is deleted (NIP-09)
    before the next page: that page, without it, looks like a relay reading ``until`` as "before", and ``until``
    is asked one later from then on; every other event is still handed over (before the fix of that reading,
    a page reaching into the second after ``until`` ended the catch-up, 5 events short)."""
    t = CURSOR + 10
    seconds = {t + 4: 9, t + 3: 1, t + 2: 6, t + 1: 6, t: 3}
    events = [sign_event(PERSON, f"{at}/{n}", kind=11, created_at=at) for at, k in seconds.items() for n in range(k)]
    relay = CappedRelay(events)
    [deleted] = [e for e in events if e.created_at == t + 3]
    paging = relay.fetch

    async def deleting_before_the_second_page(fetch_id: str, filters: list[Filter], wait_s: float) -> _Fetch:
        if relay.pages == 2:  # the first answer and the first page came
            relay.events.remove(deleted)
        return await paging(fetch_id, filters, wait_s)

    rig = Rig(relay, [{"kinds": [11]}])
    rig.connection._fetch = deleting_before_the_second_page  # type: ignore[method-assign]
    relay.fetch = deleting_before_the_second_page  # type: ignore[method-assign]

    await rig.catch_up()
    await rig.delivery.stop()

    assert set(rig.handed) >= {e.id for e in events if e is not deleted}
    assert not rig.subscriptions.is_held("live", URL)


async def test_a_relay_that_ignores_until_ends_the_catch_up_once_it_repeats_its_page() -> None:
    """A relay that answers every page with its newest events whatever ``until`` says: the catch-up ends at
    the first page it has seen already (it does not step back one second a page up to the page limit)."""
    relay = CappedRelay(stored(11, 35, CURSOR + 10, 3))
    newest_whatever = relay.fetch

    async def ignoring_until(fetch_id: str, filters: list[Filter], wait_s: float) -> _Fetch:
        return await newest_whatever(fetch_id, [{k: v for k, v in filters[0].items() if k != "until"}], wait_s)

    rig = Rig(relay, [{"kinds": [11]}])
    rig.connection._fetch = ignoring_until  # type: ignore[method-assign]

    await rig.catch_up()
    await rig.delivery.stop()

    assert relay.pages <= 4
    assert not rig.subscriptions.is_held("live", URL)


async def test_a_relay_added_to_the_settings_is_caught_up_from_the_others_cursor_page_by_page() -> None:
    """A relay with no cursor of its own, the subscription's cursor being on another relay: it is asked from
    that cursor as a catch-up, paged past the relay's cap (all 35 events since it handed over, none older),
    its cursor held until then (before, its newest event moved its cursor at once and nothing was paged)."""
    old = stored(11, 3, CURSOR - 100, 1)
    since = stored(11, 35, CURSOR + 10, 3)
    rig = Rig(CappedRelay(old + since), [{"kinds": [11]}], cursor_on="ws://other")

    await rig.catch_up()
    await rig.delivery.stop()

    assert sorted(rig.handed) == sorted(e.id for e in since)
    assert rig.cursor() == max(e.created_at for e in since)
    assert rig.relay.pages > 1


async def test_a_live_event_that_comes_while_the_catch_up_pages_is_taken_in_after_the_stored_ones() -> None:
    """A person writes right after the reconnect, while the catch-up still pages through what was written
    during the outage: the new message is taken in after every older one (it was taken in first, and the
    older ones, answered after it, stood as the newest)."""
    older = stored(11, 25, CURSOR + 10, 1)
    relay = CappedRelay(older)
    rig = Rig(relay, [{"kinds": [11]}])
    live = sign_event(PERSON, "written after the reconnect", kind=11, created_at=CURSOR + 100)
    paging = relay.fetch

    async def fetch_then_a_live_event(fetch_id: str, filters: list[Filter], wait_s: float) -> _Fetch:
        if relay.pages == 1:  # the catch-up's first page is asked: the live event comes meanwhile
            await rig.connection._on_event(EventMessage("live", live))
        return await paging(fetch_id, filters, wait_s)

    rig.connection._fetch = fetch_then_a_live_event  # type: ignore[method-assign]
    await rig.catch_up()
    await rig.delivery.stop()

    assert rig.handed[-1] == live.id
    assert sorted(rig.handed[:-1]) == sorted(e.id for e in older)
