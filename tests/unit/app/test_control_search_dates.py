"""The control API's date filters: ``date_from``/``date_to``, also spelled ``from``/``to``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tenex_daemon import ConversationManager
from tenex_daemon.app.control_api import create_app
from tenex_daemon.app.metrics import Metrics
from tenex_daemon.testing import FakeClock
from tests.conftest import Cast

DAY_MS = 24 * 3600 * 1000


@dataclass
class Target:
    """A ControlTarget over the manager, with an empty status."""

    manager: ConversationManager
    metrics: Metrics = field(default_factory=Metrics)

    def status(self) -> dict[str, Any]:
        """Return an empty status."""
        return {}


@dataclass(frozen=True)
class Dated:
    """Two conversations created ten days apart (2023-11-14 and 2023-11-24, UTC)."""

    older: str
    newer: str


@pytest.fixture
async def dated(cast: Cast, manager: ConversationManager, clock: FakeClock) -> Dated:
    """One conversation created at the fake clock's start, one ten days later."""
    older = await manager.create_conversation(cast.user_says("Older", kind=11))
    clock.advance(10 * DAY_MS)
    newer = await manager.create_conversation(cast.user_says("Newer", kind=11))
    return Dated(older.id, newer.id)


@pytest.fixture
async def client(manager: ConversationManager) -> AsyncIterator[TestClient[Any, Any]]:
    """An HTTP client on the control API app."""
    async with TestClient(TestServer(create_app(Target(manager)))) as test_client:
        yield test_client


async def ids(client: TestClient[Any, Any], params: dict[str, str], status: int = 200) -> Any:
    """GET /api/v1/conversations with ``params``; the ids listed (or the error body for a 4xx)."""
    response = await client.get("/api/v1/conversations", params=params)
    assert response.status == status, await response.text()
    body = await response.json()
    return sorted(row["id"] for row in body["conversations"]) if status == 200 else body


@pytest.mark.parametrize(("start", "end"), [("date_from", "date_to"), ("from", "to")])
async def test_both_spellings_filter_by_creation_date(
    client: TestClient[Any, Any], dated: Dated, start: str, end: str
) -> None:
    """``date_from``/``date_to`` and their aliases ``from``/``to`` select the same conversations."""
    assert await ids(client, {start: "2023-11-20"}) == [dated.newer]
    assert await ids(client, {end: "2023-11-20"}) == [dated.older]
    assert await ids(client, {start: "2023-11-01", end: "2023-11-30"}) == sorted([dated.older, dated.newer])
    assert await ids(client, {start: "2023-11-15", end: "2023-11-20"}) == []


async def test_a_bad_alias_is_a_400_naming_it(client: TestClient[Any, Any]) -> None:
    """A malformed ``from`` gives 400 naming ``from``, as ``date_from`` does for itself."""
    body = await ids(client, {"from": "yesterday"}, 400)
    assert "from must be an ISO 8601 date" in body["error"]


async def test_both_spellings_at_once_are_refused(client: TestClient[Any, Any]) -> None:
    """Giving ``date_to`` and ``to`` together is a 400 rather than a silent choice."""
    body = await ids(client, {"date_to": "2023-11-20", "to": "2023-11-21"}, 400)
    assert "not both" in body["error"]
