"""The peer-messages contract (``PeerMessages``): what daemons sharing a store tell each other, run
against the in-memory fake the service tests use and against PostgreSQL (NOTIFY and LISTEN)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from tenex_daemon.adapters.storage.postgres import PostgresStore
from tenex_daemon.core.ports import PeerMessages
from tenex_daemon.testing.fakes import PeerBus
from tests.contract.postgres_server import PostgresServer


@pytest.fixture(params=["fake", "postgres"])
async def two_daemons(request: pytest.FixtureRequest) -> AsyncIterator[tuple[PeerMessages, PeerMessages]]:
    """The messages of two daemons sharing a store: one bus for both, or two clients of one database."""
    if request.param == "fake":
        bus = PeerBus()
        yield bus, bus
        return
    server: PostgresServer = request.getfixturevalue("postgres_server")
    dsn = await server.create_database()
    stores = PostgresStore(dsn), PostgresStore(dsn)
    for store in stores:
        await store.open()
    try:
        yield stores
    finally:
        for store in stores:
            await store.close()


async def test_a_message_reaches_everyone_hearing_its_channel_and_no_other(
    two_daemons: tuple[PeerMessages, PeerMessages],
) -> None:
    """A message told on a channel reaches everyone hearing it, the teller too, in the order told; nobody
    hearing another channel gets it, and nothing is heard once the block has ended. Each channel counts
    those hearing it."""
    first, second = two_daemons
    heard: dict[str, list[str]] = {"first": [], "second": [], "other": []}

    async def until(count: int) -> None:
        async with asyncio.timeout(10):
            while len(heard["first"]) < count or len(heard["second"]) < count:  # noqa: ASYNC110
                await asyncio.sleep(0.01)

    async with (
        first.hear("stops", heard["first"].append),
        second.hear("stops", heard["second"].append),
        second.hear("others", heard["other"].append),
    ):
        hearing = [await first.hearers("stops"), await second.hearers("others"), await first.hearers("none")]
        await first.tell("stops", "one")
        await second.tell("stops", "two")
        await until(2)
    await first.tell("stops", "after")
    await asyncio.sleep(0.2)

    assert heard["first"] == heard["second"] == ["one", "two"]
    assert heard["other"] == []
    assert hearing == [2, 1, 0]
