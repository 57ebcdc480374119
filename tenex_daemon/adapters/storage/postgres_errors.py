"""Which errors of the PostgreSQL driver say that the database does not answer, and their translation into
:class:`~tenex_daemon.core.errors.StoreUnavailableError` (what the control API answers 503 for, and the
logs write in one line)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import asyncpg

from tenex_daemon.core.errors import StoreUnavailableError

UNAVAILABLE = (
    OSError,
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
)
"""What a query raises when the database does not answer (refused, reset, starting up, shut down); and
:func:`lost_connection`'s interface and client errors."""

_LOST_INTERFACE = ("closed", "closing", "released back to the pool")
"""What an interface error says when its connection or pool is gone."""
_LOST_CLIENT = ("cannot switch to state", "not connected")
"""What the driver's own protocol error says when its connection cannot be used any more: it failed, or
a statement cut short (cancelled, timed out) left it in the middle of another operation."""


def lost_connection(error: BaseException) -> bool:
    """Whether an asyncpg interface or client error says the connection or the pool is gone (the client's
    own misuses, a bad argument say, are errors of their own, with their tracebacks); a pool's connection
    that broke while held is "released back to the pool" by asyncpg (a lease's, when the database
    restarted)."""
    text = str(error)
    if type(error) is asyncpg.InterfaceError:
        return any(words in text for words in _LOST_INTERFACE)
    if type(error) is asyncpg.InternalClientError:
        return any(words in text for words in _LOST_CLIENT)
    return False


@contextmanager
def unavailable_as_store_error() -> Iterator[None]:
    """Raise an error of the block that says the database does not answer (refused, reset, restarting,
    shut down, a connection the driver can no longer use) as :class:`StoreUnavailableError`, naming the
    driver's reason; a statement's own timeout and every other error pass as they are."""
    try:
        yield
    except StoreUnavailableError:
        raise
    except TimeoutError:
        raise  # a statement's own timeout: its callers wait for it by that name
    except (*UNAVAILABLE, asyncpg.InterfaceError, asyncpg.InternalClientError) as exc:
        if isinstance(exc, asyncpg.InterfaceError | asyncpg.InternalClientError) and not lost_connection(exc):
            raise
        reason = str(exc) or type(exc).__name__
        raise StoreUnavailableError(f"the PostgreSQL store does not answer: {reason}") from exc


@asynccontextmanager
async def acquired(pool: Any) -> AsyncIterator[Any]:
    """A connection of ``pool`` for the block, given back after it; a database that does not answer when
    it is asked for is :class:`StoreUnavailableError` (the block's own errors pass as they are)."""
    with unavailable_as_store_error():
        conn = await pool.acquire()
    try:
        yield conn
    finally:
        await pool.release(conn)
