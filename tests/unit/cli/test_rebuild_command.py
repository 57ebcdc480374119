"""`tenexd conversations rebuild`'s arguments: one conversation or --all, a readable --since, a relay to read."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tenex_daemon.app.home import init_home
from tenex_daemon.cli.main import app


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A home made by init with no relay configured."""
    path = tmp_path / "home"
    init_home(path)
    return path


def tenexd(home: Path, *args: str) -> tuple[int, str]:
    """Run the CLI in-process; return (exit code, stdout and stderr)."""
    result = CliRunner().invoke(app, ["--home", str(home), *args], catch_exceptions=False)
    return result.exit_code, result.output


@pytest.mark.parametrize(
    "args",
    [(), ("ab" * 32, "--all"), ("--all", "--since", "last tuesday"), ("not-an-id",)],
    ids=["neither", "both", "bad-since", "bad-id"],
)
def test_bad_arguments_exit_2(home: Path, args: tuple[str, ...]) -> None:
    """Neither an ID nor --all, both, an unreadable --since or a malformed id exit 2 with an error."""
    code, output = tenexd(home, "conversations", "rebuild", *args)

    assert code == 2
    assert "error" in output.lower() or "usage" in output.lower()


def test_without_daemon_or_relays_it_says_where_to_set_them(home: Path) -> None:
    """With no daemon running and no relay in relays.urls, the command exits 2 (a configuration error, as
    the README's exit codes say) naming relays.urls."""
    code, output = tenexd(home, "conversations", "rebuild", "--all")

    assert code == 2
    assert "relays.urls" in output
