"""Hardening of the stores and of what they are fed: damaged logs keep their data, snapshots do not
repeat the history, absurd timestamps are refused at intake and never crash a display, and
``storage.path`` means what its docstring says."""

from __future__ import annotations

import inspect
import json
import time
from pathlib import Path

import pytest

from tenex_daemon import ConversationManager
from tenex_daemon.adapters.nostr.codec.frames import Rejection, RejectReason, parse_relay_frame
from tenex_daemon.adapters.storage.filesystem import LOG_NAME, STATE_NAME, FileSystemStore, encode_line
from tenex_daemon.app.home import init_home
from tenex_daemon.app.settings import StorageSettings, load_settings
from tenex_daemon.app.wiring import build_store
from tenex_daemon.cli.output import ms_time, s_time
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.testing import FakeClock, FakeResolver, sign_event
from tests.conftest import Cast


async def _home_with_log(tmp_path: Path, cast: Cast, replies: int = 3) -> tuple[Path, str, list[str]]:
    """A closed home with one conversation of a root and ``replies`` replies."""
    home = tmp_path / "home"
    store = FileSystemStore(home)
    await store.open()
    root = cast.user_says("root", kind=11, tags=[["title", "Hardening"]])
    conversation = Conversation(id=root.id, title="Hardening", created_at=1, updated_at=1)
    conversation.append(root)
    await store.create(conversation)
    ids = [root.id]
    for i in range(replies):
        event = cast.alice_says(f"reply {i}")
        await store.append_event(root.id, event)
        ids.append(event.id)
    await store.close()
    return home, root.id, ids


def _corrupt_dir_files(home: Path) -> list[Path]:
    """The files in ``conversations/corrupt/``."""
    folder = home / "conversations" / "corrupt"
    return sorted(folder.iterdir()) if folder.exists() else []


async def _reopened_history(home: Path, conversation_id: str) -> tuple[list[str], set[str]]:
    """Open the home, load the conversation; return its event ids and the repair kinds reported."""
    store = FileSystemStore(home)
    await store.open()
    loaded = await store.load(conversation_id)
    kinds = {action.kind for action in store.recovery}
    await store.close()
    assert loaded is not None
    return [e.id for e in loaded.history], kinds


# --- defect 3: a complete corrupt line is not a torn tail ------------------------------------------


async def test_corrupt_complete_last_line_is_copied_to_corrupt_before_the_cut(tmp_path: Path, cast: Cast) -> None:
    """A complete (newline-terminated) last line whose checksum fails is kept in corrupt/ and reported, not cut as torn."""
    home, conversation_id, ids = await _home_with_log(tmp_path, cast)
    log_path = home / "conversations" / conversation_id / LOG_NAME
    lines = log_path.read_bytes().split(b"\n")
    lines[-2] = lines[-2][:30] + (b"Y" if lines[-2][30:31] != b"Y" else b"Z") + lines[-2][31:]
    original = b"\n".join(lines)
    log_path.write_bytes(original)  # same size: found when the conversation is read
    history, kinds = await _reopened_history(home, conversation_id)
    assert history == ids[:-1]
    assert "log_salvaged" in kinds
    [saved] = _corrupt_dir_files(home)
    assert saved.read_bytes() == original


async def test_corrupt_complete_line_past_the_indexed_size_is_kept_with_its_torn_tail(
    tmp_path: Path, cast: Cast
) -> None:
    """A complete bad line after the indexed end, then unterminated bytes: open copies all of it to corrupt/ first."""
    home, conversation_id, ids = await _home_with_log(tmp_path, cast)
    log_path = home / "conversations" / conversation_id / LOG_NAME
    original = log_path.read_bytes() + b"00000000 {\"a line\": \"whose checksum fails\"}\n" + b"0badc0de {\"torn"
    log_path.write_bytes(original)
    history, kinds = await _reopened_history(home, conversation_id)
    assert history == ids
    assert "log_salvaged" in kinds
    [saved] = _corrupt_dir_files(home)
    assert saved.read_bytes() == original


async def test_checksummed_line_that_is_not_an_event_is_kept_and_reported(tmp_path: Path, cast: Cast) -> None:
    """A complete line whose checksum holds but whose payload is no event is kept in corrupt/ and reported."""
    home, conversation_id, ids = await _home_with_log(tmp_path, cast)
    log_path = home / "conversations" / conversation_id / LOG_NAME
    original = log_path.read_bytes() + encode_line(b'{"not": "an event"}')
    log_path.write_bytes(original)
    history, kinds = await _reopened_history(home, conversation_id)
    assert history == ids
    assert "log_salvaged" in kinds
    [saved] = _corrupt_dir_files(home)
    assert saved.read_bytes() == original


async def test_unterminated_last_line_alone_is_still_a_torn_tail(tmp_path: Path, cast: Cast) -> None:
    """Bytes after the last newline are a torn tail: cut and reported, nothing copied to corrupt/."""
    home, conversation_id, ids = await _home_with_log(tmp_path, cast)
    log_path = home / "conversations" / conversation_id / LOG_NAME
    data = log_path.read_bytes()
    log_path.write_bytes(data + data[:25])
    history, kinds = await _reopened_history(home, conversation_id)
    assert history == ids
    assert "torn_tail_cut" in kinds
    assert "log_salvaged" not in kinds
    assert _corrupt_dir_files(home) == []
    assert log_path.read_bytes() == data


# --- defect 8: state.json does not repeat the history -----------------------------------------------


