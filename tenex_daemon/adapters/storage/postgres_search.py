"""How :class:`~tenex_daemon.adapters.storage.postgres.PostgresStore` searches its index rows, and how an
index row is written and read (docs/ARCHITECTURE.md, "Ports, one per job").

A search filters in SQL what SQL can; the fuzzy title rule and the summary's (core's ``summary_matches``,
on the ``lifecycle`` JSON kept as text) run on the rows found. A search with such a filter and a limit
reads its rows a page at a time, each page a statement with a ``LIMIT`` that starts after the last row of
the one before (keyset), all in one read-only snapshot, and stops once it has found its count: the
persona's recall, run before every agent run, costs the same in a database of ten ended conversations or
of a million. Each page is planned for the values it is run with (``plan_cache_mode``), never by a
prepared statement's generic plan, which knows neither whose conversations nor how few rows are wanted,
and may sort every matching row before the first is read.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tenex_daemon.core.phases import Phase
from tenex_daemon.core.search import (
    LIFECYCLE_FIELDS,
    ConversationSummary,
    SearchQuery,
    apply_query,
    lifecycle_fields,
    summary_matches,
)

BIGINT_MIN, BIGINT_MAX = -(2**63), 2**63 - 1
"""The range of PostgreSQL's ``bigint`` (the times' columns, ``LIMIT``)."""
FIRST_PAGE = 20
"""The fewest rows the first page of a filtered search reads (more when its limit is more)."""
PAGE_MAX = 1000
"""The most rows one page reads; each page after the first reads twice as many as the one before, up to it."""
CUSTOM_PLANS = "SET LOCAL plan_cache_mode = force_custom_plan"
"""Plan each page for the values it is run with, for the rest of its transaction."""
COLUMNS = (
    "id, title, phase, created_at, updated_at, event_count, agent_count, archived, participants, "
    "activity_at, ended_at, lifecycle"
)
EXACT_TITLE = "exact_title"
"""The ``lifecycle`` key holding a title with NUL in it (the ``title`` column has it replaced)."""


def title_column(title: str) -> str:
    """The title as the ``title`` column holds it: ``text`` refuses NUL, so it is replaced there."""
    return title.replace("\x00", "\ufffd")


def lifecycle_json(summary: ConversationSummary) -> str:
    """The lifecycle fields an index row keeps in its ``lifecycle`` column (the others have columns),
    and the exact title when the ``title`` column cannot hold it."""
    kept = {*LIFECYCLE_FIELDS} - {"activity_at", "ended_at"}
    fields = summary.model_dump(mode="json", include=kept)
    if "\x00" in summary.title:
        fields[EXACT_TITLE] = summary.title
    return json.dumps(fields)


def summary_of_row(r: Any) -> ConversationSummary:
    """A search row as a summary (the exact title from ``lifecycle`` when the column's differs)."""
    lifecycle: dict[str, Any] = json.loads(r["lifecycle"])
    return ConversationSummary(
        id=r["id"], title=lifecycle.get(EXACT_TITLE, r["title"]), phase=Phase(r["phase"]),
        created_at=r["created_at"], updated_at=r["updated_at"], event_count=r["event_count"],
        agent_count=r["agent_count"], archived=r["archived"], participants=sorted(r["participants"]),
        **lifecycle_fields({**lifecycle, "activity_at": r["activity_at"], "ended_at": r["ended_at"]}),
    )


class _Args:
    """A statement's arguments, each named ``$n`` where it is used."""

    def __init__(self, values: list[Any] | None = None) -> None:
        self.values: list[Any] = list(values or [])

    def __call__(self, value: Any) -> str:
        self.values.append(value)
        return f"${len(self.values)}"


def _filters(query: SearchQuery, arg: _Args) -> list[str]:
    """The conditions SQL answers (all but the fuzzy title and the summary's)."""
    clauses: list[str] = []
    if query.id_prefix is not None:
        # the range lets the primary key's index find them under any collation (ids are lowercase hex)
        prefix = arg(query.id_prefix)
        clauses.append(f"id >= {prefix} AND id < {prefix} || 'g' AND starts_with(id, {prefix})")
    if query.archived is not None:
        clauses.append(f"archived = {arg(query.archived)}")
    if query.phase is not None:
        clauses.append(f"phase = {arg(query.phase.value)}")
    if query.date_from is not None:
        clauses.append(f"created_at >= {arg(int(query.date_from.timestamp() * 1000))}")
    if query.date_to is not None:
        clauses.append(f"created_at <= {arg(int(query.date_to.timestamp() * 1000))}")
    if query.participant is not None:
        clauses.append(f"participants @> ARRAY[{arg(query.participant)}]::text[]")
    if query.participants:
        clauses.append(f"participants @> {arg(list(query.participants))}::text[]")
    if query.ended is not None:
        clauses.append("ended_at IS NOT NULL" if query.ended else "ended_at IS NULL")
    if query.inactive_before is not None and query.inactive_before <= BIGINT_MAX:  # past it: every row
        if query.inactive_before <= BIGINT_MIN:
            clauses.append("false")  # no bigint is below it
        else:
            at = arg(query.inactive_before)
            clauses.append(f"(CASE WHEN activity_at > 0 THEN activity_at ELSE updated_at END) < {at}")
    return clauses


@dataclass(frozen=True)
class _Order:
    """A search's order (``ORDER BY``), and the condition for the rows that come after a given one in it."""

    by: str
    after: Callable[[Any, _Args], str]


def _after_updated(row: Any, arg: _Args) -> str:
    return f"(updated_at, id) < ({arg(row['updated_at'])}, {arg(row['id'])})"


def _after_ended(row: Any, arg: _Args) -> str:
    # ``ended_at <= `` first: the ``conversations_ended`` index starts there
    ended, id_ = arg(row["ended_at"]), arg(row["id"])
    return f'ended_at <= {ended} AND (ended_at < {ended} OR id COLLATE "C" < {id_})'


def _after_ended_nulls_last(row: Any, arg: _Args) -> str:
    if row["ended_at"] is None:
        return f'ended_at IS NULL AND id COLLATE "C" < {arg(row["id"])}'
    ended, id_ = arg(row["ended_at"]), arg(row["id"])
    return f'(ended_at IS NULL OR ended_at < {ended} OR (ended_at = {ended} AND id COLLATE "C" < {id_}))'


def _order(query: SearchQuery) -> _Order:
    if query.order == "ended" and query.ended is True:
        # no NULLs: a backward scan of ``conversations_ended`` gives this order (then ties by id)
        return _Order('ended_at DESC, id COLLATE "C" DESC', _after_ended)
    if query.order == "ended":
        return _Order('ended_at DESC NULLS LAST, id COLLATE "C" DESC', _after_ended_nulls_last)
    return _Order("updated_at DESC, id DESC", _after_updated)


def _select(clauses: list[str], order: _Order) -> str:
    where = " WHERE " + " AND ".join(clauses) if clauses else ""
    return f"SELECT {COLUMNS} FROM conversations{where} ORDER BY {order.by}"


async def search_rows(conn: Any, query: SearchQuery) -> list[ConversationSummary]:
    """The index rows ``query`` asks for, in its order, cut at its limit (read on ``conn``)."""
    arg = _Args()
    clauses = _filters(query, arg)
    order = _order(query)
    exact = query.title is None and query.summarized is None  # SQL answers every filter
    if query.limit is None or query.limit < 0:  # every row (a negative limit cuts from the end)
        found = [summary_of_row(r) for r in await conn.fetch(_select(clauses, order), *arg.values)]
    elif exact:
        sql = f"{_select(clauses, order)} LIMIT {arg(min(query.limit, BIGINT_MAX))}"
        found = [summary_of_row(r) for r in await conn.fetch(sql, *arg.values)]
    else:
        found = await _first_matching(conn, clauses, arg, order, query)
    return apply_query(found, query)


async def _first_matching(
    conn: Any, clauses: list[str], arg: _Args, order: _Order, query: SearchQuery
) -> list[ConversationSummary]:
    """The first ``query.limit`` rows, in the query's order, that pass the filters SQL leaves to core's
    rules: read a page at a time (see the module's description), so the reading stops there."""
    limit = query.limit or 0
    found: list[ConversationSummary] = []
    if limit < 1:
        return found
    page = min(max(limit, FIRST_PAGE), PAGE_MAX)
    last: Any = None
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        await conn.execute(CUSTOM_PLANS)
        while True:
            page_arg = _Args(arg.values)
            conditions = clauses if last is None else [*clauses, order.after(last, page_arg)]
            sql = f"{_select(conditions, order)} LIMIT {page_arg(page)}"
            rows = await conn.fetch(sql, *page_arg.values)
            for record in rows:
                row = summary_of_row(record)
                if summary_matches(row, query):
                    found.append(row)
                    if len(found) >= limit:
                        return found
            if len(rows) < page:
                return found
            last = rows[-1]
            page = min(2 * page, PAGE_MAX)
