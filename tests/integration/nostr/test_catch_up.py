"""A restarted daemon asks its relays for what it missed from its cursor; a relay sends a capped number of
stored events per REQ (nostr-sdk's LocalRelay: 500, newest first), so the pool asks for older ones a page at
a time until none is left, and its cursor moves only once every one of them was handed over."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from websockets.asyncio.client import connect

from tenex_daemon.adapters.nostr.relay_pool import RelayPool
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.core.vocabulary import KIND_CONVERSATION_ROOT
from tenex_daemon.testing import KeyPair, sign_event

from .conftest import FAST
from .harness import Collector, LocalRelayServer

pytestmark = [pytest.mark.integration]

AGENT = KeyPair.from_seed(111)
USER = KeyPair.from_seed(112)
MISSED = 1_300
"""More than twice the 500 events the relay sends for one REQ."""
FILTERS: list[dict[str, Any]] = [{"kinds": [KIND_CONVERSATION_ROOT], "#p": [AGENT.pubkey]}]


async def publish_directly(url: str, count: int, start: int) -> set[str]:
    """Store ``count`` kind-11 events p-tagging the agent on the relay (dated from ``start`` on, a few per
    second), as people wrote them while no daemon was listening; return their ids."""
    events = [
        sign_event(USER, f"message {n}", kind=KIND_CONVERSATION_ROOT, tags=[["p", AGENT.pubkey]],
                   created_at=start + n // 7)
        for n in range(count)
    ]
    async with connect(url, max_size=None) as ws:
        for event in events:
            await ws.send(json.dumps(["EVENT", event.to_dict()]))
        answered = 0
        while answered < count:
            frame = json.loads(await asyncio.wait_for(ws.recv(), 20))
            if frame[0] == "OK":
                assert frame[2], frame
                answered += 1
    return {event.id for event in events}


async def test_a_restart_gets_every_event_missed_though_the_relay_sends_500_per_request(
    local_relay: LocalRelayServer,
) -> None:
    """With a cursor from an earlier run and 1,300 events stored since, the pool hands over each of the 1,300
    once (the relay's first answer held 500), and its cursor ends at the newest of them."""
    store = MemoryStore()
    start = int(time.time()) - MISSED // 7 - 5
    await store.set_meta(f"nostr.cursor:mentions:{local_relay.url}", str(start - 1))
    missed = await publish_directly(local_relay.url, MISSED, start)
    collector = Collector()

    async with RelayPool([local_relay.url], on_event=collector, store=store, settings=FAST) as pool:
        await pool.subscribe("mentions", FILTERS)
        assert await collector.wait_for(lambda c: len(c.received) >= MISSED, within=60)
        await asyncio.sleep(0.5)  # a page asked twice would hand its events over again now
        assert sorted(collector.ids) == sorted(missed)
        assert pool.cursor("mentions", local_relay.url) == start + (MISSED - 1) // 7


async def test_a_first_subscription_takes_what_the_relay_sends_and_asks_no_further(
    local_relay: LocalRelayServer,
) -> None:
    """Without a cursor (a home's first start) the pool takes the relay's one answer, the newest 500, and does
    not page through everything the relay ever stored for the agent."""
    await publish_directly(local_relay.url, 600, int(time.time()) - 200)
    collector = Collector()

    async with RelayPool([local_relay.url], on_event=collector, store=MemoryStore(), settings=FAST) as pool:
        await pool.subscribe("mentions", FILTERS)
        assert await collector.wait_for(lambda c: len(c.received) >= 500, within=30)
        await asyncio.sleep(1.0)
        assert len(collector.received) == 500
