"""`tenexd status` (without --json) shows the embedded relay and how often it was started again, and the
routings the orchestrator's model did not decide."""

from __future__ import annotations

from pathlib import Path

import pytest

from tenex_daemon.app.status import new_status
from tenex_daemon.cli.daemon_commands import _print_status_data
from tenex_daemon.runtime.code_id import code_id, digest_of


def test_tenexd_status_prints_the_embedded_relays_restarts(capsys: pytest.CaptureFixture[str]) -> None:
    """The human status prints the embedded relay's URL, pid and restarts since start (with the last one's
    reason when the status names it), and no such line for a daemon without an embedded relay."""
    data = dict(new_status("0.1.0"))
    data.update(embedded_relay="ws://127.0.0.1:7777", embedded_relay_pid=4243, embedded_relay_restarts=2)
    _print_status_data(data)
    restarted = " ".join(capsys.readouterr().out.split())
    data["embedded_relay_last_restart_reason"] = "unresponsive"
    _print_status_data(data)
    with_reason = " ".join(capsys.readouterr().out.split())
    data.update(embedded_relay=None, embedded_relay_pid=None, embedded_relay_restarts=0)
    _print_status_data(data)
    without = " ".join(capsys.readouterr().out.split())

    assert "embedded relay: ws://127.0.0.1:7777, pid 4243; 2 restarts since start" in restarted
    assert "(last:" not in restarted
    assert "embedded relay: ws://127.0.0.1:7777, pid 4243; 2 restarts since start (last: unresponsive)" in with_reason
    assert "embedded relay" not in without


def test_tenexd_status_prints_the_routings_the_model_did_not_decide(capsys: pytest.CaptureFixture[str]) -> None:
    """The human status says how many routings went without the orchestrator's model's decision, by why, and
    says nothing of it when there were none."""
    data = dict(new_status("0.1.0"))
    _print_status_data(data)
    none = " ".join(capsys.readouterr().out.split())
    data["routing_fallbacks"] = {"invalid_answer": 7, "backend_failed": 1}
    _print_status_data(data)
    some = " ".join(capsys.readouterr().out.split())

    assert "routing without" not in none
    assert "routing without the model's decision 8 (" in some
    assert "invalid_answer 7" in some
    assert "backend_failed 1" in some


def test_tenexd_status_says_when_the_daemon_runs_other_code_than_installed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A running daemon whose code digest differs from this tenexd's (installed since it started) is told to be
    restarted; the same digest, or a daemon that stopped, says nothing of it. The digest follows the files."""
    data = dict(new_status("0.1.0"))
    data["state"] = "running"
    _print_status_data(data)
    same = " ".join(capsys.readouterr().out.split())
    data["code"] = "000000000000"
    _print_status_data(data)
    other = " ".join(capsys.readouterr().out.split())
    data["state"] = "stopped"
    _print_status_data(data)
    stopped = " ".join(capsys.readouterr().out.split())

    assert "restart it" not in same
    assert f"code 000000000000: the daemon runs other code than this tenexd ({code_id()})" in other
    assert "restart it" not in stopped
    (tmp_path / "a.py").write_text("x = 1\n")
    first = digest_of(tmp_path)
    assert digest_of(tmp_path) == first
    (tmp_path / "a.py").write_text("x = 2\n")
    assert digest_of(tmp_path) != first
