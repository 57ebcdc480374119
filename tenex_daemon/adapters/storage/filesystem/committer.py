"""Commits: every durable write of the store goes through :class:`Committer`.

``always``: each call's ops are written and fsynced on a worker thread (``direct.py``).
``batch``: ops join a queue; one task takes everything queued while the previous group was
being committed (plus up to ``batch_delay`` seconds) and commits it as one group through the
journal (``group_commit.py``), on one thread: groups are durable in call order. While the store
closes, commits go straight to that thread, journaled while the journal is open.
"""

from __future__ import annotations

import asyncio
import errno
import functools
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import structlog

from tenex_daemon.adapters.storage.filesystem.direct import apply_ops
from tenex_daemon.adapters.storage.filesystem.group_commit import apply_journaled
from tenex_daemon.adapters.storage.filesystem.journal import JOURNAL_LIMIT, NOT_HELD, Journal, NotHeld
from tenex_daemon.adapters.storage.filesystem.ops import Op, commit_thread

log = structlog.get_logger(__name__)
T = TypeVar("T")


async def _on_commit_thread(work: Callable[[], T]) -> T:
    """Run blocking commit work on the one commit thread (commits and checkpoints never overlap)."""
    return await asyncio.get_running_loop().run_in_executor(commit_thread(), work)


def _apply_closing(journal: Journal, ops: list[Op]) -> bool:
    """A commit while the store closes: journaled while the journal is open (a direct write could be
    undone by an older journaled snapshot on replay), durable file by file once it is gone. Return
    whether it was written directly."""
    if journal.is_open:
        apply_journaled(journal, ops)
        return False
    apply_ops(ops)
    return True


class Committer:
    """The store's commits, per its fsync policy (``batched``: ``batch``)."""

    def __init__(self, *, batched: bool, batch_delay: float) -> None:
        self.batched = batched
        self.batch_delay = batch_delay
        self.closing = False
        """Set when the store starts closing: commits no longer wait in the queue."""
        self.journal: Journal | None = None
        self._queue: list[tuple[list[Op], asyncio.Future[None]]] = []
        """Each waiting call's ops and the future it awaits (one per call, not per op)."""
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._held: dict[Path, bytes | None] = {}
        """The journal's held small values; kept after the journal is gone while the store closes
        (a final checkpoint that failed or was skipped leaves them newer than their files)."""

    def reset(self) -> None:
        """Get ready for commits (the store is opening)."""
        self.closing = False
        self._wakeup = asyncio.Event()
        self._held = {}

    def held_value(self, path: Path) -> bytes | NotHeld | None:
        """A small value's newest content while its file is older (None: erased), else ``NOT_HELD``."""
        return self._held.get(path, NOT_HELD)

    async def start(self, journal: Journal) -> None:
        """Start ``batch``'s journal and the group committer."""
        self.journal = journal
        self._held = journal.held
        await asyncio.to_thread(journal.start)
        self._task = asyncio.create_task(self._run(), name="fs-store-commit")

    async def commit(self, ops: list[Op]) -> None:
        """Make ``ops`` durable per the fsync policy; raise the first op's error."""
        if self.batched and not self.closing:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._queue.append((ops, future))
            self._wakeup.set()
            await future
            return
        if self.journal is not None:  # closing: serial with the final checkpoint, on its thread
            direct = await _on_commit_thread(functools.partial(_apply_closing, self.journal, ops))
        else:
            await asyncio.to_thread(apply_ops, ops)
            direct = True
        if direct:  # these files are newer than any value the journal held for them
            for op in ops:
                if op.kind == "replace" and op.error is None:
                    self._held.pop(op.path, None)
        for op in ops:
            if op.error is not None:
                raise op.error

    async def checkpoint(self) -> None:
        """``batch``: checkpoint the journal now (the files written are fsynced and the journal file
        that recorded their bytes is deleted); nothing without a journal open."""
        journal = self.journal
        if journal is None or not journal.is_open:
            return
        # on the commit thread: never beside a group commit
        await _on_commit_thread(journal.checkpoint)

    async def stop(self) -> None:
        """Commit what is queued, then checkpoint the journal a last time (it is deleted).

        A failed final checkpoint keeps the journal: the next open replays it.
        """
        self.closing = True
        if self._task is not None:
            self._wakeup.set()
            await self._task
            self._task = None
        if self.journal is not None:
            journal = self.journal
            try:
                await _on_commit_thread(functools.partial(journal.checkpoint, final=True))
            except OSError:
                log.exception("journal_checkpoint_failed")  # kept: the next open replays it
                journal.close()
            self.journal = None

    async def _run(self) -> None:
        """Group commit: appends arriving while a commit is in flight share the next one.

        A waiting append is delayed by at most the commit in flight plus ``batch_delay``;
        each batch costs one fsync of the journal.
        """
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if not self._queue:
                if self.closing:
                    return
                continue
            if self.batch_delay > 0 and not self.closing:
                await asyncio.sleep(self.batch_delay)
            batch, self._queue = self._queue, []
            if await self._commit_group(batch):
                await self._checkpoint_if_full()
            if self._queue:
                self._wakeup.set()

    async def _commit_group(self, batch: list[tuple[list[Op], asyncio.Future[None]]]) -> bool:
        """Commit one group and settle its waiters; False when the group failed as a whole."""
        ops = [op for call, _ in batch for op in call]
        try:
            if self.journal is not None:
                # a thread of its own: never queued behind other to_thread work
                await _on_commit_thread(functools.partial(apply_journaled, self.journal, ops))
            else:
                await asyncio.to_thread(apply_ops, ops)
        except asyncio.CancelledError:
            # Stopped mid-commit: the group's fate is unknown, so none of it is acknowledged.
            stopped = OSError(errno.ECANCELED, "the store's group committer was stopped mid-commit")
            _settle(batch, stopped)
            raise
        except Exception as exc:  # a bug in a commit stage: fail every waiter, keep committing
            log.exception("group_commit_failed")
            _settle(batch, exc)
            return False
        for call, future in batch:
            if not future.done():
                error = next((op.error for op in call if op.error is not None), None)
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(None)
        return True

    async def _checkpoint_if_full(self) -> None:
        if self.journal is not None and self.journal.size > JOURNAL_LIMIT:
            try:
                # on the commit thread: never beside a commit made while closing
                await _on_commit_thread(self.journal.checkpoint)
            except OSError:
                log.exception("journal_checkpoint_failed")  # the journal keeps covering them


def _settle(batch: list[tuple[list[Op], asyncio.Future[None]]], exc: BaseException) -> None:
    """Fail every waiter of the group not yet answered."""
    for _, future in batch:
        if not future.done():
            future.set_exception(exc)
