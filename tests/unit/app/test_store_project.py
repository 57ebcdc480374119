"""One store serves one project: the first daemon to start on a store marks it with its project, and a
daemon or a copy of another project is refused (two projects on one PostgreSQL database answered each
other's notes, read and swept each other's conversations)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from structlog.testing import capture_logs
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
    note_agent_keys,
)
from tenex_daemon.cli.main import app
from tenex_daemon.core.search import SearchQuery
from tenex_daemon.testing import make_agent
from tests.unit.cli.test_cli import seed_conversation
from tests.unit.cli.test_migrate_smarthole import data_file

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
    settings_a, project_a, settings_b, project_b, shared = shared_homes(tmp_path)

    asyncio.run(start_check(settings_a, project_a, shared))  # A's daemon starts: the store is A's
    with pytest.raises(StoreOfAnotherProjectError):
        asyncio.run(start_check(settings_b, project_b, shared))
    result = CliRunner().invoke(app, ["--home", str(tmp_path / "b"), "migrate", "--from-store", str(tmp_path / "b")])
    assert result.exit_code == 2
    assert "serves another project" in result.stderr
    assert asyncio.run(titles_in(shared)) == []  # nothing of b's was copied


async def start_check(settings: Settings, project: str, folder: Path) -> None:
    """What a daemon of ``settings`` (its project key ``project``) checks of the filesystem store in ``folder``
    at its start."""
    store = FileSystemStore(folder)
    await store.open()
    try:
        await check_the_store(settings, store, SUBSCRIPTION_ID, project)
    finally:
        await store.close()


def shared_homes(tmp_path: Path) -> tuple[Settings, str, Settings, str, Path]:
    """Homes a and b (b with a conversation of its own) whose config.toml both name one storage.path."""
    init_home(tmp_path / "a")
    init_home(tmp_path / "b")
    seed_conversation(tmp_path / "b", "B's own", "hello")
    shared = tmp_path / "shared"
    shared.mkdir(exist_ok=True)
    for home in ("a", "b"):
        config = tmp_path / home / "config.toml"
        config.write_text(config.read_text().replace("[storage]\n", f'[storage]\npath = "{shared}"\n', 1))
    settings_a, settings_b = load_settings(tmp_path / "a"), load_settings(tmp_path / "b")
    project_a, project_b = load_project_pubkey(settings_a), load_project_pubkey(settings_b)
    assert project_a is not None
    assert project_b is not None
    return settings_a, project_a, settings_b, project_b, shared


async def titles_in(folder: Path) -> list[str]:
    """The titles of the conversations the filesystem store in ``folder`` holds."""
    store = FileSystemStore(folder)
    await store.open()
    try:
        return [row.title for row in await store.search(SearchQuery())]
    finally:
        await store.close()


async def mark_of(folder: Path) -> str | None:
    """The project mark of the filesystem store in ``folder``."""
    store = FileSystemStore(folder)
    await store.open()
    try:
        return await store.get_meta(PROJECT_MARK_KEY)
    finally:
        await store.close()


def test_a_copy_refused_for_another_reason_leaves_the_store_unmarked(tmp_path: Path) -> None:
    """A store another home used, not marked yet (written before the mark existed), into which home b's copy
    is refused as used already, is left unmarked (its own project's daemon would then be refused on it)."""
    *_, shared = shared_homes(tmp_path)
    seed_conversation(tmp_path / "a", "A's own", "hi")  # a's config names the shared store: it is used

    result = CliRunner().invoke(app, ["--home", str(tmp_path / "b"), "migrate", "--from-store", str(tmp_path / "b")])

    assert result.exit_code == 2
    assert "used already" in result.stderr
    assert asyncio.run(mark_of(shared)) is None


def test_a_project_key_made_anew_is_refused_until_reopen_makes_the_store_its(tmp_path: Path) -> None:
    """A shared store marked by the project key a home had is refused once the key is made anew, the
    message naming `tenexd migrate --reopen`, which makes the store the new key's; the home's own store
    (no storage.path) is never marked."""
    settings_a, project_a, _, _, shared = shared_homes(tmp_path)

    asyncio.run(start_check(settings_a, project_a, shared))
    with pytest.raises(StoreOfAnotherProjectError, match="tenexd migrate --reopen"):
        asyncio.run(start_check(settings_a, B, shared))
    (tmp_path / "a" / "keys" / "project.key").unlink()
    assert CliRunner().invoke(app, ["--home", str(tmp_path / "a"), "init", "--force"]).exit_code == 0
    config = tmp_path / "a" / "config.toml"  # init wrote it anew: storage.path again
    if str(shared) not in config.read_text():
        config.write_text(config.read_text().replace("[storage]\n", f'[storage]\npath = "{shared}"\n', 1))
    renewed = load_project_pubkey(load_settings(tmp_path / "a"))
    assert renewed is not None
    with pytest.raises(StoreOfAnotherProjectError):
        asyncio.run(start_check(load_settings(tmp_path / "a"), renewed, shared))

    result = CliRunner().invoke(app, ["--home", str(tmp_path / "a"), "migrate", "--reopen"])

    assert result.exit_code == 0, result.output
    assert asyncio.run(mark_of(shared)) == renewed
    own = tmp_path / "own"
    init_home(own)
    own_settings = load_settings(own)
    asyncio.run(start_check(own_settings, A, own))
    assert asyncio.run(mark_of(own)) is None


def test_a_store_another_project_marked_is_not_copied_and_the_target_stays_unmarked(tmp_path: Path) -> None:
    """A ``storage.path`` store marked by home a's project, given to home b's ``migrate --from-store``, is refused
    (its conversations are a's), and b's new store is left unmarked and empty."""
    _, project_a, _, _, shared = shared_homes(tmp_path)
    seed_conversation(tmp_path / "a", "A's own", "hi")  # in the shared store, which a's daemon marks
    asyncio.run(claim_on(shared, project_a))
    config = tmp_path / "b" / "config.toml"
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    config.write_text(config.read_text().replace(f'path = "{shared}"', f'path = "{fresh}"'))

    result = CliRunner().invoke(app, ["--home", str(tmp_path / "b"), "migrate", "--from-store", str(shared)])

    assert result.exit_code == 2
    assert "serves another project" in result.stderr
    assert asyncio.run(mark_of(fresh)) is None
    assert asyncio.run(titles_in(fresh)) == []


async def claim_on(folder: Path, project: str) -> None:
    """Mark the filesystem store in ``folder`` as ``project``'s."""
    store = FileSystemStore(folder)
    await store.open()
    try:
        await claim_for_project(store, project)
    finally:
        await store.close()


def test_commands_run_without_a_daemon_refuse_a_store_another_project_marked(tmp_path: Path) -> None:
    """With no daemon answering, home b's `conversations list`, `migrate --from` and `--from-smarthole` on the
    store home a's project marked are refused (exit 2), so b neither reads a's conversations nor imports into
    a's store (it holds a's conversation only); home a lists its own."""
    _, project_a, _, _, shared = shared_homes(tmp_path)
    seed_conversation(tmp_path / "a", "A's own", "hi")
    asyncio.run(claim_on(shared, project_a))
    tenex_export = tmp_path / "project" / ".tenex" / "conversations"
    tenex_export.mkdir(parents=True)

    listed = CliRunner().invoke(app, ["--home", str(tmp_path / "b"), "conversations", "list"])
    imported = CliRunner().invoke(app, ["--home", str(tmp_path / "b"), "migrate", "--from", str(tmp_path / "project")])
    smarthole = data_file(tmp_path)
    from_smarthole = CliRunner().invoke(app, ["--home", str(tmp_path / "b"), "migrate", "--from-smarthole", str(smarthole)])

    assert listed.exit_code == 2
    assert "serves another project" in listed.stderr
    assert "A's own" not in listed.output
    assert imported.exit_code == 2
    assert "serves another project" in imported.stderr
    assert from_smarthole.exit_code == 2
    assert "serves another project" in from_smarthole.stderr
    assert asyncio.run(titles_in(shared)) == ["A's own"]  # nothing of b's imported into a's store
    own = CliRunner().invoke(app, ["--home", str(tmp_path / "a"), "conversations", "list"])
    assert own.exit_code == 0, own.output
    assert "A's own" in own.output


async def test_an_agent_whose_key_changed_since_the_last_start_is_told() -> None:
    """An agent's key file replaced (or a new agent given a removed one's slug) between two starts: the start
    warns (``agent_key_changed``, naming the agent and both keys' beginnings) once, and keeps the removed
    agents' keys, so one added back later with another key is told too (before, nothing was said: the old
    key's conversations went on with the new key, and replies p-tagging the old one were never heard)."""
    store = MemoryStore()
    planner, executor = make_agent("planner", "Planner", 1)[0], make_agent("executor", "Executor", 2)[0]
    rotated = make_agent("planner", "Planner", 3)[0]
    new_executor = make_agent("executor", "Other", 4)[0]

    first = await note_agent_keys(store, [planner, executor])
    with capture_logs() as logs:
        rotated_start = await note_agent_keys(store, [rotated])  # the executor removed
        again = await note_agent_keys(store, [rotated])
        readded = await note_agent_keys(store, [rotated, new_executor])

    assert (first, rotated_start, again, readded) == ([], ["planner"], [], ["executor"])
    [told, _] = [entry for entry in logs if entry["event"] == "agent_key_changed"]
    assert (told["agent"], told["was"], told["now"]) == ("planner", planner.pubkey[:16], rotated.pubkey[:16])
