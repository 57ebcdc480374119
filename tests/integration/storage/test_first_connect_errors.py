"""A PostgreSQL store's ``alive`` (a daemon's name) and ``hear`` (a channel listened on) whose first
connection cannot be made say so as ``open`` does: the project's own error, naming the database (its
password hidden) and the driver's reason, never the driver's bare error."""

from __future__ import annotations

import asyncio
import socket

import asyncpg
import pytest

from tenex_daemon.adapters.storage.postgres import PostgresOpenError, PostgresStore
from tenex_daemon.core.errors import StoreUnavailableError
from tests.contract.postgres_server import PostgresServer, find_bin_dir

pytestmark = pytest.mark.integration

PASSWORD = "hunter2"
"""A password in every dsn here (the test servers trust every login): it must never be shown."""


def _with_password(dsn: str) -> str:
    """``dsn`` (``postgresql://postgres@...``) with :data:`PASSWORD` in its address."""
    return dsn.replace("postgres@", f"postgres:{PASSWORD}@", 1)


def _closed_port() -> int:
    """A loopback port nothing listens on (one just bound and let go)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _ignore(message: str) -> None:
    """A listener's callback that keeps nothing."""


async def test_hear_on_a_port_nothing_listens_on_is_a_store_unavailable_error_naming_the_database() -> None:
    """hear() whose first connection is refused (a wrong port) raises StoreUnavailableError naming the
    channel, host, port and database, the password hidden, and the refusal (before: ConnectionRefusedError)."""
    port = _closed_port()
    store = PostgresStore(f"postgresql://postgres:{PASSWORD}@127.0.0.1:{port}/tenex")

    with pytest.raises(StoreUnavailableError) as caught:
        async with store.hear("tenexd_stop_x", _ignore):
            pass

    message = str(caught.value)
    assert message.startswith(
        f"cannot listen on 'tenexd_stop_x': the PostgreSQL store at postgresql://postgres:***@127.0.0.1:{port}"
        "/tenex does not answer: "
    )
    assert "Connect call failed" in message
    assert PASSWORD not in message
    assert isinstance(caught.value.__cause__, ConnectionRefusedError)


async def test_hear_on_a_database_that_does_not_exist_is_a_postgres_open_error_naming_it(
    postgres_server: PostgresServer,
) -> None:
    """hear() on a server without the dsn's database raises PostgresOpenError naming the dsn, the password
    hidden, and the server's refusal (before: asyncpg's InvalidCatalogNameError)."""
    store = PostgresStore(_with_password(postgres_server.dsn("no_such_database")))

    with pytest.raises(PostgresOpenError) as caught:
        async with store.hear("tenexd_stop_x", _ignore):
            pass

    assert str(caught.value) == (
        f"cannot listen on 'tenexd_stop_x': the PostgreSQL store at postgresql://postgres:***@127.0.0.1:"
        f'{postgres_server.port}/no_such_database refuses: database "no_such_database" does not exist'
    )
    assert isinstance(caught.value.__cause__, asyncpg.InvalidCatalogNameError)


async def test_alive_on_a_database_dropped_since_open_is_a_postgres_open_error_naming_it(
    postgres_server: PostgresServer,
) -> None:
    """alive() whose first connection finds the store's database gone (dropped since open) raises
    PostgresOpenError naming the name, the dsn with its password hidden and the server's refusal (before:
    asyncpg's InvalidCatalogNameError)."""
    dsn = _with_password(await postgres_server.create_database())
    database = dsn.rpartition("/")[2]
    store = PostgresStore(dsn)
    await store.open()
    try:
        admin = await asyncpg.connect(postgres_server.dsn())
        try:
            await admin.execute(f'DROP DATABASE "{database}" WITH (FORCE)')
        finally:
            await admin.close()

        with pytest.raises(PostgresOpenError) as caught:
            async with store.alive("daemon-1"):
                pass
    finally:
        await store.close()

    assert str(caught.value) == (
        f"cannot hold the name 'daemon-1': the PostgreSQL store at postgresql://postgres:***@127.0.0.1:"
        f'{postgres_server.port}/{database} refuses: database "{database}" does not exist'
    )
    assert isinstance(caught.value.__cause__, asyncpg.InvalidCatalogNameError)


async def test_alive_and_hear_when_nothing_answers_on_the_port_are_store_unavailable_errors() -> None:
    """With the store's server stopped since open (its port now answers nothing), alive() and hear() each
    raise StoreUnavailableError naming host, port and database, the password hidden, and the refusal
    (before: the driver's ConnectionRefusedError)."""
    if find_bin_dir() is None:
        pytest.skip("PostgreSQL is not installed; scripts/setup.d/20-postgres.sh installs it")
    server = await asyncio.to_thread(PostgresServer.start)  # its own server: this test stops it
    try:
        dsn = _with_password(await server.create_database())
        store = PostgresStore(dsn)
        await store.open()
    finally:
        await asyncio.to_thread(server.stop)
    where = dsn.replace(PASSWORD, "***")
    try:
        with pytest.raises(StoreUnavailableError) as alive_error:
            async with store.alive("daemon-1"):
                pass
        with pytest.raises(StoreUnavailableError) as hear_error:
            async with store.hear("tenexd_stop_x", _ignore):
                pass
    finally:
        await store.close()

    for caught, doing in ((alive_error, "hold the name 'daemon-1'"), (hear_error, "listen on 'tenexd_stop_x'")):
        message = str(caught.value)
        assert message.startswith(f"cannot {doing}: the PostgreSQL store at {where} does not answer: ")
        assert f"127.0.0.1:{server.port}" in where
        assert PASSWORD not in message
        assert isinstance(caught.value.__cause__, OSError)
