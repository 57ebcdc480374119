"""How tenexd keeps its PostgreSQL sessions: advisory locks held on connections and checked until they
fail, sessions of its own ended before a lock is taken again, the server's keepalive on every connection,
and pools closed within a bound (docs/ARCHITECTURE.md, "Scale-out")."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import asyncpg
import structlog

from tenex_daemon.adapters.storage.postgres_errors import UNAVAILABLE

log = structlog.get_logger(__name__)

LEASE_SQL = "SELECT pg_advisory_lock(hashtextextended($1, 0))"
TRY_LEASE_SQL = "SELECT pg_try_advisory_lock(hashtextextended($1, 0))"
UNLEASE_SQL = "SELECT pg_advisory_unlock(hashtextextended($1, 0))"
_SESSION_COLUMNS = (
    "pg_backend_pid() AS pid, "
    "(SELECT backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()) AS started"
)
"""Which session a connection is: its process and when it started (a pid can be reused)."""
SESSION_SQL = f"SELECT {_SESSION_COLUMNS}"
TRY_KEPT_LEASE_SQL = f"SELECT pg_try_advisory_lock(hashtextextended($1, 0)) AS taken, {_SESSION_COLUMNS}"
"""Take a lock to keep, and say which session holds it."""
END_SESSION_SQL = (
    "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity WHERE pid = $1 AND backend_start = $2"
)
"""End a session and wait (up to 5 s) until it has exited, its locks released (PostgreSQL 14 and later)."""
NAME_CHECK_S = 1.0
"""How often the connection holding a daemon's name is checked (a broken one is replaced)."""
NAME_RETRY_S = 0.5
"""How soon a daemon tries to take its name again after its connection broke."""
CHECK_TIMEOUT_S = 5.0
"""A connection kept for listening, for a daemon's name or for a run's lease that does not answer a check
within this long is replaced."""
KEEPALIVE: dict[str, str] = {
    "tcp_keepalives_idle": "10", "tcp_keepalives_interval": "5", "tcp_keepalives_count": "3"
}
"""The server's TCP keepalive on every connection tenexd opens: a daemon whose machine died without
closing its connections (power lost, network cut) has its sessions ended by the server within about
25 s, and its locks (its name, its run and conversation leases) freed with them, where the server's
default (the kernel's) waits over two hours. Unix-socket connections have none."""
SOCKET_KEEPALIVE: tuple[tuple[str, str, int], ...] = (
    ("SOL_SOCKET", "SO_KEEPALIVE", 1),
    ("IPPROTO_TCP", "TCP_KEEPIDLE", 10),
    ("IPPROTO_TCP", "TCP_KEEPINTVL", 5),
    ("IPPROTO_TCP", "TCP_KEEPCNT", 3),
    ("IPPROTO_TCP", "TCP_USER_TIMEOUT", 25_000),
)
"""The same keepalive on this side's socket of every connection, with a bound (25 s) on data the server
does not acknowledge: a statement sent over a network that stopped carrying it fails (the connection is
closed, ``ConnectionDoesNotExistError``) within about 25 s instead of waiting for an answer forever. A
healthy server answers the probes, so a long statement (a lock waited for) is never cut. Options the
platform lacks are left out."""
LISTENER_PREFIX = "tenexd listen "
"""How the ``application_name`` of a connection that listens for the other daemons' messages starts
(the channel follows, :func:`listener_name`)."""


def listener_name(channel: str) -> str:
    """The ``application_name`` of a connection listening on ``channel`` (what ``pg_stat_activity`` shows,
    and how :meth:`PostgresStore.hearers` counts them)."""
    return f"{LISTENER_PREFIX}{channel}"


def keep_alive(conn: Any) -> None:
    """Set :data:`SOCKET_KEEPALIVE` on ``conn``'s socket (a TCP one: a Unix socket has none)."""
    sock = conn._transport.get_extra_info("socket")  # asyncpg names no public way to its socket
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    for level, option, value in SOCKET_KEEPALIVE:
        if hasattr(socket, option):
            sock.setsockopt(getattr(socket, level), getattr(socket, option), value)


async def keep_alive_on_connect(conn: Any) -> None:
    """A pool's ``init``: :func:`keep_alive` on each connection it opens."""
    keep_alive(conn)


