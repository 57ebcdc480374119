"""The one background-task helper: every task tenexd starts beside its caller goes through it.

A :class:`BackgroundTasks` keeps a reference to each task (so none is garbage-collected while it
runs), logs a failure with the name its caller gave it, and lets its owner wait for the tasks or
cancel them on stop (no orphan tasks, docs/STYLE.md).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

import structlog

from tenex_daemon.runtime.failures import log_failure

log = structlog.get_logger(__name__)

T = TypeVar("T")


class BackgroundTasks:
    """A set of tracked tasks, named by their owner (``owner`` prefixes each task's name in logs)."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def __bool__(self) -> bool:
        return bool(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, T], name: str, *, log_failure: bool = True) -> asyncio.Task[T]:
        """Run ``coro`` as a tracked task; its failure is logged (``background_task_failed``) unless
        ``log_failure`` is False (the coroutine logs its own failures)."""
        task = asyncio.create_task(coro, name=f"{self.owner}: {name}")
        self._tasks.add(task)
        task.add_done_callback(self._done if log_failure else self._forget)
        return task

    def _forget(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: its coroutine logged it

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            log_failure(log, "background_task_failed", error, task=task.get_name())

    def snapshot(self) -> set[asyncio.Task[Any]]:
        """The tasks still running now."""
        return set(self._tasks)

    async def wait(self, timeout_s: float | None = None) -> int:
        """Wait up to ``timeout_s`` for the tasks running now; return how many are still running."""
        if not self._tasks:
            return 0
        _, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
        return len(pending)

    async def gather(self) -> None:
        """Wait for every task running now, whatever its outcome (failures were logged)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def cancel_all(self) -> int:
        """Cancel every task and wait until they have ended; return how many there were."""
        tasks = set(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        return len(tasks)


async def unless_set(event: asyncio.Event, step: Coroutine[Any, Any, T]) -> T | None:
    """``step``'s result, or None once ``event`` is set first (``step`` then cancelled, and waited for); an
    error of ``step`` is raised as it is."""
    if event.is_set():
        step.close()
        return None
    task, happened = asyncio.ensure_future(step), asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait((task, happened), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waited in (task, happened):
            if not waited.done():
                waited.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await waited
    return None if task.cancelled() else task.result()
