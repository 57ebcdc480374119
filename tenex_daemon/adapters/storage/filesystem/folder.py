"""One conversation's folder: its log and snapshot made, read, repaired, moved and removed.

Blocking file work: called in worker threads.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from pydantic import ValidationError

from tenex_daemon.adapters.storage.atomic import Stamp, fsync_dir, fsync_file, replace_file, write_file
from tenex_daemon.adapters.storage.filesystem.layout import (
    DELETED_FOLDER_PREFIX,
    LOG_NAME,
    STATE_NAME,
    TEMP_FOLDER_PREFIX,
    archive_twin,
)
from tenex_daemon.adapters.storage.filesystem.logfile import (
    LogScan,
    cut_tail,
    encode_line,
    parse_event,
    scan_log,
)
from tenex_daemon.adapters.storage.filesystem.repairs import (
    RecoveryAction,
    copy_to_corrupt,
    move_to_corrupt,
)
from tenex_daemon.core.conversation import UNTITLED, Conversation
from tenex_daemon.core.errors import ConversationExistsError
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.vocabulary import TAG_TITLE

log = structlog.get_logger(__name__)

STATE_FORMAT = 1


LAST_USER_EVENT = "last_user_event"
"""The state key naming the event whose content is ``metadata.last_user_message``: the snapshot
refers to that event instead of repeating its content (the log holds it already)."""


def _newest_event_with(content: str, conversation: Conversation, appended: NostrEvent | None) -> str | None:
    """The id of the newest event (``appended`` first, then history from the end) holding ``content``."""
    if appended is not None and appended.content == content:
        return appended.id
    for event in reversed(conversation.history):
        if event.content == content:
            return event.id
    return None


def state_snapshot(
    conversation: Conversation, archived: bool, appended: NostrEvent | None = None
) -> tuple[bytes, dict[str, Any]]:
    """The ``state.json`` of a conversation, and the state it holds as data (the index's summary is
    copied from it: made once per write). Everything but its history, which it never repeats: the last
    user message is the id of the event holding it (``appended``: the event written with it)."""
    state = conversation.state_dict()
    state["archived"] = archived
    message = conversation.metadata.last_user_message
    event_id = None if not message else _newest_event_with(message, conversation, appended)
    if event_id is not None:
        state["metadata"]["last_user_message"] = None
        state[LAST_USER_EVENT] = event_id
    data = json.dumps({"format": STATE_FORMAT, "state": state}, separators=(",", ":"), ensure_ascii=False)
    return data.encode("utf-8"), state


# --- making a folder -----------------------------------------------------------------------------


def prepare_folder(final: Path, log_data: bytes, state_data: bytes, *, durable: bool) -> tuple[Path, Stamp]:
    """Write a new conversation's two files into a temp folder next to ``final``.

    ``durable``: fsync both files and the folder (otherwise the journal covers them). Return
    the temp folder and the state file's stamp (a rename keeps it).
    """
    if final.exists() or archive_twin(final).exists():
        raise ConversationExistsError(final.name)
    tmp = final.parent / f"{TEMP_FOLDER_PREFIX}{final.name}-{os.getpid()}-{time.time_ns()}"
    tmp.mkdir()
    try:
        write_file(tmp / LOG_NAME, log_data, durable=durable, exclusive=True)
        stamp = write_file(tmp / STATE_NAME, state_data, durable=durable, exclusive=True)
        if durable:
            fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp, stamp


def create_folder(final: Path, log_data: bytes, state_data: bytes) -> Stamp:
    """Create a conversation folder durably (``always``): temp folder, fsyncs, rename, fsync.

    Return the state file's stamp.
    """
    tmp, stamp = prepare_folder(final, log_data, state_data, durable=True)
    try:
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(final.parent)
    return stamp


# --- moving and removing -------------------------------------------------------------------------


def move_folder(source: Path, target: Path) -> None:
    """Archive or restore a conversation: one rename, both folders fsynced."""
    os.rename(source, target)
    fsync_dir(target.parent)
    fsync_dir(source.parent)


def delete_folder(folder: Path) -> None:
    """Rename the folder aside (the deletion counts from then on), then remove it."""
    doomed = folder.parent / f"{DELETED_FOLDER_PREFIX}{folder.name}-{time.time_ns()}"
    os.rename(folder, doomed)
    try:
        fsync_dir(folder.parent)
    except OSError as exc:  # the rename is done: the deletion counts, open finishes it
        log.warning("delete_not_synced", folder=str(folder), error=str(exc))
    shutil.rmtree(doomed, ignore_errors=True)


def keep_after_failed_delete(folder: Path) -> bool:
    """Whether the folder is still there; if so its files are fsynced (a committed forget frame
    no longer lets the journal cover them)."""
    if not folder.exists():
        return False
    for name in (LOG_NAME, STATE_NAME):
        with contextlib.suppress(OSError):
            fsync_file(folder / name)
    with contextlib.suppress(OSError):
        fsync_dir(folder)
    return True


# --- reading and repairing -----------------------------------------------------------------------


@dataclass
class ScannedFolder:
    """A conversation folder read from disk by a worker thread."""

    state: dict[str, Any]
    events: list[NostrEvent]
    log_size: int
    event_ids: list[str]
    participants: set[str]
    state_stamp: Stamp
    actions: list[RecoveryAction]
    start: int = 0
    """Where the scan of the log began (0: the whole log, its counts cover all of it)."""


def _default_state(conversation_id: str, events: list[NostrEvent]) -> dict[str, Any]:
    """State for a conversation whose snapshot was lost: derived from its events."""
    root = events[0] if events else None
    created = root.created_at * 1000 if root else 0
    updated = events[-1].created_at * 1000 if events else 0
    conversation = Conversation(
        id=conversation_id,
        title=(root.tag_value(TAG_TITLE) if root else None) or UNTITLED,
        root_kind=root.kind if root else 11,
        created_at=created,
        updated_at=updated,
        activity_at=updated,
        phase_started_at=created,
    )
    return conversation.state_dict()


def _read_state(path: Path) -> tuple[dict[str, Any] | None, Stamp]:
    """Return (state, stamp); state None when missing or unreadable."""
    try:
        data = path.read_bytes()
        st = os.stat(path)
    except FileNotFoundError:
        return None, (0, 0)
    try:
        wrapper = json.loads(data)
        state = wrapper["state"]
        if wrapper.get("format") != STATE_FORMAT or not isinstance(state, dict):
            raise ValueError("not a state snapshot")
        Conversation.model_validate({**state, "history": []})
    except (ValueError, KeyError, TypeError, ValidationError):
        return None, (st.st_size, st.st_mtime_ns)
    return state, (st.st_size, st.st_mtime_ns)


def _salvage(
    log_path: Path, keep: list[bytes], bad: int, conversation_id: str, corrupt_dir: Path,
    actions: list[RecoveryAction],
) -> LogScan:
    """Copy the log to ``corrupt/`` as it is, then rewrite it with the ``keep`` payloads only.

    Return the scan of the salvaged log (from its start).
    """
    saved = copy_to_corrupt(corrupt_dir, log_path, f"{conversation_id}.events.log")
    good = b"".join(encode_line(p) for p in keep)
    replace_file(log_path, good)
    detail = f"{bad} corrupt line(s); original kept at {saved.name}"
    actions.append(RecoveryAction("log_salvaged", conversation_id, detail))
    log.error("event_log_salvaged", conversation_id=conversation_id, detail=detail)
    return scan_log(good)


def _read_from(path: Path, start: int) -> bytes:
    """The bytes of ``path`` from offset ``start`` on."""
    with open(path, "rb") as handle:
        if start:
            handle.seek(start)
        return handle.read()


def _whole(log_path: Path, data: bytes, start: int) -> bytes:
    """The whole log: ``data`` when it was read from its start, else read again (only open reads a
    tail, and no line is appended meanwhile)."""
    return data if start == 0 else log_path.read_bytes()


def _repair_log(
    log_path: Path, data: bytes, start: int, scan: LogScan, conversation_id: str, corrupt_dir: Path,
    actions: list[RecoveryAction], *, live: bool,
) -> LogScan | None:
    """Salvage a log with corrupt complete lines (the original copied to ``corrupt/`` first, torn
    tail and all) or cut its torn tail (an unterminated last line, nothing else), unless ``live``.
    ``data`` is the log from offset ``start`` on.

    Return the scan of the salvaged log (from its start), None when no salvage was needed.
    """
    if scan.bad_lines:
        every = scan_log(_whole(log_path, data, start)).payloads
        return _salvage(log_path, every, scan.bad_lines, conversation_id, corrupt_dir, actions)
    if scan.torn and not live:
        cut_tail(log_path, scan.good_end, durable=True)
        detail = f"cut {scan.size - scan.good_end} byte(s) after offset {scan.good_end}"
        actions.append(RecoveryAction("torn_tail_cut", conversation_id, detail))
        log.warning("torn_tail_cut", conversation_id=conversation_id, detail=detail)
    return None


def _restore_last_user_message(state: dict[str, Any], events: list[NostrEvent]) -> None:
    """Put back the last user message a snapshot refers to by event id (absent event: none)."""
    event_id = state.pop(LAST_USER_EVENT, None)
    if event_id is None:
        return
    for event in reversed(events):
        if event.id == event_id:
            metadata = state.setdefault("metadata", {})
            if isinstance(metadata, dict):
                metadata["last_user_message"] = event.content
            return


def _rebuild_state(
    state_path: Path, conversation_id: str, corrupt_dir: Path, history: list[NostrEvent],
    actions: list[RecoveryAction],
) -> tuple[dict[str, Any], Stamp]:
    """Move an unreadable snapshot aside and write one derived from the events."""
    if state_path.exists():
        moved = move_to_corrupt(corrupt_dir, state_path, f"{conversation_id}.state.json")
        detail = f"unreadable snapshot moved to {moved.name}; state rebuilt from the event log"
        actions.append(RecoveryAction("moved_to_corrupt", conversation_id, detail))
    else:
        detail = "snapshot missing; state rebuilt from the event log"
    state = _default_state(conversation_id, history)
    stamp = replace_file(state_path, json.dumps({"format": STATE_FORMAT, "state": state}).encode())
    actions.append(RecoveryAction("state_rebuilt", conversation_id, detail))
    log.error("state_rebuilt", conversation_id=conversation_id, detail=detail)
    return state, stamp


@dataclass
class _Payloads:
    """What a log's good lines hold."""

    events: list[NostrEvent]
    event_ids: list[str]
    participants: set[str]
    good: list[bytes]
    """The payloads that are events."""
    unreadable: int


