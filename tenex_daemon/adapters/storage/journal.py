"""The commit journal of FileSystemStore's ``batch`` policy: one fsync makes a whole group durable.

A group commit appends each op's bytes to its own file (a conversation's ``events.log``, an
event-id bucket) without fsyncing it, then writes one frame per op to the home's journal
(``conversations/.journal/<generation>``) and fsyncs that one file: the group is durable once
the journal is. Every ``JOURNAL_LIMIT`` bytes a checkpoint fsyncs the files written since the
last one and starts a new journal, so the journal stays small. On open, a journal left behind
(a crash, or a power loss that kept the journal but not a log's page cache) is replayed: every
record missing from its file is appended, the files are fsynced, the journal is deleted.

Frame: ``<crc32 of body: u32 LE><body length: u32 LE><body>``; body is one of
- ``b"A" + relpath + b"\\0" + offset + b"\\0" + data``: ``data`` was written at ``offset`` of
  ``relpath`` (relative to ``conversations/``);
- ``b"R" + relpath + b"\\0" + data``: ``relpath`` was replaced (temp file renamed over it) and
  now holds ``data`` (a state snapshot, a meta value);
- ``b"C" + relpath``: the conversation folder ``relpath`` was created (renamed into place);
- ``b"F" + conversation id``: the conversation was deleted: forget its earlier records, so a new
  conversation with the same id never receives them.

Replay never cuts a good line: a record whose bytes are at their offset (or anywhere after the
first record's offset, if something rewrote the file since) is left alone; the missing ones
are appended at the end, after cutting a torn tail from a line-terminated log.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import struct
import time
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

JOURNAL_DIR = ".journal"
JOURNAL_LIMIT = 16 * 1024 * 1024
"""Journal bytes after which the committer checkpoints (fsyncs the files written, starts anew)."""

_FRAME = struct.Struct("<II")
_ARCHIVE_PREFIX = "archive/"


def append_frame(relpath: str, offset: int, data: bytes) -> bytes:
    """Return the journal frame saying ``data`` was appended at ``offset`` of ``relpath``."""
    body = b"A%s\0%d\0%s" % (relpath.encode("utf-8"), offset, data)
    return _FRAME.pack(zlib.crc32(body), len(body)) + body


def replace_frame(relpath: str, data: bytes) -> bytes:
    """Return the journal frame saying ``relpath`` now holds ``data`` (replaced whole)."""
    body = b"R%s\0%s" % (relpath.encode("utf-8"), data)
    return _FRAME.pack(zlib.crc32(body), len(body)) + body


def create_frame(relpath: str) -> bytes:
    """Return the journal frame saying the conversation folder ``relpath`` was created."""
    body = b"C" + relpath.encode("utf-8")
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
    replaces: dict[str, bytes]
    """Each replaced file's last content; forgotten ones dropped."""
    created: list[str]
    """Conversation folders created (relpaths); forgotten ones dropped."""
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
    replaces: dict[str, bytes] = {}
    created: list[str] = []
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
            replaces = {path: data for path, data in replaces.items() if not _is_log_of(path, gone)}
            created = [path for path in created if not _is_log_of(path, gone)]
            forgotten.add(gone)
        elif body[:1] == b"A":
            parts = body[1:].split(b"\0", 2)
            if len(parts) != 3 or not parts[1].isdigit():
                corrupt = True
                break
            appends.append((parts[0].decode("utf-8"), int(parts[1]), parts[2]))
        elif body[:1] == b"R":
            relpath, sep, content = body[1:].partition(b"\0")
            if not sep or not relpath:
                corrupt = True
                break
            replaces.pop(relpath.decode("utf-8"), None)  # keeps commit order: the last one last
            replaces[relpath.decode("utf-8")] = content
        elif body[:1] == b"C" and len(body) > 1:
            created.append(body[1:].decode("utf-8"))
        else:
            corrupt = True
            break
        pos = end
    return JournalRead(appends, replaces, created, forgotten, pos, size, corrupt)


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


