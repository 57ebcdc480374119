"""The commit journal of FileSystemStore's ``batch`` policy: one fsync makes a whole group durable.

A group commit appends each op's bytes to its own file (a conversation's ``events.log``, an
event-id bucket) without fsyncing it, then writes one frame per op to the home's journal
(``conversations/.journal/<generation>``) and fsyncs that one file: the group is durable once
the journal is. Every ``JOURNAL_LIMIT`` bytes a checkpoint fsyncs the files written since the
last one and starts a new journal, so the journal stays small. On open, a journal left behind
(a crash, or a power loss that kept the journal but not a log's page cache) is replayed: every
record missing from its file is appended, the files are fsynced, the journal is deleted.

Frame: ``<crc32 of body: u32 LE><body length: u32 LE><body>``; body is either
``b"A" + relpath + b"\\0" + offset + b"\\0" + data`` (``data`` was written at ``offset`` of
``relpath``, relative to ``conversations/``) or ``b"F" + conversation id`` (the conversation was
deleted: forget its earlier records, so a new conversation with the same id never receives them).

Replay never cuts a good line: a record whose bytes are at their offset (or anywhere after the
first record's offset, if something rewrote the file since) is left alone; the missing ones
are appended at the end, after cutting a torn tail from a line-terminated log.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import struct
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

JOURNAL_DIR = ".journal"
JOURNAL_LIMIT = 16 * 1024 * 1024
"""Journal bytes after which the committer checkpoints (fsyncs the files written, starts anew)."""
OPEN_FILES = 128
"""Files the journal keeps open for appending (one write per file per commit, no open/close)."""

_FRAME = struct.Struct("<II")
_ARCHIVE_PREFIX = "archive/"


def append_frame(relpath: str, offset: int, data: bytes) -> bytes:
    """Return the journal frame saying ``data`` was appended at ``offset`` of ``relpath``."""
    body = b"A%s\0%d\0%s" % (relpath.encode("utf-8"), offset, data)
    return _FRAME.pack(zlib.crc32(body), len(body)) + body


def forget_frame(conversation_id: str) -> bytes:
    """Return the journal frame saying the conversation was deleted."""
    body = b"F" + conversation_id.encode("utf-8")
    return _FRAME.pack(zlib.crc32(body), len(body)) + body


@dataclass
class JournalRead:
    """What one journal file holds."""

    appends: list[tuple[str, int, bytes]]
    """``(relpath, offset, data)`` in commit order; forgotten records already dropped."""
    forgotten: set[str]
    """Conversations deleted in this file: appends in older journal files are dropped too."""
    good_end: int
    size: int
    corrupt: bool
    """A complete frame failed its checksum (more than a torn tail)."""


def _is_log_of(relpath: str, conversation_id: str) -> bool:
    bare = relpath[len(_ARCHIVE_PREFIX):] if relpath.startswith(_ARCHIVE_PREFIX) else relpath
    return bare.split("/", 1)[0] == conversation_id


def read_journal(data: bytes) -> JournalRead:
    """Decode frames up to the first bad one; a ``F`` frame drops the conversation's earlier appends."""
    appends: list[tuple[str, int, bytes]] = []
    pos = 0
    size = len(data)
    corrupt = False
    forgotten: set[str] = set()
    while pos + _FRAME.size <= size:
        crc, length = _FRAME.unpack_from(data, pos)
        end = pos + _FRAME.size + length
        if end > size:
            break  # torn: the frame was being written
        body = data[pos + _FRAME.size:end]
        if zlib.crc32(body) != crc or not body:
            corrupt = True
            break
        if body[:1] == b"F":
            gone = body[1:].decode("utf-8", "replace")
            appends = [record for record in appends if not _is_log_of(record[0], gone)]
            forgotten.add(gone)
        elif body[:1] == b"A":
            parts = body[1:].split(b"\0", 2)
            if len(parts) != 3 or not parts[1].isdigit():
                corrupt = True
                break
            appends.append((parts[0].decode("utf-8"), int(parts[1]), parts[2]))
        else:
            corrupt = True
            break
        pos = end
    return JournalRead(appends, forgotten, pos, size, corrupt)


def journal_files(root: Path) -> list[tuple[int, Path]]:
    """The journal files under ``root/.journal``, oldest first."""
    folder = root / JOURNAL_DIR
    if not folder.is_dir():
        return []
    found = [(int(p.name), p) for p in folder.iterdir() if p.name.isdigit()]
    return sorted(found)


