"""A refused ``agents add`` or ``init`` leaves nothing behind: text options that are not UTF-8 (bytes of the
command line Python hands over as lone surrogates) are one error line and exit 2 before anything is written,
and an ``agents add`` whose config.toml cannot be written removes the key file it wrote."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tenex_daemon.app import home as home_module
from tenex_daemon.cli.main import app
from tests.unit.cli.conftest import USER, tenexd

NOT_UTF8 = "W\udcffr"
"""What Python makes of the command line's bytes ``W\\xffr``: the byte 0xff, no UTF-8, as a lone surrogate."""


def _run(home: Path, *args: str) -> tuple[int, str, str]:
    """Run ``tenexd --home HOME ARGS`` in-process; return (exit code, stdout, stderr)."""
    result = CliRunner().invoke(app, ["--home", str(home), *args], catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _one_line_naming(stderr: str, option: str) -> None:
    """``stderr`` is one error line naming ``option`` and saying its text is not valid UTF-8."""
    [line] = stderr.splitlines()
    assert line.startswith(f"error: {option}: the text is not valid UTF-8"), line


@pytest.mark.parametrize("option", ["--name", "--instructions"])
def test_agents_add_refuses_text_not_utf8_in_one_line_and_writes_nothing(home: Path, option: str) -> None:
    """`agents add writer --name/--instructions` with text that is not UTF-8 exits 2 with one line naming the
    option, leaves config.toml and keys/ as they were (no keys/writer.key), so the retry with good text works."""
    before = _files(home)

    code, out, err = _run(home, "agents", "add", "writer", option, NOT_UTF8)

    assert (code, out) == (2, "")
    _one_line_naming(err, option)
    assert _files(home) == before
    code, out = tenexd(home, "agents", "add", "writer", option, "Wr")
    assert code == 0, out


def test_init_refuses_a_project_name_not_utf8_before_making_the_home(tmp_path: Path) -> None:
    """`init --project` with text that is not UTF-8 exits 2 with one line naming --project, and makes no home
    (no keys/ without a config.toml); the retry with a good name makes it."""
    path = tmp_path / "home"

    code, out, err = _run(path, "init", "--owner", USER.npub, "--project", "p\udcff")

    assert (code, out) == (2, "")
    _one_line_naming(err, "--project")
    assert not path.exists()
    code, out = tenexd(path, "init", "--owner", USER.npub, "--project", "p")
    assert code == 0, out


def test_agents_add_whose_config_cannot_be_written_leaves_no_key_behind(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When config.toml cannot be written (permission denied, for its restore too), `agents add` exits 2 with
    the one permission line, keys/writer.key is removed all the same and config.toml, never changed, is not
    rewritten, so the retry once it can be written is not refused."""
    config = home / "config.toml"
    before = _files(home)
    writes: list[Path] = []

    def denied(path: Path, text: str, mode: int = 0o600) -> None:
        writes.append(path)
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(home_module, "_write_atomic", denied)

    code, out, err = _run(home, "agents", "add", "writer")

    assert (code, out) == (2, "")
    assert err.splitlines() == [f"error: permission denied: {config} (run tenexd as the user the daemon runs as)"]
    assert _files(home) == before
    assert writes == [config]  # the config was never changed: nothing to put back
    monkeypatch.undo()
    code, out = tenexd(home, "agents", "add", "writer")
    assert code == 0, out
