"""Which errors of the PostgreSQL driver say that the database does not answer, or refuses statements for
now (read-only, out of space, a statement cancelled: :func:`refused_for_now`), and their translation into
:class:`~tenex_daemon.core.errors.StoreUnavailableError` (what the control API answers 503 for, and the
logs write in one line); a connection given back to its pool without raising over its block
(:func:`acquired`); what the store says when it cannot connect at all (:class:`PostgresOpenError`,
:func:`connect_failure`), its dsn shown with the passwords hidden (:func:`shown_dsn`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import structlog

from tenex_daemon.core.errors import StoreTooNewError, StoreUnavailableError, TenexError

log = structlog.get_logger(__name__)

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
"""What the driver's own protocol error says when its connection cannot be used any more: it failed (the
"failed" state a lost connection leaves), or the server ended the session mid-statement and the next
statement came before the loss was seen (the state of the one cut off: "another operation (N) is in
progress"); such a connection is never used again (a pool's reset fails and cuts it, :func:`unlock` cuts
a lock's), so the call tried again gets another. Two coroutines using one connection at once, a
programming error, are another error (``InterfaceError``: "cannot perform operation: another operation is
in progress", not matched: it passes with its traceback); the same words as here come of it only while a
COPY streams, and this adapter copies nothing and never shares a connection between coroutines (each
call acquires its own from a pool; a lease's is used by the task holding it, one statement at a time)."""


_REFUSED_FOR_NOW: tuple[tuple[type[asyncpg.PostgresError], str], ...] = (
    (asyncpg.ReadOnlySQLTransactionError, "is read-only (a standby, or default_transaction_read_only on)"),
    (asyncpg.DiskFullError, "is out of disk space"),
    (asyncpg.TooManyConnectionsError, "has too many connections"),
    (asyncpg.InsufficientResourcesError, "is out of resources"),
    (asyncpg.LockNotAvailableError, "gave up waiting for a lock"),
    (asyncpg.QueryCanceledError, "cancelled the statement"),
)
"""The server's errors that say the database refuses the statement for now, not that the statement is
wrong, and what each says of the database: read-only (25006: a failover to a standby,
``default_transaction_read_only``), out of disk space, memory or connections (class 53), a lock waited
for past ``lock_timeout`` (55P03), a statement cancelled (57014: ``statement_timeout``,
``pg_cancel_backend``). Its transaction is rolled back whole; the call may be made again (an operator
may have to act first: free disk space, point the dsn at the new primary)."""


def refused_for_now(error: BaseException) -> str | None:
    """What the database is, when ``error`` says it refuses the statement for now
    (:data:`_REFUSED_FOR_NOW`: "is read-only ...", "is out of disk space", ...); else None."""
    for kind, what in _REFUSED_FOR_NOW:
        if isinstance(error, kind):
            return what
    return None


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


class PostgresOpenError(TenexError):
    """The database named by ``storage.dsn`` cannot be reached, or refuses the connection or the schema."""


class SchemaTooNewError(PostgresOpenError, StoreTooNewError):
    """The database's schema was migrated by a newer tenexd (:meth:`PostgresStore.migrate`)."""


def shown_dsn(dsn: str) -> str:
    """``dsn`` as it may be shown: a password, in the address or as a parameter (``password``,
    ``sslpassword``), is ``***``."""
    parts = urlsplit(dsn)
    shown = dsn
    if parts.password is not None:
        host = parts.netloc.rpartition("@")[2]
        shown = shown.replace(parts.netloc, f"{parts.username or ''}:***@{host}", 1)
    if parts.query:
        names = [pair.partition("=")[0] for pair in parts.query.split("&")]
        pairs = zip(names, parts.query.split("&"), strict=True)
        query = "&".join(f"{name}=***" if "password" in name else pair for name, pair in pairs)
        shown = shown.replace("?" + parts.query, "?" + query, 1)
    return shown


def connect_failure(error: BaseException, dsn: str, doing: str) -> BaseException:
    """What to raise for ``error``, met ``doing`` something (a name held, a channel listened on) on a
    connection of its own that could not be made or kept at its first try, naming the database (its
    passwords hidden, :func:`shown_dsn`) and the driver's reason: :class:`StoreUnavailableError` when the
    database does not answer (refused, reset, starting up, shut down) or refuses for now (too many
    connections, :func:`refused_for_now`), :class:`PostgresOpenError` when it refuses (no such database, a
    failed login, a dsn it cannot read). A statement's own timeout and every other error are returned as
    they are."""
    if isinstance(error, TimeoutError | TenexError) or not isinstance(error, Exception):
        return error
    reason = str(error) or type(error).__name__
    where = f"cannot {doing}: the PostgreSQL store at {shown_dsn(dsn)}"
    translated: Exception
    if isinstance(error, UNAVAILABLE) or lost_connection(error):
        translated = StoreUnavailableError(f"{where} does not answer: {reason}")
    elif (what := refused_for_now(error)) is not None:
        translated = StoreUnavailableError(f"{where} {what}: {reason}")
    elif isinstance(error, asyncpg.PostgresError | ValueError):
        translated = PostgresOpenError(f"{where} refuses: {reason}")
    else:
        return error
    translated.__cause__ = error
    return translated


@contextmanager
def unavailable_as_store_error() -> Iterator[None]:
    """Raise an error of the block that says the database does not answer (refused, reset, restarting,
    shut down, a connection the driver can no longer use) or refuses for now (read-only, out of space or
    connections, a statement cancelled: :func:`refused_for_now`) as :class:`StoreUnavailableError`, naming
    the driver's reason; a statement's own timeout and every other error pass as they are."""
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
    except asyncpg.PostgresError as exc:
        what = refused_for_now(exc)
        if what is None:
            raise
        raise StoreUnavailableError(f"the PostgreSQL store {what}: {exc}") from exc


@asynccontextmanager
async def acquired(pool: Any) -> AsyncIterator[Any]:
    """A connection of ``pool`` for the block, given back after it; a database that does not answer when
    it is asked for is :class:`StoreUnavailableError` (the block's own errors pass as they are). A
    connection that cannot be given back (its reset fails: the server ended its session meanwhile) is
    cut and logged, never raised over the block's result or its own error (:func:`given_back`)."""
    with unavailable_as_store_error():
        conn = await pool.acquire()
    try:
        yield conn
    finally:
        await given_back(pool, conn)


async def given_back(pool: Any, conn: Any) -> None:
    """Give ``conn`` back to ``pool``. asyncpg resets a connection given back (its locks, its settings); a
    reset that fails (a session the server has just ended: "connection was closed in the middle of
    operation", "cannot switch to state ...") is logged as a warning and the connection cut, so what its
    block did, a write committed, is never reported as failed for it. A cancellation passes."""
    try:
        await pool.release(conn)
    except Exception as error:
        log.warning("postgres_release_failed", error=repr(error))
        try:
            conn.terminate()  # asyncpg cuts it too: its session ends, and every lock with it
        except asyncpg.InterfaceError:
            log.debug("postgres_connection_already_released")
