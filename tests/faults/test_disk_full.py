"""The data disk filling up under tenexd (ENOSPC on a small tmpfs): it says degraded, keeps what it
accepted, and answers everything once space is back."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tenex_daemon.app.status import read_status
from tests.e2e.harness import DaemonProcess, Home
from tests.evidence import record, scale
from tests.faults.harness import StreamClient, answering_agents, log_tails, message_tags, tally
from tests.integration.nostr.harness import LocalRelayServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TMPFS_SIZE = "4m"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs mounted for this test (skipped, with the reason, where mounting is impossible)."""
    mount_point = tmp_path / "small-disk"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE},mode=0700", "tmpfs", str(mount_point)],
        capture_output=True, text=True, check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def _fill(disk: Path) -> Path:
    """Write a file until the disk is full (ENOSPC); return it."""
    filler = disk / "filler"
    block = b"\0" * 65536
    # unbuffered: a buffered file keeps the bytes a full disk refused and fails again when closed
    with filler.open("wb", buffering=0) as out:
        while True:
            try:
                out.write(block)  # a short write fills the disk; the next one raises ENOSPC
            except OSError as error:
                if error.errno != errno.ENOSPC:
                    raise
                break
    # the last partial block: the disk has no byte left
    with contextlib.suppress(OSError), filler.open("ab", buffering=0) as out:
        while True:
            out.write(b"\0" * 512)
    return filler


async def _wait_status(home: Home, want_degraded: bool, within: float = 30.0) -> str | None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        report = read_status(home.path / "run" / "status.json", stale_after_s=5.0)
        reason = report.degraded
        if (reason is not None) == want_degraded and report.data is not None:
            return reason
        await asyncio.sleep(0.2)
    raise AssertionError(f"status never became {'degraded' if want_degraded else 'healthy'}")


async def test_a_full_data_disk_degrades_then_recovers_with_every_message_answered_once(
    relay: LocalRelayServer, home: Home, small_disk: Path
) -> None:
    """Messages arriving while the data disk is full are kept unaccepted, status says degraded with
    the reason; once space is freed each is accepted and answered exactly once, and status is healthy."""
    daemon = DaemonProcess(home, env={"TENEX_STORAGE__PATH": f'"{small_disk}"'})
    before, during, after = 4, scale(6, 40), 4
    since = int(time.time()) - 5
    try:
        await daemon.start()
        async with StreamClient([relay.url], home.owner_secret) as client:
            for n in range(before):
                await client.send(f"message {n}: plan something", message_tags(home, n))
            early = await tally([relay.url], answering_agents(home), list(client.sent), since, quiet_for=0.0)
            assert early.lost == [], log_tails([daemon])
            filler = _fill(small_disk)
            for n in range(before, before + during):
                await client.send(f"message {n}: plan something", message_tags(home, n))
            reason = await _wait_status(home, want_degraded=True)
            assert reason is not None
            assert "No space left on device" in reason
            filler.unlink()  # space is back
            for n in range(before + during, before + during + after):
                await client.send(f"message {n}: plan something", message_tags(home, n))
            result = await tally([relay.url], answering_agents(home), client.sent, since)
            assert await _wait_status(home, want_degraded=False) is None
    finally:
        await daemon.stop()
        daemon.kill()
    record("faults.enospc", during_full_disk=during, **result.figures())
    assert result.lost == [], log_tails([daemon])
    assert result.doubled == {}, log_tails([daemon])
