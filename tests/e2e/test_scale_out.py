"""Several tenexd daemons on one PostgreSQL database and one relay: every message is answered exactly
once, and when one daemon is SIGKILLed the others answer what it held."""

from __future__ import annotations

import asyncio
import random
import shutil
import time
from collections import defaultdict
from pathlib import Path

import pytest

from tenex_daemon.adapters.nostr.relay_pool import PoolSettings, ReceivedEvent, RelayPool
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.core.events import NostrEvent
from tests.contract.postgres_server import find_bin_dir, shared_server
from tests.e2e.harness import DaemonProcess, Home
from tests.integration.nostr.harness import LocalRelayServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MESSAGES = 200
TAKEOVER_BOUND_S = 30.0
"""After a daemon is killed, what it held is answered within this long (takeover every 1 s here)."""


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
                killed_at = time.monotonic()
            await asyncio.sleep(rng.uniform(0.0, 0.03))
        deadline = killed_at + TAKEOVER_BOUND_S
        while time.monotonic() < deadline and not all(replies[e.id] for e in sent):  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        answered_within = time.monotonic() - killed_at
        await asyncio.sleep(1.5)  # a second answer, if any, would come now
    finally:
        await client.stop()
        for process in processes[1:]:
            await process.stop()
        for process in processes:
            process.kill()

    wrong = {e.content: len(replies[e.id]) for e in sent if len(replies[e.id]) != 1}
    assert wrong == {}, (wrong, "\n".join(p.log_tail(15) for p in processes))
    assert answered_within < TAKEOVER_BOUND_S
