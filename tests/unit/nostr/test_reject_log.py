"""A relay's refused frames are each counted, and logged at most 200 a minute per reason: a relay sending
20,000 forged events wrote 7 MB of warnings in 12 s (one line each), while a small attack is still logged
event by event."""

from __future__ import annotations

import asyncio
import json
import time

import structlog
from structlog.testing import capture_logs
from websockets.asyncio.server import ServerConnection, serve

from tenex_daemon.adapters.nostr.relay_pool import PoolSettings, RelayPool
from tenex_daemon.adapters.nostr.relay_pool.rejects import REJECT_LINES, RejectLog
from tenex_daemon.adapters.nostr.signer import Signer

AUTHOR = Signer.generate(label="author")


def test_a_reasons_lines_stop_at_the_limit_and_the_next_window_says_how_many_were_not_logged() -> None:
    """250 refusals of one reason in a minute: 200 lines; another reason is logged on its own; a minute later
    the next line says 50 were not logged."""
    now = [100.0]
    rejects = RejectLog(structlog.get_logger("test"), clock=lambda: now[0])
    with capture_logs() as logs:
        for n in range(250):
            rejects.said("bad_signature", "signature does not verify", f"{n:064x}")
        rejects.said("bad_id", "id does not match", "ff" * 32)
        now[0] += 60
        rejects.said("bad_signature", "signature does not verify", "ee" * 32)

    bad_signature = [entry for entry in logs if entry["reason"] == "bad_signature"]
    assert len(bad_signature) == REJECT_LINES + 1
    assert [entry.get("not_logged") for entry in bad_signature[-2:]] == [None, 50]
    assert [entry["event_id"] for entry in logs if entry["reason"] == "bad_id"] == ["ff" * 32]


async def test_a_relay_flooding_forged_events_is_counted_whole_and_logged_in_part() -> None:
    """A relay answers the REQ with 300 events whose signatures do not verify: all 300 are counted as
    refused (``bad_signature``), 200 are logged, each with its event id."""
    forged = []
    for n in range(300):
        event = AUTHOR.sign(1, f"forged {n}", created_at=int(time.time()) - 5).model_dump()
        forged.append({**event, "sig": "00" * 64})

    async def flood(ws: ServerConnection) -> None:
        async for raw in ws:
            frame = json.loads(raw)
            if frame[0] == "REQ":
                for event in forged:
                    await ws.send(json.dumps(["EVENT", frame[1], event]))
                await ws.send(json.dumps(["EOSE", frame[1]]))

    async with serve(flood, "127.0.0.1", 0) as server:
        url = f"ws://127.0.0.1:{next(iter(server.sockets)).getsockname()[1]}"
        with capture_logs() as logs:
            async with RelayPool([url], settings=PoolSettings()) as pool:
                await pool.subscribe("live", [{"kinds": [1]}])
                for _ in range(200):
                    if pool.health().rejects.get("bad_signature", 0) >= 300:
                        break
                    await asyncio.sleep(0.05)
                counted = pool.health().rejects.get("bad_signature", 0)

    logged = [entry["event_id"] for entry in logs if entry["event"] == "frame rejected"]
    assert counted == 300
    assert logged == [event["id"] for event in forged[:REJECT_LINES]]
