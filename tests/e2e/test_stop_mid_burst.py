"""A daemon stopped while a burst of messages is still coming in leaves what it had not taken in to the
relay, quietly, and after its restart every message of the burst is answered once: more of them than the
relay sends for one request (500) included, since the restarted daemon asks for what it missed page by page."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from websockets.asyncio.client import connect

from tenex_daemon.adapters.nostr.signer import Signer
from tests.e2e.harness import DaemonProcess, Home
from tests.integration.nostr.harness import LocalRelayServer

BURST = 700
PER_SECOND = 7
"""The burst is dated over the last 100 seconds, a few messages a second, as many people writing at once."""


async def replies_on_relay(url: str, person: str) -> dict[str, set[str]]:
    """Every kind-1111 reply the relay holds addressed to ``person``, by the root it answers (a set of reply
    ids each), read a page at a time (``until``), as the relay sends at most 500 events per request."""
    replies: dict[str, set[str]] = {}
    seen: set[str] = set()
    until: int | None = None
    async with connect(url, max_size=None) as ws:
        for page in range(100):
            flt: dict[str, Any] = {"kinds": [1111], "#p": [person]}
            if until is not None:
                flt["until"] = until
            await ws.send(json.dumps(["REQ", f"page{page}", flt]))
            fresh, oldest = 0, until
            while True:
                frame = json.loads(await asyncio.wait_for(ws.recv(), 20))
                if frame[0] == "EOSE":
                    break
                if frame[0] != "EVENT" or frame[2]["id"] in seen:
                    continue
                event = frame[2]
                seen.add(event["id"])
                fresh += 1
                oldest = event["created_at"] if oldest is None else min(oldest, event["created_at"])
                root = next((t[1] for t in event["tags"] if t[:1] == ["E"] and len(t) > 1), "")
                replies.setdefault(root, set()).add(event["id"])
            await ws.send(json.dumps(["CLOSE", f"page{page}"]))
            if not fresh:
                return replies
            until = oldest
    return replies


async def answered(url: str, person: str, at_least: int, within: float) -> dict[str, set[str]]:
    """The replies on the relay once at least ``at_least`` roots have one, or after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        replies = await replies_on_relay(url, person)
        if len(replies) >= at_least or time.monotonic() > deadline:
            return replies
        await asyncio.sleep(0.5)


async def taken_in(daemon: DaemonProcess, at_least: int, within: float) -> int:
    """How many events the daemon's log says it handled, once at least ``at_least`` or after ``within`` seconds.
    The stop is timed by the daemon's own log, not by reading replies back: under the burst a relay's answer to a
    REQ can lag the daemon by seconds, long enough for the daemon to answer the whole burst before the stop."""
    deadline = time.monotonic() + within
    while True:
        handled = daemon.log_path.read_text(errors="replace").count('"event": "event_handled"')
        if handled >= at_least or time.monotonic() > deadline:
            return handled
        await asyncio.sleep(0.05)


async def test_a_stop_mid_burst_loses_nothing_and_logs_no_failure(
    relay: LocalRelayServer, home: Home, daemon: DaemonProcess
) -> None:
    """700 new conversations for the planner are sent at once; the daemon gets SIGTERM once it has taken in a few
    and exits 0, logging no handler failure and no refused frame (at most one count of the events it left to
    the relay); restarted, it answers each of the 700 with exactly one reply (read back from the relay)."""
    owner, planner = Signer.from_text(home.owner_secret), home.agent("planner")
    start = int(time.time()) - BURST // PER_SECOND
    events = [
        owner.sign(11, f"message {n}", [["p", planner]], created_at=start + n // PER_SECOND) for n in range(BURST)
    ]
    async with connect(relay.url, max_size=None) as ws:
        for event in events:
            await ws.send(json.dumps(["EVENT", event.to_dict()]))
        assert await taken_in(daemon, 20, within=60) >= 20
        assert await daemon.stop() == 0
    stopped_with = len(await replies_on_relay(relay.url, owner.pubkey))
    log = daemon.log_path.read_text()

    await daemon.start()
    replies = await answered(relay.url, owner.pubkey, BURST, within=120)
    await asyncio.sleep(1.0)  # a second reply to one of them would be on the relay now
    replies = await replies_on_relay(relay.url, owner.pubkey)

    assert stopped_with < BURST
    assert "event handler failed" not in log
    assert "frame rejected" not in log  # a relay's events for the subscription closed at the stop included
    assert log.count('"events_left_to_relays"') <= 1  # none when every event was in by the stop
    assert sorted(replies) == sorted(event.id for event in events), daemon.log_tail()
    assert {len(ids) for ids in replies.values()} == {1}