def _conversation_of(relpath: str) -> str | None:
    """The conversation a relpath belongs to (None for the event-id buckets and meta values)."""
    if relpath.startswith("."):
        return None
    return relpath.removeprefix(_ARCHIVE_PREFIX).split("/", 1)[0]


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd``."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def replace_file(path: Path, data: bytes, *, sync_dir: bool = True) -> tuple[int, int]:
    """Write ``data`` to a temp file, fsync it, rename over ``path``, fsync the folder (unless
    ``sync_dir`` is False); return the file's (size, mtime_ns)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if sync_dir:
        fsync_dir(path.parent)
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def _restore_file(path: Path, content: bytes) -> bool:
    """Make ``path`` hold ``content`` durably; False if it already did (its folder is synced later)."""
    with contextlib.suppress(FileNotFoundError):
        if path.read_bytes() == content:
            _fsync_path(path)
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
                end = _after_last_line(fd, size)  # a line-terminated log: cut a torn tail
                os.ftruncate(fd, end)
            os.pwrite(fd, b"".join(missing), end)
        os.fsync(fd)
        return len(missing)
    finally:
        os.close(fd)


@dataclass
class Replayed:
    """What :func:`replay` did."""

    actions: list[tuple[str, str | None, str]]
    """Recovery actions ``(kind, conversation id or None, detail)``."""
    touched: set[str]
    """Conversations the journal appended to: their derived data (index entry, event-id
    bucket lines, never fsynced) may lag behind, so open rescans their logs."""
    files: list[Path]
    """The journal files replayed: deleted by :func:`discard` once open has made the rescans'
    derived data durable (until then a crash replays them again)."""
    next_generation: int
    """The first generation free for a new journal."""


def replay(root: Path, corrupt_dir: Path) -> Replayed:
    """Bring every file up to the journals under ``root`` and delete them.

    A journal holding a corrupt frame is copied to ``corrupt_dir`` first (its good frames
    are still replayed).
    """
    actions: list[tuple[str, str | None, str]] = []
    touched: set[str] = set()
    files = journal_files(root)
    if not files:
        return Replayed(actions, touched, [], 0)
    pending: dict[str, list[tuple[int, bytes]]] = {}
    replaced: dict[str, bytes] = {}
    created: list[str] = []
    repaired_folders: set[Path] = set()
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
            for relpath in [p for p in replaced if _is_log_of(p, gone)]:
                del replaced[relpath]
            created = [p for p in created if not _is_log_of(p, gone)]
        created.extend(read.created)
        for relpath, offset, chunk in read.appends:
            pending.setdefault(relpath, []).append((offset, chunk))
        for relpath, content in read.replaces.items():
            replaced.pop(relpath, None)
            replaced[relpath] = content
    for relpath in created:
        if resolve(root, relpath + "/_") is None:  # lost with the page cache: make it again
            (root / relpath).mkdir(parents=True, exist_ok=True)
            repaired_folders.add((root / relpath).parent)
            actions.append(("journal_replayed", _conversation_of(relpath), f"folder {relpath} re-created"))
            log.warning("journal_replayed", path=relpath, folder="re-created")
    for relpath, records in pending.items():
        found = resolve(root, relpath)
        if found is None:
            continue  # the conversation was deleted after these appends
        added = _repair_file(found, records)
        repaired_folders.add(found.parent)
        conversation_id = _conversation_of(relpath)
        if conversation_id is not None:
            touched.add(conversation_id)
        if added:
            actions.append((
                "journal_replayed", conversation_id,
                f"{added} of {len(records)} journaled appends re-applied to {relpath}",
            ))
            log.warning("journal_replayed", path=relpath, records=added)
    for relpath, content in replaced.items():
        found = resolve(root, relpath)
        if found is None:
            continue  # deleted since
        conversation_id = _conversation_of(relpath)
        if conversation_id is not None:
            touched.add(conversation_id)
        repaired_folders.add(found.parent)
        if _restore_file(found, content):
            actions.append(("journal_replayed", conversation_id, f"{relpath} restored to its last snapshot"))
            log.warning("journal_replayed", path=relpath, replaced=True)
    for parent in repaired_folders | {root / ".events", root}:
        if parent.is_dir():
            fsync_dir(parent)
    return Replayed(actions, touched, [path for _, path in files], files[-1][0] + 1)


def discard(files: list[Path]) -> None:
    """Delete replayed journal files (their contents are durable in the files they name)."""
    for path in files:
        path.unlink(missing_ok=True)
    if files:
        fsync_dir(files[0].parent)


class FsyncError(OSError):
    """fsync itself failed: the kernel may have dropped the pages it could not write."""


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
        self._relpaths: dict[Path, str] = {}
        self.poisoned = False
        """A checkpoint's fsync failed: the kernel may since have dropped those pages and a
        retry would wrongly succeed, so no journal is deleted any more (the next open replays;
        the journal grows until then; the failure was logged when it happened)."""

    def relpath(self, path: Path) -> str:
        """``path`` relative to the conversations folder, as frames name it (remembered)."""
        found = self._relpaths.get(path)
        if found is None:
            if len(self._relpaths) >= 4096:
                self._relpaths.clear()
            found = self._relpaths[path] = path.relative_to(self.root).as_posix()
        return found

    @property
    def is_open(self) -> bool:
        """Whether frames can still be written (not after the final checkpoint or a close)."""
        return self._fd is not None

    def start(self) -> None:
        """Create the first journal file (after :func:`replay` removed any old one)."""
        self.folder.mkdir(exist_ok=True)
        fsync_dir(self.root)
        self._fd = self._create(self.generation)

    def _create(self, generation: int) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND
        fd = os.open(self.folder / str(generation), flags, 0o600)
        try:
            fsync_dir(self.folder)
        except OSError:
            os.close(fd)
            raise
        return fd

    def write(self, frames: list[bytes], relpaths: Iterable[str], forgotten: Iterable[str] = ()) -> None:
        """Append frames and fsync: on return they are durable. On error the journal is cut back.

        ``relpaths`` are the files the frames wrote (fsynced at the next checkpoint);
        ``forgotten`` the conversations deleted (their files need no checkpoint any more).
        """
        if self._fd is None:
            raise OSError(errno.EBADF, "the commit journal is closed")
        data = b"".join(frames)
        try:
            write_all(self._fd, data)
            os.fsync(self._fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self.size)
            raise
        self.size += len(data)
        self._dirty.update(relpaths)
        for conversation_id in forgotten:
            self._dirty = {p for p in self._dirty if not _is_log_of(p, conversation_id)}

    def _sync(self, relpath: str) -> Path | None:
        """fsync ``relpath`` where it is now; a folder moved meanwhile (archive) is followed."""
        previous: Path | None = None
        for _ in range(5):
            path = resolve(self.root, relpath)
            if path is None:
                return None  # deleted
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                if path == previous:
                    return None  # its folder stays but the file is gone (moved to corrupt/)
                previous = path
                continue  # moved between resolve and open: look again
            try:
                os.fsync(fd)
            except OSError as exc:
                raise FsyncError(exc.errno, f"fsync of {relpath}: {exc.strerror}") from exc
            finally:
                os.close(fd)
            return path
        raise OSError(errno.EAGAIN, f"{relpath} kept moving while being checkpointed")

    def checkpoint(self, *, final: bool = False) -> None:
        """fsync every file written since the last checkpoint, then start a new journal.

        ``final`` (a clean close) deletes the journal instead of starting one. After a failed
        fsync the journal is never deleted (see :attr:`poisoned`).
        """
        if self.poisoned:
            if final:
                self.close()
            return
        dirty, self._dirty = self._dirty, set()
        try:
            synced = [p for p in self._pool().map(self._sync, sorted(dirty)) if p is not None]
            # the files' folders (names replaced or created), then the folders holding those
            # (conversation folders created or moved since the last checkpoint)
            for parent in {p.parent for p in synced} | {self.root, self.root / _ARCHIVE_PREFIX.rstrip("/")}:
                with contextlib.suppress(FileNotFoundError):
                    fsync_dir(parent)
        except OSError as exc:
            self._dirty |= dirty  # the journal keeps covering them
            if isinstance(exc, FsyncError):
                self.poisoned = True
            raise
        old_fd, old = self._fd, self.folder / str(self.generation)
        if final:
            self._fd = None
        else:
            self._fd = self._create(self.generation + 1)  # fails before anything is given up
            self.generation += 1
            self.size = 0
        if old_fd is not None:
            os.close(old_fd)
        old.unlink()
        fsync_dir(self.folder)

    def close(self) -> None:
        """Close the file without a checkpoint (the journal stays for the next open to replay)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
