"""A PostgreSQL store whose database does not answer says so as one error: StoreUnavailableError (an
OSError), with the driver's reason, for what the control API answers 503 and the logs write in one line."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

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

    @asynccontextmanager
    async def acquire(self) -> AsyncIterator[object]:
        """Fail as the database does."""
        raise self.error
        yield  # pragma: no cover


@pytest.mark.parametrize(
    "error",
    [
        ConnectionRefusedError(111, "Connect call failed"),
        asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
        asyncpg.CannotConnectNowError("the database system is starting up"),
        asyncpg.InterfaceError("cannot perform operation: connection is closed"),
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
    misuses = (asyncpg.DataError("invalid input for query argument $1"), asyncpg.InterfaceError("another op"))
    for error in (TimeoutError(), asyncpg.UniqueViolationError("duplicate key"), *misuses):
        store._pool = DownPool(error)  # type: ignore[assignment]
        with pytest.raises(type(error)):
            await store.get_meta("outbox.pending")


def test_an_outage_is_logged_in_one_line_and_a_defect_with_its_traceback() -> None:
    """log_failure writes a StoreUnavailableError as a warning without a traceback, anything else as an
    error with it."""
    log = structlog.get_logger("test")
    with capture_logs() as logs:
        log_failure(log, "run_journal_write_failed", StoreUnavailableError("the store does not answer: down"))
        log_failure(log, "run_journal_write_failed", KeyError("bug"))

    assert [(e["log_level"], "exc_info" in e) for e in logs] == [("warning", False), ("error", True)]
    assert logs[0]["error"] == "the store does not answer: down"
