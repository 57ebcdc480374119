"""What a PostgreSQL store says of its database when it cannot open it: the dsn, its passwords hidden."""

from __future__ import annotations

import pytest

from tenex_daemon.adapters.storage.postgres import PostgresOpenError, PostgresStore, shown_dsn


@pytest.mark.parametrize(
    ("dsn", "shown"),
    [
        ("postgresql://u:hunter2@db:5432/x", "postgresql://u:***@db:5432/x"),
        ("postgresql://:hunter2@db/x", "postgresql://:***@db/x"),
        ("postgresql://u@db/x?password=hunter2&sslmode=require", "postgresql://u@db/x?password=***&sslmode=require"),
        ("postgresql:///x?host=/run/pg&sslpassword=hunter2", "postgresql:///x?host=/run/pg&sslpassword=***"),
        ("postgresql://u@db/x", "postgresql://u@db/x"),
    ],
)
def test_a_dsn_is_shown_with_every_password_hidden(dsn: str, shown: str) -> None:
    """A password in the address or in a password/sslpassword parameter is shown as ***; the rest as given."""
    assert shown_dsn(dsn) == shown


async def test_a_dsn_asyncpg_cannot_read_is_one_error_naming_the_database() -> None:
    """A port that is no number is a PostgresOpenError naming the database, its password hidden (it was
    asyncpg's ValueError, a traceback)."""
    store = PostgresStore("postgresql://u:hunter2@db:54x2/x")
    with pytest.raises(PostgresOpenError) as caught:
        await store.open()
    assert "cannot open the PostgreSQL store at postgresql://u:***@db:54x2/x" in str(caught.value)
    assert "hunter2" not in str(caught.value)
