"""The commit journal of the ``batch`` policy: one fsync makes a whole group durable.

A group commit appends each op's bytes to its own file (a conversation's ``events.log``, an
event-id bucket) without fsyncing it, then writes one frame per op to the home's journal
(``conversations/.journal/<generation>``) and fsyncs that one file: the group is durable once
the journal is. Every ``JOURNAL_LIMIT`` bytes a checkpoint fsyncs the files written since the
last one and starts a new journal, so the journal stays small.

Small values (``.meta/``: the run and dispatch journal, the outbox, cursors) are rewritten whole
several times per reply. Their frames carry them whole, so their files wait for the checkpoint:
until then the journal *holds* their newest content in memory (:attr:`Journal.held`, which readers
look at first), and the checkpoint writes each file once (temp file and rename, so a reader of the
folder sees an old value or a new one, never a part) or removes it when the value was erased.

Lines whose frames are durable but whose write to their log failed (a full disk) are *unwritten*
(:attr:`Journal.unwritten`): they count as stored (the journal covers them), are written at the next
group commit (before any new line of their log: until then those are refused), and hold back every
checkpoint, so the journal that covers them is never deleted before they are in their logs.

On open, a journal left behind (a crash, or a power loss that kept the journal but not a log's
page cache) is replayed (``journal_replay.py``).

Frame: ``<crc32 of body: u32 LE><body length: u32 LE><body>``; body is one of
- ``b"A" + relpath + b"\\0" + offset + b"\\0" + data``: ``data`` was written at ``offset`` of
  ``relpath`` (relative to ``conversations/``);
- ``b"R" + relpath + b"\\0" + data``: ``relpath`` was replaced (temp file renamed over it) and
  now holds ``data`` (a state snapshot, a meta value);
- ``b"C" + relpath``: the conversation folder ``relpath`` was created (renamed into place);
- ``b"F" + conversation id``: the conversation was deleted: forget its earlier records, so a new
  conversation with the same id never receives them;
- ``b"K" + generation``: a checkpoint made every record before it durable in its file. A journal
  file whose last frame it is gets no more records, and replay skips it: one left behind (its
  deletion failed) would otherwise write its old records over newer files (a file written directly
  while the store closed included) or bring back a conversation deleted since.
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tenex_daemon.adapters.storage.atomic import fsync_dir, put_in_place, stage, write_all, write_or_cut
from tenex_daemon.adapters.storage.filesystem.layout import ARCHIVE_DIR, JOURNAL_DIR, META_DIR
from tenex_daemon.adapters.storage.filesystem.ops import run_parallel

JOURNAL_LIMIT = 16 * 1024 * 1024
"""Journal bytes after which the committer checkpoints (fsyncs the files written, starts anew)."""

_FRAME = struct.Struct("<II")
_ARCHIVE_PREFIX = ARCHIVE_DIR + "/"
_HELD_PREFIX = META_DIR + "/"


def is_held(relpath: str) -> bool:
    """Whether a replacement of ``relpath`` is held until the checkpoint (a small value)."""
    return relpath.startswith(_HELD_PREFIX)


class NotHeld:
    """The type of :data:`NOT_HELD`: a small value whose newest content is in its file."""


NOT_HELD = NotHeld()


def _frame(body: bytes) -> bytes:
    return _FRAME.pack(zlib.crc32(body), len(body)) + body


def append_frame(relpath: str, offset: int, data: bytes) -> bytes:
    """Return the journal frame saying ``data`` was appended at ``offset`` of ``relpath``."""
    return _frame(b"A%s\0%d\0%s" % (relpath.encode("utf-8"), offset, data))


def replace_frame(relpath: str, data: bytes) -> bytes:
    """Return the journal frame saying ``relpath`` now holds ``data`` (replaced whole)."""
    return _frame(b"R%s\0%s" % (relpath.encode("utf-8"), data))


def create_frame(relpath: str) -> bytes:
    """Return the journal frame saying the conversation folder ``relpath`` was created."""
    return _frame(b"C" + relpath.encode("utf-8"))


def forget_frame(conversation_id: str) -> bytes:
    """Return the journal frame saying the conversation was deleted."""
    return _frame(b"F" + conversation_id.encode("utf-8"))


def checkpoint_frame(generation: int) -> bytes:
    """Return the frame that ends journal ``generation`` once a checkpoint made its records durable."""
    return _frame(b"K%d" % generation)


# --- relpaths ------------------------------------------------------------------------------------


def is_log_of(relpath: str, conversation_id: str) -> bool:
    """Whether ``relpath`` is in the conversation's folder (archived or not)."""
    bare = relpath[len(_ARCHIVE_PREFIX):] if relpath.startswith(_ARCHIVE_PREFIX) else relpath
    return bare.split("/", 1)[0] == conversation_id


