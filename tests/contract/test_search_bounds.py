"""A search's numbers outside what a database column holds answer in every store as in the memory store: a
negative limit cuts that many rows from the end, a limit or a time past 64 bits bounds nothing. Before,
PostgreSQL raised its own errors for them (a negative LIMIT; an argument out of the int64 range)."""

from __future__ import annotations

import pytest

from tenex_daemon.core.ports import Store
from tenex_daemon.core.search import SearchQuery
from tests.conftest import Cast
from tests.contract.test_store_contract import T0, stored

pytestmark = pytest.mark.integration


async def test_a_negative_limit_and_bounds_past_64_bits_answer_as_in_every_store(store: Store, cast: Cast) -> None:
    """With or without a filter core applies (a title), a limit of -1 leaves the last row out, a limit of
    2**63 cuts nothing, an ``inactive_before`` of 2**63 keeps every row and one below -2**63 none."""
    made = [await stored(store, cast, f"Chat {n}", created_at=T0 + n) for n in range(3)]
    every = [conversation.id for conversation in reversed(made)]

    async def found(**asked: object) -> list[str]:
        return [row.id for row in await store.search(SearchQuery.model_validate(asked))]

    for title in (None, "chat"):
        assert await found(title=title) == every
        assert await found(title=title, limit=-1) == every[:-1]
        assert await found(title=title, limit=2**63) == every
        assert await found(title=title, limit=2**70) == every
        assert await found(title=title, inactive_before=2**63) == every
        assert await found(title=title, inactive_before=2**63, limit=2) == every[:2]
        assert await found(title=title, inactive_before=-(2**63) - 1) == []