async def unlock(conn: Any, name: str) -> None:
    """Release ``name``'s advisory lock on ``conn``; a broken connection already dropped it, and one that
    does not answer within ``CHECK_TIMEOUT_S`` is cut from this side (a server still holding its session
    keeps the lock until it notices the connection gone: TCP keepalive)."""
    try:
        await conn.execute(UNLEASE_SQL, name, timeout=CHECK_TIMEOUT_S)
    except TimeoutError:  # first: a TimeoutError is an OSError too
        log.warning("postgres_unlock_skipped", name=name, reason="connection_silent")
        terminate(conn)
    except (*UNAVAILABLE, asyncpg.InterfaceError, asyncpg.InternalClientError):
        # broken, busy with a statement a cancellation cut short, its session ended by the server as the
        # statement ran (AdminShutdownError: a restart, pg_terminate_backend), or its protocol out of step
        # with the server ("cannot switch to state": a session the server ended mid-statement): never
        # given back to the pool so, nor its error raised over the block's
        log.info("postgres_unlock_skipped", name=name, reason="connection_broken")
        terminate(conn)
    except asyncpg.PostgresError as error:  # refused (the statement cancelled): cut, so the lock ends too
        log.warning("postgres_unlock_skipped", name=name, reason="refused", error=repr(error))
        terminate(conn)


async def end_session(conn: Any, session: tuple[int, Any]) -> None:
    """End one of this daemon's sessions whose connection failed, and wait (up to 5 s) for it to exit.
    A server that refuses (before PostgreSQL 14, or without the privilege) leaves it to end by itself:
    a lock it holds is then waited for, never taken from it."""
    try:
        await conn.fetch(END_SESSION_SQL, *session, timeout=2 * CHECK_TIMEOUT_S)
    except asyncpg.PostgresError as error:  # a refusal; a broken connection fails the next statement too
        log.warning("postgres_session_not_ended", pid=session[0], error=repr(error))


@dataclass
class KeptLock:
    """Where a kept lock is held now: the pool's connection it was taken on, or one of its own after
    a break (``own``, terminated at the end); ``conn`` None once lost. ``session``: the server process
    of the session holding it and when that started."""

    conn: Any
    session: tuple[int, Any]
    own: Any = None


@asynccontextmanager
async def keeping(
    keep: Callable[[asyncio.Future[None]], Coroutine[Any, Any, None]], name: str
) -> AsyncIterator[None]:
    """Run ``keep`` (it keeps a connection's lock or listening until cancelled) as a task for the whole
    block, entered once ``keep`` sets the future it is given (its exception: the first try failed)."""
    first: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    keeper = asyncio.create_task(keep(first), name=name)
    try:
        await asyncio.shield(first)
        yield
    finally:
        await cancelled(keeper)


async def hold_name(conn: Any, name: str, first: asyncio.Future[None], stale: list[tuple[int, Any]]) -> None:
    """Lock ``name`` on ``conn`` and check the connection every ``NAME_CHECK_S`` until a check fails
    (raised) or the keeper is cancelled. Every statement has a timeout, and a connection that failed
    or was cancelled is cut, never given back to the pool mid-statement."""
    try:
        row: Any = await conn.fetchrow(SESSION_SQL, timeout=CHECK_TIMEOUT_S)
        while stale:
            await end_session(conn, stale[0])
            stale.pop(0)
        stale.append((int(row["pid"]), row["started"]))  # a wait cut short may be granted later
        await conn.execute(LEASE_SQL, name, timeout=2 * CHECK_TIMEOUT_S)
        if not first.done():
            first.set_result(None)
        else:
            log.warning("postgres_name_taken_again", name=name)
        while True:  # a broken connection fails the next round trip, a silent one times out
            await asyncio.sleep(NAME_CHECK_S)
            await conn.fetchval("SELECT 1", timeout=CHECK_TIMEOUT_S)
    except BaseException:
        terminate(conn)  # its session ends with it (the name too), or is ended before the next try
        raise


async def close_pool(pool: Any) -> None:
    """Close a pool within ``CHECK_TIMEOUT_S``; past it every connection of the pool is cut."""
    try:
        await asyncio.wait_for(pool.close(), CHECK_TIMEOUT_S)
    except TimeoutError:
        log.warning("postgres_pool_cut", reason="its connections did not answer the close")
        pool.terminate()


def terminate(conn: Any) -> None:
    """Close a connection at once, from this side; one the pool already took back (its server session
    ended) is left to the pool."""
    try:
        conn.terminate()
    except asyncpg.InterfaceError:
        log.debug("postgres_connection_already_released")


async def cancelled(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` and wait until it has ended (a cancellation of the caller meanwhile still raises)."""
    task.cancel()
    await asyncio.wait([task])
    if not task.cancelled() and task.exception() is not None:
        log.warning("postgres_keeper_failed", task=task.get_name(), error=repr(task.exception()))
