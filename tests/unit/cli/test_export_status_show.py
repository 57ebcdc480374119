"""What `conversations export -o`, `status` and `conversations show` say on the edges: an export file that
cannot be written is one error line (exit 2) and one that is written is its owner's only (0600); `status` of
a home that does not exist says so as every command does (exit 2); `show` labels the title's source as the
title's."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tenex_daemon.app.home import load_agents, load_project_pubkey
from tenex_daemon.app.settings import load_settings
from tenex_daemon.app.status import read_status
from tenex_daemon.app.wiring import build_store
from tenex_daemon.cli.main import app
from tenex_daemon.core.conversation import TitleSource
from tenex_daemon.services.conversation_manager import ConversationManager
from tests.unit.cli.test_cli import seed_conversation
from tests.unit.cli.test_send_private_reply import seed_private_conversation


def tenexd(home: Path, *args: str) -> tuple[int, str, str]:
    """Run ``tenexd --home HOME ARGS`` in-process; return (exit code, stdout, stderr with its lines joined)."""
    result = CliRunner().invoke(app, ["--home", str(home), *args], catch_exceptions=False)
    return result.exit_code, result.stdout, " ".join(result.stderr.split())


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The usual umask (files 0644 unless asked otherwise) while the test runs."""
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


def test_an_export_that_cannot_be_written_is_one_error_line_and_exit_2(home: Path, tmp_path: Path) -> None:
    """`conversations export ID -o` into a folder that does not exist, or onto a folder, exits 2 with
    `error: cannot write PATH: REASON` on stderr (no traceback) and writes nothing."""
    picnic = seed_conversation(home, "Picnic plans", "Plan a picnic")
    missing = tmp_path / "nowhere" / "x.json"
    folder = tmp_path / "exports"
    folder.mkdir()

    into_missing = tenexd(home, "conversations", "export", picnic, "-o", str(missing))
    onto_folder = tenexd(home, "conversations", "export", picnic, "-o", str(folder))

    assert into_missing == (2, "", f"error: cannot write {missing}: No such file or directory")
    assert onto_folder == (2, "", f"error: cannot write {folder}: Is a directory")
    assert list(folder.iterdir()) == []
    assert not missing.parent.exists()


@pytest.mark.usefixtures("umask_022")
def test_an_export_file_is_mode_0600_new_or_replaced(home: Path, tmp_path: Path) -> None:
    """Exporting a private conversation (its text decrypted) creates the file with mode 0600 under umask 022,
    and an existing 0644 file it replaces ends 0600 holding the export."""
    conversation, _ = seed_private_conversation(home)
    new = tmp_path / "private.json"
    old = tmp_path / "old.json"
    old.write_text("old, longer than nothing at all\n" * 100)
    old.chmod(0o644)

    assert tenexd(home, "conversations", "export", conversation, "-o", str(new))[0] == 0
    assert tenexd(home, "conversations", "export", conversation[:8], "--output", str(old))[0] == 0

    for path in (new, old):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        exported = json.loads(path.read_text())
        assert exported["id"] == conversation
        assert exported["history"][0]["content"] == "my salary is 90k"


def test_status_of_a_home_that_does_not_exist_says_so_with_exit_2(home: Path, tmp_path: Path) -> None:
    """`status` (and `status --json`) of a home folder that does not exist, or that has no config.toml, exits
    2 saying its config.toml is not found and to run init, as `conversations list` does; a home that exists
    with no status file still says `not running: no status file at ...` with exit 1."""
    nowhere = tmp_path / "nohome"
    empty = tmp_path / "empty"
    empty.mkdir()

    for path in (nowhere, empty):
        expected = f"error: {path}/config.toml: not found (run `tenexd init --home {path}` first)"
        assert tenexd(path, "status") == (2, "", expected)
        assert tenexd(path, "status", "--json") == (2, "", expected)
        assert tenexd(path, "conversations", "list")[::2] == (2, expected)
    assert not nowhere.exists()
    code, printed, _ = tenexd(home, "status")
    assert (code, " ".join(printed.split())) == (1, f"tenexd: not running: no status file at {home}/run/status.json")


def test_a_home_without_its_key_files_is_refused_with_nothing_created(home: Path, tmp_path: Path) -> None:
    """`conversations list` in a home holding only a config.toml (its keys missing, as in a copied config) exits
    2 naming the missing key file, and leaves the home as it was: no conversation store is made in it."""
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.toml").write_text((home / "config.toml").read_text(encoding="utf-8"), encoding="utf-8")

    code, _, error = tenexd(bare, "conversations", "list")

    assert code == 2
    assert f"key file {bare}/keys/" in error
    assert "does not exist" in error
    assert sorted(p.name for p in bare.iterdir()) == ["config.toml"]


