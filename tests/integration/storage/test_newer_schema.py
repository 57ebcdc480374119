"""A PostgreSQL store whose database a newer tenexd has migrated (a schema version past the last this one
knows) refuses to open, saying so and what to do, rather than running on tables it may misread."""

from __future__ import annotations

import asyncpg
import pytest

from tenex_daemon.adapters.storage.postgres import MIGRATIONS, PostgresOpenError, PostgresStore
from tenex_daemon.core.errors import StoreTooNewError
from tests.contract.postgres_server import PostgresServer

pytestmark = pytest.mark.integration


async def test_a_database_migrated_by_a_newer_tenexd_is_refused_at_open_and_left_as_it_is(
    postgres_server: PostgresServer,
) -> None:
    """open() on a database whose schema_migrations holds a version past the last of MIGRATIONS raises
    PostgresOpenError naming the database and both versions and saying to upgrade tenexd (before: it opened
    silently), a StoreTooNewError (``tenexd run`` exits 2 on it: not restarted by systemd), closes its pools,
    and leaves schema_migrations unchanged."""
    dsn = await postgres_server.create_database()
    first = PostgresStore(dsn)
    await first.open()
    await first.close()
    known = MIGRATIONS[-1][0]
    admin = await asyncpg.connect(dsn)
    try:
        await admin.execute(
            "INSERT INTO schema_migrations (version, description) VALUES ($1, 'from a newer tenexd')", known + 1
        )
        before = await admin.fetch("SELECT version, description FROM schema_migrations ORDER BY version")
        store = PostgresStore(dsn)

        with pytest.raises(PostgresOpenError) as caught:
            await store.open()

        after = await admin.fetch("SELECT version, description FROM schema_migrations ORDER BY version")
    finally:
        await admin.close()
    assert str(caught.value) == (
        f"cannot open the PostgreSQL store at {dsn}: the database's schema (version {known + 1}) is newer "
        f"than this tenexd knows ({known}): upgrade tenexd"
    )
    assert isinstance(caught.value, StoreTooNewError)
    assert (store._pool, store._lease_pool, store._name_pool) == (None, None, None)
    assert after == before
