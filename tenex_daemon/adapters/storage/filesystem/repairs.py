"""What the store repairs on its own, and ``corrupt/``, where it puts what it cannot read."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from tenex_daemon.adapters.storage.atomic import fsync_dir, fsync_file


@dataclass(frozen=True)
class RecoveryAction:
    """One thing the store repaired on its own (logged, and kept in ``FileSystemStore.recovery``)."""

    kind: str
    """``torn_tail_cut``, ``log_salvaged``, ``state_rebuilt``, ``index_rebuilt``,
    ``index_entry_repaired``, ``index_entry_added``, ``index_entry_removed``, ``moved_to_corrupt``,
    ``journal_replayed``, ``journal_skipped``."""
    conversation_id: str | None
    detail: str


def move_to_corrupt(corrupt_dir: Path, source: Path, label: str) -> Path:
    """Move ``source`` into ``corrupt/`` under a unique name; never delete it."""
    corrupt_dir.mkdir(parents=True, exist_ok=True)
    target = corrupt_dir / f"{label}.{time.time_ns()}"
    os.rename(source, target)  # a move within the home: atomic, and the name is new
    fsync_dir(corrupt_dir)
    fsync_dir(source.parent)
    return target


def copy_to_corrupt(corrupt_dir: Path, source: Path, label: str) -> Path:
    """Copy ``source`` into ``corrupt/`` under a unique name, durably (the original is repaired next)."""
    corrupt_dir.mkdir(parents=True, exist_ok=True)
    target = corrupt_dir / f"{label}.{time.time_ns()}"
    shutil.copy2(source, target)
    fsync_file(target)
    fsync_dir(corrupt_dir)
    return target
