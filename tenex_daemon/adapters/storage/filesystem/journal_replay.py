"""Replaying on open the commit journals a crash or a power loss left behind.

Every record missing from its file is brought back: folders re-created, appends re-applied,
snapshots restored; then the files are fsynced. Replay never cuts a good line: a record whose
bytes are at their offset (or anywhere after the first record's offset, if something rewrote
the file since) is left alone; the missing ones are appended at the end, after cutting a torn
tail from a line-terminated log. A journal file its checkpoint sealed (left behind because its
deletion failed) is not replayed: its records are in their files already. The journal files are deleted
(:func:`discard`) only once open has made the rescans' derived data durable.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from tenex_daemon.adapters.storage.atomic import fsync_dir, fsync_file, replace_file
from tenex_daemon.adapters.storage.filesystem.erasure import is_tombstone
from tenex_daemon.adapters.storage.filesystem.journal import (
    JournalRead,
    conversation_of,
    is_held,
    is_log_of,
    journal_files,
    read_journal,
    resolve,
)
from tenex_daemon.adapters.storage.filesystem.layout import EVENTS_DIR
from tenex_daemon.adapters.storage.filesystem.logfile import after_last_line
from tenex_daemon.adapters.storage.filesystem.repairs import RecoveryAction, copy_to_corrupt

log = structlog.get_logger(__name__)


@dataclass
class Replayed:
    """What :func:`replay` did."""

    actions: list[RecoveryAction]
    touched: set[str]
    """Conversations the journal appended to: their derived data (index entry, event-id
    bucket lines, never fsynced) may lag behind, so open rescans their logs."""
    files: list[Path]
    """The journal files replayed: deleted by :func:`discard` once open has made the rescans'
    derived data durable (until then a crash replays them again)."""
    next_generation: int
    """The first generation free for a new journal."""


@dataclass
class _Records:
    """The records of every journal file, in commit order, forgotten ones dropped."""

    appends: dict[str, list[tuple[int, bytes]]] = field(default_factory=dict)
    replaced: dict[str, bytes] = field(default_factory=dict)
    created: list[str] = field(default_factory=list)

    def forget(self, conversation_id: str) -> None:
        for relpath in [p for p in self.appends if is_log_of(p, conversation_id)]:
            del self.appends[relpath]
        for relpath in [p for p in self.replaced if is_log_of(p, conversation_id)]:
            del self.replaced[relpath]
        self.created = [p for p in self.created if not is_log_of(p, conversation_id)]


def _current(files: list[tuple[int, Path]], actions: list[RecoveryAction]) -> list[tuple[Path, JournalRead]]:
    """Read the journal files, oldest first, but those a checkpoint sealed: their records are in their
    files (a deletion that failed left them), and replaying them would write old records over newer
    ones."""
    current = []
    for _, path in files:
        read = read_journal(path.read_bytes())
        if not read.checkpointed or read.corrupt:  # a corrupt one is copied aside and replayed as ever
            current.append((path, read))
            continue
        detail = f"journal {path.name}: sealed by its checkpoint"
        actions.append(RecoveryAction("journal_skipped", None, detail))
        log.warning("journal_skipped", journal=str(path))
    return current


def _read_all(files: list[tuple[int, Path]], corrupt_dir: Path, actions: list[RecoveryAction]) -> _Records:
    """Read the journal files still current (:func:`_current`) oldest first; one holding a corrupt
    frame is copied to ``corrupt/`` (its good frames are still replayed)."""
    records = _Records()
    for path, read in _current(files, actions):
        if read.corrupt:
            target = copy_to_corrupt(corrupt_dir, path, f"journal.{path.name}")
            actions.append(RecoveryAction(
                "moved_to_corrupt", None,
                f"journal {path.name}: bad frame at byte {read.good_end}, copied to {target.name}",
            ))
            log.error("journal_corrupt", journal=str(path), offset=read.good_end)
        elif read.good_end < read.size:
            actions.append(RecoveryAction(
                "torn_tail_cut", None,
                f"journal {path.name}: {read.size - read.good_end} bytes of a frame being written",
            ))
        for gone in read.forgotten:
            records.forget(gone)
        records.created.extend(read.created)
        for relpath, offset, chunk in read.appends:
            records.appends.setdefault(relpath, []).append((offset, chunk))
        for relpath, content in read.replaces.items():
            records.replaced.pop(relpath, None)
            records.replaced[relpath] = content
    return records


def _restore_file(path: Path, content: bytes) -> bool:
    """Make ``path`` hold ``content`` durably; False if it already did (its folder is synced later)."""
    with contextlib.suppress(FileNotFoundError):
        if path.read_bytes() == content:
            fsync_file(path)
            return False
    replace_file(path, content, sync_dir=False)
    return True


def _repair_file(path: Path, records: list[tuple[int, bytes]]) -> int:
    """Append the records missing from ``path``; return how many were. fsyncs the file.

    A record is present when its bytes are at its offset or, if something rewrote the file
    since (a salvage of a damaged log moves lines), anywhere in it.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        size = os.fstat(fd).st_size
        whole: bytes | None = None
        missing: list[bytes] = []
        for offset, data in records:
            if offset + len(data) <= size and os.pread(fd, len(data), offset) == data:
                continue
            if whole is None:
                whole = os.pread(fd, size, 0) if size else b""
            if data in whole:
                continue
            missing.append(data)
        if missing:
            end = size
            if missing[0].endswith(b"\n") and size:
                end = after_last_line(fd, size)  # a line-terminated log: cut a torn tail
                os.ftruncate(fd, end)
            os.pwrite(fd, b"".join(missing), end)
        os.fsync(fd)
        return len(missing)
    finally:
        os.close(fd)