def _read_payloads(payloads: list[bytes], parse_events: bool) -> _Payloads:
    """Read each payload as an event (whole with ``parse_events``, else its id and pubkey only);
    one that is not an event is counted in ``unreadable``, not skipped silently."""
    read = _Payloads([], [], set(), [], 0)
    for payload in payloads:
        if parse_events:
            event = parse_event(payload)
            if event is None:
                read.unreadable += 1
                continue
            event_id, pubkey = event.id, event.pubkey
            read.events.append(event)
        else:
            try:
                raw = json.loads(payload)
                event_id, pubkey = raw["id"], raw["pubkey"]
            except (ValueError, KeyError, TypeError):
                read.unreadable += 1
                continue
            if not isinstance(event_id, str) or not isinstance(pubkey, str):
                read.unreadable += 1
                continue
        read.event_ids.append(event_id)
        read.participants.add(pubkey)
        read.good.append(payload)
    return read


def scan_folder(
    folder: Path, conversation_id: str, corrupt_dir: Path, *, parse_events: bool, start: int = 0,
    live: bool = False,
) -> ScannedFolder:
    """Read a conversation folder, repairing it: cut a torn tail, salvage a corrupt log,
    move an unreadable snapshot aside and rebuild it from the events.

    With ``start`` > 0 only the part of the log after that (line-aligned) offset is read and scanned
    for event ids; counts then cover that part only (a salvage scans it whole: the result's
    ``start`` says which). ``live`` (a load while the store is open): an unterminated last line is
    not cut but left out, as it may be a line being appended that very moment (a large one is
    written, and seen by readers, a page at a time); the scan ends at the last complete line. A
    torn tail a crash left is cut by the next open, which rescans every log whose size disagrees.
    """
    actions: list[RecoveryAction] = []
    log_path = folder / LOG_NAME
    try:
        data = _read_from(log_path, start)  # the log from ``start`` on
    except FileNotFoundError:
        data, start = b"", 0
        log_path.touch()
    scan = scan_log(data, offset=start)
    salvaged = _repair_log(log_path, data, start, scan, conversation_id, corrupt_dir, actions, live=live)
    if salvaged is not None:
        scan, start = salvaged, 0
    read = _read_payloads(scan.payloads, parse_events)
    if read.unreadable:
        # checksummed lines that are no event: corruption too, kept in corrupt/ and reported
        every = scan.payloads if start == 0 else scan_log(_whole(log_path, data, start)).payloads
        keep = _read_payloads(every, parse_events).good
        scan = _salvage(log_path, keep, len(every) - len(keep), conversation_id, corrupt_dir, actions)
        data, start = log_path.read_bytes(), 0
        read = _read_payloads(scan.payloads, parse_events)
    events, event_ids, participants = read.events, read.event_ids, read.participants
    state_path = folder / STATE_NAME
    state, stamp = _read_state(state_path)
    if state is None:
        every = scan.payloads if start == 0 else scan_log(_whole(log_path, data, start)).payloads
        history = events or [e for e in (parse_event(p) for p in every[:1] + every[-1:]) if e]
        state, stamp = _rebuild_state(state_path, conversation_id, corrupt_dir, history, actions)
    if parse_events:
        _restore_last_user_message(state, events)
    return ScannedFolder(state, events, scan.good_end, event_ids, participants, stamp, actions, start)
