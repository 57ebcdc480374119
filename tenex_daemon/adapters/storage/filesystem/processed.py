"""The processed set: every event id ever accepted or marked processed, and its conversation.

Ids are spread over 4,096 bucket files (``.events/<xyz>``, the first three hex digits of the
id), each a list of lines ``\\n<event id> <conversation id or ->``. A bucket is read once and
kept loaded; lines of accepted events are derived data, written in rounds; an id marked processed
without a conversation is committed like any durable write.

What stays loaded is bounded twice: at most ``cache_size`` buckets, and at most ``max_ids`` ids in
all (each bucket holds every id ever filed in it, so a bound on buckets alone lets memory grow with
every event the home ever took in); the least recently used buckets go first and are read again
from their files when asked. A conversation id is held once however many of its events are loaded.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

from tenex_daemon.adapters.storage.filesystem.derived import DerivedLines

BUCKET_CHARS = 3
DEFAULT_MAX_IDS = 50_000
"""Ids kept loaded at most, over every bucket (about 10 MB); more are read from their files."""
_HEX = frozenset("0123456789abcdef")


def bucket_of(event_id: str) -> str:
    """The bucket an event id belongs to."""
    head = event_id[:BUCKET_CHARS]
    if len(head) == BUCKET_CHARS and set(head) <= _HEX:
        return head
    return hashlib.sha256(event_id.encode("utf-8")).hexdigest()[:BUCKET_CHARS]


def bucket_line(event_id: str, conversation_id: str) -> bytes:
    """The line recording an id (``-`` for an id processed without a conversation)."""
    return f"\n{event_id} {conversation_id or '-'}".encode()


def merge_lines(found: dict[str, str], lines: Iterable[bytes]) -> None:
    """Add the ids of bucket lines (``\\n<event id> <conversation id or ->``) to ``found``."""
    for chunk in lines:
        for line in chunk.split(b"\n"):
            parts = line.split(b" ")
            if len(parts) != 2 or not parts[0] or not parts[1]:
                continue  # a torn line: the next write starts with a newline, so it stays alone
            conversation_id = sys.intern(parts[1].decode("utf-8", "replace"))  # shared by its events
            found[parts[0].decode("utf-8", "replace")] = "" if conversation_id == "-" else conversation_id


def read_bucket(path: Path) -> dict[str, str]:
    """A bucket file's ids (empty when it has no file)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    found: dict[str, str] = {}
    merge_lines(found, data.split(b"\n"))
    return found


def absent_buckets(events_dir: Path) -> set[str]:
    """The buckets with no file yet: known empty without reading anything."""
    present = {item.name for item in os.scandir(events_dir)}
    return {f"{n:03x}" for n in range(16**BUCKET_CHARS)} - present


class ProcessedIds:
    """The loaded buckets, and the ids added while one is being read."""

    def __init__(
        self, events_dir: Path, derived: DerivedLines, cache_size: int, max_ids: int = DEFAULT_MAX_IDS
    ) -> None:
        self.cache_size = cache_size
        self.max_ids = max_ids
        self.loaded_ids = 0
        """Ids in the loaded buckets, all together (kept at most :attr:`max_ids`, the newest bucket aside)."""
        self._events_dir = events_dir
        self._derived = derived
        self._buckets: OrderedDict[str, dict[str, str]] = OrderedDict()
        self._loading: dict[str, tuple[asyncio.Future[dict[str, str]], dict[str, str]]] = {}
        self._paths: dict[str, Path] = {}
        self._absent: set[str] = set()

    def reset(self, absent: set[str]) -> None:
        """Take the buckets open found without a file."""
        self._absent = absent

    def clear(self) -> None:
        """Forget the loaded buckets (the store closed)."""
        self._buckets.clear()
        self.loaded_ids = 0

    def path_of(self, event_id: str) -> Path:
        """The bucket file of an event id."""
        return self._path(bucket_of(event_id))

    def _path(self, bucket: str) -> Path:
        path = self._paths.get(bucket)
        if path is None:
            path = self._paths[bucket] = self._events_dir / bucket
        return path

    def add(self, event_id: str, conversation_id: str) -> None:
        """Record an accepted event's id (its bucket line is derived data, written in a round)."""
        bucket = bucket_of(event_id)
        if bucket in self._absent:
            self._adopt_absent(bucket)
        self._note(bucket, event_id, conversation_id)
        self._derived.add(self._path(bucket), bucket_line(event_id, conversation_id))

    def marked(self, event_id: str) -> None:
        """Record an id whose bucket line was just committed (processed without a conversation)."""
        self._note(bucket_of(event_id), event_id, "")

    def _note(self, bucket: str, event_id: str, conversation_id: str) -> None:
        """Put an id in its bucket if loaded, and beside a read of it under way."""
        loaded = self._buckets.get(bucket)
        if loaded is not None:
            if event_id not in loaded:
                self.loaded_ids += 1
            loaded[event_id] = sys.intern(conversation_id)
            self._trim()
        loading = self._loading.get(bucket)
        if loading is not None:
            loading[1][event_id] = conversation_id

    async def contains(self, event_id: str) -> bool:
        """Whether this event id was ever accepted or marked processed."""
        return event_id in await self.table(event_id)

    async def table(self, event_id: str) -> dict[str, str]:
        """Return the loaded bucket holding ``event_id`` (reading it once, off the loop).

        Lines for the bucket still queued or being written are merged in; ids added and lines
        written while the file is read are caught on the side and merged too.
        """
        bucket = bucket_of(event_id)
        loaded = self._buckets.get(bucket)
        if loaded is not None:
            self._buckets.move_to_end(bucket)
            return loaded
        if bucket in self._absent:
            return self._adopt_absent(bucket)
        loading = self._loading.get(bucket)
        if loading is not None:
            return await asyncio.shield(loading[0])
        future: asyncio.Future[dict[str, str]] = asyncio.get_running_loop().create_future()
        added: dict[str, str] = {}
        self._loading[bucket] = (future, added)
        path = self._path(bucket)
        try:
            with self._derived.watch(path) as written:
                loaded = await asyncio.to_thread(read_bucket, path)
        except BaseException as exc:
            del self._loading[bucket]
            future.set_exception(exc)
            future.exception()  # retrieved: waiters (if any) get it through shield
            raise
        del self._loading[bucket]
        merge_lines(loaded, self._derived.queued(path))
        merge_lines(loaded, written)
        loaded.update(added)
        self._keep(bucket, loaded)
        future.set_result(loaded)
        return loaded

    def _adopt_absent(self, bucket: str) -> dict[str, str]:
        """A bucket with no file holds nothing but what this process adds: load it as empty.

        Every id added to it from now on passes through the loaded table, so it stays
        complete; once evicted it is read from its file like any other.
        """
        self._absent.discard(bucket)
        loaded: dict[str, str] = {}
        self._keep(bucket, loaded)
        return loaded

    def _keep(self, bucket: str, loaded: dict[str, str]) -> None:
        self._buckets[bucket] = loaded
        self.loaded_ids += len(loaded)
        self._trim()

    def _trim(self) -> None:
        """Unload the least recently used buckets while either bound is passed (never the newest: the
        one just read is returned to its caller)."""
        while len(self._buckets) > 1 and (
            len(self._buckets) > self.cache_size or self.loaded_ids > self.max_ids
        ):
            _, dropped = self._buckets.popitem(last=False)
            self.loaded_ids -= len(dropped)
