"""A run's conversation lease lost to another daemon (daemons sharing a database): the run is cancelled, and
the cancellation becomes :class:`RunLeaseLostError`, so the run is tried again once the lease is free
(:class:`~tenex_daemon.services.runs.RunScheduler`)."""

from __future__ import annotations

import asyncio


class RunLeaseLostError(RuntimeError):
    """Another daemon took a running run's conversation lease after a database restart: the run was
    cancelled, to be tried again once the lease is free."""

    def __init__(self, conversation_id: str) -> None:
        super().__init__(f"the run lease of conversation {conversation_id} was taken by another daemon")


class LeaseLoss:
    """A run's lease lost to another daemon: the task running the run is cancelled, and the
    cancellation becomes :class:`RunLeaseLostError`."""

    def __init__(self) -> None:
        self._task = asyncio.current_task()
        self.cancelled_run = False

    def cancel_run(self) -> None:
        """Cancel the run (its slot's block raises RunLeaseLostError in place of the cancellation)."""
        if self._task is not None:
            self.cancelled_run = True
            self._task.cancel()

    def only_cancellation(self) -> bool:
        """Take back this cancellation of the run, once it has ended the run's block; return whether it
        was the only one (no stop or shutdown asked the task to cancel too)."""
        if not self.cancelled_run or self._task is None:
            return False
        self.cancelled_run = False
        return self._task.uncancel() == 0