async def test_state_json_does_not_repeat_a_message_of_the_history(
    tmp_path: Path, cast: Cast, clock: FakeClock, resolver: FakeResolver
) -> None:
    """The newest user message is kept in state.json as a reference to its event, and loads back whole."""
    store = FileSystemStore(tmp_path / "home")
    await store.open()
    manager = ConversationManager(
        store, cast.agents, cast.project.pubkey, resolver=resolver, clock=clock, resolve_timeout=0.2,
        owner_pubkey=cast.user.pubkey,
    )
    first = "FIRST-MESSAGE " + "x" * 500
    second = "SECOND-MESSAGE " + "y" * 500
    root = await manager.create_conversation(cast.user_says(first, kind=11, tags=[["title", "T"]]))
    state_path = tmp_path / "home" / "conversations" / root.id / STATE_NAME
    assert "FIRST-MESSAGE" not in state_path.read_text()
    await manager.add_event(root.id, cast.user_says(second))
    assert "SECOND-MESSAGE" not in state_path.read_text()
    await store.close()
    reopened = FileSystemStore(tmp_path / "home")
    await reopened.open()
    loaded = await reopened.load(root.id)
    await reopened.close()
    assert loaded is not None
    assert loaded.metadata.last_user_message == second


async def test_a_last_user_message_not_in_the_history_stays_in_the_snapshot(tmp_path: Path, cast: Cast) -> None:
    """A last user message that no stored event holds (an import) is kept in state.json as text."""
    store = FileSystemStore(tmp_path / "home")
    await store.open()
    root = cast.user_says("root", kind=11)
    conversation = Conversation(id=root.id, created_at=1, updated_at=1)
    conversation.append(root)
    conversation.metadata.last_user_message = "imported text"
    await store.create(conversation)
    await store.close()
    reopened = FileSystemStore(tmp_path / "home")
    await reopened.open()
    loaded = await reopened.load(root.id)
    await reopened.close()
    assert loaded is not None
    assert loaded.metadata.last_user_message == "imported text"


# --- defect 8: created_at bound and robust display --------------------------------------------------


def test_event_from_the_far_future_is_refused_at_intake(cast: Cast) -> None:
    """An event whose created_at is more than a day ahead of now (2^62, or now + 2 days) is rejected, saying why."""
    for created_at in (2**62, int(time.time()) + 2 * 86_400):
        event = sign_event(cast.user, "from the future", kind=1, created_at=created_at)
        for frame in (json.dumps(["EVENT", "s", event.to_dict()]), json.dumps(["EVENT", "s", event.to_dict()], indent=1)):
            result = parse_relay_frame(frame)
            assert isinstance(result, Rejection), created_at
            assert result.reason is RejectReason.BAD_CREATED_AT
            assert "created_at" in result.detail


def test_event_a_little_ahead_of_now_is_accepted(cast: Cast) -> None:
    """Clock skew of an hour is tolerated."""
    event = sign_event(cast.user, "skewed", kind=1, created_at=int(time.time()) + 3600)
    result = parse_relay_frame(json.dumps(["EVENT", "s", event.to_dict()]))
    assert not isinstance(result, Rejection)


def test_time_display_survives_absurd_values() -> None:
    """A time beyond what a calendar can show (2^62) is displayed as its raw number, never raises."""
    assert str(2**62) in ms_time(2**62)
    assert str(2**62) in s_time(2**62)
    assert ms_time(1_700_000_000_000) == "2023-11-14 22:13:20"


# --- defect 8: storage.path ---------------------------------------------------------------------------


def test_storage_path_docstring_matches_where_the_store_puts_conversations(tmp_path: Path) -> None:
    """``storage.path`` is documented as the store's home, and build_store keeps conversations in ``<path>/conversations``."""
    source = inspect.getsource(StorageSettings)
    assert "<path>/conversations" in source
    init_home(tmp_path / "h")
    settings = load_settings(tmp_path / "h", {"TENEX_STORAGE__PATH": json.dumps(str(tmp_path / "data"))})
    store = build_store(settings)
    assert isinstance(store, FileSystemStore)
    assert store.root == tmp_path / "data" / "conversations"
    assert settings.conversations_path == store.root


async def test_a_store_outside_the_home_keeps_its_conversations_private(tmp_path: Path, cast: Cast) -> None:
    """A ``storage.path`` outside the home gets a conversations folder only its owner can enter (0700),
    so neither the conversations' folder names (their ids) nor the folders are listed to other users."""
    init_home(tmp_path / "h")
    settings = load_settings(tmp_path / "h", {"TENEX_STORAGE__PATH": json.dumps(str(tmp_path / "data"))})
    store = build_store(settings)
    assert isinstance(store, FileSystemStore)
    await store.open()
    try:
        root = cast.user_says("root", kind=11)
        conversation = Conversation(id=root.id, title="Private", created_at=1, updated_at=1)
        conversation.append(root)
        await store.create(conversation)
    finally:
        await store.close()
    assert store.root.stat().st_mode & 0o777 == 0o700


def test_a_conversation_id_ending_in_a_newline_cannot_name_a_folder() -> None:
    """An id with a final newline is refused like any id that cannot name a file (a pattern ending in "$"
    let it through, and the processed-id lines, split on newlines, then named a conversation that does not
    exist); the same id without it is a name."""
    from tenex_daemon.adapters.storage.filesystem.layout import check_id, is_conversation_name

    assert is_conversation_name("conv")
    assert not is_conversation_name("conv\n")
    with pytest.raises(ValueError, match="cannot name a file"):
        check_id("conv\n")
