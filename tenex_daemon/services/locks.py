"""Per-key asyncio locks (one writer per conversation, no unbounded growth), and the lock order.

The lock order, the one place it is written down. A task that holds a lock may take only locks
further down this list, so no two tasks ever wait on each other:

0. ``Stopper``'s per-conversation lock (one stop at a time), taken outside any run: a stop waits
   under it for the runs it cancels to end, and no run ever takes it.
1. ``RunScheduler``'s per-conversation run slot (one agent run at a time in a conversation), then the
   global cap (a semaphore), then, with daemons sharing a database, the conversation's run lease across
   daemons (``run:<id>``, tried without waiting: while another daemon holds it, the run gives its place
   under the cap back and tries again, holding neither).
2. ``Delegation``'s per-thread lock (one ``send_message`` exchange at a time between two agents in
   a conversation), taken inside a run.
3. ``ThreadManager``'s per-thread load lock (loading a delegation thread once); on a store daemons
   share, a thread's save takes the store's lease on ``thread:<id>`` under it, with nothing under that.
4. ``ConversationLifecycle``'s per-channel or per-task lock, with the store's lease on the same key
   (``channel.<key>``, ``task.<id>``), taken when a person's kind-1 note or a task's event picks its
   conversation, and the dispatcher's per-root lock with the lease on ``adopted_root.<id>``, taken when a
   reply whose root is missing starts its thread's conversation, and by a run whose private answer points
   its channel to the conversation (and a start's redispatch); nothing but the manager's steps (5, 6) is
   taken under them. The dispatcher's
   per-conversation routing lock (one orchestrator decision at a time), taken
   when an event or a saved reply is routed, inside a run for replies.
5. ``ConversationManager``'s per-conversation lock, around one load -> change -> save step.
6. The store's lease on the conversation (``SmallValues.lease``: exclusive across daemons sharing a
   PostgreSQL database), always taken inside the manager's lock and held only for that step.

On PostgreSQL each held lease or name is a connection, so the pools follow this order too: names (a run
lease, a daemon's own) come from a pool of their own, with a place for each run under the cap, and the
leases of 4 and 6 from another, larger than the intake lanes and runs together (4 is the only lease held
around another, by one intake lane or run at most each), so a task holding a connection never waits for
good on its own pool.

``RunScheduler``'s journal lock is a leaf: it is held only around one store write of the journal
and nothing is taken under it but the store's own internal locks.
"""

from __future__ import annotations

import asyncio
from types import TracebackType


class KeyedLock:
    """An asyncio lock per key, created on first use and dropped when nobody holds or waits."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    def __len__(self) -> int:
        return len(self._locks)

    def hold(self, key: str) -> _Held:
        """Hold the lock for ``key`` for the duration of the ``async with`` block."""
        return _Held(self._locks, key)


class _Held:
    """One ``async with keyed.hold(key)``: a plain context manager rather than a generator's, since the
    reply path takes these locks about ten times per reply."""

    __slots__ = ("_key", "_lock", "_locks")

    def __init__(self, locks: dict[str, tuple[asyncio.Lock, int]], key: str) -> None:
        self._locks = locks
        self._key = key
        self._lock: asyncio.Lock | None = None

    async def __aenter__(self) -> None:
        lock, users = self._locks.get(self._key, (None, 0))
        if lock is None:
            lock = asyncio.Lock()
        self._locks[self._key] = (lock, users + 1)  # counted while waiting too: the lock stays in the map
        self._lock = lock
        try:
            await lock.acquire()
        except BaseException:
            self._leave()
            raise

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        assert self._lock is not None
        self._lock.release()
        self._leave()

    def _leave(self) -> None:
        lock, users = self._locks[self._key]
        if users <= 1:
            del self._locks[self._key]
        else:
            self._locks[self._key] = (lock, users - 1)