def test_show_labels_the_title_source_as_the_titles_not_the_summarys(home: Path) -> None:
    """`conversations show` of a conversation titled by the person's tag and summarized by a model prints
    `title source: tag` and `summary: ...`, never `summary (tag): ...`."""
    picnic = seed_conversation(home, "Picnic plans", "Plan a picnic")

    async def describe() -> None:
        settings = load_settings(home)
        store = build_store(settings)
        await store.open()
        try:
            manager = ConversationManager(store, load_agents(settings), load_project_pubkey(settings))
            conversation = await manager.get_conversation(picnic)
            assert conversation is not None
            await manager.describe(
                picnic, title="A model's title", summary="They planned a picnic.", source=TitleSource.MODEL,
                for_activity=conversation.last_activity,
            )
        finally:
            await store.close()

    asyncio.run(describe())
    code, shown, _ = tenexd(home, "conversations", "show", picnic)

    lines = shown.splitlines()
    assert code == 0
    assert lines[0] == "Picnic plans"
    assert "title source: tag" in lines
    assert "summary: They planned a picnic." in lines
    assert "summary (" not in shown


def test_words_that_look_like_rich_markup_are_printed_as_written(home: Path) -> None:
    """A title and an end reason holding square brackets or an emoji code (a person's or a model's words) are
    printed as they are by `conversations list`, `search` and `show`: "[/oops]" raises nothing, "[draft]" does
    not vanish, ":rocket:" stays text."""
    title = "[/oops] Plan [draft] trip :rocket:"
    picnic = seed_conversation(home, title, "Plan a picnic")
    assert tenexd(home, "conversations", "end", picnic, "--reason", "done [/x] [bold]")[0] == 0

    listed = tenexd(home, "conversations", "list")
    found = tenexd(home, "conversations", "search", "trip")
    shown = tenexd(home, "conversations", "show", picnic)

    assert (listed[0], found[0], shown[0]) == (0, 0, 0)
    assert title in listed[1]
    assert title in found[1]
    assert title in shown[1]
    assert "done [/x] [bold]" in shown[1]


def test_an_empty_home_is_refused_and_the_current_folder_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--home ""` (an unset variable in `--home "$VAR"`) exits 2 saying it is empty, for init and status alike,
    and writes nothing in the current folder (which it took for the home)."""
    monkeypatch.chdir(tmp_path)
    for args in (["init"], ["status"]):
        result = CliRunner().invoke(app, ["--home", "", *args], catch_exceptions=False)
        assert result.exit_code == 2, result.stdout
        assert "--home is empty" in " ".join(result.stderr.split())
    assert list(tmp_path.iterdir()) == []


def test_a_store_that_cannot_be_opened_is_one_error_line(home: Path, tmp_path: Path) -> None:
    """`conversations list` whose storage path is a file exits 2 with one line saying the store cannot be
    opened and why (its folder is a file: check storage.path), not a traceback."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    config = home / "config.toml"
    config.write_text(config.read_text().replace("[storage]", f'[storage]\npath = "{blocker}"', 1))

    code, out, said = tenexd(home, "conversations", "list")

    assert (code, out) == (2, "")
    assert said.startswith("error: cannot open the conversation store in ")
    assert said.endswith("that folder, or one above it, is a file (check storage.path)")
    assert "\n" not in said


def test_a_home_this_user_may_not_read_is_one_error_line_not_a_verdict(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`status` by a user who may not read the status file (the daemon's user made it) exits 2 with one
    line naming the file and what to do, not "not running" (the daemon may well run) nor a traceback; the
    reader itself raises rather than judging a file it could not read."""
    status_file = home / "run" / "status.json"
    status_file.parent.mkdir(exist_ok=True)
    status_file.write_text("{}")
    read_text = Path.read_text

    def denied(path: Path, *args: object, **kwargs: object) -> str:
        if path == status_file:
            raise PermissionError(13, "Permission denied", str(path))
        return read_text(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "read_text", denied)

    code, out, said = tenexd(home, "status")

    assert (code, out) == (2, "")
    assert said == f"error: permission denied: {status_file} (run tenexd as the user the daemon runs as)"
    with pytest.raises(PermissionError):
        read_status(status_file, 30)


def test_status_prints_a_status_file_of_odd_shapes_without_failing(home: Path) -> None:
    """A status file whose sections are not what this version writes (another version's) is printed as far as
    it can be (a section of the wrong shape counts as empty), never a traceback."""
    status_file = home / "run" / "status.json"
    status_file.parent.mkdir(exist_ok=True)
    odd = {
        "pid": os.getpid(), "updated_at": time.time(), "state": "running", "conversations": "x", "events": 5,
        "relays": ["ws://x", {"url": "ws://y", "state": "connected"}], "outbox": {"oldest_age_s": float("nan")},
        "retention": {"totals": "y"}, "uptime_s": float("inf"),
    }
    status_file.write_text(json.dumps(odd))  # NaN and Infinity as Python writes them

    code, out, said = tenexd(home, "status")

    assert said == ""
    assert "conversations 0" in out
    assert "ws://y" in out
    assert code in (0, 1)


def test_status_prints_durations_past_any_float_as_written(home: Path) -> None:
    """An uptime and an outbox age that are whole numbers past any float (another writer's file) are printed
    as written, not a traceback (OverflowError)."""
    status_file = home / "run" / "status.json"
    status_file.parent.mkdir(exist_ok=True)
    huge = 10**400
    odd = {
        "pid": os.getpid(), "updated_at": time.time(), "state": "running", "uptime_s": huge,
        "outbox": {"depth": 1, "oldest_age_s": huge},
    }
    status_file.write_text(json.dumps(odd))

    code, out, said = tenexd(home, "status")

    assert said == ""
    assert f"up {huge} s" in " ".join(out.split())
    assert code in (0, 1)
