"""What the PostgreSQL store raises when a connection of its own fails at its first try (connect_failure),
and how it lets go of a lock on a connection whose protocol is out of step with the server (unlock)."""

from __future__ import annotations

import asyncpg
import pytest
from structlog.testing import capture_logs

from tenex_daemon.adapters.storage.postgres_errors import PostgresOpenError, connect_failure
from tenex_daemon.adapters.storage.postgres_sessions import unlock
from tenex_daemon.core.errors import StoreUnavailableError

DSN = "postgresql://u:hunter2@db.example:6543/tenex"


@pytest.mark.parametrize(
    "error",
    [
        ConnectionRefusedError(111, "Connect call failed ('10.0.0.1', 6543)"),
        asyncpg.CannotConnectNowError("the database system is starting up"),
        asyncpg.InternalClientError('cannot switch to state 14; protocol is in the "failed" state'),
    ],
)
def test_a_first_connection_the_database_does_not_answer_is_a_store_unavailable_error(
    error: Exception,
) -> None:
    """Refused, starting up or lost: StoreUnavailableError saying what was tried, on which database (its
    password hidden) and the driver's reason, caused by the driver's error."""
    failure = connect_failure(error, DSN, "hold the name 'd1'")

    assert isinstance(failure, StoreUnavailableError)
    assert str(failure) == (
        f"cannot hold the name 'd1': the PostgreSQL store at postgresql://u:***@db.example:6543/tenex "
        f"does not answer: {error}"
    )
    assert failure.__cause__ is error


@pytest.mark.parametrize(
    "error",
    [
        asyncpg.InvalidPasswordError('password authentication failed for user "u"'),
        asyncpg.InvalidCatalogNameError('database "tenex" does not exist'),
        ValueError("invalid port '65x3'"),
    ],
)
def test_a_first_connection_the_database_refuses_is_a_postgres_open_error(error: Exception) -> None:
    """A failed login, a database that does not exist or a dsn the driver cannot read: PostgresOpenError
    naming the database (its password hidden) and the reason, caused by the driver's error."""
    failure = connect_failure(error, DSN, "listen on 'tenexd_stop_x'")

    assert isinstance(failure, PostgresOpenError)
    assert str(failure) == (
        f"cannot listen on 'tenexd_stop_x': the PostgreSQL store at postgresql://u:***@db.example:6543/tenex "
        f"refuses: {error}"
    )
    assert "hunter2" not in str(failure)
    assert failure.__cause__ is error


@pytest.mark.parametrize(
    "error",
    [
        TimeoutError(),
        asyncpg.InterfaceError("cannot perform operation: another operation is in progress"),
        KeyError("a defect"),
        StoreUnavailableError("the PostgreSQL store does not answer: down"),
    ],
)
def test_a_timeout_a_misuse_or_a_defect_at_the_first_try_passes_as_it_is(error: Exception) -> None:
    """A lock's wait that timed out (the daemon's name held elsewhere), two statements at once on one
    connection, a defect or an error already the project's own are returned unchanged."""
    assert connect_failure(error, DSN, "hold the name 'd1'") is error


class OutOfStep:
    """A connection whose protocol is out of step with the server: every statement fails as asyncpg's
    "cannot switch to state" (a session the server ended mid-statement, the loss not seen yet)."""

    def __init__(self) -> None:
        self.terminated = False

    async def execute(self, *args: object, **kwargs: object) -> str:
        """Fail as such a connection does."""
        raise asyncpg.InternalClientError("cannot switch to state 14; another operation (2) is in progress")

    def terminate(self) -> None:
        """Close at once, from this side."""
        self.terminated = True


async def test_a_lock_on_a_connection_out_of_step_is_let_go_by_cutting_the_connection() -> None:
    """unlock() on a connection that fails as "cannot switch to state" cuts the connection (its session,
    and the lock, end with it) and raises nothing over the lease's own error."""
    conn = OutOfStep()

    await unlock(conn, "conversation")

    assert conn.terminated


class _SilentConnection:
    """A connection whose statements time out; records whether it was cut."""

    def __init__(self) -> None:
        self.terminated = False

    async def execute(self, *args: object, **kwargs: object) -> None:
        """Time out, as a server that no longer answers does."""
        raise TimeoutError

    def terminate(self) -> None:
        """Record the cut."""
        self.terminated = True


async def test_a_lock_whose_connection_does_not_answer_is_let_go_as_silent_and_cut() -> None:
    """An unlock that times out is logged as a silent connection (not a broken one: a TimeoutError is an
    OSError too, and was taken for one) and the connection is cut."""
    conn = _SilentConnection()
    with capture_logs() as logs:
        await unlock(conn, "lease:x")

    assert conn.terminated
    assert [(e["event"], e["reason"]) for e in logs] == [("postgres_unlock_skipped", "connection_silent")]


def test_a_first_connection_refused_for_too_many_connections_is_a_store_unavailable_error() -> None:
    """A server with no connection left (class 53) is StoreUnavailableError saying so, naming the database
    (its password hidden) and the server's reason (before: PostgresOpenError, as a failed login is)."""
    error = asyncpg.TooManyConnectionsError("sorry, too many clients already")

    failure = connect_failure(error, DSN, "hold the name 'd1'")

    assert isinstance(failure, StoreUnavailableError)
    assert str(failure) == (
        "cannot hold the name 'd1': the PostgreSQL store at postgresql://u:***@db.example:6543/tenex "
        "has too many connections: sorry, too many clients already"
    )
    assert failure.__cause__ is error


class _Refusing:
    """A connection whose statements fail as ``error``; records whether it was cut."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.terminated = False

    async def execute(self, *args: object, **kwargs: object) -> str:
        """Fail as ``error``."""
        raise self.error

    def terminate(self) -> None:
        """Record the cut."""
        self.terminated = True


@pytest.mark.parametrize(
    "error",
    [
        asyncpg.AdminShutdownError("terminating connection due to administrator command"),
        asyncpg.QueryCanceledError("canceling statement due to user request"),
    ],
)
async def test_a_lock_whose_unlock_the_server_ends_or_cancels_is_let_go_by_cutting_the_connection(
    error: Exception,
) -> None:
    """unlock() whose statement the server answers by ending the session (a restart) or cancelling it cuts
    the connection (its session, and the lock, end with it) and raises nothing over the lease's block
    (before: the driver's error)."""
    conn = _Refusing(error)

    await unlock(conn, "conversation")

    assert conn.terminated
