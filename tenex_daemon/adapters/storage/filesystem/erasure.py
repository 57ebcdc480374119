"""What a deleted conversation leaves outside its folder, and erasing it.

Deleting a conversation removes its folder; its content can also be in the small values that
belong to it (its delegation threads, :mod:`~tenex_daemon.core.erasure`), in copies the store moved
to ``corrupt/`` while repairing it, in the index (its title and summary: rewritten by a compaction)
and in ``batch``'s commit journal (renewed by a checkpoint). The first two are erased here. A small
value is first replaced by a tombstone through the commit journal (so a journal replayed after a
crash ends with the tombstone, never the old value: the replay removes the file), then its file is
removed.

Blocking file work (all but :class:`SharedRounds`): called in worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

from tenex_daemon.adapters.storage.atomic import fsync_dir
from tenex_daemon.core.erasure import value_owner


def tombstone(key: str) -> bytes:
    """The content of an erased small value's file: its key and no value (read as absent)."""
    return json.dumps({"key": key, "value": None}, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def is_tombstone(data: bytes) -> bool:
    """Whether a small value's content is a tombstone (:func:`tombstone`)."""
    try:
        record = json.loads(data)
    except ValueError:
        return False
    return isinstance(record, dict) and "key" in record and record.get("value", "") is None


def scan_owned_values(meta_dir: Path) -> dict[str, set[str]]:
    """Read every small value's key: conversation id -> keys of the values that belong to it."""
    owned: dict[str, set[str]] = {}
    if not meta_dir.is_dir():
        return owned
    for path in meta_dir.glob("*.json"):
        try:
            record = json.loads(path.read_bytes())
        except (OSError, ValueError):
            continue  # gone meanwhile, or unreadable (moved to corrupt/ when it is read)
        key = record.get("key") if isinstance(record, dict) else None
        if isinstance(key, str) and (owner := value_owner(key)) is not None:
            owned.setdefault(owner, set()).add(key)
    return owned


SHARED_COPIES = re.compile(r"^(?:journal\.\d+|index\.snapshot\.json|meta\.[0-9a-f]+\.json)\.\d+$")
"""Copies in ``corrupt/`` of files that hold several conversations (a commit journal with a bad frame, an
unreadable index snapshot, an unreadable small value): one that names a deleted conversation goes with it.
Its readable part was replayed or rebuilt when it was moved aside; what is left is for reading by hand."""


def corrupt_copies(corrupt_dir: Path, conversation_id: str) -> list[Path]:
    """The conversation's files and half-made folders that repairs moved or copied to ``corrupt/``
    (``<id>.events.log.<ns>``, ``<id>.state.json.<ns>``, ``tmp-<id>-<pid>-<ns>.<ns>``), and the copies of
    shared files that name it (:data:`SHARED_COPIES`)."""
    if not corrupt_dir.is_dir():
        return []
    name = re.escape(conversation_id)
    pattern = re.compile(rf"^(?:{name}\.(?:events\.log|state\.json)|tmp-{name}-\d+-\d+)\.\d+$")
    found = []
    for path in corrupt_dir.iterdir():
        if pattern.match(path.name) or (SHARED_COPIES.match(path.name) and _names(path, conversation_id)):
            found.append(path)
    return found


def _names(path: Path, conversation_id: str) -> bool:
    """Whether the file's bytes hold the conversation's id (a file gone meanwhile holds nothing)."""
    try:
        return conversation_id.encode("utf-8") in path.read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return False


def remove_leftovers(paths: list[Path]) -> None:
    """Remove files (and folders) and make the removals durable (their folders fsynced)."""
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    for folder in {path.parent for path in paths}:
        with contextlib.suppress(FileNotFoundError):
            fsync_dir(folder)


class SharedRounds:
    """Work that several callers ask for at once, done once for all of them (the index rewrite and
    the journal checkpoint after deletions made together).

    A request is answered by a round of ``work`` that started after it was made: a request made while
    a round runs waits for the next round, which starts when that one ends and answers every request
    waiting by then. A round that fails raises to its requester; the others waiting try again.
    """

    def __init__(self, work: Callable[[], Awaitable[None]]) -> None:
        self._work = work
        self._lock = asyncio.Lock()
        self._requested = 0
        self._answered = 0

    async def request(self) -> None:
        """Return once a round started after this call has finished."""
        self._requested += 1
        ticket = self._requested
        async with self._lock:
            if self._answered >= ticket:
                return
            covers = self._requested
            await self._work()
            self._answered = covers
