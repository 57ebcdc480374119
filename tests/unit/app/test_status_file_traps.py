"""A status file that is not what the daemon writes (bytes that are not UTF-8, a pid no process can have, an
``updated_at`` no float holds, JSON nested past the parser's depth) is a report, never an exception."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tenex_daemon.app.status import Health, read_status


def test_a_status_file_not_utf8_is_not_valid_json(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 in the status file read as content that is not JSON: stale, no data."""
    path = tmp_path / "status.json"
    path.write_bytes(b"\xff\xfe")

    report = read_status(path, 30)

    assert (report.state, report.data) == (Health.STALE, None)
    assert report.reason == f"status file {path} is not a JSON object"


@pytest.mark.parametrize("text", ["[" * 100_000, '{"pid": ' + "1" * 5000 + "}"])
def test_json_too_deep_or_a_number_too_long_is_not_valid_json(tmp_path: Path, text: str) -> None:
    """Arrays nested past the JSON parser's depth, or a number of more digits than Python converts, read as
    content that is not JSON (json.loads raises RecursionError, ValueError for them)."""
    path = tmp_path / "status.json"
    path.write_text(text)

    report = read_status(path, 30)

    assert (report.state, report.data) == (Health.STALE, None)


@pytest.mark.parametrize("pid", [10**20, 2**31, True, False, 0, -5, 1.5, "1"])
def test_a_pid_no_process_can_have_makes_the_status_file_not_valid(tmp_path: Path, pid: object) -> None:
    """A pid that is not a whole number from 1 to 2**31-1 (too large for os.kill, a boolean, zero, negative,
    a float, a string) makes the file not valid: stale with the reason, never an OverflowError, and never a
    probe of process 1 (``true``) nor a daemon reported running."""
    path = tmp_path / "status.json"
    path.write_text(json.dumps({"pid": pid, "updated_at": time.time(), "state": "running"}))

    report = read_status(path, 30)

    assert (report.state, report.data) == (Health.STALE, None)
    assert report.reason == (
        f"status file {path} is not valid: its pid is not a process id (a whole number from 1 to 2147483647)"
    )


def test_the_largest_pid_is_still_judged(tmp_path: Path) -> None:
    """A pid up to 2**31-1 is one a system may have: it is looked up (gone here), not refused."""
    path = tmp_path / "status.json"
    path.write_text(json.dumps({"pid": 2**31 - 1, "updated_at": time.time(), "state": "running"}))

    report = read_status(path, 30)

    assert report.state is Health.STOPPED
    assert "gone" in report.reason


@pytest.mark.parametrize("updated_at", ["10" + "0" * 400, "1e999", "-1e999", "NaN", "true"])
def test_an_updated_at_no_float_holds_is_left_for_the_file_time(tmp_path: Path, updated_at: str) -> None:
    """An updated_at that is no finite time (a whole number past any float, infinities, NaN, a boolean) is
    ignored as a missing one is: the file's own time says how old the status is (stale an hour on)."""
    path = tmp_path / "status.json"
    path.write_text(f'{{"pid": {os.getpid()}, "state": "running", "updated_at": {updated_at}}}')

    fresh = read_status(path, 30)
    later = read_status(path, 30, now=time.time() + 3600)

    assert fresh.state is Health.RUNNING
    assert fresh.age_s is not None
    assert fresh.age_s < 5
    assert later.state is Health.STALE
