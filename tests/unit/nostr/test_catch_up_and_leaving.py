"""Two things the pool does for a daemon that stops and starts again: a cursor held while a catch-up is under
way moves only once it is over (and not at all when it was cut short), and once the daemon stops taking
events, those still on their way are left to the relays quietly, without errors, retries or marks."""

from __future__ import annotations

import asyncio

from structlog.testing import capture_logs

from tenex_daemon.adapters.nostr.relay_pool.delivery import Delivery
from tenex_daemon.adapters.nostr.relay_pool.subscriptions import Subscriptions
from tenex_daemon.adapters.nostr.relay_pool.types import PoolSettings, ReceivedEvent
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.testing import EventFactory, KeyPair

URL = "ws://relay.test"


def test_a_held_cursor_moves_only_when_a_catch_up_completes() -> None:
    """Events accepted while a cursor is held leave it at 100, a second hold changes nothing, and the release
    of a complete catch-up moves it to the newest accepted (130); held again and never released (a catch-up
    cut short), it stays there whatever is accepted."""
    subscriptions = Subscriptions(since_window=30)
    subscriptions.advance("live", URL, 100)

    subscriptions.hold("live", URL)
    subscriptions.advance("live", URL, 130)
    subscriptions.hold("live", URL)
    subscriptions.advance("live", URL, 120)
    held = subscriptions.cursor("live", URL)
    subscriptions.release("live", URL)
    moved = subscriptions.cursor("live", URL)
    subscriptions.hold("live", URL)
    subscriptions.advance("live", URL, 150)

    assert (held, moved) == (100, 130)
    assert subscriptions.cursor("live", URL) == 130
    assert subscriptions.is_held("live", URL)


async def test_events_on_their_way_when_the_daemon_stops_are_left_to_the_relays() -> None:
    """A consumer that refuses everything once the daemon stops: after ``leave_to_relays`` the event it was
    refusing then and those taken in after are not handed over, marked processed, retried or logged as
    failures, the cursor stays at the last one handed over, ``settled`` says some were left, and one line at
    stop counts them."""
    factory, person = EventFactory(), KeyPair.from_seed(7)
    events = [factory.event(person, f"message {n}", kind=11) for n in range(5)]
    handed: list[str] = []
    cursors: list[int] = []
    stopping, inside = asyncio.Event(), asyncio.Event()

    async def consumer(received: ReceivedEvent) -> None:
        if received.event is events[1]:  # the one in the consumer when the daemon starts to stop
            inside.set()
            await stopping.wait()
        if stopping.is_set():
            raise RuntimeError("shutting down")
        handed.append(received.event.id)

    store = MemoryStore()
    delivery = Delivery(
        PoolSettings(), lambda sub, url, at: cursors.append(at), on_event=consumer, store=store, lane_key=None
    )
    delivery.start()
    with capture_logs() as logs:
        await delivery.intake(events[0], URL, "live")
        handed_for_good = await delivery.settled()
        await delivery.intake(events[1], URL, "live")
        await inside.wait()
        delivery.leave_to_relays()
        stopping.set()
        for event in events[2:]:
            await delivery.intake(event, URL, "live")
        left_some = not await delivery.settled()
        await delivery.stop()

    assert (handed_for_good, left_some) == (True, True)
    assert handed == [events[0].id]
    assert [await store.is_processed(event.id) for event in events] == [True, False, False, False, False]
    assert cursors == [events[0].created_at]
    assert (delivery.left, delivery.consumer_errors, delivery.retrying) == (4, 0, 0)
    assert [(line["event"], line.get("count")) for line in logs] == [("events_left_to_relays", 4)]


async def test_events_still_on_their_way_when_delivery_stops_are_counted_as_left() -> None:
    """The daemon stops while the consumer still holds one event and two more wait behind it (its drain
    ran out of time): the line at stop counts all three as left to the relays, and none is marked."""
    factory, person = EventFactory(), KeyPair.from_seed(8)
    events = [factory.event(person, f"message {n}", kind=11) for n in range(3)]
    inside = asyncio.Event()

    async def consumer(received: ReceivedEvent) -> None:
        inside.set()
        await asyncio.Event().wait()  # never done: cancelled by the stop

    store = MemoryStore()
    delivery = Delivery(PoolSettings(), lambda sub, url, at: None, on_event=consumer, store=store, lane_key=None)
    delivery.start()
    with capture_logs() as logs:
        for event in events:
            await delivery.intake(event, URL, "live")
        await inside.wait()
        delivery.leave_to_relays()
        await delivery.stop()

    assert [await store.is_processed(event.id) for event in events] == [False, False, False]
    assert [(line["event"], line.get("count")) for line in logs] == [("events_left_to_relays", 3)]


async def test_events_left_at_a_stop_are_counted_once_each_after_retries() -> None:
    """One event fails once and is handed over on its retry; another keeps failing and waits for its retry;
    two more are on their way (one held by the consumer) when the daemon stops: the line at stop counts the
    three left, each once (a retried event was counted off twice before, and a queued retry would count
    twice)."""
    factory, person = EventFactory(), KeyPair.from_seed(9)
    flaky, failing, *rest = [factory.event(person, f"message {n}", kind=11) for n in range(4)]
    failures = {flaky.id: 1, failing.id: 1_000}
    handed, failed_again, inside = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def consumer(received: ReceivedEvent) -> None:
        event_id = received.event.id
        if failures.get(event_id, 0) > 0:
            failures[event_id] -= 1
            if failures[failing.id] <= 998:
                failed_again.set()  # its retry failed too: back in the retry set
            raise RuntimeError("for a moment")
        if event_id == flaky.id:
            handed.set()
            return
        inside.set()
        await asyncio.Event().wait()  # never done: cancelled by the stop

    delivery = Delivery(
        PoolSettings(retry_base=0.01), lambda sub, url, at: None, on_event=consumer, store=MemoryStore(),
        lane_key=None,
    )
    delivery.start()
    with capture_logs() as logs:
        await delivery.intake(flaky, URL, "live")
        await handed.wait()
        await delivery.intake(failing, URL, "live")
        await failed_again.wait()
        for event in rest:
            await delivery.intake(event, URL, "live")
        await inside.wait()
        delivery.leave_to_relays()
        await delivery.stop()

    assert delivery.retries >= 2  # the flaky event's and the failing one's
    left = [(line["event"], line.get("count")) for line in logs if line["event"] == "events_left_to_relays"]
    assert left == [("events_left_to_relays", 3)]
