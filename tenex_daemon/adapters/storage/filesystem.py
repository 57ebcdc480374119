"""FileSystemStore: the default durable store, plain files under the home's ``conversations/``.

Layout (``home/conversations/``)::

    .lock                     exclusive lock of the home, holds the owner's pid
    <id>/events.log           append-only event log, one checksummed JSON line per event
    <id>/state.json           everything but history, replaced atomically (temp file, rename)
    archive/<id>/             archived conversations (read-only until restored)
    corrupt/                  unreadable files moved aside (never deleted)
    .index/snapshot.json      the index of conversations, rewritten only on compaction
    .index/log.<gen>          index changes since that snapshot, appended incrementally
    .events/<xyz>             event id -> conversation id (the processed set), 4,096 buckets
    .meta/<hash>.json         small values kept beside conversations
    .journal/<generation>     batch's commit journal (see ``journal.py``), gone after a clean close

Durability: an event line is written and fsynced before ``append_event`` returns (``always``),
or (``batch``) written to its log and recorded in the home's commit journal, whose one fsync
per group commit makes every write of the group (appends, snapshots, new conversations, meta
values) durable before any is acknowledged; a checkpoint fsyncs the files written and renews
the journal, and open replays a journal left behind.
The index and the event-id buckets are derived data, written every ``AUX_FLUSH_INTERVAL``
seconds after the events they describe are durable; on open each indexed log is checked by
size with ``stat`` (no log is read), and a log whose size disagrees is rescanned, its torn
tail cut, its entry repaired.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import threading
import time
import zlib
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import structlog
from pydantic import ValidationError

from tenex_daemon.adapters.storage.journal import (
    JOURNAL_LIMIT,
    Journal,
    Replayed,
    append_frame,
    create_frame,
    discard,
    forget_frame,
    replace_frame,
    replay,
)
from tenex_daemon.adapters.storage.journal import fsync_dir as _fsync_dir
from tenex_daemon.adapters.storage.journal import replace_file as _replace_file
from tenex_daemon.adapters.storage.journal import write_all as _write_all
from tenex_daemon.core.conversation import UNTITLED, Conversation
from tenex_daemon.core.errors import (
    ConversationArchivedError,
    ConversationExistsError,
    ConversationNotFoundError,
    TenexError,
)
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.phases import Phase
from tenex_daemon.core.search import ConversationSummary, SearchQuery, apply_query
from tenex_daemon.core.vocabulary import TAG_TITLE

log = structlog.get_logger(__name__)

FsyncPolicy = Literal["always", "batch"]

LOG_NAME = "events.log"
STATE_NAME = "state.json"
ARCHIVE_DIR = "archive"
CORRUPT_DIR = "corrupt"
INDEX_DIR = ".index"
EVENTS_DIR = ".events"
META_DIR = ".meta"
LOCK_NAME = ".lock"
STATE_FORMAT = 1
INDEX_FORMAT = 1
BUCKET_CHARS = 3
DEFAULT_CACHE_SIZE = 256
DEFAULT_BATCH_DELAY = 0.0
LOAD_ATTEMPTS = 5
"""Reads of a conversation folder before a load gives up on appends that keep landing."""
AUX_FLUSH_INTERVAL = 2.0
"""Seconds between writes of derived lines (index records, event-id buckets): they are not
needed for durability, and one write per file per round keeps them off the commit path."""
AUX_MAX_PENDING = 20_000
DEFAULT_BUCKET_CACHE = 512
COMPACT_MIN_RECORDS = 20_000

_ID_PATTERN = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,199}$")
_RESERVED = frozenset({ARCHIVE_DIR, CORRUPT_DIR})
_HEX = frozenset("0123456789abcdef")


class StoreLockedError(TenexError):
    """Another process holds the home's lock (one writer per home)."""

    def __init__(self, path: Path, pid: int | None) -> None:
        holder = f"process {pid}" if pid is not None else "another process"
        super().__init__(
            f"the conversation store at {path} is in use by {holder}; "
            "stop that daemon or use another home"
        )
        self.path = path
        self.pid = pid


@dataclass(frozen=True)
class RecoveryAction:
    """One thing the store repaired on its own (logged, and kept in :attr:`FileSystemStore.recovery`)."""

    kind: str
    """``torn_tail_cut``, ``log_salvaged``, ``state_rebuilt``, ``index_rebuilt``,
    ``index_entry_repaired``, ``index_entry_added``, ``index_entry_removed``, ``moved_to_corrupt``,
    ``journal_replayed``."""
    conversation_id: str | None
    detail: str


# --- encoding ------------------------------------------------------------------------------------


def encode_line(payload: bytes) -> bytes:
    """Return a log line: crc32 of the payload (8 hex digits), a space, the payload, a newline."""
    return b"%08x " % zlib.crc32(payload) + payload + b"\n"


def encode_event(event: NostrEvent) -> bytes:
    """Return the log line of one event."""
    return encode_line(event.model_dump_json().encode("utf-8"))


def _check_line(line: bytes) -> bytes | None:
    """Return the payload of a complete line (without newline) if its checksum holds."""
    if len(line) < 10 or line[8:9] != b" ":
        return None
    try:
        crc = int(line[:8], 16)
    except ValueError:
        return None
    payload = line[9:]
    return payload if zlib.crc32(payload) == crc else None


@dataclass
class LogScan:
    """What reading a checksummed log found."""

    payloads: list[bytes]
    good_end: int
    """Offset just after the last good line: everything after it is a torn tail."""
    size: int
    bad_lines: int
    """Bad lines before ``good_end`` (corruption, not a torn tail)."""

    @property
    def torn(self) -> bool:
        """Whether bytes follow the last good line."""
        return self.good_end < self.size


def scan_log(data: bytes, start: int = 0) -> LogScan:
    """Split ``data`` (from ``start``) into good payloads, a torn tail and corrupt lines."""
    payloads: list[bytes] = []
    good_end = start
    bad_since_good = 0
    bad_lines = 0
    pos = start
    size = len(data)
    while pos < size:
        end = data.find(b"\n", pos)
        if end < 0:
            break
        payload = _check_line(data[pos:end])
        if payload is None:
            bad_since_good += 1
        else:
            payloads.append(payload)
            bad_lines += bad_since_good
            bad_since_good = 0
            good_end = end + 1
        pos = end + 1
    return LogScan(payloads, good_end, size, bad_lines)


def _bucket_of(event_id: str) -> str:
    head = event_id[:BUCKET_CHARS]
    if len(head) == BUCKET_CHARS and set(head) <= _HEX:
        return head
    return hashlib.sha256(event_id.encode("utf-8")).hexdigest()[:BUCKET_CHARS]


def _check_id(conversation_id: str) -> None:
    if not _ID_PATTERN.match(conversation_id) or conversation_id in _RESERVED:
        raise ValueError(f"conversation id {conversation_id!r} cannot name a file")


def _check_event_id(event_id: str) -> None:
    if not event_id or any(c.isspace() for c in event_id):
        raise ValueError(f"event id {event_id!r} is empty or contains whitespace")


# --- the index -----------------------------------------------------------------------------------


