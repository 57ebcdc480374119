"""On PostgreSQL, a run journal write that fails inside ``RunScheduler.accept`` (its connection ended by the
server mid-statement, as a database restart or an administrator does) raises, and the same event
accepted again once the database answers is journaled: nothing in memory takes it for accepted already."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from typing import Any

import asyncpg
import pytest

from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.adapters.storage.postgres import PostgresStore
from tenex_daemon.core.errors import StoreUnavailableError
from tenex_daemon.services.dispatcher import Outcome
from tenex_daemon.services.runs import RunRequest, RunScheduler
from tests.conftest import Cast
from tests.pipeline import build_rig

pytestmark = pytest.mark.integration


async def _no_run(request: RunRequest) -> None:
    """A run that does nothing (no run is asked for here)."""


async def _with_the_journal_write_cut(
    dsn: str, journal_key: str, accepting: Coroutine[Any, Any, object]
) -> BaseException:
    """Run ``accepting`` while another session holds the journal's row (``journal_key``) uncommitted, end
    the accepting session while its write waits for that row (``pg_terminate_backend``), and return what
    ``accepting`` raised."""
    admin = await asyncpg.connect(dsn)
    try:
        holding = admin.transaction()
        await holding.start()
        await admin.execute("INSERT INTO meta (key, value) VALUES ($1, '[]')", journal_key)
        task = asyncio.ensure_future(accepting)
        async with asyncio.timeout(10):
            ended = False
            while not ended:
                await asyncio.sleep(0.02)
                ended = bool(await admin.fetchval(
                    """SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                        WHERE datname = current_database() AND pid <> pg_backend_pid()
                          AND wait_event_type = 'Lock' AND query LIKE 'INSERT INTO meta%'"""
                ))
            outcome = await asyncio.gather(task, return_exceptions=True)
        await holding.rollback()
    finally:
        await admin.close()
    assert isinstance(outcome[0], BaseException), "the accept whose write was cut short did not fail"
    return outcome[0]


async def _accept_with_its_connection_ended(scheduler: RunScheduler, dsn: str, event_id: str) -> BaseException:
    """``scheduler.accept(event_id)`` with its journal write cut (:func:`_with_the_journal_write_cut`)."""
    return await _with_the_journal_write_cut(dsn, scheduler.journal_key, scheduler.accept(event_id))


async def _journal(store: PostgresStore | MemoryStore, scheduler: RunScheduler) -> list[object]:
    """The run journal as stored."""
    raw = await store.get_meta(scheduler.journal_key)
    assert raw is not None
    entries: list[object] = json.loads(raw)
    return entries


async def test_an_event_accepted_again_after_its_journal_write_failed_is_journaled(
    store_and_dsn: tuple[PostgresStore, str],
) -> None:
    """accept() whose journal write failed (its connection ended mid-statement) raises StoreUnavailableError,
    and the next accept() of the same event id succeeds and stores it in the journal."""
    store, dsn = store_and_dsn
    scheduler = RunScheduler(store, _no_run)

    error = await _accept_with_its_connection_ended(scheduler, dsn, "event-1")
    assert isinstance(error, StoreUnavailableError)

    await scheduler.accept("event-1")

    assert await _journal(store, scheduler) == [{"dispatch": "event-1"}]


async def test_an_accept_whose_journal_write_failed_leaves_nothing_for_the_next_write(
    store_and_dsn: tuple[PostgresStore, str],
) -> None:
    """After an accept() whose journal write failed, the next write (another event's accept) journals only
    that other event: the failed one left no entry in memory to be written later."""
    store, dsn = store_and_dsn
    scheduler = RunScheduler(store, _no_run)
    await _accept_with_its_connection_ended(scheduler, dsn, "event-1")

    await scheduler.accept("event-2")

    assert await _journal(store, scheduler) == [{"dispatch": "event-2"}]


async def test_a_root_handed_over_again_after_its_accept_failed_starts_its_conversation(
    store_and_dsn: tuple[PostgresStore, str], cast: Cast
) -> None:
    """A person's root whose handling failed at accept (the journal write's connection ended) is, handed over
    again, stored in a new conversation and dispatched (not dropped as a duplicate), its entry then gone."""
    store, dsn = store_and_dsn
    rig = build_rig(cast, store=store)
    root = cast.user_says("hello alice", kind=11, tags=[["p", cast.alice.pubkey]])
    try:
        error = await _with_the_journal_write_cut(dsn, rig.scheduler.journal_key, rig.dispatcher.handle(root))
        assert isinstance(error, StoreUnavailableError)
        assert not await store.is_processed(root.id)

        result = await rig.dispatcher.handle(root)
        await rig.settle()
    finally:
        await rig.scheduler.drain(1.0)

    assert result.outcome is Outcome.SCHEDULED
    assert await store.is_processed(root.id)
    found = await store.find_event(root.id)
    assert found is not None
    assert found[0] == result.conversation_id


class _FirstWriteFails(MemoryStore):
    """A store whose writes are not in order (as PostgreSQL's) and whose first small-value write fails."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    @property
    def commits_in_order(self) -> bool:
        """Each write waits for itself, as on PostgreSQL."""
        return False

    async def set_meta(self, key: str, value: str) -> None:
        """Fail the first write (a database restarting), after a moment; keep the others."""
        self.writes += 1
        if self.writes == 1:
            await asyncio.sleep(0.01)
            raise OSError("the database is restarting")
        await super().set_meta(key, value)


async def test_an_event_accepted_twice_at_once_stays_journaled_when_only_the_first_write_fails() -> None:
    """One event accepted twice at once (one rumor in two gift wraps): the first accept's journal write fails,
    the second's goes through; the second returns (its caller stores the event), so its write holds the
    event's dispatch (before, the first's failure took the event out before the second's write was made)."""
    store = _FirstWriteFails()
    scheduler = RunScheduler(store, _no_run)
    first = asyncio.create_task(scheduler.accept("event-1"))
    await asyncio.sleep(0)
    second = asyncio.create_task(scheduler.accept("event-1"))

    results = await asyncio.gather(first, second, return_exceptions=True)

    assert isinstance(results[0], OSError)
    assert results[1] is None
    assert await _journal(store, scheduler) == [{"dispatch": "event-1"}]
