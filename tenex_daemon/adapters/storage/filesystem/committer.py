"""Commits: every durable write of the store goes through :class:`Committer`.

``always``: each call's ops are written and fsynced on a worker thread (``direct.py``); calls that
write one file take turns in call order (two replacements of a file at once would share its temp file).
``batch``: ops join a queue; everything queued while the previous group was being committed
(plus up to ``batch_delay`` seconds) is committed as one group through the journal
(``group_commit.py``), on one thread: groups are durable in call order. While the store
closes, commits go straight to that thread, journaled while the journal is open.
"""

from __future__ import annotations

import asyncio
import contextlib
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
Waiting = tuple[list[Op], asyncio.Future[None]]
"""A call's ops and the future it awaits."""


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
        """Set when the store starts closing: commits no longer wait in the queue (unless calls not yet
        handed over wait there: then they keep their place behind them)."""
        self.journal: Journal | None = None
        self._queue: list[Waiting] = []
        """Each waiting call's ops and the future it awaits (one per call, not per op)."""
        self._idle = asyncio.Event()
        self._idle.set()
        self._just_settled = False
        """A group was settled and the loop's next turn has not ended: its callers resume in that turn
        and often save again at once."""
        self._delayed: asyncio.TimerHandle | None = None
        """The hand-over of a group waiting out ``batch_delay``."""
        self._held: dict[Path, bytes | None] = {}
        """The journal's held small values; kept after the journal is gone while the store closes
        (a final checkpoint that failed or was skipped leaves them newer than their files)."""
        self._last_writer: dict[Path, asyncio.Task[None]] = {}
        """``always``: the newest call writing each file; the next call writing it waits for it."""

    def reset(self) -> None:
        """Get ready for commits (the store is opening)."""
        self.closing = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._just_settled = False
        self._delayed = None
        self._queue = []  # calls of a loop that closed before they were answered: nobody awaits them
        self._held = {}
        self._last_writer = {}

    def held_value(self, path: Path) -> bytes | NotHeld | None:
        """A small value's newest content while its file is older (None: erased), else ``NOT_HELD``."""
        return self._held.get(path, NOT_HELD)

    async def start(self, journal: Journal) -> None:
        """Start ``batch``'s journal; groups are committed from then on."""
        self.journal = journal
        self._held = journal.held
        await asyncio.to_thread(journal.start)

    async def commit(self, ops: list[Op]) -> None:
        """Make ``ops`` durable per the fsync policy; raise the first op's error."""
        # while closing, a call joins only calls not yet handed over (so it keeps its place after them);
        # else it goes to the commit thread at once, behind any group in flight there
        if self.batched and (not self.closing or self._queue):
            loop = asyncio.get_running_loop()
            future: asyncio.Future[None] = loop.create_future()
            self._queue.append((ops, future))
            if not self._busy:
                if self._just_settled:  # the callers of the group just settled resume in this turn: they join
                    self._idle.clear()
                    loop.call_soon(self._next_group)
                else:
                    self._next_group()
            await future
            return
        if self.journal is not None:  # closing: serial with the final checkpoint, on its thread
            direct = await _on_commit_thread(functools.partial(_apply_closing, self.journal, ops))
        elif self.batched:  # the journal is gone (closed): still one call at a time, in order
            await _on_commit_thread(functools.partial(apply_ops, ops))
            direct = True
        else:
            await self._in_turn(ops)
            direct = True
        if direct:  # these files are newer than any value the journal held for them
            for op in ops:
                if op.kind == "replace" and op.error is None:
                    self._held.pop(op.path, None)
        for op in ops:
            if op.error is not None:
                raise op.error

    async def _in_turn(self, ops: list[Op]) -> None:
        """``always``: write ``ops`` on a worker thread once every earlier call writing one of their files
        is done. A cancelled caller stops waiting, not the writing (its thread cannot be stopped), and
        the next writer of those files still waits for it."""
        paths = {op.path for op in ops}
        earlier = {self._last_writer[path] for path in paths if path in self._last_writer}
        writer = asyncio.get_running_loop().create_task(_write_after(earlier, ops))
        for path in paths:
            self._last_writer[path] = writer

        def done(task: asyncio.Task[None]) -> None:
            for path in paths:
                if self._last_writer.get(path) is task:
                    del self._last_writer[path]
            if not task.cancelled():
                task.exception()  # retrieved: a cancelled caller's failure is not logged as unretrieved

        writer.add_done_callback(done)
        await asyncio.shield(writer)

    async def checkpoint(self) -> None:
        """``batch``: checkpoint the journal now (the files written are fsynced and the journal file
        that recorded their bytes is deleted); nothing without a journal open."""
        journal = self.journal
        if journal is None or not journal.is_open:
            return
        # on the commit thread: never beside a group commit
        await _on_commit_thread(journal.checkpoint)

    async def write_unwritten(self, conversation_id: str) -> None:
        """``batch``: write the lines a full disk kept from the conversation's log (``group_commit.py``),
        on the commit thread; raise OSError while they still cannot be written. Nothing when none wait."""
        journal = self.journal
        if journal is None or journal.blocked_conversation(conversation_id) is None:
            return
        await _on_commit_thread(journal.write_unwritten)
        error = journal.blocked_conversation(conversation_id)
        if error is not None:
            raise error

    async def stop(self) -> None:
        """Commit what is queued, then checkpoint the journal a last time (it is deleted).

        A failed final checkpoint keeps the journal: the next open replays it.
        """
        self.closing = True
        if self._delayed is not None:  # a group waiting out batch_delay goes now
            self._delayed.cancel()
            self._delayed = None
            self._hand_over()
        await self._idle.wait()
        if self.journal is not None:
            journal = self.journal
            try:
                await _on_commit_thread(functools.partial(journal.checkpoint, final=True))
            except OSError:
                log.exception("journal_checkpoint_failed")  # kept: the next open replays it
                journal.close()
            self.journal = None

    # -- group commit ---------------------------------------------------------------------------
    #
    # Appends arriving while a group is being committed share the next one; each group costs one
    # fsync of the journal. A group is handed to the commit thread by the call that finds the
    # committer idle (no turn of a task of its own in between), and the thread hands the outcome
    # back with one callback: a commit's latency is the thread's work plus two wake-ups. One
    # exception: in the turn of the loop after a group was settled, its callers resume and often save
    # again at once (many writers), so a call then waits for the end of that turn and the others
    # join its group (one fsync, not two). A waiting append is delayed by at most the group
    # in flight plus ``batch_delay``.

    @property
    def _busy(self) -> bool:
        return not self._idle.is_set()

    def _next_group(self) -> None:
        """Commit what is queued as the next group (after ``batch_delay``), or become idle."""
        if not self._queue:
            self._idle.set()
            return
        self._idle.clear()
        if self.batch_delay > 0 and not self.closing:
            self._delayed = asyncio.get_running_loop().call_later(self.batch_delay, self._hand_over)
        else:
            self._hand_over()

    def _hand_over(self) -> None:
        """Give the queued calls to the commit thread as one group."""
        loop = asyncio.get_running_loop()
        self._delayed = None
        batch, self._queue = self._queue, []
        ops = [op for call, _ in batch for op in call]
        journal = self.journal

        def work() -> None:  # on the commit thread
            error: BaseException | None = None
            try:
                if journal is not None:
                    apply_journaled(journal, ops)
                else:
                    apply_ops(ops)
            except BaseException as exc:  # a bug in a commit stage: the group fails, committing goes on
                error = exc
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                loop.call_soon_threadsafe(self._group_done, batch, error)

        try:
            commit_thread().submit(work)
        except RuntimeError as exc:  # the thread is gone (interpreter shutting down)
            self._group_done(batch, exc)

    def _group_done(self, batch: list[Waiting], error: BaseException | None) -> None:
        """On the loop: settle the group's waiters, checkpoint a full journal, go on with the queue
        (whatever happens here: a queue left waiting would never be handed over)."""
        try:
            if error is not None:
                log.error("group_commit_failed", exc_info=error)
                _settle(batch, error)
                return
            for call, future in batch:
                if not future.done():
                    failed = next((op.error for op in call if op.error is not None), None)
                    if failed is not None:
                        future.set_exception(failed)
                    else:
                        future.set_result(None)
            journal = self.journal
            if journal is not None and journal.size > JOURNAL_LIMIT:
                # on the commit thread, before the next group (the thread is serial)
                try:
                    commit_thread().submit(_checkpoint_logged, journal)
                except RuntimeError:  # the thread is gone (interpreter shutting down): the journal stays
                    log.exception("journal_checkpoint_failed")
        finally:
            self._next_group()
            if not self._busy:
                self._just_settled = True
                asyncio.get_running_loop().call_soon(self._settled_turn_over)

    def _settled_turn_over(self) -> None:
        self._just_settled = False


async def _write_after(earlier: set[asyncio.Task[None]], ops: list[Op]) -> None:
    if earlier:
        await asyncio.wait(earlier)
    await asyncio.to_thread(apply_ops, ops)


def _checkpoint_logged(journal: Journal) -> None:
    """A full journal's checkpoint, on the commit thread; a failure is logged (nobody awaits it)."""
    try:
        journal.checkpoint()
    except Exception:
        log.exception("journal_checkpoint_failed")  # the journal keeps covering them


def _settle(batch: list[Waiting], exc: BaseException) -> None:
    """Fail every waiter of the group not yet answered."""
    for _, future in batch:
        if not future.done():
            future.set_exception(exc)
