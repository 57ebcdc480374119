"""One durable write (:class:`Op`), how a group of them is sorted, and the threads writes run on."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

from tenex_daemon.adapters.storage.atomic import Stamp

OpKind = Literal["append", "replace", "create", "forget"]
T = TypeVar("T")
R = TypeVar("R")


@dataclass(slots=True)
class Op:
    """One durable write: an append to a file, an atomic replacement of one, a new conversation
    folder (``path``; its log in ``data``, its state in ``extra``), or (``batch``'s journal only)
    the record that a conversation was deleted, its id in ``data``.

    The commit fills in ``result`` (a replaced or created state file's stamp) or ``error``.
    """

    kind: OpKind
    path: Path
    data: bytes
    create: bool = False
    """An append that may create its file (an event-id bucket)."""
    extra: bytes = b""
    erases: bool = False
    """A replacement that erases a small value (``data`` is its tombstone): with ``batch``, its file
    is removed at the journal's checkpoint rather than written."""
    after: Op | None = None
    """An append of the same call this replacement goes with (a snapshot saved with its event): when
    that append fails, so does this, and the file keeps its content (never a state without its event)."""
    result: Stamp | None = None
    error: BaseException | None = None


def fail(ops: list[Op], exc: BaseException) -> None:
    """Mark every op of ``ops`` failed with ``exc``."""
    for op in ops:
        op.error = exc


def going_ahead(ops: list[Op]) -> list[Op]:
    """The replacements of ``ops`` to make: those whose :attr:`Op.after` append failed (appends are
    made or failed first) are marked failed with its error and left out."""
    kept: list[Op] = []
    for op in ops:
        if op.after is not None and op.after.error is not None:
            op.error = op.after.error
        else:
            kept.append(op)
    return kept


@dataclass(frozen=True, slots=True)
class Partition:
    """A group's ops sorted by what they do; appends and replacements grouped by file, in order."""

    creates: list[Op] = field(default_factory=list)
    appends: dict[Path, list[Op]] = field(default_factory=dict)
    replaces: dict[Path, list[Op]] = field(default_factory=dict)
    forgets: list[Op] = field(default_factory=list)

    @classmethod
    def of(cls, ops: list[Op]) -> Partition:
        """Sort ``ops``."""
        parts = cls()
        for op in ops:
            if op.kind == "create":
                parts.creates.append(op)
            elif op.kind == "forget":
                parts.forgets.append(op)
            else:
                (parts.appends if op.kind == "append" else parts.replaces).setdefault(op.path, []).append(op)
        return parts


_APPEND_LOCKS = tuple(threading.Lock() for _ in range(64))


def append_lock(path: Path) -> threading.Lock:
    """The lock held while an event-id bucket (or a derived file) gets a write and, if that fails, is
    cut back: the derived lines' writer and the commits both append to buckets, and a cut-back must
    never remove a line the other wrote meanwhile. One of a few locks, picked by the path."""
    return _APPEND_LOCKS[hash(path) % len(_APPEND_LOCKS)]


def append_flags(group: list[Op]) -> int:
    """How to open a file for a group's appends (created only when an op allows it: a bucket)."""
    return os.O_WRONLY | os.O_APPEND | (os.O_CREAT if any(o.create for o in group) else 0)


_FSYNC_THREADS = 16
_fsync_executor: ThreadPoolExecutor | None = None
_commit_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def fsync_pool() -> ThreadPoolExecutor:
    """The threads a group commit writes and fsyncs its files on, in parallel (made on first use)."""
    global _fsync_executor
    with _executor_lock:
        if _fsync_executor is None:
            _fsync_executor = ThreadPoolExecutor(_FSYNC_THREADS, thread_name_prefix="fs-store-fsync")
        return _fsync_executor


def commit_thread() -> ThreadPoolExecutor:
    """The one thread ``batch`` group commits run on (made on first use; commits are serial)."""
    global _commit_executor
    with _executor_lock:
        if _commit_executor is None:
            _commit_executor = ThreadPoolExecutor(1, thread_name_prefix="fs-store-commit")
        return _commit_executor


def run_parallel(work: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``[work(item) for item in items]``, the items shared out in runs over the fsync threads.

    fsyncs of different files made at once are committed together by the filesystem (measured
    here: 16 files fsynced from 16 threads cost a third of 16 fsyncs in a row); one task per run
    of items, not per item, wakes each thread once (a checkpoint of 900 files: a quarter of the
    CPU of a task per file). The first exception raised is raised; the rest of its run is not done.
    """
    if len(items) <= 1:
        return [work(item) for item in items]
    size = -(-len(items) // _FSYNC_THREADS)
    runs = [items[start:start + size] for start in range(0, len(items), size)]
    results: list[R] = []
    for done in fsync_pool().map(lambda run: [work(item) for item in run], runs):
        results.extend(done)
    return results
