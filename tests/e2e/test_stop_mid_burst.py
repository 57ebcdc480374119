"""A daemon stopped while a burst of messages is still coming in leaves what it had not taken in to the
relay, quietly, and after its restart every message of the burst is answered once: more of them than the
relay sends for one request (500) included, since the restarted daemon asks for what it missed page by page."""

from __future__ import annotations

import asyncio
import json
import time

from websockets.asyncio.client import connect

from tenex_daemon.adapters.nostr.signer import Signer
from tests.e2e.harness import DaemonProcess, Home
from tests.integration.nostr.harness import LocalRelayServer

BURST = 700
PER_SECOND = 7
"""The burst is dated over the last 100 seconds, a few messages a second, as many people writing at once."""


async def test_a_stop_mid_burst_loses_nothing_and_logs_no_failure(
    relay: LocalRelayServer, home: Home, daemon: DaemonProcess
) -> None:
    """700 new conversations for the planner are sent at once; the daemon gets SIGTERM once a few are answered
    and exits 0, logging no handler failure and no refused frame (at most one count of the events it left to
    the relay); restarted, it answers each of the 700 exactly once."""
    owner, planner = Signer.from_text(home.owner_secret), home.agent("planner")
    start = int(time.time()) - BURST // PER_SECOND
    events = [
        owner.sign(11, f"message {n}", [["p", planner]], created_at=start + n // PER_SECOND) for n in range(BURST)
    ]
    answers: dict[str, int] = {}

    async with connect(relay.url, max_size=None) as ws:
        await ws.send(json.dumps(["REQ", "answers", {"kinds": [1111], "#p": [owner.pubkey]}]))

        async def read() -> None:
            async for message in ws:
                frame = json.loads(message)
                if frame[0] == "EVENT":
                    root = next((t[1] for t in frame[2]["tags"] if t[:1] == ["E"] and len(t) > 1), "")
                    answers[root] = answers.get(root, 0) + 1

        reader = asyncio.create_task(read())
        try:
            for event in events:
                await ws.send(json.dumps(["EVENT", event.to_dict()]))
            while len(answers) < 20:  # noqa: ASYNC110 - waiting for the daemon's answers to arrive
                await asyncio.sleep(0.05)
            assert await daemon.stop() == 0
            stopped_with = len(answers)
            log = daemon.log_path.read_text()

            await daemon.start()
            deadline = time.monotonic() + 120
            while len(answers) < BURST and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.2)
            await asyncio.sleep(1.0)  # an answer given twice would arrive now
        finally:
            reader.cancel()

    assert stopped_with < BURST
    assert "event handler failed" not in log
    assert "frame rejected" not in log  # a relay's events for the subscription closed at the stop included
    assert log.count('"events_left_to_relays"') <= 1  # none when every event was in by the stop
    assert sorted(answers) == sorted(event.id for event in events), daemon.log_tail()
    assert set(answers.values()) == {1}
