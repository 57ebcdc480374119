"""The home's lock: one process writes a home (``conversations/.lock`` holds its pid)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path

from tenex_daemon.adapters.storage.filesystem.layout import LOCK_NAME
from tenex_daemon.core.errors import TenexError


class StoreLockedError(TenexError):
    """Another process holds the home's lock (one writer per home)."""

    def __init__(self, path: Path, pid: int | None) -> None:
        holder = f"process {pid}" if pid is not None else "another process"
        super().__init__(
            f"the conversation store at {path} is in use by {holder}; "
            "stop that daemon (or let that tenexd command end) or use another home"
        )
        self.path = path
        self.pid = pid


def lock_home(root: Path) -> int:
    """Take the lock of ``root`` (created if missing) and write this process's pid in it; return
    the descriptor holding the lock. Raise :class:`StoreLockedError` when another process holds it.
    A ``root`` made here is the owner's only (0700): conversation folders and their names are private
    wherever ``storage.path`` points, not only inside the home (itself 0700)."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        raw = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise StoreLockedError(root, int(raw) if raw.isdigit() else None) from None
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def unlock_home(fd: int) -> None:
    """Release the lock taken by :func:`lock_home` (its pid is erased)."""
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
    os.close(fd)


class StoreOpenError(TenexError):
    """The home's conversation store cannot be opened (a file or folder this process may not read)."""
