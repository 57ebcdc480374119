"""A relay killed and restarted mid-stream: every event published meanwhile is delivered once."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from tenex_daemon.adapters.nostr.relay_pool import RelayPool, RelayState
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.core.events import compute_event_id
from tenex_daemon.core.vocabulary import KIND_COMMENT
from tenex_daemon.testing import KeyPair

from .conftest import FAST
from .harness import Collector, LocalRelayServer, NodeTool, NostrRelayProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]

AGENT = KeyPair.from_seed(201)
USER = KeyPair.from_seed(202)
COUNT = 24


def stream_templates(start: int) -> tuple[list[dict[str, Any]], list[str]]:
    """COUNT kind-1111 events p-tagging the agent, one second apart, and their ids."""
    templates: list[dict[str, Any]] = []
    ids: list[str] = []
    for i in range(COUNT):
        tags = [["p", AGENT.pubkey]]
        content = f"message {i}"
        templates.append({"kind": KIND_COMMENT, "content": content, "tags": tags, "created_at": start + i})
        ids.append(compute_event_id(USER.pubkey, start + i, KIND_COMMENT, tags, content))
    return templates, ids


async def test_relay_killed_and_restarted_mid_stream(
    real_relay: LocalRelayServer | NostrRelayProcess, node: NodeTool
) -> None:
    """While nostr-tools keeps publishing, the relay dies and comes back; nothing is lost or doubled."""
    collector = Collector()
    store = MemoryStore()
    pool = RelayPool([real_relay.url], on_event=collector, store=store, settings=FAST)
    await pool.start()
    try:
        await pool.subscribe("mentions", [{"kinds": [KIND_COMMENT], "#p": [AGENT.pubkey]}])
        assert await pool.wait_connected(within=15)
        templates, ids = stream_templates(int(time.time()) - COUNT - 5)
        publisher = await node.start({"op": "publish", "relays": [real_relay.url], "secret": USER.secret,
                                      "templates": templates, "interval_ms": 60, "deadline_ms": 60000})
        published: list[str] = []
        restarted = False
        async for line in node.lines(publisher):
            if "published" in line:
                published.append(line["published"])
            if len(published) == COUNT // 3 and not restarted:
                restarted = True
                # the client keeps publishing (and retrying) while the relay is down
                await real_relay.restart(down_for=0.8)
            if line.get("done"):
                break
        assert await publisher.wait() == 0
        assert restarted
        assert sorted(published) == sorted(ids)
        assert await collector.wait_for(lambda c: len(c.received) >= COUNT, within=30)
        await asyncio.sleep(0.5)
        assert sorted(collector.ids) == sorted(ids)  # every event, none twice
        health = pool.health().relays[0]
        assert health.reconnects >= 1
        assert health.state is RelayState.CONNECTED
    finally:
        await pool.stop()
