"""tenexd on PostgreSQL under faults: several daemons on one database and one relay, one of them
SIGKILLed (the others answer what it held); and the database server itself crashed and restarted
under load. Every message is answered exactly once."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import time
from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import pytest

from tenex_daemon.adapters.nostr.relay_pool import PoolSettings, ReceivedEvent, RelayPool
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.core.events import NostrEvent
from tests.contract.postgres_server import PostgresServer, find_bin_dir, shared_server
from tests.e2e.harness import DaemonProcess, Home
from tests.evidence import record, scale
from tests.faults.harness import StreamClient, answering_agents, log_tails, message_tags, tally
from tests.integration.nostr.harness import LocalRelayServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MESSAGES = scale(200, 600)
TAKEOVER_BOUND_S = 30.0
"""After a daemon is killed, another takes over what it held within this long (a look every 1 s here, a
peer believed dead after ``PEER_GRACE_S``, 5 s)."""
ANSWERED_WITHIN_S = 120.0
"""How long after the kill every message may take to be answered (the stream's rest included)."""


def taken_over_at(processes: Sequence[DaemonProcess]) -> float | None:
    """When (Unix time, from its log) one of ``processes`` first took over a dead daemon; None: none did.
    Only whole lines are read (a daemon may be writing the last one)."""
    times = []
    for process in processes:
        text = process.log_path.read_text(errors="replace")
        for line in text[: text.rfind("\n") + 1].splitlines():
            if '"dead_daemon_taken_over"' in line:
                times.append(datetime.fromisoformat(json.loads(line)["timestamp"]).timestamp())
    return min(times, default=None)


def twin(home: Home, path: Path) -> Home:
    """Another home with the same keys and configuration (a second machine of the same project)."""
    shutil.copytree(home.path / "keys", path / "keys")
    shutil.copy2(home.path / "config.toml", path / "config.toml")
    (path / "keys").chmod(0o700)
    return Home(path, home.init)


@pytest.mark.parametrize("daemons", [2, 3])
async def test_daemons_sharing_postgres_answer_each_message_once_and_take_over_a_dead_one(
    relay: LocalRelayServer, home: Home, tmp_path: Path, daemons: int
) -> None:
    """N daemons (subprocesses) on one PostgreSQL and one relay share a stream of direct and routed
    messages: each is answered exactly once; one daemon SIGKILLed mid-stream leaves nothing unanswered
    (the others take over its journal and outbox within the stated bound)."""
    if find_bin_dir() is None:
        pytest.skip("PostgreSQL is not installed; scripts/setup.d/20-postgres.sh installs it")
    dsn = await shared_server().create_database()
    env = {
        "TENEX_STORAGE__KIND": '"postgres"',
        "TENEX_STORAGE__DSN": f'"{dsn}"',
        "TENEX_DAEMON__TAKEOVER_INTERVAL_S": "1",
    }
    homes = [home] + [twin(home, tmp_path / f"home{n}") for n in range(1, daemons)]
    processes = [DaemonProcess(h, env=env) for h in homes]
    for process in processes:
        await process.start()
    owner = Signer.from_text(home.owner_secret)
    agents = [home.agent(slug) for slug in ("planner", "orchestrator", "executor")]
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
    rng = random.Random(7)
    try:
        for n in range(MESSAGES):
            # half address the planner directly, half the project (the orchestrator routes them)
            target = home.agent("planner") if n % 2 == 0 else home.project
            event = owner.sign(11, f"message {n}: plan something", [["p", target]])
            await client.publish(event)
            sent.append(event)
            if n == MESSAGES // 2:
                processes[0].kill()  # SIGKILL, mid-stream
                killed_at, killed_at_wall = time.monotonic(), time.time()
            await asyncio.sleep(rng.uniform(0.0, 0.03))
        deadline = killed_at + ANSWERED_WITHIN_S
        answered_within = None
        while time.monotonic() < deadline:
            if answered_within is None and all(replies[e.id] for e in sent):
                answered_within = time.monotonic() - killed_at
            if answered_within is not None and taken_over_at(processes[1:]) is not None:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.5)  # a second answer, if any (the takeover's included), would come now
    finally:
        await client.stop()
        for process in processes[1:]:
            await process.stop()
        for process in processes:
            process.kill()

    wrong = {e.content: len(replies[e.id]) for e in sent if len(replies[e.id]) != 1}
    taken_over = taken_over_at(processes[1:])
    taken_over_within = None if taken_over is None else taken_over - killed_at_wall
    record(
        f"faults.daemon_killed_among_{daemons}", daemons=daemons, kills=1, messages=len(sent),
        lost=sum(1 for e in sent if not replies[e.id]), doubled=sum(1 for e in sent if len(replies[e.id]) > 1),
        answered_within_s=-1.0 if answered_within is None else round(answered_within, 1),
        taken_over_within_s=-1.0 if taken_over_within is None else round(taken_over_within, 1),
    )
    assert wrong == {}, (wrong, "\n".join(p.log_tail(15) for p in processes))
    assert taken_over_within is not None, "\n".join(p.log_tail(15) for p in processes)
    assert 0 < taken_over_within < TAKEOVER_BOUND_S


@pytest.mark.parametrize("daemons", [1, 2])
async def test_postgres_crashed_and_restarted_under_load_loses_and_doubles_nothing(
    relay: LocalRelayServer, home: Home, tmp_path: Path, daemons: int
) -> None:
    """The PostgreSQL server of one or two daemons is crashed (immediate stop) and started again several
    times while a client streams messages: every message still gets exactly one reply, and no daemon
    takes a live peer for dead (every daemon's connections broke at once)."""
    if find_bin_dir() is None:
        pytest.skip("PostgreSQL is not installed; scripts/setup.d/20-postgres.sh installs it")
    server = await asyncio.to_thread(PostgresServer.start)  # its own server: this test restarts it
    restarts = scale(2, 10)
    rng = random.Random(23)
    since = int(time.time()) - 5
    env = {
        "TENEX_STORAGE__KIND": '"postgres"', "TENEX_STORAGE__DSN": f'"{await server.create_database()}"',
        "TENEX_DAEMON__TAKEOVER_INTERVAL_S": "1",
    }
    homes = [home] + [twin(home, tmp_path / f"home{n}") for n in range(1, daemons)]
    processes = [DaemonProcess(h, env=env) for h in homes]
    try:
        for process in processes:
            await process.start()
        async with StreamClient([relay.url], home.owner_secret) as client:
            n = 0
            for _ in range(restarts):
                for _ in range(rng.randint(4, 10)):
                    await client.send(f"message {n}: plan something", message_tags(home, n))
                    n += 1
                    await asyncio.sleep(rng.uniform(0.0, 0.1))
                await asyncio.to_thread(server.restart, crash=True)
            for _ in range(5):
                await client.send(f"message {n}: plan something", message_tags(home, n))
                n += 1
        result = await tally([relay.url], answering_agents(home), client.sent, since, within=120.0)
        alive = [p.proc is not None and p.proc.poll() is None for p in processes]
        exits = [await p.stop() for p in processes]
    finally:
        for process in processes:
            process.kill()
        await asyncio.to_thread(server.stop)
    takeovers = sum(p.log_path.read_text().count("dead_daemon_taken_over") for p in processes)
    record(f"faults.postgres_restart.{daemons}_daemons", restarts=restarts, takeovers=takeovers, **result.figures())
    assert all(alive), log_tails(processes)
    assert exits == [0] * daemons, log_tails(processes)
    assert takeovers == 0, log_tails(processes)
    assert result.lost == [], log_tails(processes)
    assert result.doubled == {}, log_tails(processes)
