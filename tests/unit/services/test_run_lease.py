"""A run's lease on a shared database (docs/ARCHITECTURE.md, "Scale-out"): when a database restart lets
another daemon take it, the run is cancelled and tried again, unless its reply is being saved."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext

from tenex_daemon import MemoryStore
from tenex_daemon.services.runs import RUN_LEASE_PREFIX, RunRequest, RunScheduler, saving_reply
from tests import pipeline
from tests.conftest import Cast
from tests.unit.services.test_bursts import GatedBackend


class LeasePeers:
    """Daemons sharing a store whose run leases are always free, until the test says another daemon took
    one (:meth:`take_away`)."""

    def __init__(self) -> None:
        self.on_lost: dict[str, Callable[[], None]] = {}
        self.names_lost = 0

    @asynccontextmanager
    async def try_take(self, name: str, on_lost: Callable[[], None] | None = None) -> AsyncIterator[bool]:
        """Take the lease (always free), remembering whom to tell when it is lost."""
        if on_lost is not None:
            self.on_lost[name] = on_lost
        try:
            yield True
        finally:
            self.on_lost.pop(name, None)

    def take_away(self, conversation_id: str) -> None:
        """Another daemon took the conversation's run lease."""
        self.on_lost[f"{RUN_LEASE_PREFIX}{conversation_id}"]()

    def alive(self, name: str) -> AbstractAsyncContextManager[None]:
        """No name to hold here."""
        return nullcontext()

    async def keys_with_prefix(self, prefix: str) -> list[str]:
        """No other daemon's keys."""
        return []

    async def forget(self, key: str) -> None:
        """Nothing to forget."""


async def until_leased(peers: LeasePeers, conversation_id: str) -> None:
    """Wait until a run holds the conversation's lease."""
    async with asyncio.timeout(5):
        while f"{RUN_LEASE_PREFIX}{conversation_id}" not in peers.on_lost:  # noqa: ASYNC110
            await asyncio.sleep(0.01)


async def test_a_run_whose_lease_another_daemon_took_is_cancelled_and_tried_again() -> None:
    """Another daemon takes a running run's lease (a database restart dropped it): the run is cancelled
    before it answers, counted as failed, and tried again as recovered (its saved reply, if any, is
    found), which answers."""
    peers = LeasePeers()
    calls: list[tuple[str, bool]] = []
    cancelled: list[str] = []

    async def run(request: RunRequest) -> None:
        calls.append((request.trigger_id, request.recovered))
        if len(calls) == 1:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.append(request.trigger_id)
                raise

    scheduler = RunScheduler(MemoryStore(), run, peers=peers)
    await scheduler.submit(RunRequest("c", "t1", "alice"))
    await until_leased(peers, "c")
    peers.take_away("c")
    async with asyncio.timeout(10):
        while scheduler.completed < 1:  # noqa: ASYNC110 - the retry comes after RUN_RETRY_S[0]
            await asyncio.sleep(0.05)
    await scheduler.drain(5.0)

    assert calls == [("t1", False), ("t1", True)]
    assert cancelled == ["t1"]
    assert (scheduler.failed, scheduler.completed) == (1, 1)


async def test_a_run_saving_its_reply_finishes_when_its_lease_is_lost() -> None:
    """A run whose reply is being saved when its lease is lost is let finish (a reply is never left half
    saved) and is not tried again."""
    peers = LeasePeers()
    gate = asyncio.Event()
    calls: list[tuple[str, bool]] = []

    async def run(request: RunRequest) -> None:
        calls.append((request.trigger_id, request.recovered))
        saving_reply()
        await gate.wait()

    scheduler = RunScheduler(MemoryStore(), run, peers=peers)
    await scheduler.submit(RunRequest("c", "t1", "alice"))
    await until_leased(peers, "c")
    peers.take_away("c")
    gate.set()
    await scheduler.drain(5.0)

    assert calls == [("t1", False)]
    assert (scheduler.failed, scheduler.completed) == (0, 1)


async def test_a_stop_that_comes_with_a_lost_lease_still_stops_the_run() -> None:
    """A stop that cancels the run in the same moment its lease is lost wins: the run is stopped and not
    tried again."""
    peers = LeasePeers()
    calls: list[tuple[str, bool]] = []

    async def run(request: RunRequest) -> None:
        calls.append((request.trigger_id, request.recovered))
        await asyncio.Event().wait()

    scheduler = RunScheduler(MemoryStore(), run, peers=peers)
    await scheduler.submit(RunRequest("c", "t1", "alice"))
    await until_leased(peers, "c")
    peers.take_away("c")
    stopped = await scheduler.cancel("c")
    await asyncio.sleep(1.5)  # past the first retry's wait, had the run been tried again
    await scheduler.drain(5.0)

    assert [r.trigger_id for r in stopped] == ["t1"]
    assert calls == [("t1", False)]
    assert (scheduler.failed, scheduler.completed) == (0, 0)


async def test_an_answer_another_daemon_saved_while_the_model_worked_is_kept_not_doubled(cast: Cast) -> None:
    """With daemons sharing a database, another daemon that took this run over while the model worked
    (a partition it took for this daemon's death, its lease then given back) saved its answer to the
    trigger: the run, finding it under the conversation's lease, saves nothing, and publishes that one."""
    backend = GatedBackend()
    rig = pipeline.build_rig(cast, backend=backend, peers=LeasePeers())
    root = cast.user_says("Plan it", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(backend.asked.wait(), 5)
    thread = [["E", root.id, "", root.pubkey], ["K", "11"], ["e", root.id], ["p", root.pubkey]]
    elsewhere = cast.alice_says("the other daemon's answer", tags=thread)
    await rig.manager.add_event(root.id, elsewhere)

    backend.release.set()
    await rig.settle()

    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert [e.content for e in conversation.history] == ["Plan it", "the other daemon's answer"]
    alice = [e.id for e in rig.publisher.published if e.pubkey == cast.alice.pubkey]
    assert alice == [elsewhere.id]
