"""Text given on the command line that is not UTF-8 (a terminal in Latin-1: Python hands the bytes over as lone
surrogates) is refused before anything is written or sent: exit 2 and one line naming the option (README:
"2 bad input or configuration"), where each command failed its own way (a traceback, an "internal error" from
the daemon, a position inside the serialized event)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tenex_daemon.cli.main import app
from tests.unit.cli.conftest import tenexd

LATIN_1 = "caf\udce9"
"""``café`` typed in a Latin-1 terminal, as Python decodes it from the command line."""


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("send", LATIN_1, "--to", "planner"), "TEXT"),
        (("conversations", "end", "abcd", "--reason", LATIN_1), "--reason"),
        (("agents", "add", "writer", "--name", LATIN_1), "--name"),
    ],
)
def test_text_that_is_not_utf8_exits_2_naming_the_option_and_writes_nothing(
    home: Path, args: tuple[str, ...], named: str
) -> None:
    """``send``, ``conversations end --reason`` and ``agents add --name`` with such text exit 2 saying which
    option's text is not UTF-8; no key file or config change is left behind."""
    config = (home / "config.toml").read_text()
    keys = sorted(p.name for p in (home / "keys").iterdir())

    result = CliRunner().invoke(app, ["--home", str(home), *args], catch_exceptions=False)

    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: {named}: the text is not valid UTF-8 (check the terminal's encoding)"
    assert (home / "config.toml").read_text() == config
    assert sorted(p.name for p in (home / "keys").iterdir()) == keys


def test_a_path_with_bytes_that_are_not_utf8_is_not_refused_as_text(home: Path, tmp_path: Path) -> None:
    """A file name may hold any bytes: ``export -o`` to one is written (only text values are checked)."""
    target = tmp_path / "export-\udce9.json"
    code, _ = tenexd(home, "conversations", "export", "f" * 64, "-o", str(target))

    assert code == 1  # no such conversation: the path itself was taken


def test_a_home_whose_path_is_not_utf8_is_taken_after_the_command_too(tmp_path: Path) -> None:
    """``--home`` is a path, which may hold any bytes: given after the command, as before it, such a home is
    made (the text check refused it there). Run as a person runs it, the bytes on the command line."""
    path = os.fsencode(tmp_path) + b"/caf\xe9"
    command = [os.fsencode(sys.executable), b"-m", b"tenex_daemon.cli.main", b"init", b"--home", path]

    done = subprocess.run(command, capture_output=True, timeout=120, check=False)

    assert done.returncode == 0, done.stderr
    assert os.path.isfile(path + b"/config.toml")