class _Replay:
    """One replay's bookkeeping: what it did, which conversations and folders it touched."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.actions: list[RecoveryAction] = []
        self.touched: set[str] = set()
        self.folders: set[Path] = set()

    def recreate_folders(self, created: list[str]) -> None:
        """Folders whose creation the page cache lost are made again."""
        for relpath in created:
            if resolve(self.root, relpath + "/_") is None:
                (self.root / relpath).mkdir(parents=True, exist_ok=True)
                self.folders.add((self.root / relpath).parent)
                self.actions.append(RecoveryAction(
                    "journal_replayed", conversation_of(relpath), f"folder {relpath} re-created"
                ))
                log.warning("journal_replayed", path=relpath, folder="re-created")

    def reapply_appends(self, appends: dict[str, list[tuple[int, bytes]]]) -> None:
        """Each file gets the appends it lacks."""
        for relpath, records in appends.items():
            found = resolve(self.root, relpath)
            if found is None:
                continue  # the conversation was deleted after these appends
            added = _repair_file(found, records)
            self.folders.add(found.parent)
            conversation_id = conversation_of(relpath)
            if conversation_id is not None:
                self.touched.add(conversation_id)
            if added:
                self.actions.append(RecoveryAction(
                    "journal_replayed", conversation_id,
                    f"{added} of {len(records)} journaled appends re-applied to {relpath}",
                ))
                log.warning("journal_replayed", path=relpath, records=added)

    def restore_replaced(self, replaced: dict[str, bytes]) -> None:
        """Each replaced file is brought to its last journaled content."""
        for relpath, content in replaced.items():
            found = resolve(self.root, relpath)
            if found is None:
                continue  # deleted since
            conversation_id = conversation_of(relpath)
            if conversation_id is not None:
                self.touched.add(conversation_id)
            self.folders.add(found.parent)
            if is_held(relpath) and is_tombstone(content):
                self._erase(found, relpath)
            elif _restore_file(found, content):
                self.actions.append(RecoveryAction(
                    "journal_replayed", conversation_id, f"{relpath} restored to its last snapshot"
                ))
                log.warning("journal_replayed", path=relpath, replaced=True)

    def _erase(self, path: Path, relpath: str) -> None:
        """A small value's last record is its tombstone: the file goes (no older frame is left once
        the journals are discarded), rather than keeping a file that names what was erased."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        self.actions.append(RecoveryAction("journal_replayed", None, f"{relpath} erased (its file removed)"))
        log.warning("journal_replayed", path=relpath, erased=True)

    def sync_folders(self) -> None:
        """fsync every folder a replayed file is in, the buckets' and the root."""
        for parent in self.folders | {self.root / EVENTS_DIR, self.root}:
            if parent.is_dir():
                fsync_dir(parent)


def replay(root: Path, corrupt_dir: Path) -> Replayed:
    """Bring every file up to the journals under ``root`` (the journal files stay: see :func:`discard`).

    A journal holding a corrupt frame is copied to ``corrupt_dir`` first (its good frames
    are still replayed).
    """
    files = journal_files(root)
    if not files:
        return Replayed([], set(), [], 0)
    run = _Replay(root)
    records = _read_all(files, corrupt_dir, run.actions)
    run.recreate_folders(records.created)
    run.reapply_appends(records.appends)
    run.restore_replaced(records.replaced)
    run.sync_folders()
    return Replayed(run.actions, run.touched, [path for _, path in files], files[-1][0] + 1)


def discard(files: list[Path]) -> None:
    """Delete replayed journal files (their contents are durable in the files they name)."""
    for path in files:
        path.unlink(missing_ok=True)
    if files:
        fsync_dir(files[0].parent)
