"""tenexd killed with SIGKILL at random moments while messages stream in, and started again each time."""

from __future__ import annotations

import asyncio
import os
import random
from collections import defaultdict

import pytest

from tenex_daemon.adapters.nostr.relay_pool import PoolSettings, ReceivedEvent, RelayPool
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.core.events import NostrEvent
from tests.e2e.harness import DaemonProcess, Home
from tests.integration.nostr.harness import LocalRelayServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KILLS = 4
PER_ROUND = 12
SEED = int(os.environ.get("CRASH_DAEMON_SEED", "1123"))


async def test_sigkill_mid_stream_leaves_every_message_answered_once(
    relay: LocalRelayServer, home: Home, daemon: DaemonProcess
) -> None:
    """After SIGKILLs at random moments and restarts, every message gets exactly one agent reply (none lost, none twice)."""
    rng = random.Random(SEED)
    owner = Signer.from_text(home.owner_secret)
    agents = [home.agent(slug) for slug in ("planner", "orchestrator")]
    replies: defaultdict[str, set[str]] = defaultdict(set)

    async def on_event(received: ReceivedEvent) -> None:
        parent = received.event.tag_value("e")
        if parent is not None:
            replies[parent].add(received.event.id)

    client = RelayPool([relay.url], on_event=on_event, settings=PoolSettings(publish_timeout=10.0))
    await client.start()
    await client.subscribe("replies", [{"kinds": [1111], "authors": agents}])
    assert await client.wait_connected(within=10)
    sent: list[NostrEvent] = []

    async def publish(n: int) -> None:
        # half address the planner, half the project (the orchestrator routes them)
        tags = [["p", home.agent("planner") if n % 2 == 0 else home.project]]
        event = owner.sign(11, f"message {n}: plan something", tags)
        await client.publish(event)
        sent.append(event)

    try:
        for round_ in range(KILLS):
            stream = asyncio.create_task(_stream(publish, round_ * PER_ROUND, rng))
            await asyncio.sleep(rng.uniform(0.02, 0.4))
            daemon.kill()  # SIGKILL, mid-stream
            await stream
            await daemon.start()
        for _ in range(600):  # up to 60 s
            if all(replies[e.id] for e in sent):
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # a second answer, if any, would come now
    finally:
        await client.stop()

    assert len(sent) == KILLS * PER_ROUND
    wrong = {e.content: len(replies[e.id]) for e in sent if len(replies[e.id]) != 1}
    assert wrong == {}, daemon.log_tail()


async def _stream(publish: object, start: int, rng: random.Random) -> None:
    assert callable(publish)
    for n in range(start, start + PER_ROUND):
        await publish(n)
        await asyncio.sleep(rng.uniform(0.0, 0.04))
