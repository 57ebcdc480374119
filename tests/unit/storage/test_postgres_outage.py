"""A PostgreSQL store whose database does not answer says so as one error: StoreUnavailableError (an
OSError), with the driver's reason, for what the control API answers 503 and the logs write in one line."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import asyncpg
import pytest
import structlog
from structlog.testing import capture_logs

from tenex_daemon.adapters.storage.postgres import PostgresStore
from tenex_daemon.core.errors import StoreUnavailableError
from tenex_daemon.runtime.failures import log_failure


class DownPool:
    """A pool whose every connection fails as ``error``."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    async def acquire(self) -> object:
        """Fail as the database does."""
        raise self.error


@pytest.mark.parametrize(
    "error",
    [
        ConnectionRefusedError(111, "Connect call failed"),
        asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
        asyncpg.CannotConnectNowError("the database system is starting up"),
        asyncpg.InterfaceError("cannot perform operation: connection is closed"),
        asyncpg.InternalClientError("cannot switch to state 14; another operation (2) is in progress"),
        asyncpg.InternalClientError('cannot switch to state 14; protocol is in the "failed" state'),
    ],
)
async def test_a_database_that_does_not_answer_is_a_store_unavailable_error(error: BaseException) -> None:
    """Refused, reset or starting up: the store's call raises StoreUnavailableError naming the reason."""
    store = PostgresStore("postgresql://u@127.0.0.1:1/db")
    store._pool = DownPool(error)  # type: ignore[assignment]

    with pytest.raises(StoreUnavailableError, match="the PostgreSQL store does not answer") as caught:
        await store.get_meta("outbox.pending")

    assert str(error) in str(caught.value)
    assert isinstance(caught.value, OSError)


async def test_a_statements_own_timeout_and_other_errors_pass_as_they_are() -> None:
    """A timeout keeps its name (callers wait for it by that name); a refusal of the statement itself (not
    the connection), and the client's own misuse (a bad argument), are no outage."""
    store = PostgresStore("postgresql://u@127.0.0.1:1/db")
    misuses = (
        asyncpg.DataError("invalid input for query argument $1"), asyncpg.InterfaceError("another op"),
        asyncpg.InternalClientError("no binary format encoder for type x"),
    )
    for error in (TimeoutError(), asyncpg.UniqueViolationError("duplicate key"), *misuses):
        store._pool = DownPool(error)  # type: ignore[assignment]
        with pytest.raises(type(error)):
            await store.get_meta("outbox.pending")


class Acquiring:
    """What asyncpg's ``Pool.acquire()`` gives: awaited, or entered as an async context manager."""

    def __init__(self, pool: LeasePool) -> None:
        self.pool = pool

    def __await__(self) -> Generator[Any, None, LeasePool]:
        return self.pool.connect().__await__()

    async def __aenter__(self) -> LeasePool:
        return await self.pool.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.pool.release(self.pool)


