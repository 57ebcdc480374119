"""A home moved from its filesystem store to PostgreSQL the way README says (stop the daemon, switch
``storage.kind``, ``tenexd migrate --from-store``, start it again): the daemon, a subprocess on a real relay
and a real PostgreSQL, answers what comes after the switch and nothing before it a second time, though the
relay still holds every earlier message."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.contract.postgres_server import find_bin_dir, shared_server
from tests.e2e.harness import TENEXD, DaemonProcess, Home, tenexd_environment
from tests.faults.harness import StreamClient, answering_agents, message_tags, tally
from tests.integration.nostr.harness import LocalRelayServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_a_home_switched_to_postgresql_answers_each_message_once(relay: LocalRelayServer, home: Home) -> None:
    """Four messages answered on the filesystem store, the store copied into PostgreSQL, the daemon started
    on it: two more messages are answered, and each of the six has exactly one answer on the relay."""
    if find_bin_dir() is None:
        pytest.skip("PostgreSQL is not installed; scripts/setup.d/20-postgres.sh installs it")
    since = int(time.time()) - 5
    postgres = {
        "TENEX_STORAGE__KIND": '"postgres"',
        "TENEX_STORAGE__DSN": f'"{await shared_server().create_database()}"',
    }
    agents = answering_agents(home)
    async with StreamClient([relay.url], home.owner_secret) as client:
        before = DaemonProcess(home)
        await before.start()
        try:
            sent = [await client.send(f"message {n}: plan something", message_tags(home, n)) for n in range(4)]
            answered = await tally([relay.url], agents, sent, since, within=60.0, quiet_for=0.5)
        finally:
            await before.stop()
        assert (answered.lost, answered.doubled) == ([], {}), before.log_tail(20)

        copy = await asyncio.create_subprocess_exec(
            str(TENEXD), "--home", str(home.path), "migrate", "--from-store", str(home.path),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**tenexd_environment(), **postgres},
        )
        out, err = await asyncio.wait_for(copy.communicate(), 60)
        assert copy.returncode == 0, err.decode()
        assert "copied 4 conversation(s)" in out.decode()

        after = DaemonProcess(home, env=postgres)
        await after.start()
        try:
            sent += [await client.send(f"message {n}: plan something", message_tags(home, n)) for n in (4, 5)]
            result = await tally([relay.url], agents, sent, since, within=60.0)
        finally:
            await after.stop()

    assert (result.lost, result.doubled) == ([], {}), after.log_tail(30)