def conversation_of(relpath: str) -> str | None:
    """The conversation a relpath belongs to (None for the event-id buckets and meta values)."""
    if relpath.startswith("."):
        return None
    return relpath.removeprefix(_ARCHIVE_PREFIX).split("/", 1)[0]


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


# --- reading -------------------------------------------------------------------------------------


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
    checkpointed: bool = False
    """The file's last frame is a checkpoint's: its records are in their files (replay skips it)."""

    def forget(self, conversation_id: str) -> None:
        """Drop the conversation's records read so far."""
        self.appends = [record for record in self.appends if not is_log_of(record[0], conversation_id)]
        self.replaces = {p: data for p, data in self.replaces.items() if not is_log_of(p, conversation_id)}
        self.created = [p for p in self.created if not is_log_of(p, conversation_id)]
        self.forgotten.add(conversation_id)

    def take(self, body: bytes) -> bool:
        """Apply one frame's body; False when it is not a valid record."""
        kind, rest = body[:1], body[1:]
        if kind == b"F":
            self.forget(rest.decode("utf-8", "replace"))
        elif kind == b"A":
            parts = rest.split(b"\0", 2)
            if len(parts) != 3 or not parts[1].isdigit():
                return False
            self.appends.append((parts[0].decode("utf-8"), int(parts[1]), parts[2]))
        elif kind == b"R":
            relpath, sep, content = rest.partition(b"\0")
            if not sep or not relpath:
                return False
            self.replaces.pop(relpath.decode("utf-8"), None)  # keeps commit order: the last one last
            self.replaces[relpath.decode("utf-8")] = content
        elif kind == b"C" and rest:
            self.created.append(rest.decode("utf-8"))
        elif kind == b"K" and rest.isdigit():
            pass  # read by :func:`read_journal` when it comes first
        else:
            return False
        return True


def read_journal(data: bytes) -> JournalRead:
    """Decode frames up to the first bad one; a ``F`` frame drops the conversation's earlier appends."""
    read = JournalRead([], {}, [], set(), 0, len(data), False)
    pos = 0
    while pos + _FRAME.size <= read.size:
        crc, length = _FRAME.unpack_from(data, pos)
        end = pos + _FRAME.size + length
        if end > read.size:
            break  # torn: the frame was being written
        body = data[pos + _FRAME.size:end]
        if zlib.crc32(body) != crc or not body or not read.take(body):
            read.corrupt = True
            break
        read.checkpointed = body[:1] == b"K"  # the last whole frame decides
        pos = end
    read.good_end = pos
    return read


def journal_files(root: Path) -> list[tuple[int, Path]]:
    """The journal files under ``root/.journal``, oldest first."""
    folder = root / JOURNAL_DIR
    if not folder.is_dir():
        return []
    found = [(int(p.name), p) for p in folder.iterdir() if p.name.isdigit()]
    return sorted(found)


# --- the live journal ----------------------------------------------------------------------------


class FsyncError(OSError):
    """fsync itself failed: the kernel may have dropped the pages it could not write."""


@dataclass(slots=True)
class Unwritten:
    """Lines of one log journaled (durable) that its write could not take (a full disk)."""

    before: int
    """The log's size before them: where they go."""
    data: bytes
    error: OSError
    """Why the last attempt to write them failed."""


