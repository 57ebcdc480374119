"""PostgreSQL's small values found by a key prefix (a daemon's look for dead peers, a deletion's owned values):
exactly the keys that start with it, found through an index rather than by reading the whole table."""

from __future__ import annotations

import pytest

from tenex_daemon.adapters.storage.postgres import PostgresStore, _key_prefix
from tests.contract.postgres_server import PostgresServer

pytestmark = pytest.mark.integration

KEYS = [
    "outbox.pending", "outbox.pending.p.a", "outbox.pending.p.b", "outbox.pendinh", "outbox.pendinf.x",
    "runs.pending.p.a", "thread.é.1", "thread.é", "thread.ê", "thread.e", "a" + chr(0x10FFFF) + "z",
    "b" + chr(0xD7FF) + "x", "b" + chr(0xE000),
]


async def test_keys_with_a_prefix_are_exactly_those_that_start_with_it_and_an_index_finds_them(
    postgres_server: PostgresServer,
) -> None:
    """Among keys around each prefix's edges (the next letter, accents, the last code point, the code point
    before the surrogates), each prefix
    finds exactly the keys starting with it; and with 20,000 other values stored, the query plan reads an
    index, not the whole table."""
    store = PostgresStore(await postgres_server.create_database())
    await store.open()
    try:
        for key in KEYS:
            await store.set_meta(key, "v")
        found = {
            prefix: await store.keys_with_prefix(prefix)
            for prefix in (
                "outbox.pending.", "outbox.pending", "thread.é", "thread.", "a" + chr(0x10FFFF), "b" + chr(0xD7FF), ""
            )
        }
        async with store.pool.acquire() as conn:
            await conn.executemany(
                "INSERT INTO meta (key, value) VALUES ($1, 'v')", [(f"channel.{n:06d}",) for n in range(20_000)]
            )
            await conn.execute("ANALYZE meta")
            condition, args = _key_prefix("outbox.pending.")
            plan = "\n".join(
                row[0] for row in await conn.fetch(f"EXPLAIN SELECT key FROM meta WHERE {condition}", *args)
            )
    finally:
        await store.close()

    for prefix, keys in found.items():
        assert sorted(keys) == sorted(key for key in KEYS if key.startswith(prefix)), prefix
    assert "meta_key_bytes" in plan, plan
    assert "Seq Scan" not in plan, plan