class LeasePool:
    """A lease or name pool: each connection it gives fails as ``error`` when asked for (None: it is given,
    and answers every statement)."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error
        self.released = 0

    def acquire(self) -> Acquiring:
        """Fail as the database does, or give a connection (the pool itself plays it)."""
        return Acquiring(self)

    async def connect(self) -> LeasePool:
        """Fail as the database does, or give a connection."""
        if self.error is not None:
            raise self.error
        return self

    async def release(self, conn: object) -> None:
        """Take the connection back."""
        self.released += 1

    async def execute(self, *args: object, **kwargs: object) -> str:
        """Answer a statement."""
        return "SELECT 1"

    async def fetchval(self, *args: object, **kwargs: object) -> bool:
        """Answer that the lock was free."""
        return True


@pytest.mark.parametrize(
    "error",
    [
        ConnectionRefusedError(111, "Connect call failed"),
        asyncpg.CannotConnectNowError("the database system is starting up"),
        asyncpg.InternalClientError("cannot switch to state 14; another operation (2) is in progress"),
    ],
)
async def test_a_lease_or_a_name_asked_of_a_database_that_does_not_answer_is_a_store_unavailable_error(
    error: BaseException,
) -> None:
    """A conversation's lease, and a name or run lease (try_take), asked while the database does not answer
    raise StoreUnavailableError naming the reason (the control API's 503): before, the driver's own error
    (a ConnectionRefusedError: a 500)."""
    store = PostgresStore("postgresql://u@127.0.0.1:1/db")
    store._lease_pool = store._name_pool = LeasePool(error)  # type: ignore[assignment]

    with pytest.raises(StoreUnavailableError, match="the PostgreSQL store does not answer") as caught:
        async with store.lease("conversation"):
            pass
    assert str(error) in str(caught.value)
    for on_lost in (None, lambda: None):
        with pytest.raises(StoreUnavailableError, match="the PostgreSQL store does not answer"):
            async with store.try_take("run lease", on_lost):
                pass


async def test_the_errors_of_a_lease_s_own_block_pass_as_they_are() -> None:
    """An error the block under a lease raises (an OSError of its own, say) is not taken for an outage, and
    the lease's connection is given back."""
    store = PostgresStore("postgresql://u@127.0.0.1:1/db")
    pool = LeasePool(None)
    store._lease_pool = store._name_pool = pool  # type: ignore[assignment]

    with pytest.raises(ConnectionRefusedError):
        async with store.lease("conversation"):
            raise ConnectionRefusedError(111, "the block's own")
    with pytest.raises(FileNotFoundError):
        async with store.try_take("name"):
            raise FileNotFoundError("the block's own")
    assert pool.released == 2


def test_an_outage_is_logged_in_one_line_and_a_defect_with_its_traceback() -> None:
    """log_failure writes a StoreUnavailableError as a warning without a traceback, anything else as an
    error with it."""
    log = structlog.get_logger("test")
    with capture_logs() as logs:
        log_failure(log, "run_journal_write_failed", StoreUnavailableError("the store does not answer: down"))
        log_failure(log, "run_journal_write_failed", KeyError("bug"))

    assert [(e["log_level"], "exc_info" in e) for e in logs] == [("warning", False), ("error", True)]
    assert logs[0]["error"] == "the store does not answer: down"


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (asyncpg.DiskFullError('could not extend file "base/1/2": No space left on device'), "is out of disk space"),
        (asyncpg.TooManyConnectionsError("sorry, too many clients already"), "has too many connections"),
        (asyncpg.OutOfMemoryError("out of memory"), "is out of resources"),
        (asyncpg.ConfigurationLimitExceededError("temporary file size exceeds temp_file_limit"), "is out of resources"),
    ],
)
async def test_a_database_out_of_space_memory_or_connections_is_a_store_unavailable_error(
    error: BaseException, said: str
) -> None:
    """A database out of disk space, memory or connections (class 53) makes the store's call raise
    StoreUnavailableError saying which and the server's reason (before: asyncpg's own error, a 500)."""
    store = PostgresStore("postgresql://u@127.0.0.1:1/db")
    store._pool = DownPool(error)  # type: ignore[assignment]

    with pytest.raises(StoreUnavailableError) as caught:
        await store.set_meta("outbox.pending", "[]")

    assert str(caught.value) == f"the PostgreSQL store {said}: {error}"
    assert caught.value.__cause__ is error


class UnreturnablePool(LeasePool):
    """A lease or name pool whose connections fail as asyncpg does when given back after the server ended
    their session (the reset cannot run); records whether the connection was cut."""

    def __init__(self) -> None:
        super().__init__(None)
        self.terminated = 0

    async def release(self, conn: object) -> None:
        """Fail the reset, as asyncpg does on a session the server has just ended."""
        self.released += 1
        raise asyncpg.InternalClientError("cannot switch to state 15; another operation (2) is in progress")

    def terminate(self) -> None:
        """Cut the connection."""
        self.terminated += 1


async def test_a_lease_whose_connection_cannot_be_given_back_raises_nothing_over_its_block() -> None:
    """A lease and a run lease whose connection's reset fails when given back end as their block did: a
    block that finished raises nothing, a block's StoreUnavailableError is raised as it is (before:
    asyncpg's InternalClientError replaced both); each connection is cut and a warning logged."""
    store = PostgresStore("postgresql://u@127.0.0.1:1/db")
    pool = UnreturnablePool()
    store._lease_pool = store._name_pool = pool  # type: ignore[assignment]

    with capture_logs() as logs:
        async with store.lease("conversation"):
            pass
        async with store.try_take("run lease") as taken:
            assert taken
        with pytest.raises(StoreUnavailableError, match="the block's own"):
            async with store.lease("conversation"):
                raise StoreUnavailableError("the block's own")

    assert (pool.released, pool.terminated) == (3, 3)
    failures = [(e["event"], e["log_level"]) for e in logs if e["event"] == "postgres_release_failed"]
    assert failures == [("postgres_release_failed", "warning")] * 3


async def test_a_query_whose_connection_cannot_be_given_back_answers_as_it_did() -> None:
    """A query (a small value read) whose connection's reset fails when given back answers what it read: the
    connection is cut and a warning logged (before: asyncpg's InternalClientError replaced its answer)."""
    store = PostgresStore("postgresql://u@127.0.0.1:1/db")
    pool = UnreturnablePool()
    store._pool = pool  # type: ignore[assignment]

    with capture_logs() as logs:
        answer = await store.get_meta("outbox.pending")

    assert answer == "True"  # what the fake connection answered, as text
    assert (pool.released, pool.terminated) == (1, 1)
    assert [e["event"] for e in logs if e["event"] == "postgres_release_failed"] == ["postgres_release_failed"]
