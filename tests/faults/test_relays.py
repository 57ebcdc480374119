"""Relays failing under tenexd: a relay killed and restarted mid-stream, and three relays of which one
dies for a while. Each message is still answered exactly once."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tenex_daemon.app.home import init_home
from tests.e2e.harness import DaemonProcess, Home, make_home
from tests.evidence import record, scale
from tests.faults.harness import StreamClient, answering_agents, log_tails, message_tags, tally
from tests.integration.nostr.harness import LocalRelayServer, NostrRelayProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]

Relay = LocalRelayServer | NostrRelayProcess


async def _down(relay: Relay) -> None:
    """Kill the relay process (SIGKILL); its storage stays for the restart."""
    if isinstance(relay, LocalRelayServer):
        relay.stop()
    else:
        await relay.kill()


async def _stop(relays: list[Relay]) -> None:
    for relay in relays:
        await _down(relay)


def _relay(kind: str, path: Path) -> Relay:
    return LocalRelayServer(path / "lmdb") if kind == "local-relay" else NostrRelayProcess(path / "nostr-relay")


@pytest.fixture
async def relays(tmp_path: Path) -> AsyncIterator[list[Relay]]:
    """Three real relays of both kinds: two nostr-sdk LocalRelays and PyPI nostr-relay."""
    started: list[Relay] = []
    try:
        for n, kind in enumerate(("local-relay", "nostr-relay", "local-relay")):
            relay = _relay(kind, tmp_path / f"relay{n}")
            await relay.start()
            started.append(relay)
        yield started
    finally:
        await _stop(started)


@pytest.mark.parametrize("kind", ["local-relay", "nostr-relay"])
async def test_a_relay_killed_and_restarted_mid_stream_loses_and_doubles_nothing(
    tmp_path: Path, kind: str
) -> None:
    """The daemon's only relay is SIGKILLed and restarted several times while a client streams messages
    (the client retries while it is down): every message gets exactly one reply on the relay."""
    relay = _relay(kind, tmp_path / "relay")
    await relay.start()
    home = make_home(tmp_path / "home", relay.url)
    daemon = DaemonProcess(home)
    restarts = scale(2, 10)
    rng = random.Random(17)
    since = int(time.time()) - 5
    try:
        await daemon.start()
        async with StreamClient([relay.url], home.owner_secret) as client:
            n = 0
            for _ in range(restarts):
                for _ in range(rng.randint(3, 8)):
                    await client.send(f"message {n}: plan something", message_tags(home, n))
                    n += 1
                    await asyncio.sleep(rng.uniform(0.0, 0.1))
                await relay.restart(down_for=rng.uniform(0.2, 2.0))  # SIGKILL, down, start again
            for _ in range(5):
                await client.send(f"message {n}: plan something", message_tags(home, n))
                n += 1
        result = await tally([relay.url], answering_agents(home), client.sent, since)
    finally:
        await daemon.stop()
        daemon.kill()
        await _down(relay)
    record(f"faults.relay_restart.{kind}", restarts=restarts, **result.figures())
    assert result.lost == [], log_tails([daemon])
    assert result.doubled == {}, log_tails([daemon])


async def test_three_relays_one_dying_for_a_while_answer_each_message_once(
    tmp_path: Path, relays: list[Relay]
) -> None:
    """With three relays (two LocalRelays, one nostr-relay), messages sent to one relay each, some to all
    three, and the middle relay killed for part of the stream: each message is answered exactly once
    (the same event from several relays is one message), and every reply reaches a live relay."""
    urls = [relay.url for relay in relays]
    home = Home(tmp_path / "home", init_home(tmp_path / "home", relays=urls))
    daemon = DaemonProcess(home)
    messages = scale(30, 300)
    rng = random.Random(31)
    since = int(time.time()) - 5
    try:
        await daemon.start()
        async with StreamClient(urls, home.owner_secret) as client:
            for n in range(messages):
                if n == messages // 3:
                    await _down(relays[1])  # the middle relay dies...
                if n == 2 * messages // 3:
                    await relays[1].start()  # ...and comes back
                live = [0, 2] if messages // 3 <= n < 2 * messages // 3 else [0, 1, 2]
                to = live if n % 5 == 0 else [live[n % len(live)]]  # every fifth to all live relays
                await client.send(f"message {n}: plan something", message_tags(home, n), to=to)
                await asyncio.sleep(rng.uniform(0.0, 0.05))
        result = await tally(urls, answering_agents(home), client.sent, since)
    finally:
        await daemon.stop()
        daemon.kill()
    record("faults.three_relays", relays=3, **result.figures())
    assert result.lost == [], log_tails([daemon])
    assert result.doubled == {}, log_tails([daemon])
