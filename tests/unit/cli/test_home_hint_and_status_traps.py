"""The "run init first" hint pastes as it reads, and ``tenexd status`` on a status file that is not what the
daemon writes is one verdict with exit 1, never a traceback."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tenex_daemon.app.settings import load_settings
from tenex_daemon.cli.main import app


def test_the_init_hint_quotes_a_home_with_a_space(tmp_path: Path) -> None:
    """`tenexd --home "/.../my home" status` without a home hints `tenexd init --home '/.../my home'`, which
    a shell splits back into that one path."""
    path = tmp_path / "my home"

    result = CliRunner().invoke(app, ["--home", str(path), "status"], catch_exceptions=False)

    assert result.exit_code == 2
    hint = f"(run `tenexd init --home {shlex.quote(str(path))}` first)"
    assert result.stderr.splitlines() == [f"error: {path}/config.toml: not found {hint}"]
    assert shlex.split(hint.split("`")[1]) == ["tenexd", "init", "--home", str(path)]


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"\xff\xfe", "is not a JSON object"),
        (b'{"pid": 99999999999999999999, "updated_at": 0}', "is not valid: its pid is not a process id"),
    ],
)
def test_status_on_a_status_file_not_utf8_or_with_a_huge_pid_says_so(
    home: Path, content: bytes, reason: str
) -> None:
    """`tenexd status` on a status file that is not UTF-8, or whose pid is too large for os.kill, exits 1
    with the verdict that the file is not valid (no UnicodeDecodeError, no OverflowError)."""
    status_path = load_settings(home).status_path
    status_path.parent.mkdir(parents=True, exist_ok=True)
    status_path.write_bytes(content)

    result = CliRunner().invoke(app, ["--home", str(home), "status"], catch_exceptions=False)

    assert result.exit_code == 1
    assert result.stdout.strip() == f"tenexd: status file {status_path} {reason}" + (
        " (a whole number from 1 to 2147483647)" if "pid" in reason else ""
    )


def test_status_of_a_home_copied_while_its_daemon_ran_says_no_daemon_runs_there(tmp_path: Path) -> None:
    """`tenexd status` on a copy of a home whose daemon still runs (its status file copied, naming the
    original home and a live pid) exits 1 saying no daemon runs here: it said running, with the original's
    figures."""
    from tenex_daemon.app.home import init_home
    from tenex_daemon.app.status import new_status, write_status

    original, copy = tmp_path / "original", tmp_path / "copy"
    init_home(copy, relays=["ws://127.0.0.1:1"])
    data = new_status("0.1.0", home=str(original))
    data["state"] = "running"
    write_status(copy / "run" / "status.json", data)

    result = CliRunner().invoke(app, ["--home", str(copy), "status"])

    assert result.exit_code == 1
    assert f"not running here: the status file is the daemon's of {original}" in result.output