@dataclass(slots=True)
class IndexEntry:
    """One conversation in the index: its summary fields and what its files looked like."""

    id: str
    title: str = UNTITLED
    phase: str = Phase.CHAT.value
    created_at: int = 0
    updated_at: int = 0
    event_count: int = 0
    agent_count: int = 0
    archived: bool = False
    participants: set[str] = field(default_factory=set)
    log_size: int = 0
    state_sig: tuple[int, int] = (0, 0)
    """(size, mtime_ns) of state.json when the entry was last made to agree with it."""

    def to_json(self) -> dict[str, Any]:
        """Return the entry as a compact JSON object."""
        return {
            "id": self.id, "t": self.title, "ph": self.phase, "ca": self.created_at,
            "ua": self.updated_at, "n": self.event_count, "ac": self.agent_count,
            "ar": self.archived, "p": sorted(self.participants), "s": self.log_size,
            "ss": list(self.state_sig),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> IndexEntry:
        """Rebuild an entry from :meth:`to_json` output."""
        size, mtime = data.get("ss", (0, 0))
        return cls(
            id=str(data["id"]), title=str(data["t"]), phase=str(data["ph"]),
            created_at=int(data["ca"]), updated_at=int(data["ua"]), event_count=int(data["n"]),
            agent_count=int(data["ac"]), archived=bool(data["ar"]), participants=set(data["p"]),
            log_size=int(data["s"]), state_sig=(int(size), int(mtime)),
        )

    def apply_state(self, state: dict[str, Any], archived: bool) -> None:
        """Copy the summary fields of a state snapshot."""
        self.title = str(state.get("title", UNTITLED))
        self.phase = str(state.get("phase", Phase.CHAT.value))
        self.created_at = int(state.get("created_at", 0))
        self.updated_at = int(state.get("updated_at", 0))
        self.agent_count = len(state.get("agent_states") or {})
        self.archived = archived

    def summary(self) -> ConversationSummary:
        """Return the search row."""
        return ConversationSummary(
            id=self.id, title=self.title, phase=Phase(self.phase), created_at=self.created_at,
            updated_at=self.updated_at, event_count=self.event_count, agent_count=self.agent_count,
            archived=self.archived, participants=sorted(self.participants),
        )


# --- blocking file work (always called in a worker thread) ------------------------------------


@dataclass
class _Op:
    """One durable write: an append to a file, an atomic replacement of one, a new conversation
    folder (``path``; its log in ``data``, its state in ``extra``), or (``batch``'s journal only)
    the record that a conversation was deleted, its id in ``data``."""

    kind: Literal["append", "replace", "create", "forget"]
    path: Path
    data: bytes
    create: bool = False
    extra: bytes = b""
    result: tuple[int, int] | None = None
    error: BaseException | None = None


_FSYNC_THREADS = 16
_fsync_executor: ThreadPoolExecutor | None = None
_fsync_executor_lock = threading.Lock()


def _fsync_pool() -> ThreadPoolExecutor:
    """The threads a group commit writes and fsyncs its files on, in parallel (made on first use)."""
    global _fsync_executor
    with _fsync_executor_lock:
        if _fsync_executor is None:
            _fsync_executor = ThreadPoolExecutor(_FSYNC_THREADS, thread_name_prefix="fs-store-fsync")
        return _fsync_executor


_commit_executor: ThreadPoolExecutor | None = None


def _commit_thread() -> ThreadPoolExecutor:
    """The one thread ``batch`` group commits run on (made on first use; commits are serial)."""
    global _commit_executor
    with _fsync_executor_lock:
        if _commit_executor is None:
            _commit_executor = ThreadPoolExecutor(1, thread_name_prefix="fs-store-commit")
        return _commit_executor


def _append_durably(item: tuple[Path, list[_Op]]) -> None:
    """Append one file's ops as one write and fsync it; on failure cut the file back and mark them."""
    path, group = item
    flags = os.O_WRONLY | os.O_APPEND | (os.O_CREAT if any(o.create for o in group) else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        for op in group:
            op.error = exc
        return
    try:
        before = os.fstat(fd).st_size
        try:
            _write_all(fd, b"".join(op.data for op in group))
            os.fsync(fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, before)
            for op in group:
                op.error = exc
    finally:
        os.close(fd)


def _create_folder(final: Path, log_data: bytes, state_data: bytes) -> tuple[int, int]:
    """Create a conversation folder durably (``always``): temp folder, fsyncs, rename, fsync.

    Return the state file's signature (size, mtime).
    """
    tmp, sig = _prepare_folder(final, log_data, state_data, durable=True)
    try:
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(final.parent)
    return sig


def _prepare_folder(
    final: Path, log_data: bytes, state_data: bytes, *, durable: bool
) -> tuple[Path, tuple[int, int]]:
    """Write a new conversation's two files into a temp folder next to ``final``.

    ``durable``: fsync both files and the folder (otherwise the journal covers them). Return
    the temp folder and the state file's signature (size, mtime; a rename keeps both).
    """
    if final.exists() or _archive_twin(final).exists():
        raise ConversationExistsError(final.name)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{time.time_ns()}"
    tmp.mkdir()
    try:
        sig = (0, 0)
        for name, data in ((LOG_NAME, log_data), (STATE_NAME, state_data)):
            fd = os.open(tmp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                _write_all(fd, data)
                if durable:
                    os.fsync(fd)
                st = os.fstat(fd)
                sig = (st.st_size, st.st_mtime_ns)
            finally:
                os.close(fd)
        if durable:
            _fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp, sig


def _archive_twin(folder: Path) -> Path:
    """The other place a conversation folder can be: under ``archive/``, or back out of it."""
    if folder.parent.name == ARCHIVE_DIR:
        return folder.parent.parent / folder.name
    return folder.parent / ARCHIVE_DIR / folder.name


def _apply_ops(ops: list[_Op], aux: dict[Path, list[bytes]]) -> None:
    """Make every op durable with as few fsyncs as possible, then write derived lines.

    Appends to one file are written in order as one write and fsynced once; a failed
    append is cut back to the file's previous size so no partial line stays behind.
    Replacements write and fsync temp files, rename them, then fsync each folder once.
    ``aux`` lines (index, event-id buckets) are written last and not fsynced.
    """
    appends: dict[Path, list[_Op]] = {}
    replaces: dict[Path, list[_Op]] = {}
    for op in ops:
        if op.kind == "forget":
            continue  # only the batch journal records deletions
        if op.kind == "create":
            try:
                op.result = _create_folder(op.path, op.data, op.extra)
            except (OSError, ConversationExistsError) as exc:
                op.error = exc
            continue
        (appends if op.kind == "append" else replaces).setdefault(op.path, []).append(op)
    if len(appends) > 1:
        # fsyncs of different files run at once: the filesystem's journal commits them together
        # (measured here: 16 files fsynced from 16 threads cost a third of 16 fsyncs in a row).
        list(_fsync_pool().map(_append_durably, appends.items()))
    else:
        for item in appends.items():
            _append_durably(item)
    _apply_replaces(replaces)
    _write_aux(aux)


def _apply_journaled(journal: Journal, ops: list[_Op]) -> None:
    """``batch``'s group commit: one fsync of one journal makes every op of the group durable.

    A frame per op records what it writes (an append's offset and bytes, a replacement's new
    content, a new folder), and the one fsync of the journal makes the whole group durable.
    New conversations are temp folders and replacements temp files (not fsynced), renamed into
    place only after that fsync; appends to a conversation's log are written (one write per
    file, not fsynced) only after it too. So a file on disk is never newer than the journal: a
    kill mid-group leaves nothing of it visible, or all of it journaled (open replays what is
    missing), never a later op without an earlier one. If the journal cannot be made durable,
    every op fails: temp files and folders are removed, no log was touched; nothing is
    acknowledged before the fsync that covers it. Event-id bucket lines are written before
    the journal and not cut back (derived lines are written to them concurrently, and a stray
    id line there only marks an id processed). A log write that fails after the journal
    (a full disk) fails its ops and is cut back; its frame stays, so a crash before the next
    checkpoint would bring those ops back on open (appended, rescanned).
    """
    appends: dict[Path, list[_Op]] = {}
    replaces: dict[Path, list[_Op]] = {}
    creates: list[_Op] = []
    for op in ops:
        if op.kind == "create":
            creates.append(op)
        elif op.kind != "forget":
            (appends if op.kind == "append" else replaces).setdefault(op.path, []).append(op)
    written: list[tuple[int, int, list[_Op], bool]] = []
    logs: list[tuple[int, int, list[_Op], bytes]] = []
    """Conversation logs to append to once the journal is durable: (fd, size before, ops, bytes)."""
    frames: list[bytes] = []
    relpaths: list[str] = []
    created: list[tuple[_Op, Path, tuple[int, int]]] = []
    replaced: list[tuple[list[_Op], Path, tuple[int, int]]] = []
    claimed: set[Path] = set()
    for op in creates:
        try:
            if op.path in claimed or _archive_twin(op.path) in claimed:
                raise ConversationExistsError(op.path.name)
            folder = journal.relpath(op.path)
            tmp, sig = _prepare_folder(op.path, op.data, op.extra, durable=False)
            claimed.add(op.path)
        except (OSError, ValueError, ConversationExistsError) as exc:
            op.error = exc
            continue
        created.append((op, tmp, sig))
        frames.append(create_frame(folder))
        frames.append(append_frame(f"{folder}/{LOG_NAME}", 0, op.data))
        frames.append(replace_frame(f"{folder}/{STATE_NAME}", op.extra))
        relpaths.extend((f"{folder}/{LOG_NAME}", f"{folder}/{STATE_NAME}"))
    try:
        for path, group in appends.items():
            flags = os.O_WRONLY | os.O_APPEND | (os.O_CREAT if any(o.create for o in group) else 0)
            try:
                relpath = journal.relpath(path)
                fd = os.open(path, flags, 0o600)
            except (OSError, ValueError) as exc:
                for op in group:
                    op.error = exc
                continue
            is_log = not relpath.startswith(".")
            try:
                before = os.fstat(fd).st_size
            except OSError as exc:
                os.close(fd)
                for op in group:
                    op.error = exc
                continue
            data = b"".join(op.data for op in group)
            if is_log:
                logs.append((fd, before, group, data))
            else:
                try:
                    _write_all(fd, data)
                except OSError as exc:
                    os.close(fd)
                    for op in group:
                        op.error = exc
                    continue
                written.append((fd, before, group, is_log))
            relpaths.append(relpath)
            offset = before
            for op in group:
                frames.append(append_frame(relpath, offset, op.data))
                offset += len(op.data)
        for path, group in replaces.items():
            try:
                relpath = journal.relpath(path)
                replaced.append((group, path, _write_temp(path, group[-1].data)))
            except (OSError, ValueError) as exc:
                for op in group:
                    op.error = exc
                continue
            frames.append(replace_frame(relpath, group[-1].data))
            relpaths.append(relpath)
        forgotten = [op for op in ops if op.kind == "forget"]
        frames.extend(forget_frame(op.data.decode("utf-8")) for op in forgotten)
        if frames:
            try:
                journal.write(frames, relpaths, [op.data.decode("utf-8") for op in forgotten])
            except Exception as exc:
                for _, _, group, _ in written:
                    for op in group:
                        op.error = exc
                unwritten, logs = logs, []
                for fd, _, group, _ in unwritten:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                    for op in group:
                        op.error = exc
                for op in forgotten:
                    op.error = exc
                for op, tmp, _ in created:
                    shutil.rmtree(tmp, ignore_errors=True)
                    op.error = exc
                for group, path, _ in replaced:
                    with contextlib.suppress(OSError):
                        os.unlink(path.with_name(path.name + ".tmp"))
                    for op in group:
                        op.error = exc
                created, replaced = [], []
    except BaseException:
        for fd, _, _, _ in logs:
            with contextlib.suppress(OSError):
                os.close(fd)
        raise
    finally:
        for fd, _, _, _ in written:
            with contextlib.suppress(OSError):
                os.close(fd)
    # journaled: now the logs get their lines (a kill before is repaired from the journal on open)
    for fd, before, group, data in logs:
        try:
            _write_all(fd, data)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, before)
            log.error("log_write_failed", path=str(group[0].path), error=str(exc), note="journaled")
            for op in group:
                op.error = exc
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
    # and the new folders and snapshots take their places by rename (a crash before a rename is
    # repaired from the journal on open; a reader sees the old file or the new, never a mix; a
    # write that fails, a full disk, fails before the journal and leaves the old file)
    for op, tmp, sig in created:
        try:
            os.rename(tmp, op.path)
            op.result = sig
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            op.error = exc
            _unjournal(journal, op.path.name)
    for group, path, sig in replaced:
        try:
            os.replace(path.with_name(path.name + ".tmp"), path)
        except OSError as exc:
            for op in group:
                op.error = exc
            continue
        for op in group:
            op.result = sig


def _unjournal(journal: Journal, conversation_id: str) -> None:
    """A journaled creation failed after all: a forget frame keeps replay from making it."""
    try:
        journal.write([forget_frame(conversation_id)], [], [conversation_id])
    except OSError:
        log.exception("journal_forget_failed", conversation_id=conversation_id)


def _write_temp(path: Path, data: bytes) -> tuple[int, int]:
    """Write ``data`` to ``path``'s temp file (no fsync: the journal covers it); return its signature
    (a rename keeps the size and mtime)."""
    fd = os.open(path.with_name(path.name + ".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        _write_all(fd, data)
        st = os.fstat(fd)
    finally:
        os.close(fd)
    return st.st_size, st.st_mtime_ns


def _apply_closing(journal: Journal, ops: list[_Op]) -> None:
    """A commit while the store closes: journaled while the journal is open (a direct write could be
    undone by an older journaled snapshot on replay), durable file by file once it is gone."""
    if journal.is_open:
        _apply_journaled(journal, ops)
    else:
        _apply_ops(ops, {})


def _replace_durably(item: tuple[Path, list[_Op]]) -> bool:
    """Write the group's last data to a temp file, fsync it, rename it over the path; mark errors."""
    path, group = item
    try:
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _write_all(fd, group[-1].data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        return True
    except OSError as exc:
        for op in group:
            op.error = exc
        return False


def _apply_replaces(replaces: dict[Path, list[_Op]]) -> None:
    """Replace each file atomically (temp file, fsync, rename), then fsync each folder once.

    Several files are replaced from several threads at once: the filesystem's journal commits
    their fsyncs together, as it does for appends.
    """
    items = list(replaces.items())
    if len(items) > 1:
        done = list(_fsync_pool().map(_replace_durably, items))
    else:
        done = [_replace_durably(item) for item in items]
    renamed = [item for item, ok in zip(items, done, strict=True) if ok]

    def sync_folder(folder: Path) -> OSError | None:
        try:
            _fsync_dir(folder)
        except OSError as exc:
            return exc
        return None

    folders = sorted({path.parent for path, _ in renamed})
    outcomes = list(_fsync_pool().map(sync_folder, folders)) if len(folders) > 1 else [
        sync_folder(folder) for folder in folders
    ]
    errors = dict(zip(folders, outcomes, strict=True))
    for path, group in renamed:
        failed = errors.get(path.parent)
        if failed is not None:
            for op in group:
                op.error = failed
        elif group[-1].error is None:
            try:
                st = os.stat(path)
            except OSError as exc:  # durable, but its signature is unknown: open will rescan it
                log.warning("replaced_file_stat_failed", path=str(path), error=str(exc))
                st = None
            for op in group:
                op.result = (st.st_size, st.st_mtime_ns) if st is not None else (-1, -1)


def _write_aux(aux: dict[Path, list[bytes]]) -> None:
    """Append derived lines; event-id buckets first, the index last.

    An index record saying "the log is N bytes" is what makes open skip a rescan, so it
    must never reach the disk before the bucket lines of the events it counts.
    """
    ordered = sorted(aux.items(), key=lambda item: item[0].parent.name == INDEX_DIR)
    for path, lines in ordered:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                _write_all(fd, b"".join(lines))
            finally:
                os.close(fd)
        except OSError:
            log.exception("derived_write_failed", path=str(path))


def _sync_files(paths: set[Path]) -> None:
    """fsync files (in parallel) and then their folders; files gone meanwhile are skipped."""

    def sync(path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    list(_fsync_pool().map(sync, paths))
    for folder in {path.parent for path in paths}:
        with contextlib.suppress(FileNotFoundError):
            _fsync_dir(folder)


def _log_failed_deletion(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("delete_failed", error=str(task.exception()))


def _move_to_corrupt(corrupt_dir: Path, source: Path, label: str) -> Path:
    """Move ``source`` into ``corrupt/`` under a unique name; never delete it."""
    corrupt_dir.mkdir(parents=True, exist_ok=True)
    target = corrupt_dir / f"{label}.{time.time_ns()}"
    os.replace(source, target)
    _fsync_dir(corrupt_dir)
    _fsync_dir(source.parent)
    return target


def _copy_to_corrupt(corrupt_dir: Path, source: Path, label: str) -> Path:
    corrupt_dir.mkdir(parents=True, exist_ok=True)
    target = corrupt_dir / f"{label}.{time.time_ns()}"
    shutil.copy2(source, target)
    fd = os.open(target, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    _fsync_dir(corrupt_dir)
    return target


@dataclass
class _Scanned:
    """A conversation folder read from disk by a worker thread."""

    state: dict[str, Any] | None
    events: list[NostrEvent]
    log_size: int
    event_ids: list[str]
    participants: set[str]
    state_sig: tuple[int, int]
    actions: list[RecoveryAction]


def _parse_event(payload: bytes) -> NostrEvent | None:
    try:
        return NostrEvent.model_validate_json(payload)
    except ValidationError:
        return None


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
        phase_started_at=created,
    )
    if root is not None:
        conversation.metadata.summary = root.content
    return conversation.state_dict()


def _read_state(path: Path) -> tuple[dict[str, Any] | None, tuple[int, int]]:
    """Return (state, (size, mtime_ns)); state None when missing or unreadable."""
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


def _scan_folder(
    folder: Path, conversation_id: str, corrupt_dir: Path, *, parse_events: bool, start: int = 0
) -> _Scanned:
    """Read a conversation folder, repairing it: cut a torn tail, salvage a corrupt log,
    move an unreadable snapshot aside and rebuild it from the events.

    With ``start`` > 0 only the part of the log after that (line-aligned) offset is scanned
    for event ids; counts then cover that part only.
    """
    actions: list[RecoveryAction] = []
    log_path = folder / LOG_NAME
    try:
        data = log_path.read_bytes()
    except FileNotFoundError:
        data = b""
        log_path.touch()
    scan = scan_log(data, start)
    if scan.bad_lines:
        saved = _copy_to_corrupt(corrupt_dir, log_path, f"{conversation_id}.events.log")
        good = b"".join(encode_line(p) for p in scan_log(data).payloads)
        _replace_file(log_path, good)
        detail = f"{scan.bad_lines} corrupt line(s); original kept at {saved.name}"
        actions.append(RecoveryAction("log_salvaged", conversation_id, detail))
        log.error("event_log_salvaged", conversation_id=conversation_id, detail=detail)
        scan = scan_log(good)
        start = 0
    elif scan.torn:
        fd = os.open(log_path, os.O_WRONLY)
        try:
            os.ftruncate(fd, scan.good_end)
            os.fsync(fd)
        finally:
            os.close(fd)
        detail = f"cut {scan.size - scan.good_end} byte(s) after offset {scan.good_end}"
        actions.append(RecoveryAction("torn_tail_cut", conversation_id, detail))
        log.warning("torn_tail_cut", conversation_id=conversation_id, detail=detail)
    events: list[NostrEvent] = []
    event_ids: list[str] = []
    participants: set[str] = set()
    for payload in scan.payloads:
        if parse_events:
            event = _parse_event(payload)
            if event is None:
                continue
            events.append(event)
            event_ids.append(event.id)
            participants.add(event.pubkey)
        else:
            raw = json.loads(payload)
            event_ids.append(raw["id"])
            participants.add(raw["pubkey"])
    state_path = folder / STATE_NAME
    state, sig = _read_state(state_path)
    if state is None:
        if state_path.exists():
            moved = _move_to_corrupt(corrupt_dir, state_path, f"{conversation_id}.state.json")
            detail = f"unreadable snapshot moved to {moved.name}; state rebuilt from the event log"
            actions.append(RecoveryAction("moved_to_corrupt", conversation_id, detail))
        else:
            detail = "snapshot missing; state rebuilt from the event log"
        every = scan.payloads if start == 0 else scan_log(data).payloads
        history = events or [e for e in (_parse_event(p) for p in every[:1] + every[-1:]) if e]
        state = _default_state(conversation_id, history)
        sig = _replace_file(state_path, json.dumps({"format": STATE_FORMAT, "state": state}).encode())
        actions.append(RecoveryAction("state_rebuilt", conversation_id, detail))
        log.error("state_rebuilt", conversation_id=conversation_id, detail=detail)
    return _Scanned(state, events, scan.good_end, event_ids, participants, sig, actions)


@dataclass
class _OpenResult:
    entries: dict[str, IndexEntry]
    generation: int
    replayed: int
    actions: list[RecoveryAction]
    rebuilt_ids: dict[str, list[str]]
    absent_buckets: set[str]
    """Event-id buckets with no file yet: known empty without reading anything."""
    journal: Replayed
    """What replaying a journal left behind did (its files are deleted after open's compaction)."""
    has_snapshot: bool
    """Whether the index has a snapshot (a new home gets one at once, so that a crash before
    the first derived write still finds an index)."""


# --- the store -----------------------------------------------------------------------------------


class FileSystemStore:
    """A :class:`~tenex_daemon.core.ports.ConversationStore` on plain files (see the module doc).

    ``path`` is the home folder; data lives in ``path/conversations``. ``fsync`` is ``"always"``
    (every file written is fsynced, with its folder, before the write returns) or ``"batch"``
    (group commit through the commit journal: the writes waiting while a commit is in flight, plus
    up to ``batch_delay`` seconds, share one fsync of the journal; the daemon's default).
    ``cache_size`` bounds the conversations kept loaded in memory.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fsync: FsyncPolicy = "always",
        batch_delay: float = DEFAULT_BATCH_DELAY,
        cache_size: int = DEFAULT_CACHE_SIZE,
        bucket_cache_size: int = DEFAULT_BUCKET_CACHE,
    ) -> None:
        if fsync not in ("always", "batch"):
            raise ValueError(f"fsync policy must be 'always' or 'batch', not {fsync!r}")
        if cache_size < 1:
            raise ValueError("cache_size must be at least 1")
        self.home = Path(path)
        self.root = self.home / "conversations"
        self.fsync: FsyncPolicy = fsync
        self.batch_delay = batch_delay
        self.cache_size = cache_size
        self.bucket_cache_size = bucket_cache_size
        self.recovery: list[RecoveryAction] = []
        """What the last :meth:`open` (and later loads) repaired on their own."""
        self._entries: dict[str, IndexEntry] = {}
        self._cache: OrderedDict[str, Conversation] = OrderedDict()
        self._buckets: OrderedDict[str, dict[str, str]] = OrderedDict()
        self._aux: dict[Path, list[bytes]] = {}
        self._aux_lock = asyncio.Lock()
        self._aux_task: asyncio.Task[None] | None = None
        self._aux_wake = asyncio.Event()
        self._aux_lines = 0
        self._aux_written: set[Path] = set()
        """Derived files written since the last index snapshot (fsynced before the next one)."""
        self._aux_inflight: dict[Path, list[bytes]] = {}
        self._loading: dict[str, tuple[asyncio.Future[dict[str, str]], dict[str, str]]] = {}
        self._index_records = 0
        self._generation = 0
        self._compacting: asyncio.Task[None] | None = None
        self._queue: list[tuple[_Op, asyncio.Future[None]]] = []
        self._wakeup: asyncio.Event | None = None
        self._committer: asyncio.Task[None] | None = None
        self._lock_fd: int | None = None
        self._journal: Journal | None = None
        self._log_paths: dict[str, Path] = {}
        self._index_path: Path | None = None
        self._bucket_paths: dict[str, Path] = {}
        self._absent_buckets: set[str] = set()
        self._closing = False
        self._opened = False

    # --- paths ---------------------------------------------------------------------------------

    @property
    def corrupt_dir(self) -> Path:
        """Where unreadable files are moved (never deleted)."""
        return self.root / CORRUPT_DIR

    def _folder(self, conversation_id: str, archived: bool) -> Path:
        return (self.root / ARCHIVE_DIR / conversation_id) if archived else (self.root / conversation_id)

    def _index_log(self, generation: int) -> Path:
        return self.root / INDEX_DIR / f"log.{generation}"

    def _log_path(self, conversation_id: str) -> Path:
        """The live (not archived) log's path, remembered: appends never build paths anew."""
        path = self._log_paths.get(conversation_id)
        if path is None:
            if len(self._log_paths) >= 4 * self.cache_size:
                self._log_paths.clear()
            path = self._log_paths[conversation_id] = self._folder(conversation_id, False) / LOG_NAME
        return path

    # --- open / close --------------------------------------------------------------------------

    async def open(self) -> None:
        """Take the home's lock, read the index (never the logs), check it and repair it."""
        if self._opened:
            return
        await asyncio.to_thread(self._lock_home)
        try:
            result = await asyncio.to_thread(self._open_sync)
        except BaseException:
            await asyncio.to_thread(self._unlock_home)
            raise
        self._entries = result.entries
        self._generation = result.generation
        self._index_path = None
        self._index_records = result.replayed
        self.recovery = result.actions
        self._absent_buckets = result.absent_buckets
        for conversation_id, ids in result.rebuilt_ids.items():
            for event_id in ids:
                self._queue_processed(event_id, conversation_id)
        self._closing = False
        self._opened = True
        self._wakeup = asyncio.Event()
        if self.fsync == "batch":
            self._journal = Journal(self.root, _fsync_pool)
            self._journal.generation = result.journal.next_generation
            await asyncio.to_thread(self._journal.start)
            self._committer = asyncio.create_task(self._run_committer(), name="fs-store-commit")
        if (
            result.actions or result.replayed > COMPACT_MIN_RECORDS or not result.has_snapshot
            or result.journal.files
        ):
            await self._compact()  # fsyncs the rescans' derived data before the replayed journal goes
        if result.journal.files:
            await asyncio.to_thread(discard, result.journal.files)
        log.info(
            "store_opened", path=str(self.root), conversations=len(self._entries),
            repairs=len(result.actions),
        )

    def _lock_home(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            raw = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StoreLockedError(self.root, int(raw) if raw.isdigit() else None) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _unlock_home(self) -> None:
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._lock_fd, 0)
            os.close(self._lock_fd)
            self._lock_fd = None

    def _open_sync(self) -> _OpenResult:
        for name in (ARCHIVE_DIR, INDEX_DIR, EVENTS_DIR, META_DIR):
            (self.root / name).mkdir(exist_ok=True)
        actions: list[RecoveryAction] = []
        self._sweep_leftovers(actions)
        # batch's journal first: the logs it completes are then checked like any other
        replayed_journal = replay(self.root, self.corrupt_dir)
        actions.extend(RecoveryAction(*action) for action in replayed_journal.actions)
        entries, generation, replayed, index_ok = self._read_index(actions)
        on_disk = self._list_folders()
        rebuilt: dict[str, list[str]] = {}
        if not index_ok and not on_disk and not actions:
            index_ok = True  # a new, empty home
        elif not index_ok:
            entries = {}
            actions.append(RecoveryAction("index_rebuilt", None, "index missing or unreadable"))
            log.warning("index_rebuilding", path=str(self.root), conversations=len(on_disk))
        for conversation_id in [cid for cid in entries if cid not in on_disk]:
            del entries[conversation_id]
            actions.append(RecoveryAction(
                "index_entry_removed", conversation_id, "indexed conversation has no files"
            ))
            log.warning("index_entry_removed", conversation_id=conversation_id)
        for conversation_id, archived in on_disk.items():
            entry = entries.get(conversation_id)
            folder = self._folder(conversation_id, archived)
            if entry is None:
                scanned = _scan_folder(folder, conversation_id, self.corrupt_dir, parse_events=False)
                entry = IndexEntry(id=conversation_id)
                self._fill_entry(entry, scanned, archived, full=True)
                entries[conversation_id] = entry
                rebuilt[conversation_id] = scanned.event_ids
                actions.extend(scanned.actions)
                if index_ok:
                    actions.append(RecoveryAction(
                        "index_entry_added", conversation_id, "conversation missing from the index"
                    ))
                    log.warning("index_entry_added", conversation_id=conversation_id)
                continue
            try:
                log_size = os.stat(folder / LOG_NAME).st_size
            except FileNotFoundError:
                log_size = -1
            try:
                st = os.stat(folder / STATE_NAME)
                state_sig = (st.st_size, st.st_mtime_ns)
            except FileNotFoundError:
                state_sig = (-1, -1)
            if (
                log_size == entry.log_size and state_sig == entry.state_sig and entry.archived == archived
                and conversation_id not in replayed_journal.touched
            ):
                continue
            partial = (
                conversation_id not in replayed_journal.touched  # its older bucket lines may be lost too
                and 0 < entry.log_size < log_size
                and self._line_aligned(folder / LOG_NAME, entry.log_size)
            )
            start = entry.log_size if partial else 0
            scanned = _scan_folder(
                folder, conversation_id, self.corrupt_dir, parse_events=False, start=start
            )
            self._fill_entry(entry, scanned, archived, full=not partial)
            rebuilt[conversation_id] = scanned.event_ids
            actions.extend(scanned.actions)
            detail = f"log {log_size} bytes (indexed {entry.log_size}), state {state_sig}"
            actions.append(RecoveryAction("index_entry_repaired", conversation_id, detail))
            log.info("index_entry_repaired", conversation_id=conversation_id, detail=detail)
        present = {item.name for item in os.scandir(self.root / EVENTS_DIR)}
        absent = {f"{n:03x}" for n in range(16**BUCKET_CHARS)} - present
        has_snapshot = (self.root / INDEX_DIR / "snapshot.json").exists()
        return _OpenResult(
            entries, generation, replayed, actions, rebuilt, absent, replayed_journal, has_snapshot
        )

    @staticmethod
    def _line_aligned(path: Path, offset: int) -> bool:
        with open(path, "rb") as handle:
            handle.seek(offset - 1)
            return handle.read(1) == b"\n"

    @staticmethod
    def _fill_entry(entry: IndexEntry, scanned: _Scanned, archived: bool, *, full: bool) -> None:
        assert scanned.state is not None
        entry.apply_state(scanned.state, archived)
        if full:
            entry.event_count = len(scanned.event_ids)
            entry.participants = set(scanned.participants)
        else:
            entry.event_count += len(scanned.event_ids)
            entry.participants |= scanned.participants
        entry.log_size = scanned.log_size
        entry.state_sig = scanned.state_sig

    def _sweep_leftovers(self, actions: list[RecoveryAction]) -> None:
        """Half-made creations go to corrupt/; half-finished deletions are finished."""
        for parent in (self.root, self.root / ARCHIVE_DIR):
            for item in os.scandir(parent):
                if item.name.startswith(".tmp-"):
                    moved = _move_to_corrupt(self.corrupt_dir, Path(item.path), item.name.lstrip("."))
                    actions.append(RecoveryAction(
                        "moved_to_corrupt", None, f"unfinished creation moved to {moved.name}"
                    ))
                elif item.name.startswith(".deleted-"):
                    shutil.rmtree(item.path, ignore_errors=True)

    def _list_folders(self) -> dict[str, bool]:
        """Return every conversation folder: id -> archived."""
        found: dict[str, bool] = {}
        for archived, parent in ((True, self.root / ARCHIVE_DIR), (False, self.root)):
            for item in os.scandir(parent):
                if item.is_dir(follow_symlinks=False) and _ID_PATTERN.match(item.name) and (
                    item.name not in _RESERVED
                ):
                    found[item.name] = archived
        return found

    def _read_index(
        self, actions: list[RecoveryAction]
    ) -> tuple[dict[str, IndexEntry], int, int, bool]:
        """Return (entries, generation, records replayed, readable)."""
        index_dir = self.root / INDEX_DIR
        snapshot_path = index_dir / "snapshot.json"
        logs = sorted(
            (int(p.name.split(".", 1)[1]), p) for p in index_dir.glob("log.*")
            if p.name.split(".", 1)[1].isdigit()
        )
        entries: dict[str, IndexEntry] = {}
        generation = 0
        if snapshot_path.exists():
            try:
                snapshot = json.loads(snapshot_path.read_bytes())
                if snapshot.get("format") != INDEX_FORMAT:
                    raise ValueError("unknown index format")
                generation = int(snapshot["generation"])
                for row in snapshot["entries"]:
                    entry = IndexEntry.from_json(row)
                    entries[entry.id] = entry
            except (ValueError, KeyError, TypeError):
                moved = _move_to_corrupt(self.corrupt_dir, snapshot_path, "index.snapshot.json")
                actions.append(RecoveryAction("moved_to_corrupt", None, f"index snapshot -> {moved.name}"))
                return {}, max((g for g, _ in logs), default=0) + 1, 0, False
        elif not logs:
            return {}, 0, 0, False
        replayed = 0
        for gen, path in logs:
            if gen < generation:
                path.unlink(missing_ok=True)
                continue
            data = path.read_bytes()
            scan = scan_log(data)
            if scan.torn or scan.bad_lines:
                fd = os.open(path, os.O_WRONLY)
                try:
                    os.ftruncate(fd, scan.good_end)
                finally:
                    os.close(fd)
            for payload in scan.payloads:
                self._apply_record(entries, json.loads(payload))
                replayed += 1
            generation = max(generation, gen)
        return entries, generation, replayed, True

    @staticmethod
    def _apply_record(entries: dict[str, IndexEntry], record: dict[str, Any]) -> None:
        op = record.get("op")
        if op == "put":
            entry = IndexEntry.from_json(record["e"])
            entries[entry.id] = entry
        elif op == "ev":
            found = entries.get(record["id"])
            if found is not None:
                found.event_count = int(record["n"])
                found.log_size = int(record["s"])
                found.participants.update(record.get("p", ()))
        elif op == "del":
            entries.pop(record["id"], None)

    async def close(self) -> None:
        """Finish pending commits, write the index snapshot, release the lock. Safe to call twice."""
        if not self._opened:
            return
        self._closing = True
        if self._committer is not None:
            assert self._wakeup is not None
            self._wakeup.set()
            await self._committer
            self._committer = None
        if self._journal is not None:
            journal = self._journal
            try:
                await asyncio.get_running_loop().run_in_executor(
                    _commit_thread(), functools.partial(journal.checkpoint, final=True)
                )
            except OSError:
                log.exception("journal_checkpoint_failed")  # kept: the next open replays it
                journal.close()
            self._journal = None
        if self._compacting is not None:
            await self._compacting
        await self._compact()
        if self._aux_task is not None:
            self._aux_wake.set()
            await self._aux_task
        await asyncio.to_thread(self._unlock_home)
        self._cache.clear()
        self._buckets.clear()
        self._opened = False
        log.info("store_closed", path=str(self.root))

    # --- commits -------------------------------------------------------------------------------

    async def _commit(self, ops: list[_Op]) -> None:
        """Make ``ops`` durable per the fsync policy; raise the first op's error."""
        if self.fsync == "batch" and not self._closing:
            loop = asyncio.get_running_loop()
            futures = []
            for op in ops:
                future: asyncio.Future[None] = loop.create_future()
                self._queue.append((op, future))
                futures.append(future)
            assert self._wakeup is not None
            self._wakeup.set()
            if len(futures) == 1:
                await futures[0]
            else:
                await asyncio.gather(*futures)
            return
        if self._journal is not None:  # closing: serial with the final checkpoint, on its thread
            await asyncio.get_running_loop().run_in_executor(
                _commit_thread(), _apply_closing, self._journal, ops
            )
        else:
            await asyncio.to_thread(_apply_ops, ops, {})
        for op in ops:
            if op.error is not None:
                raise op.error

    async def _run_committer(self) -> None:
        """Group commit: appends arriving while a commit is in flight share the next one.

        A waiting append is delayed by at most the commit in flight plus ``batch_delay``;
        each batch costs one fsync per file touched.
        """
        assert self._wakeup is not None
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if not self._queue:
                if self._closing:
                    return
                continue
            if self.batch_delay > 0 and not self._closing:
                await asyncio.sleep(self.batch_delay)
            batch, self._queue = self._queue, []
            ops = [op for op, _ in batch]
            try:
                if self._journal is not None:
                    # a thread of its own: never queued behind other to_thread work
                    await asyncio.get_running_loop().run_in_executor(
                        _commit_thread(), _apply_journaled, self._journal, ops
                    )
                else:
                    await asyncio.to_thread(_apply_ops, ops, {})
            except asyncio.CancelledError:
                # Stopped mid-commit: the group's fate is unknown, so none of it is acknowledged.
                stopped = OSError(errno.ECANCELED, "the store's group committer was stopped mid-commit")
                for _, future in batch:
                    if not future.done():
                        future.set_exception(stopped)
                raise
            except Exception as exc:  # a bug in _apply_ops: fail every waiter, keep committing
                log.exception("group_commit_failed")
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for op, future in batch:
                if future.done():
                    continue
                if op.error is not None:
                    future.set_exception(op.error)
                else:
                    future.set_result(None)
            if self._journal is not None and self._journal.size > JOURNAL_LIMIT:
                try:
                    # on the commit thread: never beside a commit made while closing
                    await asyncio.get_running_loop().run_in_executor(
                        _commit_thread(), self._journal.checkpoint
                    )
                except OSError:
                    log.exception("journal_checkpoint_failed")  # the journal keeps covering them
            if self._queue:
                self._wakeup.set()

    def _queue_aux(self, path: Path, line: bytes) -> None:
        self._aux.setdefault(path, []).append(line)
        self._aux_lines += 1
        if self._aux_lines >= AUX_MAX_PENDING:
            self._aux_wake.set()
        if self._aux_task is None or self._aux_task.done():
            self._aux_task = asyncio.create_task(self._flush_aux_loop(), name="fs-store-derived")

    async def _flush_aux_loop(self) -> None:
        """Write derived lines every ``AUX_FLUSH_INTERVAL`` (sooner past ``AUX_MAX_PENDING`` lines,
        at once on close): many lines per file per write, each bucket file touched once a round."""
        while self._aux:
            if not self._closing:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._aux_wake.wait(), AUX_FLUSH_INTERVAL)
            self._aux_wake.clear()
            async with self._aux_lock:
                await self._flush_aux_locked()

    async def _flush_aux_locked(self) -> None:
        if not self._aux:
            return
        pending, self._aux = self._aux, {}
        self._aux_lines = 0
        self._aux_written.update(pending)
        self._aux_inflight = pending
        try:
            await asyncio.to_thread(_write_aux, pending)
        finally:
            self._aux_inflight = {}
            # a bucket being read right now may have missed these lines: hand them over
            for bucket, (_, added) in self._loading.items():
                self._merge_lines(added, pending.get(self._bucket_path(bucket), ()))

    def _index_record(self, record: dict[str, Any]) -> None:
        self._index_payload(json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))

    def _index_payload(self, payload: bytes) -> None:
        if self._index_path is None:
            self._index_path = self._index_log(self._generation)
        self._queue_aux(self._index_path, encode_line(payload))
        self._index_records += 1
        threshold = max(COMPACT_MIN_RECORDS, 2 * len(self._entries))
        if self._index_records > threshold and (self._compacting is None or self._compacting.done()):
            self._compacting = asyncio.create_task(self._compact(), name="fs-store-compact")

    def _index_put(self, entry: IndexEntry) -> None:
        self._index_record({"op": "put", "e": entry.to_json()})

    async def _compact(self) -> None:
        """Write the whole index as a new snapshot and start a new index log (amortized O(1))."""
        async with self._aux_lock:
            # rows are taken and the generation switched before the flush: every event the
            # snapshot counts has its bucket line queued already, so this flush writes it
            generation = self._generation + 1
            rows = [entry.to_json() for entry in self._entries.values()]
            old = self._index_log(self._generation)
            self._generation = generation
            self._index_path = None
            self._index_records = 0
            await self._flush_aux_locked()
            # the snapshot lets open skip a log whose size matches: the bucket lines of every
            # event it counts must be on disk first, not only in the page cache
            written, self._aux_written = self._aux_written, set()
            await asyncio.to_thread(_sync_files, written)
            data = json.dumps(
                {"format": INDEX_FORMAT, "generation": generation, "entries": rows},
                separators=(",", ":"), ensure_ascii=False,
            ).encode("utf-8")
            await asyncio.to_thread(self._write_snapshot, data, old)

    def _write_snapshot(self, data: bytes, old_log: Path) -> None:
        _replace_file(self.root / INDEX_DIR / "snapshot.json", data)
        old_log.unlink(missing_ok=True)

    # --- the processed set ---------------------------------------------------------------------

    def _bucket_path(self, bucket: str) -> Path:
        path = self._bucket_paths.get(bucket)
        if path is None:
            path = self._bucket_paths[bucket] = self.root / EVENTS_DIR / bucket
        return path

    def _queue_processed(self, event_id: str, conversation_id: str) -> None:
        bucket = _bucket_of(event_id)
        if bucket in self._absent_buckets:
            self._adopt_absent(bucket)
        loaded = self._buckets.get(bucket)
        if loaded is not None:
            loaded[event_id] = conversation_id
        loading = self._loading.get(bucket)
        if loading is not None:
            loading[1][event_id] = conversation_id
        self._queue_aux(self._bucket_path(bucket), f"\n{event_id} {conversation_id or '-'}".encode())

    async def _bucket(self, event_id: str) -> dict[str, str]:
        """Return the loaded bucket holding ``event_id`` (reading it once, off the loop).

        Lines for the bucket still queued or being written are flushed first; ids added
        while the file is read are caught in a side table and merged.
        """
        bucket = _bucket_of(event_id)
        loaded = self._buckets.get(bucket)
        if loaded is not None:
            self._buckets.move_to_end(bucket)
            return loaded
        if bucket in self._absent_buckets:
            return self._adopt_absent(bucket)
        loading = self._loading.get(bucket)
        if loading is not None:
            return await asyncio.shield(loading[0])
        future: asyncio.Future[dict[str, str]] = asyncio.get_running_loop().create_future()
        added: dict[str, str] = {}
        self._loading[bucket] = (future, added)
        path = self._bucket_path(bucket)
        try:
            loaded = await asyncio.to_thread(self._read_bucket, path)
        except BaseException as exc:
            del self._loading[bucket]
            future.set_exception(exc)
            future.exception()  # retrieved: waiters (if any) get it through shield
            raise
        del self._loading[bucket]
        self._merge_lines(loaded, self._aux_inflight.get(path, ()))
        self._merge_lines(loaded, self._aux.get(path, ()))
        loaded.update(added)
        self._buckets[bucket] = loaded
        while len(self._buckets) > self.bucket_cache_size:
            self._buckets.popitem(last=False)
        future.set_result(loaded)
        return loaded

    def _adopt_absent(self, bucket: str) -> dict[str, str]:
        """A bucket with no file holds nothing but what this process adds: load it as empty.

        Every id added to it from now on passes through the loaded table, so it stays
        complete; once evicted it is read from its file like any other.
        """
        self._absent_buckets.discard(bucket)
        loaded: dict[str, str] = {}
        self._buckets[bucket] = loaded
        while len(self._buckets) > self.bucket_cache_size:
            self._buckets.popitem(last=False)
        return loaded

    @staticmethod
    def _read_bucket(path: Path) -> dict[str, str]:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return {}
        found: dict[str, str] = {}
        FileSystemStore._merge_lines(found, data.split(b"\n"))
        return found

    @staticmethod
    def _merge_lines(found: dict[str, str], lines: Iterable[bytes]) -> None:
        """Add the ids of bucket lines (``\\n<event id> <conversation id or ->``) to ``found``."""
        for chunk in lines:
            for line in chunk.split(b"\n"):
                parts = line.split(b" ")
                if len(parts) != 2 or not parts[0] or not parts[1]:
                    continue  # a torn line: the next write starts with a newline, so it stays alone
                conversation_id = parts[1].decode("utf-8", "replace")
                found[parts[0].decode("utf-8", "replace")] = "" if conversation_id == "-" else conversation_id

    async def is_processed(self, event_id: str) -> bool:
        """Return whether this event id was ever accepted or marked processed."""
        return event_id in await self._bucket(event_id)

    async def mark_processed(self, event_id: str) -> None:
        """Durably remember an event id handled without joining a conversation."""
        _check_event_id(event_id)
        bucket = await self._bucket(event_id)
        if event_id in bucket:
            return
        path = self._bucket_path(_bucket_of(event_id))
        await self._commit([_Op("append", path, f"\n{event_id} -".encode(), create=True)])
        bucket[event_id] = ""

    # --- conversations -------------------------------------------------------------------------

    def _require_open(self) -> None:
        if not self._opened:
            raise RuntimeError("FileSystemStore is not open; call open() first")

    def _cache_put(self, conversation: Conversation) -> None:
        self._cache[conversation.id] = conversation
        self._cache.move_to_end(conversation.id)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    @staticmethod
    def _state_bytes(conversation: Conversation, archived: bool) -> bytes:
        state = conversation.state_dict()
        state["archived"] = archived
        return json.dumps(
            {"format": STATE_FORMAT, "state": state}, separators=(",", ":"), ensure_ascii=False
        ).encode("utf-8")

    async def create(self, conversation: Conversation) -> None:
        """Store a new conversation: both files are written in a temp folder renamed into place."""
        self._require_open()
        _check_id(conversation.id)
        if conversation.id in self._entries:
            raise ConversationExistsError(conversation.id)
        log_data = b"".join(encode_event(event) for event in conversation.history)
        state_data = self._state_bytes(conversation, conversation.archived)
        op = _Op("create", self._folder(conversation.id, conversation.archived), log_data, extra=state_data)
        await self._commit([op])
        assert op.result is not None
        sig = op.result
        entry = IndexEntry(id=conversation.id)
        entry.apply_state(conversation.state_dict(), conversation.archived)
        entry.event_count = len(conversation.history)
        entry.participants = conversation.participants()
        entry.log_size = len(log_data)
        entry.state_sig = sig
        self._entries[conversation.id] = entry
        self._index_put(entry)
        for event in conversation.history:
            self._queue_processed(event.id, conversation.id)
        self._cache_put(conversation)

    async def load(self, conversation_id: str) -> Conversation | None:
        """Return the conversation (the cached live object when loaded), or None.

        A first load reads the snapshot and the log, cutting a torn tail and moving
        unreadable files to ``corrupt/``.
        """
        self._require_open()
        cached = self._cache.get(conversation_id)
        if cached is not None:
            self._cache.move_to_end(conversation_id)
            return cached
        entry = self._entries.get(conversation_id)
        if entry is None:
            return None
        for _ in range(LOAD_ATTEMPTS):
            folder = self._folder(conversation_id, entry.archived)
            try:
                scanned = await asyncio.to_thread(
                    _scan_folder, folder, conversation_id, self.corrupt_dir, parse_events=True
                )
            except FileNotFoundError:
                log.error("conversation_files_missing", conversation_id=conversation_id)
                return None
            # a racing load may have filled the cache while this one read the disk
            cached = self._cache.get(conversation_id)
            if cached is not None:
                return cached
            if scanned.actions or scanned.log_size >= entry.log_size:
                break
            # an append was acknowledged after its line was read past: read the folder again
        else:
            raise OSError(errno.EAGAIN, f"conversation {conversation_id} kept changing while it was read")
        assert scanned.state is not None
        self.recovery.extend(scanned.actions)
        conversation = Conversation.from_state(scanned.state, scanned.events)
        conversation.archived = entry.archived
        if scanned.actions:
            self._fill_entry(entry, scanned, entry.archived, full=True)
            self._index_put(entry)
            for event in scanned.events:
                self._queue_processed(event.id, conversation_id)
        self._cache_put(conversation)
        return conversation

    def _entry_required(self, conversation_id: str) -> IndexEntry:
        self._require_open()
        entry = self._entries.get(conversation_id)
        if entry is None:
            raise ConversationNotFoundError(conversation_id)
        return entry

    async def append_event(self, conversation_id: str, event: NostrEvent) -> None:
        """Append one event line to the conversation's log; durable when this returns.

        A duplicate event id changes nothing. An archived conversation is read-only.
        """
        entry = self._entry_required(conversation_id)
        if entry.archived:
            raise ConversationArchivedError(conversation_id)
        if await self.is_processed(event.id):
            return
        line = encode_event(event)
        if self._entries.get(conversation_id) is not entry:  # deleted while the bucket was read
            raise ConversationNotFoundError(conversation_id)
        await self._commit([_Op("append", self._log_path(conversation_id), line)])
        entry.event_count += 1
        entry.log_size += len(line)
        new_participant = event.pubkey not in entry.participants
        entry.participants.add(event.pubkey)
        self._queue_processed(event.id, conversation_id)
        # the index record {"op":"ev","id":…,"n":…,"s":…[,"p":[…]]}, formatted by hand: ids are
        # plain (checked by create), and this runs once per event
        extra = f',"p":[{json.dumps(event.pubkey)}]' if new_participant else ""
        self._index_payload(
            f'{{"op":"ev","id":"{conversation_id}","n":{entry.event_count},"s":{entry.log_size}{extra}}}'
            .encode()
        )
        cached = self._cache.get(conversation_id)
        if cached is not None:
            cached.append(event)

    async def append_events(self, conversation_id: str, events: Iterable[NostrEvent]) -> None:
        """Append several events with one durable write (imports, bulk loads)."""
        entry = self._entry_required(conversation_id)
        if entry.archived:
            raise ConversationArchivedError(conversation_id)
        fresh: list[NostrEvent] = []
        seen: set[str] = set()
        for event in events:
            if event.id not in seen and not await self.is_processed(event.id):
                fresh.append(event)
                seen.add(event.id)
        if not fresh:
            return
        data = b"".join(encode_event(event) for event in fresh)
        if self._entries.get(conversation_id) is not entry:  # deleted while buckets were read
            raise ConversationNotFoundError(conversation_id)
        await self._commit([_Op("append", self._log_path(conversation_id), data)])
        entry.event_count += len(fresh)
        entry.log_size += len(data)
        added = {e.pubkey for e in fresh} - entry.participants
        entry.participants |= added
        cached = self._cache.get(conversation_id)
        for event in fresh:
            self._queue_processed(event.id, conversation_id)
            if cached is not None:
                cached.append(event)
        self._index_record({
            "op": "ev", "id": conversation_id, "n": entry.event_count, "s": entry.log_size,
            "p": sorted(added),
        })

    async def save_state(self, conversation: Conversation) -> None:
        """Atomically replace the conversation's snapshot (temp file, fsync, rename, fsync folder)."""
        entry = self._entry_required(conversation.id)
        data = self._state_bytes(conversation, entry.archived)
        op = _Op("replace", self._folder(conversation.id, entry.archived) / STATE_NAME, data)
        try:
            await self._commit([op])
        except BaseException:
            self._cache.pop(conversation.id, None)
            raise
        entry.apply_state(conversation.state_dict(), entry.archived)
        assert op.result is not None
        entry.state_sig = op.result
        self._index_put(entry)
        conversation.archived = entry.archived
        self._cache_put(conversation)

    async def set_archived(self, conversation_id: str, archived: bool) -> None:
        """Move the conversation's folder into ``archive/`` (or back); rename is atomic."""
        entry = self._entry_required(conversation_id)
        if entry.archived != archived:
            source = self._folder(conversation_id, entry.archived)
            target = self._folder(conversation_id, archived)
            await asyncio.to_thread(self._move_folder, source, target)
            entry.archived = archived
            self._index_put(entry)
        cached = self._cache.get(conversation_id)
        if cached is not None:
            cached.archived = archived

    @staticmethod
    def _move_folder(source: Path, target: Path) -> None:
        os.rename(source, target)
        _fsync_dir(target.parent)
        _fsync_dir(source.parent)

    async def delete(self, conversation_id: str) -> bool:
        """Remove a conversation's files; its event ids stay processed."""
        self._require_open()
        entry = self._entries.get(conversation_id)
        if entry is None:
            return False
        folder = self._folder(conversation_id, entry.archived)
        del self._entries[conversation_id]  # from now on appends to it are refused
        # shielded: once the forget frame is queued, the deletion must finish even if the caller
        # is cancelled (a committed forget over a kept folder would drop its journaled appends)
        deletion = asyncio.ensure_future(self._delete_files(conversation_id, folder))
        deletion.add_done_callback(_log_failed_deletion)
        try:
            await asyncio.shield(deletion)
        except asyncio.CancelledError:
            raise  # the deletion goes on; a folder it leaves behind is re-indexed on open
        except BaseException:
            if await asyncio.to_thread(self._keep_after_failed_delete, folder):
                self._entries[conversation_id] = entry
            raise
        self._cache.pop(conversation_id, None)
        self._index_record({"op": "del", "id": conversation_id})
        return True

    @staticmethod
    def _keep_after_failed_delete(folder: Path) -> bool:
        """Whether the folder is still there; if so its files are fsynced (a committed forget frame
        no longer lets the journal cover them)."""
        if not folder.exists():
            return False
        for name in (LOG_NAME, STATE_NAME):
            with contextlib.suppress(OSError):
                fd = os.open(folder / name, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        with contextlib.suppress(OSError):
            _fsync_dir(folder)
        return True

    async def _delete_files(self, conversation_id: str, folder: Path) -> None:
        if self._journal is not None:
            # batch: the journal must never replay this conversation's appends into a new one
            await self._commit([_Op("forget", folder, conversation_id.encode("utf-8"))])
        await asyncio.to_thread(self._delete_sync, folder)

    @staticmethod
    def _delete_sync(folder: Path) -> None:
        doomed = folder.parent / f".deleted-{folder.name}-{time.time_ns()}"
        os.rename(folder, doomed)
        try:
            _fsync_dir(folder.parent)
        except OSError as exc:  # the rename is done: the deletion counts, open finishes it
            log.warning("delete_not_synced", folder=str(folder), error=str(exc))
        shutil.rmtree(doomed, ignore_errors=True)

    async def search(self, query: SearchQuery) -> list[ConversationSummary]:
        """Filter the in-memory index (no log is read), newest update first."""
        self._require_open()
        rows = []
        for entry in self._entries.values():
            if query.archived is not None and entry.archived != query.archived:
                continue
            if query.phase is not None and entry.phase != query.phase.value:
                continue
            if query.participant is not None and query.participant not in entry.participants:
                continue
            rows.append(entry.summary())
        return apply_query(rows, query)

    async def phase_counts(self) -> dict[tuple[str, bool], int]:
        """Count conversations by (phase, archived) from the in-memory index."""
        self._require_open()
        return dict(Counter((entry.phase, entry.archived) for entry in self._entries.values()))

    async def find_event(self, event_id: str) -> tuple[str, NostrEvent] | None:
        """Return (conversation id, event) for a stored event id."""
        self._require_open()
        conversation_id = (await self._bucket(event_id)).get(event_id)
        if not conversation_id:
            return None
        conversation = await self.load(conversation_id)
        if conversation is None:
            return None
        for event in conversation.history:
            if event.id == event_id:
                return conversation_id, event
        return None

    def __len__(self) -> int:
        return len(self._entries)

    # --- small values --------------------------------------------------------------------------

    def _meta_path(self, key: str) -> Path:
        return self.root / META_DIR / (hashlib.sha256(key.encode("utf-8")).hexdigest()[:40] + ".json")

    async def get_meta(self, key: str) -> str | None:
        """Return the value stored under ``key``, if any."""
        self._require_open()
        path = self._meta_path(key)
        try:
            data = await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:
            return None
        try:
            record = json.loads(data)
        except ValueError:
            await asyncio.to_thread(_move_to_corrupt, self.corrupt_dir, path, f"meta.{path.name}")
            self.recovery.append(RecoveryAction("moved_to_corrupt", None, f"meta value {key!r}"))
            return None
        return str(record["value"]) if record.get("key") == key else None

    async def set_meta(self, key: str, value: str) -> None:
        """Durably store ``value`` under ``key`` (one small file, replaced atomically)."""
        self._require_open()
        data = json.dumps({"key": key, "value": value}, ensure_ascii=False).encode("utf-8")
        await self._commit([_Op("replace", self._meta_path(key), data)])

    @asynccontextmanager
    async def lease(self, conversation_id: str) -> AsyncIterator[None]:
        """One process owns a home (its lock), so the lease is always granted."""
        yield

    @property
    def commits_in_order(self) -> bool:
        """With ``batch`` yes: writes join the group-commit queue in call order, and a group is
        durable (journal fsync) before the next is written; while closing, on one thread, in
        order too. With ``always`` each write fsyncs on a thread of its own: no order."""
        return self.fsync == "batch"
