"""The filesystem store's format number (``conversations/.format``): written at open, a newer tenexd's
store refused before anything of it is read or changed (docs/ARCHITECTURE.md, "Durability contract")."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tenex_daemon.adapters.storage.filesystem import FileSystemStore
from tenex_daemon.adapters.storage.filesystem.store_format import FORMAT_NAME, STORE_FORMAT, StoreFormatError
from tenex_daemon.cli.main import app
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.search import SearchQuery
from tests.conftest import Cast
from tests.unit.cli.conftest import USER, tenexd


async def stored_conversation(home: Path, cast: Cast) -> Path:
    """A home whose store holds one conversation, closed; return the store's folder."""
    store = FileSystemStore(home)
    await store.open()
    root = cast.user_says("Keep this", kind=11)
    conversation = Conversation(id=root.id, title="Keep this", created_at=1, updated_at=1)
    conversation.append(root)
    await store.create(conversation)
    await store.close()
    return store.root


async def test_open_writes_the_format_and_raises_an_older_one(tmp_path: Path, cast: Cast) -> None:
    """A store opened by this tenexd holds its format; one from before the file (none) or an older number is
    raised to it, its conversations read as before."""
    root = await stored_conversation(tmp_path / "home", cast)
    assert (root / FORMAT_NAME).read_text() == f"{STORE_FORMAT}\n"

    (root / FORMAT_NAME).unlink()
    store = FileSystemStore(tmp_path / "home")
    await store.open()
    found = await store.search(SearchQuery())
    await store.close()

    assert [row.title for row in found] == ["Keep this"]
    assert (root / FORMAT_NAME).read_text() == f"{STORE_FORMAT}\n"


@pytest.mark.parametrize(
    ("written", "words"),
    [(f"{STORE_FORMAT + 1}\n", "written by a newer tenexd"), ("two\n", "does not hold a store format number")],
)
async def test_a_newer_or_unreadable_format_is_refused_and_nothing_is_changed(
    tmp_path: Path, cast: Cast, written: str, words: str
) -> None:
    """A store a newer tenexd wrote (or whose format file is damaged) is refused at open, saying what to do,
    and left as it is: not recovered, its format not rewritten, its lock let go."""
    root = await stored_conversation(tmp_path / "home", cast)
    (root / FORMAT_NAME).write_text(written)
    before = sorted(p.name for p in root.iterdir())

    with pytest.raises(StoreFormatError, match=words):
        await FileSystemStore(tmp_path / "home").open()

    assert (root / FORMAT_NAME).read_text() == written
    assert sorted(p.name for p in root.iterdir()) == before
    (root / FORMAT_NAME).write_text(f"{STORE_FORMAT}\n")
    store = FileSystemStore(tmp_path / "home")
    await store.open()  # not left locked
    await store.close()


def test_the_daemon_refuses_a_newer_tenexds_store_with_exit_2(tmp_path: Path) -> None:
    """``tenexd run`` on a home whose store a newer tenexd wrote exits 2 (systemd's unit does not restart on
    it), saying to upgrade."""
    home = tmp_path / "home"
    code, out = tenexd(home, "init", "--owner", USER.npub, "--relay", "ws://127.0.0.1:1")
    assert code == 0, out
    (home / "conversations").mkdir(exist_ok=True)
    (home / "conversations" / FORMAT_NAME).write_text(f"{STORE_FORMAT + 5}\n")

    result = CliRunner().invoke(app, ["--home", str(home), "run"], catch_exceptions=False)

    assert result.exit_code == 2
    assert "upgrade tenexd" in result.stderr
