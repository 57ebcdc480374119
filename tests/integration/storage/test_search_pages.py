"""PostgreSQL's search with a filter SQL leaves to core (a title, a summary that says something) and a
limit: each page is planned for its values, so the persona's recall stays a short read however many ended
conversations the database holds, and its pages answer what every other store answers, in every order."""

from __future__ import annotations

import itertools
import re

import asyncpg
import pytest

from tenex_daemon.adapters.storage import postgres_search
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.adapters.storage.postgres import PostgresStore
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.search import SearchQuery
from tests.conftest import Cast
from tests.contract.postgres_server import PostgresServer

pytestmark = pytest.mark.integration

T0 = 1_700_000_000_000
RECALL = SearchQuery(ended=True, participants=("owner", "agent"), summarized=True, order="ended", limit=6)
"""What ``persona.recent_conversations`` asks before every agent run."""


async def test_the_recall_is_never_run_with_a_prepared_statements_generic_plan(
    postgres_server: PostgresServer,
) -> None:
    """The recall run ten times on one connection (asyncpg keeps its statements prepared) over 3000 ended
    conversations answers the newest each time, and PostgreSQL never runs it with a generic plan: before,
    from the sixth run on, the generic plan sorted every ended conversation before the first row (200,000
    of them: 0.5 ms, then 190 ms a run)."""
    dsn = await postgres_server.create_database()
    store = PostgresStore(dsn, pool_size=1)
    await store.open()
    try:
        async with store.pool.acquire() as conn:
            await conn.execute(
                """INSERT INTO conversations (id, title, phase, created_at, updated_at, event_count, agent_count,
                       participants, state, activity_at, ended_at, lifecycle)
                   SELECT lpad(to_hex(n), 64, '0'), 'chat ' || n, 'chat', n, n, 2, 1, ARRAY['owner', 'agent'],
                          '{}', n, n, '{"summary": "what was said"}'
                     FROM generate_series(1, 3000) AS n;
                   ANALYZE conversations"""
            )
        newest = [f"{n:064x}" for n in range(3000, 2994, -1)]
        for _ in range(10):
            assert [row.id for row in await store.search(RECALL)] == newest
        async with store.pool.acquire() as conn:
            plans = await conn.fetch(
                "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
                " WHERE starts_with(statement, 'SELECT id, title') AND statement LIKE '%ended_at DESC%'"
            )
        assert plans
        assert [row["generic_plans"] for row in plans] == [0] * len(plans)
        assert sum(row["custom_plans"] for row in plans) >= 10
    finally:
        await store.close()


def _conversation(cast: Cast, n: int) -> Conversation:
    """The ``n``th of a set with ties in update and end times, some ended, some summarized, titled two ways."""
    root = cast.user_says(f"start {n}", kind=11)
    conversation = Conversation(
        id=root.id, title=f"{'Chat' if n % 3 else 'Other'} {n}", created_at=T0, updated_at=T0 + n // 4,
        phase_started_at=T0,
    )
    conversation.append(root)
    conversation.ended_at = None if n % 5 == 0 else T0 + n // 3
    conversation.summary = None if n % 4 == 1 else f"summary {n}"
    return conversation


async def test_a_filtered_search_read_in_small_pages_answers_as_the_memory_store_in_every_order(
    postgres_server: PostgresServer, cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With pages of two rows (then three), every order (by update, by end, ended or not) and every filter
    core applies answers PostgreSQL what the memory store answers: the pages start each after the one
    before (ties in time broken by id), skip no row and repeat none."""
    monkeypatch.setattr(postgres_search, "FIRST_PAGE", 2)
    monkeypatch.setattr(postgres_search, "PAGE_MAX", 3)
    postgres = PostgresStore(await postgres_server.create_database())
    await postgres.open()
    memory = MemoryStore()
    try:
        for n in range(30):
            conversation = _conversation(cast, n)
            await postgres.create(conversation)
            await memory.create(conversation.model_copy(deep=True))
        filters = [{"title": "chat"}, {"title": "other"}, {"summarized": True}, {"summarized": False}]
        for order, ended, where, limit in itertools.product(
            ("updated", "ended"), (None, True, False), filters, (1, 2, 5, 40)
        ):
            query = SearchQuery(order=order, ended=ended, limit=limit, **where)  # type: ignore[arg-type]
            expected = [row.id for row in await memory.search(query)]
            assert [row.id for row in await postgres.search(query)] == expected, query
    finally:
        await postgres.close()


@pytest.mark.parametrize(
    ("query", "index"),
    [(RECALL, "conversations_ended"), (SearchQuery(title="chat", limit=5), "conversations_updated")],
)
async def test_each_page_is_planned_for_its_limit(
    postgres_server: PostgresServer, query: SearchQuery, index: str
) -> None:
    """A later page's statement (a keyset start and a LIMIT) over 20,000 conversations reads the next rows
    in order through the order's index (by end: ``conversations_ended``; by update:
    ``conversations_updated``), never sorting them all."""
    dsn = await postgres_server.create_database()
    store = PostgresStore(dsn)
    await store.open()
    await store.close()
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            """INSERT INTO conversations (id, title, phase, created_at, updated_at, participants, state,
                   activity_at, ended_at)
               SELECT lpad(to_hex(n), 64, '0'), 't', 'chat', n, n, ARRAY['owner', 'agent'], '{}', n, n
                 FROM generate_series(1, 20000) AS n;
               ANALYZE conversations"""
        )
        arg = postgres_search._Args()
        clauses = postgres_search._filters(query, arg)
        order = postgres_search._order(query)
        last = {"ended_at": 19_000, "updated_at": 19_000, "id": f"{19_000:064x}"}
        sql = f"{postgres_search._select([*clauses, order.after(last, arg)], order)} LIMIT {arg(20)}"
        async with conn.transaction(isolation="repeatable_read", readonly=True):
            await conn.execute(postgres_search.CUSTOM_PLANS)
            plan = "\n".join(row[0] for row in await conn.fetch(f"EXPLAIN {sql}", *arg.values))
    finally:
        await conn.close()
    assert f"using {index} on conversations" in plan, plan
    assert re.search(r"(^|->  )Sort  \(", plan, re.MULTILINE) is None, plan
