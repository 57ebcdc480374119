"""Fixtures of the CLI tests: logging restored after each test (the app tests' fixture), the owner USER,
``tenexd`` run in-process, and a home made by ``tenexd init``."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tenex_daemon.cli.main import app
from tenex_daemon.testing import KeyPair
from tests.unit.app.conftest import restore_logging

__all__ = ["USER", "home", "restore_logging", "tenexd"]

USER = KeyPair.from_seed(901)


def tenexd(home: Path, *args: str) -> tuple[int, str]:
    """Run ``tenexd --home HOME ARGS`` in-process; return (exit code, stdout)."""
    result = CliRunner().invoke(app, ["--home", str(home), *args], catch_exceptions=False)
    return result.exit_code, result.stdout


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A home made by ``tenexd init`` with USER as the owner."""
    path = tmp_path / "home"
    code, out = tenexd(path, "init", "--owner", USER.npub, "--relay", "ws://127.0.0.1:1")
    assert code == 0, out
    return path
