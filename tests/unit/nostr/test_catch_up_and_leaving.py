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


def test_a_held_cursor_moves_only_when_its_last_hold_ends_and_not_after_a_cut_short_catch_up() -> None:
    """Events accepted during a hold leave the cursor at 100; ending one of two holds keeps it there, ending
    the last moves it to the newest accepted (130); a hold ended as cut short leaves it where it was."""
    subscriptions = Subscriptions(since_window=30)
    subscriptions.advance("live", URL, 100)

    subscriptions.hold("live", URL)
    subscriptions.hold("live", URL)
    subscriptions.advance("live", URL, 130)
    subscriptions.advance("live", URL, 120)
    held = subscriptions.cursor("live", URL)
    subscriptions.release("live", URL)
    still_held = subscriptions.cursor("live", URL)
    subscriptions.release("live", URL)
    moved = subscriptions.cursor("live", URL)

    subscriptions.hold("live", URL)
    subscriptions.advance("live", URL, 150)
    subscriptions.release("live", URL, move=False)

    assert (held, still_held, moved) == (100, 100, 130)
    assert subscriptions.cursor("live", URL) == 130


async def test_events_on_their_way_when_the_daemon_stops_are_left_to_the_relays() -> None:
    """A consumer that refuses everything once the daemon stops: after ``leave_to_relays`` the events taken in
    are not handed over, marked processed, retried or logged as failures, the cursor stays at the last one
    handed over, and one line at stop counts them."""
    factory, person = EventFactory(), KeyPair.from_seed(7)
    events = [factory.event(person, f"message {n}", kind=11) for n in range(5)]
    handed: list[str] = []
    cursors: list[int] = []
    stopping = asyncio.Event()

    async def consumer(received: ReceivedEvent) -> None:
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
        await delivery.settled()
        stopping.set()
        delivery.leave_to_relays()
        for event in events[1:]:
            await delivery.intake(event, URL, "live")
        await delivery.settled()
        await delivery.stop()

    assert handed == [events[0].id]
    assert [await store.is_processed(event.id) for event in events] == [True, False, False, False, False]
    assert cursors == [events[0].created_at]
    assert (delivery.left, delivery.consumer_errors, delivery.retrying) == (4, 0, 0)
    assert [(line["event"], line.get("count")) for line in logs] == [("events_left_to_relays", 4)]
