"""Crash safety: a writer killed with SIGKILL at random instants never loses an accepted event."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tenex_daemon.adapters.storage.filesystem import LOG_NAME, STATE_NAME, FileSystemStore, scan_log
from tests.evidence import record, scale

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
ROUNDS = int(os.environ.get("TENEX_CRASH_ROUNDS", str(scale(20, 100))))
# derived data (index records, event-id buckets) is written every couple of seconds: a
# conversation created since the last write is found by its folder, one appended to by its size.
# Under batch, a snapshot or a new folder is renamed into place, and a log gets its lines, after the
# journal's fsync: a kill in between leaves the journal newer than the file, and open replays it.
ALLOWED_REPAIRS = {"torn_tail_cut", "index_entry_repaired", "index_entry_added", "journal_replayed"}


def run_and_kill(home: Path, policy: str, out: Path, rng: random.Random) -> list[str]:
    """Start the writer, let it append for a random while, SIGKILL it; return its complete stdout lines."""
    with open(out, "wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.storage.crash_writer", str(home), policy],
            stdout=sink, cwd=REPO,
        )
    deadline = time.monotonic() + 60
    while b"READY" not in out.read_bytes():
        assert proc.poll() is None, f"writer exited early with {proc.returncode}"
        assert time.monotonic() < deadline, "writer never became ready"
        time.sleep(0.02)
    time.sleep(rng.uniform(0.02, 0.5))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    data = out.read_bytes()
    return data[: data.rfind(b"\n") + 1].decode().splitlines()


async def verify(home: Path, accepted: dict[str, list[str]], snapshots: dict[str, int]) -> set[str]:
    """Reopen the home and check every accepted event and snapshot; return the repair kinds seen."""
    store = FileSystemStore(home)
    await store.open()
    try:
        repairs = {action.kind for action in store.recovery}
        assert repairs <= ALLOWED_REPAIRS, store.recovery
        # under batch a log gets its lines after the journal's fsync: a kill in between leaves
        # them to the replay (a snapshot or folder likewise); under always nothing is replayed
        replayed = [a.detail for a in store.recovery if a.kind == "journal_replayed"]
        assert all(("restored" in d or "re-created" in d or "re-applied" in d) for d in replayed), replayed
        for conversation_id, event_ids in accepted.items():
            conversation = await store.load(conversation_id)
            assert conversation is not None, f"conversation {conversation_id} lost"
            history = [event.id for event in conversation.history]
            # events written but not yet acknowledged when the kill came may also be there
            position = {event_id: i for i, event_id in enumerate(history)}
            found = [position.get(event_id, -1) for event_id in event_ids]
            assert -1 not in found, "an accepted event is missing"
            assert found == sorted(found), "accepted events are out of order"
            assert len(position) == len(history), "an event is stored twice"
            assert int(conversation.metadata.extra.get("n", 0)) >= snapshots.get(conversation_id, 0)
            for event_id in event_ids[-3:]:
                assert await store.is_processed(event_id)
        assert {action.kind for action in store.recovery} <= ALLOWED_REPAIRS
        return repairs
    finally:
        await store.close()


def assert_everything_readable(home: Path) -> None:
    """Every file outside corrupt/ reads cleanly: logs without torn or bad lines, snapshots parse."""
    root = home / "conversations"
    folders = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    folders = [p for p in folders if p.name not in ("archive", "corrupt")] + list((root / "archive").iterdir())
    for folder in folders:
        scan = scan_log((folder / LOG_NAME).read_bytes())
        assert not scan.torn, folder
        assert scan.bad_lines == 0, folder
        assert (folder / STATE_NAME).read_bytes().startswith(b'{"format":1')
    assert not (root / "corrupt").exists() or not any((root / "corrupt").iterdir())


def test_sigkill_at_random_instants_loses_no_accepted_event(tmp_path: Path) -> None:
    """After each SIGKILL (20; 100 in the full fault run; both fsync policies) every accepted event and snapshot is there, no manual repair."""
    rng = random.Random(int(os.environ.get("TENEX_CRASH_SEED", "3")))
    home = tmp_path / "home"
    accepted: dict[str, list[str]] = {}
    snapshots: dict[str, int] = {}
    repairs_seen: set[str] = set()
    total = 0
    for round_number in range(ROUNDS):
        policy = "batch" if round_number % 2 else "always"
        lines = run_and_kill(home, policy, tmp_path / f"writer-{round_number}.out", rng)
        for line in lines:
            parts = line.split()
            if parts[0] == "A":
                accepted.setdefault(parts[1], []).append(parts[2])
                total += 1
            elif parts[0] == "S":
                snapshots[parts[1]] = int(parts[2])
        repairs_seen |= asyncio.run(verify(home, accepted, snapshots))
        assert_everything_readable(home)
    assert total > ROUNDS * 10, "the writer barely wrote anything: the test proves little"
    record("faults.storage_sigkill", kills=ROUNDS, accepted=total, lost=0, repairs=len(repairs_seen))
    print(f"{ROUNDS} kills, {total} accepted events, repairs seen: {sorted(repairs_seen)}")
