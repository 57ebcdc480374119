"""A relay's cursor does not pass an event waiting for a retry, so a restart before the retry goes through
asks the relay for it again (the retry set is in memory only)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from tenex_daemon.adapters.nostr.relay_pool import PoolSettings, ReceivedEvent, RelayPool
from tenex_daemon.adapters.nostr.relay_pool.subscriptions import MAX_LEFT, Subscriptions
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.testing import KeyPair, sign_event

URL = "ws://relay"


def test_a_pinned_cursor_stops_at_its_oldest_pin_and_moves_on_once_the_last_goes() -> None:
    """A cursor pinned by events waiting for a retry moves no further than the oldest of them; as pins go it
    moves on toward the newest event accepted meanwhile (up to the oldest pin left), unless it is held; one
    given up on (``left``) still stops it."""
    subs = Subscriptions(since_window=0)
    subs.advance("s", URL, 100)
    subs.pin("s", URL, "x", 150)
    subs.pin("s", URL, "w", 140)
    subs.advance("s", URL, 200)
    assert subs.cursor("s", URL) == 140
    subs.unpin("s", URL, "w")
    assert subs.cursor("s", URL) == 150
    subs.hold("s", URL)
    subs.unpin("s", URL, "x")
    assert subs.cursor("s", URL) == 150  # held: it moves when the catch-up releases it
    subs.release("s", URL)
    assert subs.cursor("s", URL) == 200
    subs.unpin("s", URL, "unknown")  # nothing pinned: no change
    assert subs.cursor("s", URL) == 200
    subs.pin("s", URL, "v", 250)
    subs.unpin("s", URL, "v", left=True)  # given up on: the cursor still stops at it
    subs.advance("s", URL, 300)
    assert subs.cursor("s", URL) == 250


async def test_the_cursor_waits_for_an_event_whose_handler_failed_until_its_retry_went_through() -> None:
    """While an event whose handler raised waits for its retry, a later event's delivery moves its relay's
    cursor only up to the waiting event's ``created_at`` (what a restart asks from); once the retry went
    through, the cursor moves to the later event."""
    keys = KeyPair.from_seed(91)
    now = int(time.time())
    waiting = sign_event(keys, "question X", created_at=now - 400)
    later = sign_event(keys, "later message Y", created_at=now - 10)
    failing = {waiting.id}
    handed: list[str] = []

    async def on_event(received: ReceivedEvent) -> None:
        if received.event.id in failing:
            raise RuntimeError("a transient failure")
        handed.append(received.event.content)

    settings = PoolSettings(retry_base=0.3, retry_cap=0.3)
    pool = RelayPool([], on_event=on_event, store=MemoryStore(), settings=settings)
    await pool.start()
    try:
        await pool.intake(waiting, URL, "mentions")
        await pool.intake(later, URL, "mentions")
        for _ in range(100):
            if handed:
                break
            await asyncio.sleep(0.01)
        assert handed == ["later message Y"]
        assert pool.health().retrying == 1
        assert pool.cursor("mentions", URL) == waiting.created_at
        failing.clear()
        for _ in range(200):
            if len(handed) == 2:
                break
            await asyncio.sleep(0.01)
        assert handed == ["later message Y", "question X"]
        assert pool.cursor("mentions", URL) == later.created_at
    finally:
        await pool.stop()


@dataclass
class Dropped:
    """A pool whose retry set holds one event: ``dropped`` (failed first) was dropped from it when
    ``failing_too`` failed; ``later`` is not taken in yet. ``failing``: the ids its handler still fails on;
    ``handed``: the contents handed over."""

    pool: RelayPool
    dropped: NostrEvent
    failing_too: NostrEvent
    later: NostrEvent
    failing: set[str]
    handed: list[str]

    async def handed_over(self, count: int) -> None:
        """Wait (up to 2 s) until ``count`` events were handed over."""
        for _ in range(200):
            if len(self.handed) == count:
                return
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def dropped_from_a_full_retry_set(seed: int) -> AsyncIterator[Dropped]:
    """A started pool (a retry set of one) after an event was dropped from its full retry set; stopped after."""
    keys = KeyPair.from_seed(seed)
    now = int(time.time())
    dropped = sign_event(keys, "dropped", created_at=now - 500)
    failing_too = sign_event(keys, "failing too", created_at=now - 300)
    later = sign_event(keys, "later", created_at=now - 10)
    failing = {dropped.id, failing_too.id}
    handed: list[str] = []

    async def on_event(received: ReceivedEvent) -> None:
        if received.event.id in failing:
            raise RuntimeError("a transient failure")
        handed.append(received.event.content)

    settings = PoolSettings(retry_base=0.2, retry_cap=0.2, retry_capacity=1)
    pool = RelayPool([], on_event=on_event, store=MemoryStore(), settings=settings)
    await pool.start()
    try:
        for event in (dropped, failing_too):
            await pool.intake(event, URL, "mentions")
        for _ in range(100):
            if pool.consumer_errors == 2:  # the second failure dropped the first from the set
                break
            await asyncio.sleep(0.01)
        yield Dropped(pool, dropped, failing_too, later, failing, handed)
    finally:
        await pool.stop()


async def test_an_event_dropped_from_a_full_retry_set_still_stops_its_cursor_for_the_run() -> None:
    """An event dropped from a full retry set is left to the next start: its relay's cursor does not pass
    it for the rest of the run, though later events go through and no retry waits for it."""
    async with dropped_from_a_full_retry_set(92) as rig:
        rig.failing.discard(rig.failing_too.id)
        await rig.pool.intake(rig.later, URL, "mentions")
        await rig.handed_over(2)
        health = rig.pool.health()
        assert sorted(rig.handed) == ["failing too", "later"]
        assert (health.retrying, health.retry_dropped) == (0, 1)
        assert rig.pool.cursor("mentions", URL) == rig.dropped.created_at


def test_a_left_event_handed_over_again_frees_its_cursor_and_past_the_cap_the_oldest_stops_it() -> None:
    """An event given up on stops its cursor only until a relay's copy of it is handed over (the cursor then
    moves to the newest event accepted meanwhile); past MAX_LEFT events left, the oldest stops its cursor for
    the rest of the run, as before."""
    subs = Subscriptions(since_window=0)
    subs.advance("s", URL, 100)
    subs.pin("s", URL, "v", 250)
    subs.unpin("s", URL, "v", left=True)
    subs.advance("s", URL, 300)
    assert subs.cursor("s", URL) == 250
    subs.handed_over("v")  # a relay sent it again and it went through
    assert subs.cursor("s", URL) == 300
    subs.advance("s", URL, 310)
    assert subs.cursor("s", URL) == 310

    for n in range(MAX_LEFT + 1):
        subs.pin("s", URL, f"e{n}", 400 + n)
        subs.unpin("s", URL, f"e{n}", left=True)
    subs.advance("s", URL, 5_000)
    for n in range(MAX_LEFT + 1):
        subs.handed_over(f"e{n}")
    assert subs.cursor("s", URL) == 400  # e0, past the cap, stops it for the run


async def test_an_event_dropped_from_the_retry_set_then_sent_again_lets_its_cursor_move_on() -> None:
    """An event dropped from a full retry set that a relay sends again once its handler works (a catch-up) is
    handed over, and its relay's cursor moves on to the newest event taken in: it no longer stays there for
    the rest of the run, making every reconnect ask again for all that came since."""
    async with dropped_from_a_full_retry_set(93) as rig:
        rig.failing.clear()
        await rig.pool.intake(rig.later, URL, "mentions")
        await rig.pool.intake(rig.dropped, URL, "mentions")  # the relay's copy, sent again
        await rig.handed_over(3)
        assert sorted(rig.handed) == ["dropped", "failing too", "later"]
        assert rig.pool.cursor("mentions", URL) == rig.later.created_at


def test_an_event_left_through_two_relays_frees_both_cursors_once_handed_over() -> None:
    """An event whose copies from two relays were each given up on stops both relays' cursors; once a copy is
    handed over, both move on (the second relay's leave replaced the first's, whose cursor stayed frozen)."""
    subs = Subscriptions(since_window=0)
    for url in (URL, "ws://other"):
        subs.advance("s", url, 100)
        subs.pin("s", url, "v", 150)
        subs.unpin("s", url, "v", left=True)
        subs.advance("s", url, 300)
    assert (subs.cursor("s", URL), subs.cursor("s", "ws://other")) == (150, 150)

    subs.handed_over("v")

    assert (subs.cursor("s", URL), subs.cursor("s", "ws://other")) == (300, 300)


async def test_a_handler_failing_on_every_event_logs_a_bounded_number_of_lines_and_counts_every_failure() -> None:
    """A handler that fails on every event (a full disk) logs at most 20 tracebacks a minute per error type,
    and at most 20 drops from the full retry set, however many events come: every failure and every drop is
    still counted, and the drops are exported in /metrics (``tenexd_intake_retry_dropped_total``)."""
    from structlog.testing import capture_logs

    from tenex_daemon.app.metrics import Metrics

    async def on_event(received: ReceivedEvent) -> None:
        raise OSError(28, "No space left on device")

    keys = KeyPair.from_seed(93)
    events = [sign_event(keys, f"message {n}") for n in range(60)]
    settings = PoolSettings(retry_base=60.0, retry_cap=60.0, retry_capacity=10)
    pool = RelayPool([], on_event=on_event, store=MemoryStore(), settings=settings)
    metrics = Metrics()
    metrics.watch_pool(pool.health)
    await pool.start()
    try:
        with capture_logs() as logs:
            for event in events:
                await pool.intake(event, URL, "mentions")
            for _ in range(300):
                if pool.consumer_errors == len(events):
                    break
                await asyncio.sleep(0.01)
        health = pool.health()
    finally:
        await pool.stop()
    said = [entry["event"] for entry in logs]
    assert (health.consumer_errors, health.retry_dropped) == (60, 50)
    assert said.count("event handler failed") == 20
    assert said.count("event dropped from the retry set") == 20
    assert b"tenexd_intake_retry_dropped_total 50.0" in metrics.render()
