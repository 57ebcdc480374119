"""A PostgreSQL load reads a conversation's state row and its events from one snapshot: a delete or an
append another daemon commits while it reads is seen whole or not at all, never half."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import pytest

from tenex_daemon.adapters.storage.postgres import PostgresStore
from tenex_daemon.core.conversation import Conversation
from tests.conftest import Cast
from tests.contract.postgres_server import PostgresServer

pytestmark = pytest.mark.integration


def between_the_reads(monkeypatch: pytest.MonkeyPatch, meanwhile: Callable[[], Awaitable[object]]) -> None:
    """Run ``meanwhile`` (another daemon's write, committed) once, right after a load's first statement,
    the one that reads the state row, has answered (before a load that reads the events apart does so)."""
    pending = [meanwhile]

    def after(method: Any) -> Any:
        async def then_meanwhile(self: Any, query: str, *args: Any, **kwargs: Any) -> Any:
            answer = await method(self, query, *args, **kwargs)
            if pending and query.startswith("SELECT") and "state" in query and "FROM conversations" in query:
                await pending.pop()()
            return answer

        return then_meanwhile

    for name in ("fetch", "fetchrow"):
        method = getattr(asyncpg.connection.Connection, name)
        monkeypatch.setattr(asyncpg.connection.Connection, name, after(method))


async def two_daemons(dsn: str) -> tuple[PostgresStore, PostgresStore]:
    """Two stores (two daemons) on one database, open."""
    a, b = PostgresStore(dsn), PostgresStore(dsn)
    await a.open()
    await b.open()
    return a, b


async def shared(store: PostgresStore, cast: Cast) -> Conversation:
    """A stored conversation titled "before": its root and one reply."""
    root = cast.user_says("a conversation two daemons share", kind=11)
    conversation = Conversation(id=root.id, title="before", created_at=1, updated_at=1)
    conversation.append(root)
    await store.create(conversation)
    await store.append_event(root.id, cast.alice_says("reply 1", tags=[["e", root.id]]))
    return conversation


async def test_a_delete_between_a_loads_reads_is_not_seen_by_it(
    postgres_server: PostgresServer, cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Daemon B deletes a conversation while daemon A loads it: A gets it as it was, its whole history
    (before, its state with no events); the next load finds it gone."""
    a, b = await two_daemons(await postgres_server.create_database())
    try:
        conversation = await shared(a, cast)
        between_the_reads(monkeypatch, lambda: b.delete(conversation.id))
        loaded = await a.load(conversation.id)
        assert loaded is not None
        assert (loaded.title, len(loaded.history)) == ("before", 2)
        assert await a.load(conversation.id) is None
    finally:
        await a.close()
        await b.close()


async def test_an_append_between_a_loads_reads_is_seen_whole_by_the_next(
    postgres_server: PostgresServer, cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Daemon B appends a reply with a new title while daemon A loads the conversation: A gets the title and
    the history of one moment (before, the old title with the new reply); the next load gets both new."""
    a, b = await two_daemons(await postgres_server.create_database())
    try:
        conversation = await shared(a, cast)
        live = await b.load(conversation.id)
        assert live is not None
        live.title = "renamed with the reply"
        reply = cast.alice_says("reply 2", tags=[["e", conversation.id]])
        between_the_reads(monkeypatch, lambda: b.append_event(conversation.id, reply, state=live))
        loaded = await a.load(conversation.id)
        assert loaded is not None
        assert (loaded.title, len(loaded.history)) == ("before", 2)
        again = await a.load(conversation.id)
        assert again is not None
        assert (again.title, again.history[-1].id) == ("renamed with the reply", reply.id)
    finally:
        await a.close()
        await b.close()
