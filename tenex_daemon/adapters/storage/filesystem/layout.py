"""Where a home's files are: the names under ``conversations/`` and the paths built from them."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

LOG_NAME = "events.log"
STATE_NAME = "state.json"
ARCHIVE_DIR = "archive"
CORRUPT_DIR = "corrupt"
INDEX_DIR = ".index"
SNAPSHOT_NAME = "snapshot.json"
EVENTS_DIR = ".events"
META_DIR = ".meta"
JOURNAL_DIR = ".journal"
LOCK_NAME = ".lock"
TEMP_FOLDER_PREFIX = ".tmp-"
"""A conversation folder being created (renamed into place when complete)."""
DELETED_FOLDER_PREFIX = ".deleted-"
"""A conversation folder being deleted (renamed first, then removed)."""

_SPACE = re.compile(r"\s")
"""Whitespace as ``str.isspace`` has it (the pattern module tests each character the same way)."""
_ID_PATTERN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,199}")
_RESERVED = frozenset({ARCHIVE_DIR, CORRUPT_DIR})


def is_conversation_name(name: str) -> bool:
    """Whether ``name`` can be a conversation id (and so a conversation folder's name)."""
    return bool(_ID_PATTERN.fullmatch(name)) and name not in _RESERVED  # not match: "$" passes a final "\n"


def check_id(conversation_id: str) -> None:
    """Refuse a conversation id that cannot name a folder."""
    if not is_conversation_name(conversation_id):
        raise ValueError(f"conversation id {conversation_id!r} cannot name a file")


def check_event_id(event_id: str) -> None:
    """Refuse an event id that cannot be one word of an event-id bucket line."""
    if not event_id or _SPACE.search(event_id):
        raise ValueError(f"event id {event_id!r} is empty or contains whitespace")


def meta_name(key: str) -> str:
    """The name of a small value's file in the ``.meta`` folder."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:40] + ".json"


def archive_twin(folder: Path) -> Path:
    """The other place a conversation folder can be: under ``archive/``, or back out of it."""
    if folder.parent.name == ARCHIVE_DIR:
        return folder.parent.parent / folder.name
    return folder.parent / ARCHIVE_DIR / folder.name


@dataclass(frozen=True, slots=True)
class Layout:
    """The paths of one home's ``conversations/`` folder (``root``)."""

    root: Path

    @property
    def corrupt_dir(self) -> Path:
        """Where unreadable files are moved (never deleted)."""
        return self.root / CORRUPT_DIR

    @property
    def index_dir(self) -> Path:
        """The index's snapshot and logs."""
        return self.root / INDEX_DIR

    @property
    def snapshot(self) -> Path:
        """The index snapshot."""
        return self.root / INDEX_DIR / SNAPSHOT_NAME

    @property
    def events_dir(self) -> Path:
        """The event-id buckets (the processed set)."""
        return self.root / EVENTS_DIR

    @property
    def meta_dir(self) -> Path:
        """The small values."""
        return self.root / META_DIR

    def folder(self, conversation_id: str, archived: bool) -> Path:
        """A conversation's folder, under ``archive/`` when archived."""
        return (self.root / ARCHIVE_DIR / conversation_id) if archived else (self.root / conversation_id)

    def index_log(self, generation: int) -> Path:
        """The index log of changes since snapshot ``generation``."""
        return self.root / INDEX_DIR / f"log.{generation}"

    def meta_path(self, key: str) -> Path:
        """The file of one small value."""
        return self.meta_dir / meta_name(key)

    def make_folders(self) -> None:
        """Create the home's fixed folders (the root must exist)."""
        for name in (ARCHIVE_DIR, INDEX_DIR, EVENTS_DIR, META_DIR):
            (self.root / name).mkdir(exist_ok=True)

    def list_folders(self) -> dict[str, bool]:
        """Return every conversation folder: id -> archived."""
        found: dict[str, bool] = {}
        for archived, parent in ((True, self.root / ARCHIVE_DIR), (False, self.root)):
            for item in os.scandir(parent):
                if item.is_dir(follow_symlinks=False) and is_conversation_name(item.name):
                    found[item.name] = archived
        return found
