"""A relay that stays down is logged sparingly: the first failure at info, the next tries at debug, a
warning every ten minutes while it is down, and how long it was down once it is back; a publish it misses
meanwhile is a debug line."""

from __future__ import annotations

import asyncio
import json

import pytest
import structlog
from structlog.testing import capture_logs
from websockets.asyncio.server import ServerConnection, serve

from tenex_daemon.adapters.nostr.relay_pool import PoolSettings, RelayPool
from tenex_daemon.adapters.nostr.relay_pool.outage import DOWN_LOG_EVERY_S, Outage
from tenex_daemon.adapters.nostr.signer import Signer


def test_a_relay_down_for_an_hour_is_seven_lines_not_one_per_try(monkeypatch: pytest.MonkeyPatch) -> None:
    """120 failed tries over an hour (one every 30 s): one info line, then a warning every 10 minutes (six),
    the rest at debug; once up again, the tries and the time down are reported and forgotten."""
    now = [1_000.0]
    monkeypatch.setattr("tenex_daemon.adapters.nostr.relay_pool.outage.time.monotonic", lambda: now[0])
    with capture_logs() as logs:
        outage = Outage(structlog.get_logger("test"))
        for _ in range(120):
            outage.failed("ConnectionRefusedError", 30.0)
            now[0] += 30.0
        ended = outage.ended()

    levels = [(entry["log_level"], entry["event"]) for entry in logs if entry["log_level"] != "debug"]
    assert levels == [("info", "relay disconnected")] + [("warning", "relay still unreachable")] * 5
    assert ended == {"down_s": 3_600.0, "failed_tries": 120}
    assert outage.ended() == {"down_s": None, "failed_tries": 0}
    assert DOWN_LOG_EVERY_S == 600.0


async def accept_everything(ws: ServerConnection) -> None:
    """A relay that answers every EVENT ``OK true``."""
    async for raw in ws:
        frame = json.loads(raw)
        if frame[0] == "EVENT":
            await ws.send(json.dumps(["OK", frame[1]["id"], True, ""]))


async def test_a_publish_a_relay_that_is_down_misses_is_a_debug_line() -> None:
    """A publish another relay accepted, which a relay that is down never got, is logged at debug for that
    relay: its own lines say it is down (before, an info line per publish, every 15 s with the heartbeat)."""
    settings = PoolSettings(publish_timeout=0.5)
    async with serve(accept_everything, "127.0.0.1", 0) as server:
        up = f"ws://127.0.0.1:{next(iter(server.sockets)).getsockname()[1]}"
        with capture_logs() as logs:
            async with RelayPool([up, "ws://127.0.0.1:9"], settings=settings) as pool:
                assert await pool.wait_connected(count=1, within=5)
                result = await pool.publish(Signer.generate().sign(1, "hello"), raise_on_failure=False)
                await asyncio.sleep(0.8)  # the publish's tail waits out the other relay, then logs

    assert result.accepted_by == (up,)
    missed = [entry["log_level"] for entry in logs if entry["event"] == "relay did not answer a publish"]
    assert missed == ["debug"]


async def test_an_unforeseen_error_while_connecting_is_logged_and_the_relay_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first connect fails with an error the connection does not expect (a TypeError, as an older
    websockets raises for ``proxy=``): it is logged with its traceback, the relay is tried again and reached
    (before, the relay's task died without a line, and the daemon reported itself healthy, never connected)."""
    from websockets.asyncio.client import connect as real_connect

    from tenex_daemon.adapters.nostr.relay_pool import connection

    tries: list[str] = []

    def connect_failing_once(url: str, **options: object) -> object:
        tries.append(url)
        if len(tries) == 1:
            raise TypeError("connect() got an unexpected keyword argument 'proxy'")
        return real_connect(url, **options)  # type: ignore[arg-type]

    monkeypatch.setattr(connection, "connect", connect_failing_once)
    settings = PoolSettings(backoff_base=0.05, backoff_cap=0.1)
    async with serve(accept_everything, "127.0.0.1", 0) as server:
        url = f"ws://127.0.0.1:{next(iter(server.sockets)).getsockname()[1]}"
        with capture_logs() as logs:
            async with RelayPool([url], settings=settings) as pool:
                connected = await pool.wait_connected(count=1, within=5)

    assert connected
    assert len(tries) >= 2
    [failed] = [entry for entry in logs if entry["event"] == "relay_connection_failed"]
    assert failed["log_level"] == "error"
