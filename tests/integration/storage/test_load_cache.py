"""A PostgreSQL load of a conversation the store holds reads its state row and only the events past those it
holds (a load read every event of the conversation, so each message cost time in proportion to its history),
and still sees whatever another daemon sharing the database wrote since."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

from tenex_daemon.adapters.storage.postgres import PostgresStore
from tenex_daemon.adapters.storage.postgres_cache import LOAD_SQL
from tenex_daemon.core.conversation import Conversation
from tests.conftest import Cast
from tests.contract.postgres_server import PostgresServer
from tests.integration.storage.test_load_snapshot import two_daemons

pytestmark = pytest.mark.integration


def rows_read(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of rows each load's statement answered, in order (filled as loads run)."""
    counts: list[int] = []
    fetch = asyncpg.connection.Connection.fetch

    async def counted(self: Any, query: str, *args: Any, **kwargs: Any) -> Any:
        answer = await fetch(self, query, *args, **kwargs)
        if query == LOAD_SQL:
            counts.append(len(answer))
        return answer

    monkeypatch.setattr(asyncpg.connection.Connection, "fetch", counted)
    return counts


async def conversation_of(store: PostgresStore, cast: Cast, replies: int) -> Conversation:
    """A stored conversation: a root and ``replies`` replies."""
    root = cast.user_says("a long conversation", kind=11)
    conversation = Conversation(id=root.id, title="long", created_at=1, updated_at=1)
    conversation.append(root)
    for n in range(replies):
        conversation.append(cast.alice_says(f"reply {n}", tags=[["e", root.id]]))
    await store.create(conversation)
    return conversation


async def test_a_load_reads_only_the_events_past_those_the_store_holds(
    postgres_server: PostgresServer, cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Of a 200-event conversation the store created, a load reads the state row and the one event it holds
    last (the check that its history is the stored one), then two rows more for one event appended: never the
    200 again; what it returns is the conversation as stored."""
    a, b = await two_daemons(await postgres_server.create_database())
    try:
        conversation = await conversation_of(a, cast, 199)
        counts = rows_read(monkeypatch)

        first = await a.load(conversation.id)
        reply = cast.bob_says("one more", tags=[["e", conversation.id]])
        await a.append_event(conversation.id, reply)
        second = await a.load(conversation.id)
        fresh = await b.load(conversation.id)  # another store reads it whole

        assert counts == [2, 3, 202]
        assert first is not None
        assert second is not None
        assert fresh is not None
        assert [e.id for e in second.history] == [e.id for e in fresh.history]
        assert second.history[-1].id == reply.id
        assert second.state_dict() == fresh.state_dict()
    finally:
        await a.close()
        await b.close()


async def test_a_load_from_what_the_store_holds_sees_another_daemons_writes(
    postgres_server: PostgresServer, cast: Cast
) -> None:
    """Daemon A holds a conversation; daemon B renames it with a reply (state and event in one write): A's
    next load has both, its history whole and indexed. B then deletes it and a conversation of the same root
    with another reply is made: A's next load has that one, not what it held."""
    a, b = await two_daemons(await postgres_server.create_database())
    try:
        conversation = await conversation_of(a, cast, 3)
        held = await a.load(conversation.id)
        assert held is not None
        live = await b.load(conversation.id)
        assert live is not None
        live.title = "renamed by B"
        reply = cast.bob_says("B's reply", tags=[["e", conversation.id]])
        await b.append_event(conversation.id, reply, state=live)

        seen = await a.load(conversation.id)

        assert seen is not None
        assert seen.title == "renamed by B"
        assert [e.id for e in seen.history] == [*(e.id for e in conversation.history), reply.id]
        assert seen.index_of(reply.id) == 4
        assert await b.delete(conversation.id)
        again = Conversation(id=conversation.id, title="made anew", created_at=2, updated_at=2)
        again.append(conversation.history[0])
        other = cast.alice_says("another reply", tags=[["e", conversation.id]])
        again.append(other)
        again.append(cast.alice_says("and more", tags=[["e", conversation.id]]))
        again.append(cast.alice_says("and more still", tags=[["e", conversation.id]]))
        again.append(cast.alice_says("and the last", tags=[["e", conversation.id]]))
        await b.create(again)
        remade = await a.load(conversation.id)
        assert remade is not None
        assert remade.title == "made anew"
        assert [e.id for e in remade.history] == [e.id for e in again.history]
        assert not remade.contains_event(reply.id)
    finally:
        await a.close()
        await b.close()


async def test_a_load_answered_late_is_not_mixed_with_the_newer_history_another_load_took_in(
    postgres_server: PostgresServer, cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two loads of one conversation in one daemon overlap while daemon B renames it with a reply: the load
    whose (older) answer is handled last returns the conversation of one moment (the old title without the
    reply, or both of B's changes: it reads it again), never B's reply with the old title (a state that never
    was, which it returned); the next load has both of B's changes."""
    a, b = await two_daemons(await postgres_server.create_database())
    try:
        conversation = await conversation_of(a, cast, 1)
        fetch = asyncpg.connection.Connection.fetch
        late = [True]

        async def answered_late(self: Any, query: str, *args: Any, **kwargs: Any) -> Any:
            answer = await fetch(self, query, *args, **kwargs)
            if query == LOAD_SQL and late and late.pop():
                await asyncio.sleep(0.5)  # the first load's answer is handled after the second's
            return answer

        monkeypatch.setattr(asyncpg.connection.Connection, "fetch", answered_late)
        older = asyncio.create_task(a.load(conversation.id))
        await asyncio.sleep(0.1)
        live = await b.load(conversation.id)
        assert live is not None
        live.title = "renamed by B"
        reply = cast.bob_says("B's reply", tags=[["e", conversation.id]])
        assert await b.append_event(conversation.id, reply, state=live)
        newer = await a.load(conversation.id)

        seen = await older

        assert newer is not None
        assert (newer.title, newer.contains_event(reply.id)) == ("renamed by B", True)
        assert seen is not None
        assert (seen.title, seen.contains_event(reply.id)) in {("long", False), ("renamed by B", True)}
        again = await a.load(conversation.id)
        assert again is not None
        assert (again.title, again.contains_event(reply.id)) == ("renamed by B", True)
    finally:
        await a.close()
        await b.close()
