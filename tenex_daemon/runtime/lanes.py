"""A delivery lane's slot lent out while its event waits on something slow that holds none of what the
lanes' number bounds.

The relay pool hands events out in lanes, one key at a time each, at most ``daemon.intake_lanes`` at once:
that bounds the store's writes (and PostgreSQL's connections) intake makes together. An event whose
handling waits on a model (the orchestrator deciding where a message goes) or on the relays (the root of
a reply in an unknown thread) holds neither while it waits, yet it held its lane: sixteen slow routings
held every lane, and nobody's message was taken in until one ended. Inside :func:`outside_lane` the
lane's slot is given back and taken again after; the lane keeps its key, so its events still go one at a
time, in order.

The lane's task says how it lends (:func:`lend_with`); the context variable is inherited by tasks it
starts, so only that task itself lends, never a run it started that routes later.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from contextvars import ContextVar

Lend = Callable[[], AbstractAsyncContextManager[None]]
"""Gives a lane's slot back on entering, takes it again on leaving."""

_LENDER: ContextVar[tuple[asyncio.Task[object], Lend] | None] = ContextVar("lane_lender", default=None)


def lend_with(lend: Lend) -> None:
    """Make ``lend`` the current task's way of lending its lane's slot (called by the lane's task)."""
    task = asyncio.current_task()
    if task is not None:
        _LENDER.set((task, lend))


@asynccontextmanager
async def outside_lane() -> AsyncIterator[None]:
    """Lend the current lane's slot for the block (nothing outside a lane's own task)."""
    lender = _LENDER.get()
    if lender is None or lender[0] is not asyncio.current_task():
        yield
        return
    async with lender[1]():
        yield
