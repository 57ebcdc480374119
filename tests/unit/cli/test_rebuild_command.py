"""`tenexd conversations rebuild`'s arguments: one conversation or --all, a readable --since, a relay to read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def test_a_rebuild_in_a_home_no_daemon_ran_in_merges_into_its_store(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rebuild in a home without a store yet (a lost home remade: the README's restore) merges into the
    home's filesystem store, made for it, not into an empty store read in its place (the reading commands'):
    what it merged is there for the daemon."""
    from tenex_daemon.adapters.storage.filesystem import FileSystemStore
    from tenex_daemon.app import rebuild as rebuild_module
    from tenex_daemon.app.rebuild import RebuildReport

    merged_into: list[object] = []

    async def fake_rebuild(settings: object, manager: Any, request: object, progress: object) -> RebuildReport:
        merged_into.append(manager.store)
        return RebuildReport()

    monkeypatch.setattr(rebuild_module, "rebuild_from_relays", fake_rebuild)

    code, output = tenexd(home, "conversations", "rebuild", "--all")

    assert code == 0, output
    assert [type(store) for store in merged_into] == [FileSystemStore]
    assert (home / "conversations").is_dir()
