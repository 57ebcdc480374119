"""Derived lines (index records, event-id bucket lines), written in rounds off the commit path.

They are not needed for durability (open rebuilds them from the logs), so they wait in memory
and are written every ``FLUSH_INTERVAL`` seconds, many lines per file per write, not fsynced;
the index compaction fsyncs the files written before its snapshot says the logs are complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import structlog

from tenex_daemon.adapters.storage.atomic import fsync_dir, fsync_file, write_all, write_or_cut
from tenex_daemon.adapters.storage.filesystem.layout import INDEX_DIR
from tenex_daemon.adapters.storage.filesystem.ops import append_lock, run_parallel

log = structlog.get_logger(__name__)

FLUSH_INTERVAL = 2.0
"""Seconds between writes of derived lines (index records, event-id buckets): they are not
needed for durability, and one write per file per round keeps them off the commit path."""
MAX_PENDING = 20_000
"""Lines waiting after which a round starts at once."""


def write_lines(pending: dict[Path, list[bytes]]) -> dict[Path, list[bytes]]:
    """Append derived lines; event-id buckets first, the index last. Return the lines not written.

    An index record saying "the log is N bytes" is what makes open skip a rescan, so it
    must never reach the disk before the bucket lines of the events it counts: after a bucket
    whose write failed, no index line of the round is written either. A write that fails is cut
    back to the file's size before it (no torn line is left) and its lines are returned, to be
    written again (a full disk: once there is room).
    """
    ordered = sorted(pending.items(), key=lambda item: item[0].parent.name == INDEX_DIR)
    unwritten: dict[Path, list[bytes]] = {}
    for path, lines in ordered:
        if unwritten and path.parent.name == INDEX_DIR:
            unwritten[path] = lines
            continue
        try:
            _append(path, b"".join(lines))
        except OSError:
            log.exception("derived_write_failed", path=str(path))
            unwritten[path] = lines
    return unwritten


def _append(path: Path, data: bytes) -> None:
    """Append ``data`` to ``path`` whole, or leave the file as it was."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        with append_lock(path):  # a commit's bucket line never lands between the size and the cut
            write_or_cut(fd, data, os.fstat(fd).st_size, write_all)
    finally:
        os.close(fd)


def sync_files(paths: set[Path]) -> None:
    """fsync files (in parallel) and then their folders; files gone meanwhile are skipped."""

    def sync(path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            fsync_file(path)

    run_parallel(sync, sorted(paths))
    for folder in {path.parent for path in paths}:
        with contextlib.suppress(FileNotFoundError):
            fsync_dir(folder)


class DerivedLines:
    """The derived lines waiting to be written, and the task that writes them."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        """Held while lines are written (and by the index compaction around its flush)."""
        self.closing = False
        """Set by the store's close: a round then starts without waiting."""
        self._pending: dict[Path, list[bytes]] = {}
        self._count = 0
        self._inflight: dict[Path, list[bytes]] = {}
        self._written: set[Path] = set()
        """Files written since the last :meth:`sync_written` (fsynced before the next index snapshot)."""
        self._watchers: dict[Path, list[bytes]] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self.poisoned = False
        """An fsync of derived files failed: the kernel may have dropped lines it reported written, and a
        later fsync may succeed without them, so no index snapshot counts them in this process (open
        reads again every log grown since the last snapshot)."""
        self.unwritten = False
        """Whether the last round left lines unwritten (they wait for the next): no index snapshot may
        then say the logs are complete."""

    def add(self, path: Path, line: bytes) -> None:
        """Queue one line for ``path`` (the writing task starts if it is not running)."""
        self._pending.setdefault(path, []).append(line)
        self._count += 1
        if self._count >= MAX_PENDING:
            self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.run(), name="fs-store-derived")

    def queued(self, path: Path) -> Iterable[bytes]:
        """The lines for ``path`` not yet on disk: being written, then waiting."""
        return itertools.chain(self._inflight.get(path, ()), self._pending.get(path, ()))

    @contextlib.contextmanager
    def watch(self, path: Path) -> Iterator[list[bytes]]:
        """Collect the lines for ``path`` written while the body runs: a reader of the file may
        have read it before they landed."""
        written: list[bytes] = []
        self._watchers[path] = written
        try:
            yield written
        finally:
            del self._watchers[path]

    async def run(self) -> None:
        """Write the lines every ``FLUSH_INTERVAL`` (sooner past ``MAX_PENDING`` lines, at once
        while closing) until none is left: each file is touched once a round."""
        while self._pending:
            if self.unwritten and self.closing:
                log.warning("derived_lines_left_unwritten", lines=self._count)  # the next open rescans
                return
            if self.unwritten:
                await asyncio.sleep(FLUSH_INTERVAL)  # a full disk: not again at once, however many wait
            elif not self.closing:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), FLUSH_INTERVAL)
            self._wake.clear()
            async with self.lock:
                await self.flush_locked()

    async def flush_locked(self) -> None:
        """Write every waiting line now (the caller holds :attr:`lock`)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        self._count = 0
        self._written.update(pending)
        self._inflight = pending
        unwritten: dict[Path, list[bytes]] = dict(pending)
        try:
            unwritten = await asyncio.to_thread(write_lines, pending)
        finally:
            self._inflight = {}
            for path, written in self._watchers.items():
                if path not in unwritten:
                    written.extend(pending.get(path, ()))
            for path, lines in unwritten.items():  # before what came meanwhile: each file keeps its order
                self._pending[path] = [*lines, *self._pending.get(path, ())]
                self._count += len(lines)
            self.unwritten = bool(unwritten)

    async def sync_written(self) -> None:
        """fsync the files written since the last call, and their folders."""
        written, self._written = self._written, set()
        try:
            await asyncio.to_thread(sync_files, written)
        except OSError:
            self.poisoned = True
            raise
        except BaseException:  # no thread to fsync on (a process or thread limit), or cancelled: asked again
            self._written |= written
            raise

    async def stop(self) -> None:
        """Write what is left at once and wait for the writing task (the store is closing)."""
        if self._task is not None:
            self._wake.set()
            await self._task