def _alternate(relpath: str) -> str | None:
    """A conversation log moves between ``<id>/`` and ``archive/<id>/``; buckets never move."""
    if relpath.startswith("."):
        return None
    if relpath.startswith(_ARCHIVE_PREFIX):
        return relpath[len(_ARCHIVE_PREFIX):]
    return _ARCHIVE_PREFIX + relpath


def resolve(root: Path, relpath: str) -> Path | None:
    """Where ``relpath``'s file lives now: its own folder or the archive twin; None when deleted."""
    path = root / relpath
    if path.parent.is_dir():
        return path
    alternate = _alternate(relpath)
    if alternate is not None and (root / alternate).parent.is_dir():
        return root / alternate
    return None


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """fsync a folder (its entries: names created, renamed or removed)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _after_last_line(fd: int, size: int) -> int:
    """The offset just after the file's last newline (0 when it has none): its torn tail starts there."""
    end = size
    while end > 0:
        start = max(end - (1 << 16), 0)
        cut = os.pread(fd, end - start, start).rfind(b"\n")
        if cut >= 0:
            return start + cut + 1
        end = start
    return 0


def _repair_file(path: Path, records: list[tuple[int, bytes]]) -> int:
    """Append the records missing from ``path``; return how many were. fsyncs the file."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        size = os.fstat(fd).st_size
        first = min(offset for offset, _ in records)
        region = os.pread(fd, max(size - first, 0), first) if first < size else b""
        missing: list[bytes] = []
        for offset, data in records:
            at = offset - first
            if offset + len(data) <= size and region[at:at + len(data)] == data:
                continue
            if offset < size and data in region:
                continue  # the file was rewritten since (a salvage): the line is there, elsewhere
            missing.append(data)
        if missing:
            end = size
            if missing[0].endswith(b"\n") and size:
                end = _after_last_line(fd, size)  # a line-terminated log: cut a torn tail
                os.ftruncate(fd, end)
            os.pwrite(fd, b"".join(missing), end)
        os.fsync(fd)
        return len(missing)
    finally:
        os.close(fd)


def replay(root: Path, corrupt_dir: Path) -> list[tuple[str, str | None, str]]:
    """Bring every file up to the journals under ``root`` and delete them.

    Returns recovery actions ``(kind, conversation id or None, detail)``. A journal holding
    a corrupt frame is copied to ``corrupt_dir`` first (its good frames are still replayed).
    """
    actions: list[tuple[str, str | None, str]] = []
    files = journal_files(root)
    if not files:
        return actions
    pending: dict[str, list[tuple[int, bytes]]] = {}
    for _, path in files:
        data = path.read_bytes()
        read = read_journal(data)
        if read.corrupt:
            corrupt_dir.mkdir(parents=True, exist_ok=True)
            target = corrupt_dir / f"journal.{path.name}.{time.time_ns()}"
            shutil.copy2(path, target)
            _fsync_path(target)
            fsync_dir(corrupt_dir)
            actions.append((
                "moved_to_corrupt", None,
                f"journal {path.name}: bad frame at byte {read.good_end}, copied to {target.name}",
            ))
            log.error("journal_corrupt", journal=str(path), offset=read.good_end)
        elif read.good_end < read.size:
            actions.append((
                "torn_tail_cut", None,
                f"journal {path.name}: {read.size - read.good_end} bytes of a frame being written",
            ))
        for gone in read.forgotten:
            for relpath in [p for p in pending if _is_log_of(p, gone)]:
                del pending[relpath]
        for relpath, offset, chunk in read.appends:
            pending.setdefault(relpath, []).append((offset, chunk))
    for relpath, records in pending.items():
        found = resolve(root, relpath)
        if found is None:
            continue  # the conversation was deleted after these appends
        added = _repair_file(found, records)
        if added:
            conversation_id = None if relpath.startswith(".") else relpath.removeprefix(
                _ARCHIVE_PREFIX
            ).split("/", 1)[0]
            actions.append((
                "journal_replayed", conversation_id,
                f"{added} of {len(records)} journaled appends re-applied to {relpath}",
            ))
            log.warning("journal_replayed", path=relpath, records=added)
    for parent in {(root / relpath).parent for relpath in pending} | {root / ".events"}:
        if parent.is_dir():
            fsync_dir(parent)
    for _, path in files:
        path.unlink()
    fsync_dir(root / JOURNAL_DIR)
    return actions


class Journal:
    """The live journal of a store opened with ``batch``; its methods run on the committer's thread."""

    def __init__(self, root: Path, pool: Callable[[], ThreadPoolExecutor]) -> None:
        self.root = root
        self.folder = root / JOURNAL_DIR
        self._pool = pool
        self.generation = 0
        self.size = 0
        self._fd: int | None = None
        self._dirty: set[str] = set()
        self._files: OrderedDict[Path, list[int]] = OrderedDict()
        """path -> [fd, size]: the files appended to lately, kept open (least recent first)."""

    def append(self, path: Path, data: bytes, *, create: bool) -> int:
        """Write ``data`` at the end of ``path`` (not fsynced); return the offset it went to.

        On failure the file is cut back to its previous size and the error raised.
        """
        entry = self._files.get(path)
        if entry is None:
            flags = os.O_WRONLY | os.O_APPEND | (os.O_CREAT if create else 0)
            fd = os.open(path, flags, 0o600)
            entry = [fd, os.fstat(fd).st_size]
            self._files[path] = entry
            while len(self._files) > OPEN_FILES:
                os.close(self._files.popitem(last=False)[1][0])
        else:
            self._files.move_to_end(path)
        fd, before = entry
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, before)
            self.drop(path)
            raise
        entry[1] = before + len(data)
        return before

    def cut_back(self, path: Path, size: int) -> None:
        """Undo appends to ``path`` (their commit failed): truncate it to ``size``."""
        with contextlib.suppress(OSError):
            os.truncate(path, size)
        self.drop(path)

    def drop(self, path: Path) -> None:
        """Close ``path`` if it is kept open (its folder is moving away, or it was cut back)."""
        entry = self._files.pop(path, None)
        if entry is not None:
            with contextlib.suppress(OSError):
                os.close(entry[0])

    def drop_folder(self, folder: Path) -> None:
        """Close every kept file inside ``folder``."""
        for path in [p for p in self._files if p.parent == folder]:
            self.drop(path)

    def start(self) -> None:
        """Create the first journal file (after :func:`replay` removed any old one)."""
        self.folder.mkdir(exist_ok=True)
        self._open_new()

    def _open_new(self) -> None:
        path = self.folder / str(self.generation)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        self.size = 0
        fsync_dir(self.folder)

    def write(self, frames: list[bytes], relpaths: Iterable[str], forgotten: Iterable[str] = ()) -> None:
        """Append frames and fsync: on return they are durable. On error the journal is cut back.

        ``relpaths`` are the files the frames' appends went to (fsynced at the next checkpoint);
        ``forgotten`` the conversations deleted (their files need no checkpoint any more).
        """
        assert self._fd is not None
        data = b"".join(frames)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
            os.fsync(self._fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self.size)
            raise
        self.size += len(data)
        self._dirty.update(relpaths)
        for conversation_id in forgotten:
            self._dirty = {p for p in self._dirty if not _is_log_of(p, conversation_id)}

    def checkpoint(self, *, final: bool = False) -> None:
        """fsync every file written since the last checkpoint, then start a new journal.

        ``final`` (a clean close) deletes the journal instead of starting one.
        """
        dirty, self._dirty = self._dirty, set()
        targets = [t for t in (resolve(self.root, p) for p in dirty) if t is not None]

        def sync(path: Path) -> None:
            with contextlib.suppress(FileNotFoundError):
                _fsync_path(path)

        try:
            list(self._pool().map(sync, targets))
            for parent in {t.parent for t in targets}:
                with contextlib.suppress(FileNotFoundError):
                    fsync_dir(parent)
        except OSError:
            self._dirty |= dirty  # not yet durable: the journal keeps covering them
            raise
        old = self.folder / str(self.generation)
        if final:
            for path in list(self._files):
                self.drop(path)
        assert self._fd is not None
        os.close(self._fd)
        self._fd = None
        if not final:
            self.generation += 1
            self._open_new()
        old.unlink()
        fsync_dir(self.folder)

    def close(self) -> None:
        """Close the file without a checkpoint (the journal stays for the next open to replay)."""
        for path in list(self._files):
            self.drop(path)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
