"""The ``always`` policy's commit: every op durable on its own, with as few fsyncs as possible.

Blocking file work: called in a worker thread (or the commit thread, once ``batch``'s journal
is gone while the store closes).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from tenex_daemon.adapters.storage.atomic import Stamp, fsync_dir, replace_file, write_all
from tenex_daemon.adapters.storage.filesystem.folder import create_folder
from tenex_daemon.adapters.storage.filesystem.ops import (
    Op,
    Partition,
    append_flags,
    append_lock,
    fail,
    going_ahead,
    run_parallel,
)
from tenex_daemon.core.errors import ConversationExistsError


def _append_durably(item: tuple[Path, list[Op]]) -> None:
    """Append one file's ops as one write and fsync it; on failure cut the file back and mark them."""
    path, group = item
    try:
        fd = os.open(path, append_flags(group), 0o600)
    except OSError as exc:
        fail(group, exc)
        return
    # an event-id bucket is appended to by the derived lines' writer too: neither's cut-back may
    # remove the other's line (a conversation log is written by its commits only, in turn)
    shared = append_lock(path) if any(op.create for op in group) else contextlib.nullcontext()
    try:
        with shared:
            before = os.fstat(fd).st_size
            try:
                write_all(fd, b"".join(op.data for op in group))
                os.fsync(fd)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, before)
                fail(group, exc)
    finally:
        os.close(fd)


def _replace_durably(item: tuple[Path, list[Op]]) -> Stamp | None:
    """Replace the file with the group's last data (its folder is fsynced later); mark errors."""
    path, group = item
    try:
        return replace_file(path, group[-1].data, sync_dir=False)
    except OSError as exc:
        fail(group, exc)
        return None


def _sync_folder(folder: Path) -> OSError | None:
    try:
        fsync_dir(folder)
    except OSError as exc:
        return exc
    return None


def _apply_replaces(replaces: dict[Path, list[Op]]) -> None:
    """Replace each file atomically (temp file, fsync, rename), then fsync each folder once.

    Several files are replaced from several threads at once: the filesystem's journal commits
    their fsyncs together, as it does for appends.
    """
    items = [(path, kept) for path, group in replaces.items() if (kept := going_ahead(group))]
    stamps = run_parallel(_replace_durably, items)
    renamed = [(path, group, stamp) for (path, group), stamp in zip(items, stamps, strict=True)
               if stamp is not None]
    folders = sorted({path.parent for path, _, _ in renamed})
    outcomes = run_parallel(_sync_folder, folders)
    errors = dict(zip(folders, outcomes, strict=True))
    for path, group, stamp in renamed:
        failed = errors.get(path.parent)
        if failed is not None:
            fail(group, failed)
        else:
            for op in group:
                op.result = stamp


def apply_ops(ops: list[Op]) -> None:
    """Make every op durable with as few fsyncs as possible.

    Appends to one file are written in order as one write and fsynced once; a failed
    append is cut back to the file's previous size so no partial line stays behind.
    Replacements write and fsync temp files, rename them, then fsync each folder once; one that
    goes with a failed append (:attr:`Op.after`) is not made.
    Deletions (``forget``) need no op here: only the batch journal records them.
    """
    parts = Partition.of(ops)
    for op in parts.creates:
        try:
            op.result = create_folder(op.path, op.data, op.extra)
        except (OSError, ConversationExistsError) as exc:
            op.error = exc
    # fsyncs of different files run at once: the filesystem commits them together (run_parallel)
    run_parallel(_append_durably, list(parts.appends.items()))
    _apply_replaces(parts.replaces)
