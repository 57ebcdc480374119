"""Where a subscription asks a relay to start (``since``): never past now, so a clock stepped back leaves no
message unasked; and from the other relays' cursors for a relay added to the settings, not from its whole
history (docs/PROTOCOL.md, "Relays")."""

from __future__ import annotations

import pytest

from tenex_daemon.adapters.nostr.relay_pool import subscriptions as module
from tenex_daemon.adapters.nostr.relay_pool.subscriptions import Subscription, Subscriptions
from tenex_daemon.adapters.storage.memory import MemoryStore

A, B = "ws://a", "ws://b"
NOW = 1_800_000_000
WINDOW = 300


@pytest.fixture(autouse=True)
def clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wall clock reads :data:`NOW`."""
    monkeypatch.setattr("tenex_daemon.adapters.nostr.relay_pool.subscriptions.time.time", lambda: NOW + 0.5)


def since(subs: Subscriptions, sub: Subscription, url: str) -> int | None:
    """The ``since`` of the subscription's first filter for ``url`` (None: none asked)."""
    value = subs.filters_for(sub, url)[0].get("since")
    return None if value is None else int(value)


async def test_a_stored_cursor_ahead_of_the_clock_asks_from_now_not_from_the_cursor() -> None:
    """A cursor stored while the clock ran an hour fast, read after it was stepped back: the relay is asked
    from now minus the window (before, from the cursor: every message of that hour was never asked for),
    and the next accepted event brings the cursor back to now."""
    store = MemoryStore()
    await store.set_meta(module.cursor_key("live", A), str(NOW + 3_600))
    subs = Subscriptions(since_window=WINDOW)
    sub = Subscription("live", [{"kinds": [1]}])
    await subs.add(sub, [A], store)

    assert since(subs, sub, A) == NOW - WINDOW
    subs.advance("live", A, NOW - 10)
    assert subs.cursor("live", A) == NOW


async def test_a_relay_added_to_the_settings_starts_from_the_oldest_cursor_of_the_others() -> None:
    """A relay with no cursor of its own, beside relays the subscription has cursors on, is asked from the
    oldest of them minus the window (before, from its whole history: a 90-day-old message it alone held was
    answered as new); a private subscription's lookback applies to it too."""
    store = MemoryStore()
    await store.set_meta(module.cursor_key("live", A), str(NOW - 100))
    await store.set_meta(module.cursor_key("live", "ws://c"), str(NOW - 50))
    subs = Subscriptions(since_window=WINDOW)
    live = Subscription("live", [{"kinds": [1]}])
    wraps = Subscription("wraps", [{"kinds": [1059]}], lookback_s=86_400)
    await subs.add(live, [A, "ws://c", B], store)
    await store.set_meta(module.cursor_key("wraps", A), str(NOW - 100))
    await subs.add(wraps, [A, B], store)

    assert since(subs, live, B) == NOW - 100 - WINDOW
    assert since(subs, wraps, B) == NOW - 100 - WINDOW - 86_400


async def test_a_new_home_without_any_cursor_asks_each_relay_without_since() -> None:
    """With no cursor on any relay (a new home), the subscription is asked as made: no ``since``."""
    subs = Subscriptions(since_window=WINDOW)
    sub = Subscription("live", [{"kinds": [1]}])
    await subs.add(sub, [A, B], MemoryStore())

    assert since(subs, sub, A) is None
    assert since(subs, sub, B) is None


async def test_every_relay_replaced_starts_from_the_cursor_the_subscription_had_on_the_old_ones() -> None:
    """A daemon whose relays were all replaced in the settings asks the new ones from the oldest cursor it had
    on the old ones (kept at each flush under no relay's name), minus the window: before, it asked them for
    their whole history, and a days-old message only a new relay held was answered as new."""
    store = MemoryStore()
    before = Subscriptions(since_window=WINDOW)
    live = Subscription("live", [{"kinds": [1]}])
    await before.add(live, [A, "ws://c"], store)
    before.advance("live", A, NOW - 100)
    before.advance("live", "ws://c", NOW - 50)
    await before.flush(store)

    after = Subscriptions(since_window=WINDOW)
    await after.add(live, [B], store)

    assert since(after, live, B) == NOW - 100 - WINDOW


async def test_with_every_relay_replaced_a_new_relay_with_a_cursor_hides_nothing_from_the_others() -> None:
    """Every relay replaced: once one new relay has a cursor (it answered first), another new one still starts
    from the cursor the subscription had on the old relays, not from the first one's fresh cursor."""
    store = MemoryStore()
    await store.set_meta(module.cursor_key("live", module.ANY_RELAY), str(NOW - 100))
    subs = Subscriptions(since_window=WINDOW)
    live = Subscription("live", [{"kinds": [1]}])
    await subs.add(live, [B, "ws://c"], store)

    subs.advance("live", B, NOW - 10)

    assert since(subs, live, "ws://c") == NOW - 100 - WINDOW


async def test_a_home_from_before_the_key_keeps_it_at_the_first_subscription() -> None:
    """A home whose relays have cursors but no cursor under no relay's name (kept before the key existed)
    keeps it when the subscription is added, not only once an event moves a cursor: a home upgraded, then
    quiet, then given new relays does not ask them for their whole history."""
    store = MemoryStore()
    await store.set_meta(module.cursor_key("live", A), str(NOW - 100))
    await store.set_meta(module.cursor_key("live", "ws://c"), str(NOW - 50))

    await Subscriptions(since_window=WINDOW).add(Subscription("live", [{"kinds": [1]}]), [A, "ws://c"], store)

    assert await store.get_meta(module.cursor_key("live", module.ANY_RELAY)) == str(NOW - 100)


async def test_a_recent_cursor_asks_from_the_slow_clock_allowance_before_now_so_late_dated_live_events_pass() -> None:
    """A cursor ten seconds old asks from now minus the window and the slow-clock allowance, not from the
    cursor minus the window: relays apply ``since`` to live events too, and a message dated ten minutes ago,
    sent after the REQ, was dropped; an older cursor is asked from as before."""
    store = MemoryStore()
    await store.set_meta(module.cursor_key("live", A), str(NOW - 10))
    await store.set_meta(module.cursor_key("live", B), str(NOW - 7_200))
    subs = Subscriptions(since_window=WINDOW, slow_clock_allowance=3_600)
    sub = Subscription("live", [{"kinds": [1]}])
    await subs.add(sub, [A, B], store)

    assert since(subs, sub, A) == NOW - WINDOW - 3_600
    assert since(subs, sub, B) == NOW - 7_200 - WINDOW


async def test_a_filters_own_since_ahead_of_the_clock_asks_from_now() -> None:
    """A filter's own ``since`` dated an hour ahead (kept by a first start whose clock ran fast) is asked as now,
    with a cursor or without one (before, as it was: nothing the relay got until then was heard)."""
    ahead = Subscription("live", [{"kinds": [1], "since": NOW + 3_600}])
    without = Subscriptions(since_window=WINDOW)
    await without.add(ahead, [A], MemoryStore())
    store = MemoryStore()
    await store.set_meta(module.cursor_key("live", A), str(NOW - 100))
    with_cursor = Subscriptions(since_window=WINDOW)
    await with_cursor.add(ahead, [A], store)

    assert since(without, ahead, A) == NOW
    assert since(with_cursor, ahead, A) == NOW
