"""A relay connection holds the stored events a live REQ brings before its EOSE (a relay sends them newest
first) and takes them in oldest first; what becomes of those held when the REQ ends otherwise: a drop, a
CLOSED, no EOSE at all, more than a batch holds (docs/PROTOCOL.md, "Relays")."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Coroutine
from typing import Any, cast

from websockets.asyncio.client import ClientConnection

from tenex_daemon.adapters.nostr.codec import PublicKeyCache
from tenex_daemon.adapters.nostr.relay_pool.connection import RelayConnection, _Fetch
from tenex_daemon.adapters.nostr.relay_pool.delivery import Delivery
from tenex_daemon.adapters.nostr.relay_pool.subscriptions import Subscription, Subscriptions
from tenex_daemon.adapters.nostr.relay_pool.types import Filter, PoolSettings, ReceivedEvent, RelaySpec
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.testing import KeyPair, sign_event

URL = "ws://relay.test"
PERSON = KeyPair.from_seed(31)


class Socket:
    """Stands in for the websocket: the frames the connection sends are kept."""

    def __init__(self) -> None:
        self.sent: list[list[Any]] = []

    async def send(self, text: str) -> None:
        self.sent.append(json.loads(text))


class Wire:
    """A connection to a relay storing ``stored`` (each catch-up page answered with every one matching, newest
    first, and EOSE), its pool's delivery to a consumer that records what it is handed, and the subscription
    ``live`` (its cursor at ``cursor``, if any)."""

    def __init__(
        self, stored: list[NostrEvent], *, cursor: int | None = None, settings: PoolSettings | None = None
    ) -> None:
        settings = settings or PoolSettings()
        self.stored = stored
        self.handed: list[str] = []
        self.tasks: list[asyncio.Task[Any]] = []
        self.subscriptions = Subscriptions(since_window=0)
        if cursor is not None:
            self.subscriptions.advance("live", URL, cursor)
        self.sub = Subscription("live", [{"kinds": [11]}])
        self.delivery = Delivery(
            settings, self.subscriptions.advance, on_event=self.consume, store=MemoryStore(), lane_key=None
        )
        self.connection = RelayConnection(
            RelaySpec(URL), settings, subscriptions=self.subscriptions, sink=self.delivery,
            key_cache=PublicKeyCache(), auth_signer=None, spawn=self.spawn,
        )
        self.connection._fetch = self.page  # type: ignore[method-assign]
        self.delivery.start()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        self.tasks.append(asyncio.get_running_loop().create_task(coro, name=name))

    async def consume(self, received: ReceivedEvent) -> None:
        self.handed.append(received.event.id)

    async def page(self, fetch_id: str, filters: list[Filter], wait_s: float) -> _Fetch:
        (flt,) = filters
        matching = [e for e in self.stored if flt.get("since", 0) <= e.created_at <= flt.get("until", 10**10)]
        page = _Fetch(events=sorted(matching, key=lambda e: -e.created_at))
        page.done = asyncio.get_running_loop().create_future()
        page.done.set_result("eose")
        return page

    async def subscribe(self) -> None:
        """Connected, send the REQ of ``live`` (from its cursor, if any)."""
        self.connection.ws = cast(ClientConnection, Socket())
        if self.subscriptions.get("live") is None:
            await self.subscriptions.add(self.sub, [URL], None)
        await self.connection.send_req(self.sub)

    async def frame(self, *parts: Any) -> None:
        """A frame from the relay."""
        await self.connection._on_frame(json.dumps(parts))

    async def events(self, *events: NostrEvent) -> None:
        """The relay sends these events for ``live``."""
        for event in events:
            await self.frame("EVENT", "live", event.to_dict())

    async def settle(self) -> None:
        """Let the connection's tasks (catch-up, take-in) finish and the delivery hand everything over."""
        await asyncio.gather(*self.tasks)
        self.tasks.clear()
        await self.delivery.settled()

    def cursor(self) -> int | None:
        return self.subscriptions.cursor("live", URL)


async def until(check: Callable[[], bool], within: float) -> None:
    """Poll ``check`` until it holds or ``within`` seconds passed."""
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            return
        await asyncio.sleep(0.02)


