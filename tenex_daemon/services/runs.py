"""Scheduling agent runs: one at a time per conversation, a global cap, no orphan tasks,
and a durable journal so a run accepted before a crash is carried out after the restart.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, replace

import structlog

from tenex_daemon.core.ports import ConversationStore
from tenex_daemon.services.locks import KeyedLock

log = structlog.get_logger(__name__)

PENDING_RUNS_KEY = "runs.pending"
FINISHED_FLUSH_S = 1.0
"""A finished run is dropped from the stored journal within this long (with any write sooner)."""


@dataclass(frozen=True, slots=True)
class RunRequest:
    """An agent to run for a trigger in a conversation."""

    conversation_id: str
    trigger_id: str
    agent_slug: str
    via_orchestrator: bool = False
    recovered: bool = False
    """Redone after a restart: the previous process may have saved its reply already."""


RunFunction = Callable[[RunRequest], Awaitable[None]]


class RunScheduler:
    """Runs agents concurrently across conversations and serially within one.

    Every accepted request is journaled in the store (``runs.pending``) as it is scheduled,
    so :meth:`recover` can redo what a crash interrupted. A finished run leaves
    the journal with the next write, at the latest ``FINISHED_FLUSH_S`` later (or at
    :meth:`drain`): it needs no write of its own, because a recovered run whose agent
    already replied to its trigger is skipped. Journal writes are coalesced: a change waits
    for the write in flight, then one write covers every change made meanwhile. At most
    ``max_concurrent`` runs execute at once.
    """

    def __init__(self, store: ConversationStore, run: RunFunction, max_concurrent: int = 8) -> None:
        self._store = store
        self._run = run
        self._semaphore = asyncio.Semaphore(max_concurrent)
        self._conversation_locks = KeyedLock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._pending: dict[str, RunRequest] = {}
        self._journal_lock = asyncio.Lock()
        self._journal_version = 0
        """Bumped by every change to ``_pending``."""
        self._journal_written = 0
        """The version the stored journal holds."""
        self._accepting = True
        self._flush_task: asyncio.Task[None] | None = None
        self._writes: set[asyncio.Task[None]] = set()
        self.running = 0
        self.completed = 0
        self.failed = 0

    @staticmethod
    def _key(request: RunRequest) -> str:
        return f"{request.conversation_id}:{request.trigger_id}:{request.agent_slug}"

    @property
    def in_flight(self) -> int:
        """Runs scheduled and not finished (waiting or running)."""
        return len(self._tasks)

    async def _persist_journal(self) -> None:
        """Return once the stored journal holds every change made before this call."""
        self._journal_version += 1
        wanted = self._journal_version
        async with self._journal_lock:
            if self._journal_written >= wanted:
                return  # a write that started after this change already covered it
            version = self._journal_version
            payload = json.dumps([asdict(r) for r in self._pending.values()], separators=(",", ":"))
            await self._store.set_meta(PENDING_RUNS_KEY, payload)
            self._journal_written = version

    async def submit(self, request: RunRequest) -> bool:
        """Schedule a run and start its journal write; False when shutting down or already scheduled."""
        if not self._accepting:
            return False
        key = self._key(request)
        if key in self._pending:
            return False
        self._pending[key] = request
        # The run starts at once and the journal write goes on beside it: the run's first store
        # write (the agent's state) then shares a group commit with it instead of queueing behind
        # it, and the caller (an intake lane) is free again. The trigger is already accepted, so
        # waiting would shorten no crash window; a failed write is logged and the run goes on.
        self._spawn(request)
        self._write_journal_soon()
        return True

    def _write_journal_soon(self) -> None:
        task = asyncio.create_task(self._persist_journal_logged(), name="run journal write")
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _persist_journal_logged(self) -> None:
        try:
            await self._persist_journal()
        except Exception:
            log.exception("run_journal_write_failed")

    async def journaled(self) -> None:
        """Return once every run submitted so far is in the stored journal (or its write failed)."""
        if self._writes:
            await asyncio.gather(*self._writes)

    def _spawn(self, request: RunRequest) -> None:
        task = asyncio.create_task(
            self._execute(request), name=f"run {request.agent_slug} {request.conversation_id[:8]}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _execute(self, request: RunRequest) -> None:
        log_ctx = log.bind(
            conversation_id=request.conversation_id, event_id=request.trigger_id, agent=request.agent_slug
        )
        try:
            async with self._conversation_locks.hold(request.conversation_id), self._semaphore:
                self.running += 1
                try:
                    await self._run(request)
                    self.completed += 1
                finally:
                    self.running -= 1
        except asyncio.CancelledError:
            log_ctx.warning("run_cancelled", reason="shutdown")
            raise
        except Exception:
            self.failed += 1
            log_ctx.exception("run_failed")
        self._pending.pop(self._key(request), None)
        if self._flush_task is None:
            self._flush_task = asyncio.create_task(self._flush_finished(), name="run journal flush")

    async def _flush_finished(self) -> None:
        """Write the journal without the runs finished lately (they need no write of their own)."""
        await asyncio.sleep(FINISHED_FLUSH_S)
        self._flush_task = None
        self._write_journal_soon()  # tracked, so drain() waits for it

    async def recover(self) -> list[RunRequest]:
        """Schedule the runs a previous process journaled but did not finish; return them."""
        raw = await self._store.get_meta(PENDING_RUNS_KEY)
        if not raw:
            return []
        try:
            requests = [replace(RunRequest(**item), recovered=True) for item in json.loads(raw)]
        except (ValueError, TypeError):
            log.error("run_journal_unreadable", key=PENDING_RUNS_KEY)
            return []
        for request in requests:
            self._pending[self._key(request)] = request
            self._spawn(request)
        if requests:
            log.info("runs_recovered", count=len(requests))
        return requests

    async def drain(self, grace_s: float) -> int:
        """Stop accepting, wait up to ``grace_s`` for runs, cancel the rest; return how many were cancelled.

        Cancelled runs stay in the journal and are redone by :meth:`recover` on the next start.
        """
        self._accepting = False
        await self.journaled()
        pending: set[asyncio.Task[None]] = set()
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=grace_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        flush, self._flush_task = self._flush_task, None
        if flush is not None:
            flush.cancel()
            await asyncio.gather(flush, return_exceptions=True)
            self._write_journal_soon()  # the runs finished since the last write leave it now
        await self.journaled()
        return len(pending)
