"""tenexd SIGKILLed again and again while a real client (nostr-tools) streams messages at it."""

from __future__ import annotations

import asyncio
import os
import random
import time

import pytest

from tests.e2e.harness import DaemonProcess, Home
from tests.evidence import record, scale
from tests.faults.harness import StreamClient, answering_agents, keep_sending, log_tails, tally
from tests.integration.nostr.harness import LocalRelayServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SEED = int(os.environ.get("FAULTS_SEED", "1124"))


async def test_sigkills_under_a_client_stream_leave_every_message_answered_once(
    relay: LocalRelayServer, home: Home, daemon: DaemonProcess
) -> None:
    """After many SIGKILLs at random moments of a client's stream (each followed by a restart), every
    message the client published has exactly one agent reply on the relay: none lost, none doubled."""
    kills = scale(5, 50)
    rng = random.Random(SEED)
    since = int(time.time()) - 5
    done = False
    async with StreamClient([relay.url], home.owner_secret) as client:
        sender = asyncio.create_task(keep_sending(client, home, lambda: done, rng, gap=(0.0, 0.25)))
        try:
            for _ in range(kills):
                await asyncio.sleep(rng.uniform(0.05, 0.8))  # up, answering, for a random while
                daemon.kill()  # SIGKILL
                await asyncio.sleep(rng.uniform(0.0, 0.3))  # down while messages keep coming
                await daemon.start()
        finally:
            done = True
            await sender
    result = await tally([relay.url], answering_agents(home), client.sent, since)
    record("faults.sigkill", kills=kills, **result.figures())
    assert result.lost == [], log_tails([daemon])
    assert result.doubled == {}, log_tails([daemon])
    assert len(result.sent) >= kills
