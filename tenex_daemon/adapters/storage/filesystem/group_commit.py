"""``batch``'s group commit: one fsync of one journal makes every op of the group durable.

A frame per op records what it writes (an append's offset and bytes, a replacement's new
content, a new folder), and the one fsync of the journal makes the whole group durable. The
commit runs in stages over a :class:`Group`:

1. stage: new conversations are written as temp folders and replacements as temp files (not
   fsynced); each file's appends get an open descriptor and its size before; event-id bucket
   lines are written at once (not cut back: derived lines are written to them concurrently,
   and a stray id line there only marks an id processed); every op gets its frame;
2. journal: the frames are written and fsynced; if that fails, every op fails: temp files and
   folders are removed, no log was touched; nothing is acknowledged before the fsync that
   covers it;
3. put in place: conversation logs get their lines (one write per file, not fsynced), new
   folders and snapshots are renamed into place, and small values are held by the journal
   (their files are written at its checkpoint: ``journal.py``).

So a file on disk is never newer than the journal: a kill mid-group leaves nothing of it
visible, or all of it journaled (open replays what is missing), never a later op without an
earlier one. A log write that fails after the journal (a full disk) is cut back, but its ops
succeed: their frames are durable, so they count as stored (a crash brings them back on open) and
their lines wait in the journal (:attr:`Journal.unwritten`), written at the start of the next
group; until then a new line of that log fails before its frame is written, and no checkpoint
deletes the journal. Blocking file work: runs on the commit thread.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from tenex_daemon.adapters.storage.atomic import (
    Stamp,
    discard_staged,
    put_in_place,
    stage,
    write_all,
    write_or_cut,
)
from tenex_daemon.adapters.storage.filesystem.folder import prepare_folder
from tenex_daemon.adapters.storage.filesystem.journal import (
    Journal,
    append_frame,
    create_frame,
    forget_frame,
    is_held,
    replace_frame,
)
from tenex_daemon.adapters.storage.filesystem.layout import LOG_NAME, STATE_NAME, archive_twin
from tenex_daemon.adapters.storage.filesystem.ops import (
    Op,
    Partition,
    append_flags,
    append_lock,
    fail,
    going_ahead,
)
from tenex_daemon.core.errors import ConversationExistsError

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class StagedAppend:
    """One file's appends in the group: its open descriptor, its size before them, their bytes."""

    ops: list[Op]
    fd: int
    before: int
    data: bytes
    relpath: str


@dataclass(frozen=True, slots=True)
class StagedCreate:
    """A new conversation written in a temp folder, renamed into place after the journal."""

    op: Op
    temp: Path
    stamp: Stamp


@dataclass(frozen=True, slots=True)
class StagedReplace:
    """A file's new content in its temp file, renamed over it after the journal."""

    ops: list[Op]
    path: Path
    stamp: Stamp


@dataclass(slots=True)
class Group:
    """A group commit in the making: what is staged, and the journal frames that will cover it."""

    journal: Journal
    frames: list[bytes] = field(default_factory=list)
    relpaths: list[str] = field(default_factory=list)
    """The files the frames write (fsynced at the journal's next checkpoint)."""
    buckets: list[StagedAppend] = field(default_factory=list)
    """Event-id buckets, written before the journal."""
    logs: list[StagedAppend] = field(default_factory=list)
    """Conversation logs, written once the journal is durable."""
    created: list[StagedCreate] = field(default_factory=list)
    replaced: list[StagedReplace] = field(default_factory=list)
    held: list[tuple[list[Op], Path]] = field(default_factory=list)
    """Small values: no temp file; the journal holds them once their frame is durable."""
    forgotten: list[Op] = field(default_factory=list)


# --- 1. stage ------------------------------------------------------------------------------------


def _stage_creates(group: Group, creates: list[Op]) -> None:
    claimed: set[Path] = set()
    for op in creates:
        try:
            if op.path in claimed or archive_twin(op.path) in claimed:
                raise ConversationExistsError(op.path.name)
            folder = group.journal.relpath(op.path)
            temp, stamp = prepare_folder(op.path, op.data, op.extra, durable=False)
            claimed.add(op.path)
        except (OSError, ValueError, ConversationExistsError) as exc:
            op.error = exc
            continue
        group.created.append(StagedCreate(op, temp, stamp))
        log_relpath, state_relpath = f"{folder}/{LOG_NAME}", f"{folder}/{STATE_NAME}"
        group.frames.append(create_frame(folder))
        group.frames.append(append_frame(log_relpath, 0, op.data))
        group.frames.append(replace_frame(state_relpath, op.extra))
        group.relpaths.extend((log_relpath, state_relpath))


def _open_appends(journal: Journal, path: Path, ops: list[Op]) -> tuple[str, StagedAppend] | None:
    """Open a file for its appends; None (its ops failed) when it cannot be."""
    try:
        relpath = journal.relpath(path)
        fd = os.open(path, append_flags(ops), 0o600)
    except (OSError, ValueError) as exc:
        fail(ops, exc)
        return None
    try:
        before = os.fstat(fd).st_size
    except OSError as exc:
        os.close(fd)
        fail(ops, exc)
        return None
    return relpath, StagedAppend(ops, fd, before, b"".join(op.data for op in ops), relpath)


def _write_bucket(path: Path, staged: StagedAppend) -> None:
    """Write a bucket's lines whole or cut them back (no part of a line is left for the next one to run
    into), under the lock its derived writer takes too: neither's cut-back removes the other's lines."""
    with append_lock(path):
        write_or_cut(staged.fd, staged.data, os.fstat(staged.fd).st_size, write_all)