def messages(count: int, start: int) -> list[NostrEvent]:
    """``count`` messages of the person, a second apart from ``start`` on, oldest first."""
    return [sign_event(PERSON, f"message {n}", kind=11, created_at=start + n) for n in range(count)]


async def test_a_drop_before_eose_leaves_a_catch_ups_stored_events_to_the_relay_and_its_cursor_held() -> None:
    """The connection drops after two of the three events missed came (newest first), before EOSE: none is
    taken in and the cursor stays held, and the reconnect's catch-up takes all three in, oldest first."""
    now = int(time.time())
    one, two, three = messages(3, now - 30)
    wire = Wire([one, two, three], cursor=now - 60)

    await wire.subscribe()
    await wire.events(three, two)
    wire.connection._on_close()
    await wire.settle()
    dropped = (list(wire.handed), wire.cursor(), wire.subscriptions.is_held("live", URL))
    await wire.subscribe()
    await wire.events(three, two, one)
    await wire.frame("EOSE", "live")
    await wire.settle()

    assert dropped == ([], now - 60, True)
    assert wire.handed == [one.id, two.id, three.id]
    assert wire.cursor() == three.created_at


async def test_a_closed_before_eose_takes_a_first_subscriptions_stored_events_in_oldest_first() -> None:
    """A first subscription (no cursor to hold them) ended with CLOSED before its EOSE: the events that came
    are taken in, oldest first."""
    one, two, three = messages(3, int(time.time()) - 30)
    wire = Wire([])

    await wire.subscribe()
    await wire.events(three, one, two)
    await wire.frame("CLOSED", "live", "error: shutting down")
    await wire.settle()

    assert wire.handed == [one.id, two.id, three.id]


async def test_a_relay_that_never_sends_eose_is_heard_after_the_fetch_timeout_and_then_as_events_come() -> None:
    """No EOSE comes: the events held are taken in (oldest first) once ``fetch_timeout`` has passed since the
    REQ, not before, and the next one goes in as it comes."""
    one, two, three = messages(3, int(time.time()) - 30)
    fetch_timeout = 2.0
    wire = Wire([], settings=PoolSettings(fetch_timeout=fetch_timeout))

    sent_at = time.monotonic()
    await wire.subscribe()
    await wire.events(two, one)
    await wire.delivery.settled()
    early = list(wire.handed)
    await until(lambda: len(wire.handed) >= 2, within=fetch_timeout + 5)
    taken_in_after = time.monotonic() - sent_at
    await wire.settle()
    await wire.events(three)
    await wire.delivery.settled()

    assert early == []
    assert taken_in_after >= fetch_timeout - 0.01  # asyncio may run a timer a hair early
    assert wire.handed == [one.id, two.id, three.id]


async def test_a_batch_over_its_cap_is_taken_in_each_time_it_fills_each_part_oldest_first() -> None:
    """Seven stored events, a batch holding three (the intake queue's size): none is lost, the three newest go
    in first, then the three before them, then the oldest, each part oldest first."""
    events = messages(7, int(time.time()) - 30)
    wire = Wire([], settings=PoolSettings(intake_queue_size=3))

    await wire.subscribe()
    await wire.events(*reversed(events))
    await wire.frame("EOSE", "live")
    await wire.settle()

    assert wire.handed == [e.id for e in events[4:] + events[1:4] + events[:1]]


async def test_a_known_copy_before_eose_moves_the_cursor_only_with_the_events_held_before_it() -> None:
    """A first subscription, asked of two relays at once: a copy of an event the other relay delivered already
    comes before EOSE, ahead of an older event held; this relay's cursor does not move to it before the older
    one is taken in at EOSE (before, at once: a crash then would never ask for the older one again)."""
    older, newer = messages(2, int(time.time()) - 30)
    wire = Wire([])
    await wire.subscribe()
    await wire.delivery.intake(newer, "ws://other.test", "live")
    await wire.delivery.settled()

    await wire.events(newer, older)
    before_eose = wire.cursor()
    await wire.frame("EOSE", "live")
    await wire.settle()

    assert before_eose is None
    assert wire.handed == [newer.id, older.id]
    assert wire.cursor() == newer.created_at
