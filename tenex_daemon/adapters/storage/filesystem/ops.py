"""One durable write (:class:`Op`), how a group of them is sorted, and the threads writes run on."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tenex_daemon.adapters.storage.atomic import Stamp

OpKind = Literal["append", "replace", "create", "forget"]


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
    result: Stamp | None = None
    error: BaseException | None = None


def fail(ops: list[Op], exc: BaseException) -> None:
    """Mark every op of ``ops`` failed with ``exc``."""
    for op in ops:
        op.error = exc


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