def _append_after(path: Path, before: int, data: bytes) -> None:
    """Write ``data`` at the end of the log ``path``, whole or not at all. Bytes past ``before`` are
    what a failed write of it left (its cut-back failed too): no other line of the log is written while
    it waits, so they are cut first."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        size = os.fstat(fd).st_size
        if size > before:
            os.ftruncate(fd, before)
            size = before
        write_or_cut(fd, data, size, write_all)
    finally:
        os.close(fd)


class Journal:
    """The live journal of a store opened with ``batch``; its methods run on the committer's thread."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.folder = root / JOURNAL_DIR
        self.generation = 0
        self.size = 0
        self._fd: int | None = None
        self._dirty: set[str] = set()
        self._relpaths: dict[Path, str] = {}
        self.held: dict[Path, bytes | None] = {}
        """Small values replaced since the last checkpoint -> their newest content (None: erased, the
        file is removed at the checkpoint). Their frames are durable; their files are not written
        yet. Changed on the commit thread only while the journal is open (after, by the committer's
        direct writes); read from any thread (one dict lookup)."""
        self.unwritten: dict[str, Unwritten] = {}
        """Log relpath -> its journaled lines not yet in it (a full disk); changed on the commit thread."""
        self._stale: list[Path] = []
        """Checkpointed journal files not deleted yet (a deletion failed)."""
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
        """Create the first journal file (after the replay removed any old one)."""
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
            self._dirty = {p for p in self._dirty if not is_log_of(p, conversation_id)}
            for relpath in [p for p in self.unwritten if is_log_of(p, conversation_id)]:
                del self.unwritten[relpath]

    def defer(self, relpath: str, before: int, data: bytes, error: OSError) -> None:
        """Lines of ``relpath`` journaled whose write failed: they wait (see :attr:`unwritten`)."""
        self.unwritten[relpath] = Unwritten(before, data, error)

    def write_unwritten(self) -> None:
        """Write the lines waiting for their logs; those that still cannot be written wait on (their
        error kept); those of a conversation deleted meanwhile are dropped."""
        for relpath, waiting in list(self.unwritten.items()):
            path = resolve(self.root, relpath)
            if path is not None:
                try:
                    _append_after(path, waiting.before, waiting.data)
                except OSError as exc:
                    waiting.error = exc
                    continue
                self._dirty.add(relpath)  # fsynced by the next checkpoint, like any journaled line
            del self.unwritten[relpath]

    def blocked(self, relpath: str) -> OSError | None:
        """The error to give a new line of ``relpath`` while earlier lines of it wait, else None."""
        waiting = self.unwritten.get(relpath)
        if waiting is None:
            return None
        why = waiting.error.strerror or str(waiting.error)
        return OSError(waiting.error.errno, f"{relpath}: an accepted line is not yet written to it ({why})")

    def blocked_conversation(self, conversation_id: str) -> OSError | None:
        """:meth:`blocked` for the conversation's log (read from any thread)."""
        if not self.unwritten:
            return None
        for relpath in list(self.unwritten):
            if is_log_of(relpath, conversation_id):
                return self.blocked(relpath)
        return None

    def hold(self, path: Path, data: bytes | None) -> None:
        """A small value's frame is durable: keep ``data`` (None: erased) until the checkpoint."""
        self.held[path] = data

    def _write_held(self) -> set[Path]:
        """Write each held value to its file, or remove it when erased; return the folders changed.

        An erased value's file can go: once this checkpoint deletes the journal, no frame is left
        that could bring an older value back on replay.
        """
        folders: set[Path] = set()
        for path, data in self.held.items():
            relpath = self.relpath(path)
            if data is None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                self._dirty.discard(relpath)
            else:
                stage(path, data, durable=False)
                put_in_place(path)
                self._dirty.add(relpath)  # a new file each time: this checkpoint's fsyncs must cover it
            folders.add(path.parent)
        return folders

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
        fsync the journal is never deleted (see :attr:`poisoned`). Lines waiting for their logs
        (:attr:`unwritten`) are written first; while one still cannot be, nothing is done and OSError
        is raised: the journal is its only durable copy.
        """
        if self.poisoned:
            if final:
                self.close()
            return
        if self.unwritten:
            self.write_unwritten()
        held_back = next((self.blocked(relpath) for relpath in self.unwritten), None)
        if held_back is not None:
            raise OSError(held_back.errno, f"checkpoint held back: {held_back.strerror}")
        written = dict(self.held)
        folders = self._write_held()  # before the fsyncs: they cover these files too
        dirty, self._dirty = self._dirty, set()
        try:
            synced = [p for p in run_parallel(self._sync, sorted(dirty)) if p is not None]
            # the files' folders (names replaced, created or removed), then the folders holding those
            # (conversation folders created or moved since the last checkpoint)
            for parent in {p.parent for p in synced} | folders | {self.root, self.root / ARCHIVE_DIR}:
                with contextlib.suppress(FileNotFoundError):
                    fsync_dir(parent)
        except BaseException as exc:  # an OSError, or no thread to fsync on (a process or thread limit)
            self._dirty |= dirty  # the journal keeps covering them
            if isinstance(exc, FsyncError):
                self.poisoned = True
            raise
        # sealed: its records are all in their files now, so replay skips it if its deletion fails
        self.write([checkpoint_frame(self.generation)], ())
        for path, data in written.items():  # durable in their files now (changed on this thread only)
            if self.held.get(path, NOT_HELD) is data:
                del self.held[path]
        old_fd, old = self._fd, self.folder / str(self.generation)
        if final:
            self._fd = None
        else:
            self._fd = self._create(self.generation + 1)  # fails before anything is given up
            self.generation += 1
            self.size = 0
        if old_fd is not None:
            os.close(old_fd)
        self._stale.append(old)
        self._remove_stale()
        fsync_dir(self.folder)

    def _remove_stale(self) -> None:
        """Delete the checkpointed journal files; one whose deletion fails is tried again at the next
        checkpoint (replay skips it, sealed, but it still holds what it recorded, an erased
        conversation's writes included). Raise the last failure."""
        failure: OSError | None = None
        left: list[Path] = []
        for path in self._stale:
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                failure = exc
                left.append(path)
        self._stale = left
        if failure is not None:
            raise failure

    def close(self) -> None:
        """Close the file without a checkpoint (the journal stays for the next open to replay)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
