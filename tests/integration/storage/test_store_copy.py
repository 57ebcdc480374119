"""A home switched to PostgreSQL (``storage.kind``) copies its filesystem store into the database with
``tenexd migrate --from-store``: conversations, processed ids and small values land in a real PostgreSQL; the
old daemon's run journal goes under the key of a project daemon without an instance name (the first daemon on
the database takes it over), and the daemon's start check finds the database used."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tenex_daemon.adapters.storage.postgres import PostgresStore
from tenex_daemon.app.daemon import SUBSCRIPTION_ID
from tenex_daemon.app.home import load_project_pubkey
from tenex_daemon.app.settings import load_settings
from tenex_daemon.app.store_check import (
    PROJECT_MARK_KEY,
    claim_for_project,
    refuse_an_empty_store_beside_the_homes,
    used_before,
)
from tenex_daemon.services.runs import journal_key_for
from tenex_daemon.services.stopping import stop_channel
from tests.contract.postgres_server import PostgresServer
from tests.unit.cli.conftest import USER, tenexd
from tests.unit.cli.test_migrate_store import assert_copied, seed

pytestmark = [pytest.mark.integration]


def test_a_home_switched_to_postgresql_is_copied_into_it_whole(
    postgres_server: PostgresServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the switch the daemon would refuse to start on the empty database; the copy puts both kept
    conversations (one archived), the deleted one's and the lone processed id, the relay cursor and the run
    journal (renamed for a daemon to take over) into PostgreSQL, and the start check then lets it start."""
    home = tmp_path / "home"
    assert tenexd(home, "init", "--owner", USER.npub, "--relay", "ws://127.0.0.1:1")[0] == 0
    ids = seed(home)
    dsn = asyncio.run(postgres_server.create_database())
    monkeypatch.setenv("TENEX_STORAGE__KIND", '"postgres"')
    monkeypatch.setenv("TENEX_STORAGE__DSN", json.dumps(dsn))
    settings = load_settings(home)
    project = load_project_pubkey(settings)
    assert project is not None

    code, out = tenexd(home, "migrate", "--from-store", str(home), "--json")

    assert code == 0, out
    report = json.loads(out)
    assert (report["conversations"], report["archived"], report["processed"]) == (2, 1, 2)
    assert report["renamed"] == {"runs.pending": journal_key_for(project)}

    async def check() -> None:
        store = PostgresStore(dsn)
        await store.open()
        try:
            await assert_copied(store, ids, journal_key_for(project))
            assert await store.get_meta("runs.pending") is None
            assert await used_before(settings, store, SUBSCRIPTION_ID)
            await refuse_an_empty_store_beside_the_homes(settings, store, SUBSCRIPTION_ID)  # it may start
        finally:
            await store.close()

    asyncio.run(check())


def test_reopen_does_not_take_a_database_whose_projects_daemons_run_on_it(
    postgres_server: PostgresServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A database marked by another project whose daemon listens on it now is not made this home's by
    `tenexd migrate --reopen` (that project's, not a key made anew); once nobody of it listens, it is."""
    home = tmp_path / "home"
    assert tenexd(home, "init", "--owner", USER.npub, "--relay", "ws://127.0.0.1:1")[0] == 0
    dsn = asyncio.run(postgres_server.create_database())
    monkeypatch.setenv("TENEX_STORAGE__KIND", '"postgres"')
    monkeypatch.setenv("TENEX_STORAGE__DSN", json.dumps(dsn))
    other = "c" * 64

    async def with_a_listener() -> tuple[int, str | None]:
        store = PostgresStore(dsn)
        await store.open()
        try:
            await claim_for_project(store, other)
            async with store.hear(stop_channel(other), lambda message: None):
                code, _ = await asyncio.to_thread(tenexd, home, "migrate", "--reopen")
                return code, await store.get_meta(PROJECT_MARK_KEY)
        finally:
            await store.close()

    code, mark = asyncio.run(with_a_listener())
    assert code != 0
    assert mark == other
    code, _ = tenexd(home, "migrate", "--reopen")
    assert code == 0
    assert load_project_pubkey(load_settings(home)) == asyncio.run(mark_of(dsn))


async def mark_of(dsn: str) -> str | None:
    """The project mark of the database at ``dsn``."""
    store = PostgresStore(dsn)
    await store.open()
    try:
        return await store.get_meta(PROJECT_MARK_KEY)
    finally:
        await store.close()
