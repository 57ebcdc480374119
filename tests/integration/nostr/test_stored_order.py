"""Against real relays: the stored events a subscription is sent (newest first, as relays send them) reach
the consumer oldest first, and a live message dated before the subscription's ``since`` (its sender's clock
running slow) is still heard (docs/PROTOCOL.md, "Relays")."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from websockets.asyncio.client import connect

from tenex_daemon.adapters.nostr.relay_pool import RelayPool
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.vocabulary import KIND_CONVERSATION_ROOT
from tenex_daemon.testing import KeyPair, sign_event

from .conftest import FAST
from .harness import Collector, LocalRelayServer, NostrRelayProcess

pytestmark = [pytest.mark.integration]

AGENT = KeyPair.from_seed(121)
PERSON = KeyPair.from_seed(122)
FILTERS: list[dict[str, Any]] = [{"kinds": [KIND_CONVERSATION_ROOT], "#p": [AGENT.pubkey]}]


def message(text: str, created_at: int) -> NostrEvent:
    """A kind-11 message of the person to the agent."""
    return sign_event(PERSON, text, kind=KIND_CONVERSATION_ROOT, tags=[["p", AGENT.pubkey]], created_at=created_at)


async def publish_directly(url: str, events: list[NostrEvent]) -> None:
    """Store the events on the relay, each answered ``OK true``, as a person's client would while no daemon
    listens."""
    async with connect(url, max_size=None) as ws:
        for event in events:
            await ws.send(json.dumps(["EVENT", event.to_dict()]))
            while True:
                frame = json.loads(await asyncio.wait_for(ws.recv(), 10))
                if frame[0] == "OK":
                    assert frame[2], frame
                    break


async def written_while_down(url: str, store: MemoryStore | None) -> list[str]:
    """ONE, TWO and THREE, a second apart, stored on the relay; with ``store``, a cursor from before them as
    a restarted daemon has. Return their contents in the order the pool hands them over."""
    now = int(time.time())
    if store is not None:
        await store.set_meta(f"nostr.cursor:mentions:{url}", str(now - 60))
    await publish_directly(url, [message(text, now - 3 + n) for n, text in enumerate(("ONE", "TWO", "THREE"))])
    collector = Collector()
    async with RelayPool([url], on_event=collector, store=store or MemoryStore(), settings=FAST) as pool:
        await pool.subscribe("mentions", FILTERS)
        assert await collector.wait_for(lambda c: len(c.received) >= 3, within=20)
        await asyncio.sleep(0.3)  # a copy taken in twice would come now
    return [received.event.content for received in collector.received]


async def test_messages_written_while_the_daemon_was_down_reach_it_oldest_first(
    real_relay: LocalRelayServer | NostrRelayProcess,
) -> None:
    """Three messages written while no daemon listened are handed over oldest first by the catch-up of a
    restart (before, newest first: the last one was answered alone, the first two then as a burst)."""
    assert await written_while_down(real_relay.url, MemoryStore()) == ["ONE", "TWO", "THREE"]


async def test_a_first_subscriptions_stored_events_reach_the_consumer_oldest_first(
    real_relay: LocalRelayServer | NostrRelayProcess,
) -> None:
    """Without a cursor (a new home) the relay's one answer is handed over oldest first too."""
    assert await written_while_down(real_relay.url, None) == ["ONE", "TWO", "THREE"]


async def test_a_catch_up_paged_past_the_relays_cap_reaches_the_consumer_oldest_first(
    local_relay: LocalRelayServer,
) -> None:
    """1,200 messages missed (the relay sends 500 per REQ, so the catch-up pages) are each handed over once,
    all of them in order of ``created_at`` then id, though the relay sent every page newest first."""
    now = int(time.time())
    store = MemoryStore()
    await store.set_meta(f"nostr.cursor:mentions:{local_relay.url}", str(now - 400))
    missed = [message(f"message {n}", now - 300 + n // 5) for n in range(1_200)]
    await publish_directly(local_relay.url, missed)
    collector = Collector()

    async with RelayPool([local_relay.url], on_event=collector, store=store, settings=FAST) as pool:
        await pool.subscribe("mentions", FILTERS)
        assert await collector.wait_for(lambda c: len(c.received) >= len(missed), within=60)
        await asyncio.sleep(0.3)

    in_order = sorted(missed, key=lambda event: (event.created_at, event.id))
    assert collector.ids == [event.id for event in in_order]


async def test_a_message_from_a_clock_ten_minutes_slow_is_heard_right_after_a_restart(
    real_relay: LocalRelayServer | NostrRelayProcess,
) -> None:
    """A restarted daemon (its cursor a few seconds old) hears a message dated ten minutes ago that is sent
    after it subscribed: relays apply ``since`` to live events too, and it was cursor minus the window (before,
    the relay dropped the message and no later REQ asked for it)."""
    store = MemoryStore()
    await store.set_meta(f"nostr.cursor:mentions:{real_relay.url}", str(int(time.time()) - 5))
    collector = Collector()

    async with RelayPool([real_relay.url], on_event=collector, store=store, settings=FAST) as pool:
        await pool.subscribe("mentions", FILTERS)
        assert await pool.wait_connected(within=10)
        await asyncio.sleep(0.5)  # the REQ is read and answered (EOSE): what comes next is live
        slow = message("from a phone whose clock is 10 min slow", int(time.time()) - 600)
        await publish_directly(real_relay.url, [slow])
        assert await collector.wait_for(lambda c: slow.id in c.ids, within=30)  # a relay lagging under load
