"""A home restored from an older backup (a copy taken with the daemon stopped, put back after the daemon ran
on): the daemon, a subprocess on a real relay, refuses to start on it, since it would answer again every
message answered since the copy (it did: 4 of 4), and says to run `tenexd conversations rebuild --all`;
after that rebuild it starts and no message has a second answer."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from tests.e2e.harness import DaemonProcess, Home, run_cli
from tests.faults.harness import StreamClient, answering_agents, message_tags, tally
from tests.integration.nostr.harness import LocalRelayServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_a_restored_backup_is_refused_until_rebuilt_and_nothing_is_answered_twice(
    relay: LocalRelayServer, home: Home, tmp_path: Path
) -> None:
    """Two messages answered, the home copied, four more answered, the copy put back: `tenexd run` exits 2
    naming the rebuild; after `rebuild --all` the daemon runs and each of the six has exactly one answer."""
    since = int(time.time()) - 5
    daemon = DaemonProcess(home)
    backup = tmp_path / "backup"
    try:
        await daemon.start()
        async with StreamClient([relay.url], home.owner_secret) as client:
            for n in range(2):
                await client.send(f"before the backup {n}: plan something", message_tags(home, n))
            answered = await tally([relay.url], answering_agents(home), client.sent, since, within=60)
            assert answered.figures()["lost"] == 0
            assert await daemon.stop() == 0
            shutil.copytree(home.path, backup, symlinks=True)
            await daemon.start()
            for n in range(2, 6):
                await client.send(f"after the backup {n}: plan something", message_tags(home, n))
            answered = await tally([relay.url], answering_agents(home), client.sent, since, within=60)
            assert answered.figures()["lost"] == 0
            assert await daemon.stop() == 0
            shutil.rmtree(home.path)
            shutil.copytree(backup, home.path, symlinks=True)

            with pytest.raises(RuntimeError, match="tenexd exited with 2") as refused:
                await daemon.start()
            assert "the store is behind the relays: they hold 4 replies" in str(refused.value)
            assert "tenexd conversations rebuild --all" in str(refused.value)
            code, _ = await run_cli(home, "conversations", "rebuild", "--all")
            assert code == 0
            await daemon.start()
            once = await tally([relay.url], answering_agents(home), client.sent, since, within=10, quiet_for=4)

        assert once.figures() == {"messages": 6, "lost": 0, "doubled": 0}
    finally:
        await daemon.stop()
