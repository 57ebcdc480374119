"""Writing a file whole: the one atomic replacement of the project.

:func:`replace_file` writes a temp file beside the target, fsyncs it, renames it over the
target (``os.replace``) and fsyncs the folder: a reader sees the old file or the new one, never
a part, and a crash leaves one of the two. The filesystem store's ``batch`` policy splits the
same replacement in two around its commit journal's fsync: :func:`stage` writes the temp file
(the journal, not an fsync, makes its bytes durable) and :func:`put_in_place` renames it later.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

Stamp = tuple[int, int]
"""A file's ``(size, mtime_ns)``: a rename keeps both, so a replaced file keeps its temp file's."""


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd``."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_or_cut(fd: int, data: bytes, size: int, write: Callable[[int, bytes], None] = write_all) -> None:
    """Write ``data`` whole with ``write`` at the end of the file ``fd`` (``size`` bytes long before it), or
    cut the file back to ``size`` and raise: no part of it stays for the next line to run into."""
    try:
        write(fd, data)
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, size)
        raise


def fsync_dir(path: Path) -> None:
    """fsync a folder (its entries: names created, renamed or removed)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """fsync a file written earlier (through another descriptor)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_fd(fd: int, data: bytes, *, durable: bool, chmod: int | None = None) -> Stamp:
    """Write ``data`` to a fresh file (its mode set to ``chmod`` first, if given), fsync it when
    ``durable``, close it; return its stamp."""
    try:
        if chmod is not None:
            os.fchmod(fd, chmod)
        write_all(fd, data)
        if durable:
            os.fsync(fd)
        st = os.fstat(fd)
    finally:
        os.close(fd)
    return st.st_size, st.st_mtime_ns


def write_file(path: Path, data: bytes, *, durable: bool = True, exclusive: bool = False) -> Stamp:
    """Create (``exclusive``: a new file only) or truncate ``path``, write ``data``, fsync it when
    ``durable``; return its stamp. Not atomic by itself: for temp files and new folders' files."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
    return _write_fd(os.open(path, flags, 0o600), data, durable=durable)


def temp_of(path: Path) -> Path:
    """The temp file a replacement of ``path`` is written to (``<name>.tmp`` beside it)."""
    return path.with_name(path.name + ".tmp")


def stage(path: Path, data: bytes, *, durable: bool = True) -> Stamp:
    """Write ``data`` to ``path``'s temp file (fsynced when ``durable``); return the stamp ``path``
    will have once :func:`put_in_place` renames it."""
    return write_file(temp_of(path), data, durable=durable)


def put_in_place(path: Path) -> None:
    """Rename ``path``'s staged temp file over it (atomic; the folder is not fsynced here)."""
    os.replace(temp_of(path), path)


def discard_staged(path: Path) -> None:
    """Remove ``path``'s staged temp file, if any (a replacement given up)."""
    with contextlib.suppress(OSError):
        os.unlink(temp_of(path))


def replace_file(
    path: Path, data: bytes, *, sync_dir: bool = True, mode: int = 0o600, unique_temp: bool = False
) -> Stamp:
    """Replace ``path`` with ``data`` atomically: temp file, fsync, ``os.replace``, fsync the folder.

    ``sync_dir`` False leaves the folder's fsync to the caller (one for many files). The temp
    file is ``<name>.tmp``, reused by a process that is the only writer of ``path``;
    ``unique_temp`` gives each call a temp file of its own, with ``mode`` set exactly, for files
    several processes may write. The temp file is removed on failure. Return the new file's stamp.
    """
    if unique_temp:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        temp = Path(name)
    else:
        temp = temp_of(path)
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        stamp = _write_fd(fd, data, durable=True, chmod=mode if unique_temp else None)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    if sync_dir:
        fsync_dir(path.parent)
    return stamp