def _stage_appends(group: Group, appends: dict[Path, list[Op]]) -> None:
    for path, ops in appends.items():
        opened = _open_appends(group.journal, path, ops)
        if opened is None:
            continue
        relpath, staged = opened
        blocked = group.journal.blocked(relpath)
        if blocked is not None:  # its earlier lines wait (a full disk): none may go before them
            os.close(staged.fd)
            fail(ops, blocked)
            continue
        if relpath.startswith("."):  # an event-id bucket
            try:
                _write_bucket(path, staged)
            except OSError as exc:
                os.close(staged.fd)
                fail(ops, exc)
                continue
            group.buckets.append(staged)
        else:
            group.logs.append(staged)
        group.relpaths.append(relpath)
        offset = staged.before
        for op in ops:
            group.frames.append(append_frame(relpath, offset, op.data))
            offset += len(op.data)


def _stage_replaces(group: Group, replaces: dict[Path, list[Op]]) -> None:
    for path, every in replaces.items():
        ops = going_ahead(every)  # a snapshot whose event's line failed above is not written
        if not ops:
            continue
        try:
            relpath = group.journal.relpath(path)
            if is_held(relpath):
                group.held.append((ops, path))
            else:
                group.replaced.append(StagedReplace(ops, path, stage(path, ops[-1].data, durable=False)))
        except (OSError, ValueError) as exc:
            fail(ops, exc)
            continue
        group.frames.append(replace_frame(relpath, ops[-1].data))
        group.relpaths.append(relpath)


def _stage_forgets(group: Group, forgets: list[Op]) -> None:
    group.forgotten = forgets
    group.frames.extend(forget_frame(op.data.decode("utf-8")) for op in forgets)


# --- 2. journal ----------------------------------------------------------------------------------


def _write_journal(group: Group) -> None:
    if not group.frames:
        return
    try:
        group.journal.write(group.frames, group.relpaths, [op.data.decode("utf-8") for op in group.forgotten])
    except Exception as exc:
        _give_up(group, exc)


def _give_up(group: Group, exc: Exception) -> None:
    """The journal could not be made durable: every op fails and nothing staged is kept."""
    for staged in group.buckets:
        fail(staged.ops, exc)
    unwritten, group.logs = group.logs, []
    for staged in unwritten:
        with contextlib.suppress(OSError):
            os.close(staged.fd)
        fail(staged.ops, exc)
    fail(group.forgotten, exc)
    for created in group.created:
        shutil.rmtree(created.temp, ignore_errors=True)
        created.op.error = exc
    for replaced in group.replaced:
        discard_staged(replaced.path)
        fail(replaced.ops, exc)
    for ops, _ in group.held:
        fail(ops, exc)
    group.created, group.replaced, group.held = [], [], []


# --- 3. put in place -----------------------------------------------------------------------------


def _append_logs(group: Group) -> None:
    """Journaled: now the logs get their lines (a kill before is repaired from the journal on open).
    A write that fails (a full disk) is cut back and its lines wait in the journal: its ops count
    (their frames are durable; failing them would have the caller store them again, and a replay
    bring back the first copy)."""
    for staged in group.logs:
        try:
            write_all(staged.fd, staged.data)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(staged.fd, staged.before)
            group.journal.defer(staged.relpath, staged.before, staged.data, exc)
            log.error("log_write_deferred", path=str(staged.ops[0].path), error=str(exc), note="journaled")
        finally:
            with contextlib.suppress(OSError):
                os.close(staged.fd)


def _put_created(group: Group) -> None:
    """New folders take their places by rename (a crash before is repaired from the journal)."""
    for created in group.created:
        try:
            os.rename(created.temp, created.op.path)
            created.op.result = created.stamp
        except OSError as exc:
            shutil.rmtree(created.temp, ignore_errors=True)
            created.op.error = exc
            _unjournal(group.journal, created.op.path.name)


def _put_replaced(group: Group) -> None:
    """Snapshots and values take their places by rename: a reader sees the old file or the new,
    never a mix (a write that fails, a full disk, failed before the journal, keeping the old)."""
    for replaced in group.replaced:
        try:
            put_in_place(replaced.path)
        except OSError as exc:
            fail(replaced.ops, exc)
            continue
        for op in replaced.ops:
            op.result = replaced.stamp


def _hold_values(group: Group) -> None:
    """Small values: their frames are durable; the journal holds them until its checkpoint."""
    for ops, path in group.held:
        group.journal.hold(path, None if ops[-1].erases else ops[-1].data)


def _unjournal(journal: Journal, conversation_id: str) -> None:
    """A journaled creation failed after all: a forget frame keeps replay from making it."""
    try:
        journal.write([forget_frame(conversation_id)], [], [conversation_id])
    except OSError:
        log.exception("journal_forget_failed", conversation_id=conversation_id)


def _close(staged: list[StagedAppend]) -> None:
    for item in staged:
        with contextlib.suppress(OSError):
            os.close(item.fd)


def apply_journaled(journal: Journal, ops: list[Op]) -> None:
    """Commit ``ops`` as one group: stage, journal, put in place (see the module doc)."""
    if journal.unwritten:  # lines a full disk kept from their logs go before any new one
        journal.write_unwritten()
    parts = Partition.of(ops)
    group = Group(journal)
    _stage_creates(group, parts.creates)
    try:
        _stage_appends(group, parts.appends)
        _stage_replaces(group, parts.replaces)
        _stage_forgets(group, parts.forgets)
        _write_journal(group)
    except BaseException:
        _close(group.logs)
        raise
    finally:
        _close(group.buckets)
    _append_logs(group)
    _put_created(group)
    _put_replaced(group)
    _hold_values(group)
