"""One store serves one project: the first daemon to start on a store marks it with its project, and a
daemon or a copy of another project is refused (two projects on one PostgreSQL database answered each
other's notes, read and swept each other's conversations)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tenex_daemon.adapters.storage.filesystem import FileSystemStore
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.app.daemon import SUBSCRIPTION_ID
from tenex_daemon.app.home import init_home, load_project_pubkey
from tenex_daemon.app.settings import Settings, load_settings
from tenex_daemon.app.store_check import (
    PROJECT_MARK_KEY,
    StoreOfAnotherProjectError,
    check_the_store,
    claim_for_project,
)
from tenex_daemon.cli.main import app
from tests.unit.cli.test_cli import seed_conversation

A, B = "a" * 64, "b" * 64


async def test_a_store_is_claimed_by_the_first_project_and_refused_to_another() -> None:
    """An unmarked store takes the first project's mark; the same project passes again; another project is
    refused, with both keys' beginnings and what to do."""
    store = MemoryStore()

    await claim_for_project(store, A)
    await claim_for_project(store, A)
    with pytest.raises(StoreOfAnotherProjectError, match=r"another project \(project key aaaa.*this home's is bbbb"):
        await claim_for_project(store, B)

    assert await store.get_meta(PROJECT_MARK_KEY) == A


def test_a_daemon_of_another_project_and_a_copy_into_its_store_are_refused(tmp_path: Path) -> None:
    """Home B pointed at home A's store (storage.path) is refused by the daemon's start check, and a copy of
    B's store into it is refused (exit 2) before anything is copied."""
    init_home(tmp_path / "a")
    init_home(tmp_path / "b")
    seed_conversation(tmp_path / "b", "B's own", "hello")
    shared = tmp_path / "shared"
    shared.mkdir()
    for home in ("a", "b"):
        config = tmp_path / home / "config.toml"
        config.write_text(config.read_text().replace("[storage]\n", f'[storage]\npath = "{shared}"\n', 1))
    settings_a, settings_b = load_settings(tmp_path / "a"), load_settings(tmp_path / "b")
    project_a, project_b = load_project_pubkey(settings_a), load_project_pubkey(settings_b)
    assert project_a is not None
    assert project_b is not None

    async def start_check(settings: Settings, project: str) -> None:
        store = FileSystemStore(shared)
        await store.open()
        try:
            await check_the_store(settings, store, SUBSCRIPTION_ID, project)
        finally:
            await store.close()

    asyncio.run(start_check(settings_a, project_a))  # A's daemon starts: the store is A's
    with pytest.raises(StoreOfAnotherProjectError):
        asyncio.run(start_check(settings_b, project_b))
    result = CliRunner().invoke(app, ["--home", str(tmp_path / "b"), "migrate", "--from-store", str(tmp_path / "b")])
    assert result.exit_code == 2
    assert "serves another project" in result.stderr
