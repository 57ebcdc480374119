"""What a relay ends on its side: a close with 1009 on our EVENT, a ``CLOSED`` for a live subscription, AUTH
challenges it never answers (docs/PROTOCOL.md, "Relays")."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from tenex_daemon.adapters.nostr.publisher import PoolPublisher
from tenex_daemon.adapters.nostr.relay_pool import PoolSettings, ReceivedEvent, RelayPool, RelayState
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.core.errors import EventRefusedError
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.vocabulary import KIND_COMMENT
from tenex_daemon.services.outbox import Outbox, OutboxEntry

AUTHOR = Signer.generate(label="author")
FAST = PoolSettings(
    backoff_base=0.05, backoff_cap=0.2, stable_after=5.0, cursor_flush_interval=0.1, publish_timeout=5.0,
    auth_timeout=0.3,
)
Script = Callable[["ScriptedRelay", ServerConnection, int], Awaitable[None]]
"""A relay's part on one connection: the relay, the socket, the connection's number (1 first)."""


class ScriptedRelay:
    """A local websockets relay that plays a script on each connection and records the frames it read."""

    def __init__(self, script: Script, *, event: NostrEvent | None = None, message: str = "") -> None:
        """``event`` and ``message``: what the script sends, where it sends one."""
        self.script = script
        self.event = event
        self.message = message
        self.connections = 0
        self.frames: list[list[Any]] = []
        self.read_at: list[float] = []
        """When each frame was read (monotonic)."""
        self.url = ""

    async def serve(self, ws: ServerConnection) -> None:
        """Play the script on a new connection."""
        self.connections += 1
        with contextlib.suppress(ConnectionClosed):
            await self.script(self, ws, self.connections)

    async def read(self, ws: ServerConnection) -> list[Any]:
        """Read and record one frame."""
        frame: list[Any] = json.loads(await ws.recv())
        self.frames.append(frame)
        self.read_at.append(time.monotonic())
        return frame

    def sent(self, kind: str, sub_id: str | None = None) -> list[list[Any]]:
        """The frames of a kind read so far (of one subscription, when given)."""
        return [f for f in self.frames if f[0] == kind and (sub_id is None or f[1] == sub_id)]


@contextlib.asynccontextmanager
async def running(relay: ScriptedRelay, **options: Any) -> AsyncIterator[ScriptedRelay]:
    """Serve ``relay`` on a free local port for the block (``options``: websockets' own, e.g. max_size)."""
    async with serve(relay.serve, "127.0.0.1", 0, **options) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        relay.url = f"ws://127.0.0.1:{port}"
        yield relay


async def until(check: Callable[[], bool], within: float) -> bool:
    """Poll ``check`` until it holds or ``within`` seconds passed; return whether it held."""
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


# -- a relay that closes with 1009 on our EVENT ------------------------------------------------


async def ok_each_event_after_the_first_connection(relay: ScriptedRelay, ws: ServerConnection, n: int) -> None:
    """EOSE for each REQ; an EVENT is answered ``OK true`` except on the first connection (left waiting)."""
    while True:
        frame = await relay.read(ws)
        if frame[0] == "REQ":
            await ws.send(json.dumps(["EOSE", frame[1]]))
        elif frame[0] == "EVENT" and n > 1:
            await ws.send(json.dumps(["OK", frame[1]["id"], True, ""]))


async def test_a_relay_closing_with_1009_on_our_event_refuses_it_for_good_without_skipping_past() -> None:
    """A relay closing with 1009 because our EVENT is over its limit makes the outbox give that event up as
    refused for good (the notice path runs), is not counted as a frame we received too big, leaves the
    subscriptions' ``since`` at their cursors, and the connection does not flap."""
    refusals: list[EventRefusedError] = []

    async def on_refused(entry: OutboxEntry, refusal: EventRefusedError) -> None:
        refusals.append(refusal)

    store = MemoryStore()
    async with (
        running(ScriptedRelay(ok_each_event_after_the_first_connection), max_size=64 * 1024) as relay,
        RelayPool([relay.url], store=store, settings=FAST) as pool,
    ):
        await pool.subscribe("mentions", [{"kinds": [KIND_COMMENT]}])
        assert await pool.wait_connected(within=5)
        cursor = int(time.time()) - FAST.slow_clock_allowance - 50  # older: asked from it, not capped
        pool._subscriptions.advance("mentions", relay.url, cursor)
        outbox = Outbox(store, PoolPublisher(pool, {}, {}, publish_timeout_s=5.0), on_refused=on_refused)
        await outbox.add("conv", AUTHOR.sign(KIND_COMMENT, "x" * (100 * 1024)), agent_slug="a")
        assert await until(lambda: outbox.refused == 1, within=5)
        await asyncio.sleep(0.5)  # time for a reconnect loop to show
        health = pool.health()
        await outbox.close()
    assert outbox.depth == 0
    assert "too large" in refusals[0].reasons[0]
    assert health.rejects == {}
    assert relay.connections == 2
    assert relay.sent("REQ", "mentions")[-1][2]["since"] == cursor - FAST.since_window


async def test_of_the_events_awaiting_an_ok_at_a_1009_only_the_largest_is_refused() -> None:
    """When the relay closes with 1009 while a small and a large EVENT await their OK, the large one is
    refused for its size and the small one is sent again on the next connection and accepted."""
    async with (
        running(ScriptedRelay(ok_each_event_after_the_first_connection), max_size=64 * 1024) as relay,
        RelayPool([relay.url], settings=FAST) as pool,
    ):
        assert await pool.wait_connected(within=5)
        small = asyncio.create_task(pool.publish(AUTHOR.sign(KIND_COMMENT, "small"), raise_on_failure=False))
        assert await until(lambda: bool(relay.sent("EVENT")), within=5)
        large = await pool.publish(AUTHOR.sign(KIND_COMMENT, "x" * (100 * 1024)), raise_on_failure=False)
        small_result = await small
    assert large.refused_for_good
    assert small_result.ok


def test_a_1009_is_ours_only_when_we_closed_first() -> None:
    """websockets' close frames tell who closed with 1009: we (a frame we received was too big) when we sent
    it first, the relay (a frame we sent was too big) when it came first and we echoed it."""
    from websockets.frames import Close

    from tenex_daemon.adapters.nostr.relay_pool.oks import relay_closed_for_size, we_closed_for_size

    too_big, normal = Close(1009, "too big"), Close(1000, "")
    ours = [ConnectionClosed(None, too_big), ConnectionClosed(too_big, too_big, False)]
    theirs = [ConnectionClosed(too_big, too_big, True), ConnectionClosed(too_big, None)]
    neither = [ConnectionClosed(normal, normal, True), ConnectionClosed(None, None)]
    assert [we_closed_for_size(e) for e in ours + theirs + neither] == [True, True] + [False] * 4
    assert [relay_closed_for_size(e) for e in ours + theirs + neither] == [False, False, True, True, False, False]


# -- a relay that ends a live subscription -----------------------------------------------------


async def close_first_req_then_send(relay: ScriptedRelay, ws: ServerConnection, n: int) -> None:
    """The first REQ of a subscription is ended with ``CLOSED error:`` after EOSE; a later one gets an event."""
    reqs = 0
    while True:
        frame = await relay.read(ws)
        if frame[0] != "REQ":
            continue
        reqs += 1
        await ws.send(json.dumps(["EOSE", frame[1]]))
        if reqs == 1:
            await ws.send(json.dumps(["CLOSED", frame[1], "error: subscription expired, please resubscribe"]))
        else:
            await ws.send(json.dumps(["EVENT", frame[1], relay.event.to_dict() if relay.event else {}]))


async def test_a_live_subscription_the_relay_closed_is_sent_again_on_the_same_connection() -> None:
    """After a ``CLOSED error:`` for a live subscription the pool sends its REQ again (no reconnect), and the
    events the relay then sends are delivered."""
    received: list[ReceivedEvent] = []

    async def on_event(event: ReceivedEvent) -> None:
        received.append(event)

    relay = ScriptedRelay(close_first_req_then_send, event=AUTHOR.sign(KIND_COMMENT, "after the resubscribe"))
    async with running(relay), RelayPool([relay.url], settings=FAST, on_event=on_event) as pool:
        await pool.subscribe("mentions", [{"kinds": [KIND_COMMENT]}])
        assert await until(lambda: bool(received), within=5)
        health = pool.health().relays[0]
    assert [r.event.content for r in received] == ["after the resubscribe"]
    assert len(relay.sent("REQ", "mentions")) == 2
    assert health.reconnects == 0
    assert health.subscriptions_closed == 1
    assert health.unserved == {}  # served again: not counted as refused any more
    assert relay.connections == 1


async def close_every_req(relay: ScriptedRelay, ws: ServerConnection, n: int) -> None:
    """Every REQ is ended at once with ``CLOSED`` (the message in ``relay.message``)."""
    while True:
        frame = await relay.read(ws)
        if frame[0] == "REQ":
            await ws.send(json.dumps(["CLOSED", frame[1], relay.message]))


async def _reqs_read_at(message: str, count: int, *, watched_s: float = 0.0) -> list[float]:
    """When a relay that ends every REQ with ``message`` read each REQ: watched until it read ``count`` of
    them (within 10 s) and ``watched_s`` seconds passed since the first."""
    relay = ScriptedRelay(close_every_req, message=message)

    def reqs() -> list[float]:
        return [at for frame, at in zip(relay.frames, relay.read_at, strict=True) if frame[0] == "REQ"]

    async with running(relay), RelayPool([relay.url], settings=FAST) as pool:
        await pool.subscribe("mentions", [{"kinds": [KIND_COMMENT]}])
        assert await until(lambda: len(reqs()) >= count, within=10)
        await asyncio.sleep(max(0.0, reqs()[0] + watched_s - time.monotonic()))
    return reqs()


async def test_a_subscription_closed_again_and_again_is_sent_again_with_backoff_longer_when_refused() -> None:
    """A relay that ends every REQ gets it again with a growing backoff (no hot loop, nor given up); after a
    refusal unlikely to change (``blocked:``) the wait is ten times longer. The waits are read off the
    relay's own clock, so a slow machine only lengthens them."""
    transient = await _reqs_read_at("error: try again", 3, watched_s=1.0)
    refused = await _reqs_read_at("blocked: not for you", 2)
    # waits of 0.025-0.05 s, then 0.05-0.1 s, doubling up to 0.1-0.2 s: at most 12 REQs in the first second
    assert len([at for at in transient if at - transient[0] <= 1.0]) <= 12
    assert transient[1] - transient[0] >= 0.025
    assert transient[2] - transient[1] >= 0.05  # it grew
    assert refused[1] - refused[0] >= 0.25  # the first wait after ``blocked:`` is 0.25-0.5 s


async def test_a_subscription_the_relay_keeps_refusing_shows_as_unserved_in_its_health() -> None:
    """A relay that ends every REQ with ``restricted:`` leaves the subscription unserved, with the relay's
    message and for how long, and each ``CLOSED`` counted: what ``tenexd status`` degrades on."""
    relay = ScriptedRelay(close_every_req, message="restricted: members only")
    async with running(relay), RelayPool([relay.url], settings=FAST) as pool:
        await pool.subscribe("mentions", [{"kinds": [KIND_COMMENT]}])
        assert await until(lambda: bool(pool.health().relays[0].unserved), within=5)
        await asyncio.sleep(0.3)
        health = pool.health().relays[0]
    for_s, message = health.unserved["mentions"]
    assert message == "restricted: members only"
    assert for_s >= 0.3
    assert health.subscriptions_closed >= 1
    assert health.state is RelayState.CONNECTED


async def auth_required_until_third_req(relay: ScriptedRelay, ws: ServerConnection, n: int) -> None:
    """No AUTH challenge is sent; the first two REQs are answered ``CLOSED auth-required:``, the third gets
    an event."""
    while True:
        frame = await relay.read(ws)
        if frame[0] != "REQ":
            continue
        if len(relay.sent("REQ")) < 3:
            await ws.send(json.dumps(["CLOSED", frame[1], "auth-required: we only serve known users"]))
        else:
            await ws.send(json.dumps(["EVENT", frame[1], relay.event.to_dict() if relay.event else {}]))
            await ws.send(json.dumps(["EOSE", frame[1]]))


async def test_a_subscription_whose_auth_failed_is_sent_again_later() -> None:
    """A live subscription answered ``CLOSED auth-required:`` and not authenticated within the timeout (and
    refused again) is sent again later, not dropped: the relay's events come once it serves it."""
    received: list[ReceivedEvent] = []

    async def on_event(event: ReceivedEvent) -> None:
        received.append(event)

    relay = ScriptedRelay(auth_required_until_third_req, event=AUTHOR.sign(KIND_COMMENT, "served at last"))
    signer = Signer.generate(label="daemon")
    async with (
        running(relay),
        RelayPool([relay.url], settings=FAST, on_event=on_event, auth_signer=signer) as pool,
    ):
        await pool.subscribe("mentions", [{"kinds": [KIND_COMMENT]}])
        assert await until(lambda: bool(received), within=5)
    assert [r.event.content for r in received] == ["served at last"]


# -- AUTH challenges ---------------------------------------------------------------------------


async def challenge_many_times(relay: ScriptedRelay, ws: ServerConnection, n: int) -> None:
    """Send 200 AUTH challenges at once, answer none, then just read."""
    for i in range(200):
        await ws.send(json.dumps(["AUTH", f"challenge-{i}"]))
    while True:
        await relay.read(ws)


async def test_repeated_auth_challenges_are_answered_one_at_a_time_and_leave_no_pending_ok() -> None:
    """200 challenges at once are answered one at a time (the first, unless all came before it was answered,
    then only the newest), and an AUTH the relay never answers leaves nothing in the pending OKs once its
    wait is over."""
    relay = ScriptedRelay(challenge_many_times)

    def newest_answered() -> bool:
        sent = relay.sent("AUTH")
        return bool(sent) and ["challenge", "challenge-199"] in sent[-1][1]["tags"]

    async with running(relay), RelayPool([relay.url], settings=FAST, auth_signer=Signer.generate()) as pool:
        assert await pool.wait_connected(within=5)
        assert await until(newest_answered, within=5)
        await asyncio.sleep(3 * FAST.auth_timeout)  # the last AUTH's wait is over
        pending = dict(pool._relays[relay.url].pending_ok)
        answered = relay.sent("AUTH")
    assert 1 <= len(answered) <= 2  # the first challenge is answered alone only when it came alone
    assert newest_answered()
    assert pending == {}


async def challenge_then_hang_up(relay: ScriptedRelay, ws: ServerConnection, n: int) -> None:
    """On the first connection send a challenge, read the AUTH, and close; later ones stay open quietly."""
    if n == 1:
        await ws.send(json.dumps(["AUTH", "challenge"]))
        await relay.read(ws)
        await ws.close()
        return
    while True:
        await relay.read(ws)


async def test_a_drop_ends_the_wait_for_an_auth_ok_and_clears_pending_oks() -> None:
    """An AUTH awaiting its OK when the connection drops stops waiting at once (not after ``auth_timeout``)
    and leaves no pending OK behind."""
    settings = PoolSettings(backoff_base=0.05, backoff_cap=0.2, auth_timeout=30.0)
    relay = ScriptedRelay(challenge_then_hang_up)
    async with running(relay), RelayPool([relay.url], settings=settings, auth_signer=Signer.generate()) as pool:
        assert await until(lambda: relay.connections == 2, within=5)
        await asyncio.sleep(0.3)
        pending = dict(pool._relays[relay.url].pending_ok)
    assert pending == {}
