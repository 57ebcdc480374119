"""The runs' places are shared fairly between people: a freed place goes to the person holding the fewest,
so one person's flood of slow runs does not keep everybody else waiting behind it."""

from __future__ import annotations

import asyncio
import json

from tenex_daemon import MemoryStore
from tenex_daemon.core.llm import CompletionRequest, CompletionResult
from tenex_daemon.runtime.fair_slots import FairSlots
from tenex_daemon.services.run_journal import journaled_request
from tenex_daemon.services.runs import PENDING_RUNS_KEY, RunRequest, RunScheduler
from tenex_daemon.testing import KeyPair
from tests import pipeline
from tests.conftest import Cast


async def _holder(slots: FairSlots, party: str, order: list[str], release: asyncio.Event) -> None:
    async with slots.hold(party):
        order.append(party)
        await release.wait()


async def _until(check: object, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():  # type: ignore[operator]  # noqa: ASYNC110 (a test polling a condition)
            await asyncio.sleep(0.001)


async def test_a_freed_place_goes_to_the_party_holding_the_fewest_not_to_the_first_waiting() -> None:
    """Two places both held by a flood with three more of its waiters queued first: the owner, asking
    last, takes the first place freed; the flood's waiters then follow in the order they asked."""
    slots = FairSlots(2)
    order: list[str] = []
    releases = [asyncio.Event() for _ in range(6)]
    tasks = [asyncio.create_task(_holder(slots, "flood", order, releases[i])) for i in range(5)]
    await _until(lambda: len(order) == 2)
    owner = asyncio.create_task(_holder(slots, "owner", order, releases[5]))
    await asyncio.sleep(0.01)

    releases[0].set()
    await _until(lambda: len(order) == 3)
    assert order == ["flood", "flood", "owner"]
    for release in releases:
        release.set()
    await asyncio.gather(*tasks, owner)
    assert order == ["flood", "flood", "owner", "flood", "flood", "flood"]
    assert slots.in_use == 0


async def test_a_waiter_cancelled_takes_no_place_and_one_cancelled_as_it_was_given_one_passes_it_on() -> None:
    """A cancelled waiter leaves the queue; a waiter given a place in the same turn it is cancelled gives
    the place to the next waiter, so no place is ever lost."""
    slots = FairSlots(1)
    order: list[str] = []
    first, release = asyncio.Event(), asyncio.Event()
    holder = asyncio.create_task(_holder(slots, "a", order, first))
    await _until(lambda: order == ["a"])
    gone = asyncio.create_task(_holder(slots, "b", order, release))
    granted_then_cancelled = asyncio.create_task(_holder(slots, "c", order, release))
    last = asyncio.create_task(_holder(slots, "d", order, release))
    await asyncio.sleep(0.01)
    gone.cancel()
    await asyncio.sleep(0)

    first.set()
    await asyncio.sleep(0)  # the holder leaves: its place is given to "c", which has not resumed yet
    granted_then_cancelled.cancel()
    release.set()
    await asyncio.gather(holder, last)

    assert order == ["a", "d"]
    assert gone.cancelled()
    assert granted_then_cancelled.cancelled()
    assert slots.in_use == 0


async def test_the_scheduler_runs_the_owners_message_before_a_flood_that_came_first() -> None:
    """With one place, a person's six slow runs in six conversations queued before the owner's run: the
    owner's runs second, as soon as the first place comes free, not seventh."""
    started: list[str] = []
    release = asyncio.Event()

    async def run(request: RunRequest) -> None:
        started.append(request.person)
        await release.wait()

    scheduler = RunScheduler(MemoryStore(), run, max_concurrent=1)
    for c in range(6):
        await scheduler.submit(RunRequest(f"flood{c}", "t", "alice", person="flood"))
    await scheduler.submit(RunRequest("mine", "t", "alice", person="owner"))
    await _until(lambda: started == ["flood"])
    release.set()
    await scheduler.drain(10.0)

    assert started[:2] == ["flood", "owner"]
    assert started.count("flood") == 6


class Slow:
    """A model that answers after the test lets it."""

    name = "slow"

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.people: list[str] = []

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Note whom the run answers (its last message), then wait and answer."""
        self.people.append(request.messages[-1].content.split(":")[0])
        await self.release.wait()
        return CompletionResult(text="ok")


async def test_the_pipeline_gives_each_run_the_person_it_answers_and_journals_it(cast: Cast) -> None:
    """Through the production wiring, a run is scheduled as the person who wrote to the agent (the
    journal keeps it for a redo), so a whitelisted person's flood waits behind the owner's message."""
    guest = KeyPair.from_seed(40)
    model = Slow()
    rig = pipeline.build_rig(cast, backend=model, max_concurrent_runs=1, whitelist=[guest.pubkey])
    for n in range(3):
        flood = cast.factory.event(guest, f"guest: question {n}", kind=11, tags=[["p", cast.alice.pubkey]])
        await rig.dispatcher.handle(flood)
    await _until(lambda: len(model.people) == 1)
    journal = await rig.store.get_meta(PENDING_RUNS_KEY) or ""
    await rig.dispatcher.handle(cast.user_says("owner: hello", kind=11, tags=[["p", cast.alice.pubkey]]))
    model.release.set()
    await rig.settle()

    assert model.people == ["guest", "owner", "guest", "guest"]
    replies = [e for e in rig.publisher.published if e.pubkey == cast.alice.pubkey and e.content == "ok"]
    assert len(replies) == 4
    assert guest.pubkey in journal
    entry = next(e for e in json.loads(journal) if e.get("person"))
    recovered = journaled_request(entry, "k")
    assert recovered is not None
    assert recovered.person == guest.pubkey
