"""Delegation threads on a store several daemons share (docs/ARCHITECTURE.md, "Delegation threads" and
"Scale-out"): no daemon's cached thread overwrites another daemon's exchange."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext

import pytest

from tenex_daemon import MemoryStore
from tenex_daemon.core.llm import CompletionRequest, CompletionResult
from tenex_daemon.core.ports import Peers
from tenex_daemon.core.threads import ConversationThread, ThreadPersistenceError
from tenex_daemon.services.agent_runner import AgentProfile
from tenex_daemon.services.threads import META_PREFIX, ThreadManager
from tenex_daemon.services.tools import SEND_MESSAGE
from tenex_daemon.testing.fakes import PeerBus, ScriptedBackend
from tests import pipeline
from tests.conftest import Cast
from tests.unit.services.test_tool_loop import calls, text


class SharedMemoryStore(MemoryStore):
    """A memory store as daemons sharing a database see it: a :class:`Peers` (a name or run lease is free
    unless held) whose lease on a key excludes every other holder, as PostgreSQL's advisory locks do."""

    def __init__(self) -> None:
        super().__init__()
        self.names_lost = 0
        self.leased: list[str] = []
        self.meta_reads = 0
        self._locks: dict[str, asyncio.Lock] = {}

    async def get_meta(self, key: str) -> str | None:
        """Return a stored small value (counted)."""
        self.meta_reads += 1
        return await super().get_meta(key)

    @asynccontextmanager
    async def lease(self, conversation_id: str) -> AsyncIterator[None]:
        """Hold the key's lock (recorded) while the block runs."""
        self.leased.append(conversation_id)
        async with self._locks.setdefault(conversation_id, asyncio.Lock()):
            yield

    @asynccontextmanager
    async def try_take(self, name: str, on_lost: Callable[[], None] | None = None) -> AsyncIterator[bool]:
        """Take ``name``'s lock if nobody holds it."""
        lock = self._locks.setdefault(name, asyncio.Lock())
        if lock.locked():
            yield False
            return
        async with lock:
            yield True

    def alive(self, name: str) -> AbstractAsyncContextManager[None]:
        """No name to hold here."""
        return nullcontext()

    async def keys_with_prefix(self, prefix: str) -> list[str]:
        """No other daemon's keys."""
        return []

    async def forget(self, key: str) -> None:
        """Nothing to forget."""


class Asker:
    """Alice: each run asks Bob the next numbered question once, then answers."""

    name = "asker"

    def __init__(self) -> None:
        self.calls = 0
        self.asked = 0

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Ask on a run's first round, answer on its second."""
        self.calls += 1
        if self.calls % 2 == 1:
            self.asked += 1
            return calls((f"c{self.calls}", SEND_MESSAGE, {"to": "bob", "message": f"question {self.asked}"}))
        return text("ok")


class Bob(ScriptedBackend):
    """Bob on one daemon: each answer names the daemon and how many it gave."""

    def __init__(self, daemon: str) -> None:
        super().__init__([])
        self.daemon = daemon

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Answer, naming the daemon."""
        self.requests.append(request)
        return text(f"answer {len(self.requests)} from {self.daemon}")


async def stored_items(store: MemoryStore, thread_id: str) -> list[tuple[str, str]]:
    """The (from, content) of the stored thread's items."""
    data = await store.get_meta(META_PREFIX + thread_id)
    assert data is not None
    return [(item["from"], item["content"]) for item in ConversationThread.from_json(data).items]


async def test_two_daemons_keep_each_others_exchanges_in_the_pair_thread(cast: Cast) -> None:
    """Daemon a asks, daemon b asks, daemon a asks again in one conversation: the stored thread holds the
    three exchanges in order, and Bob on daemon a, asked last, saw daemon b's exchange."""
    store, bus = SharedMemoryStore(), PeerBus()
    bobs = {"a": Bob("a"), "b": Bob("b")}

    def daemon(name: str) -> pipeline.Rig:
        profiles = {
            "alice": AgentProfile(cast.alice, "", Asker()),
            "bob": AgentProfile(cast.bob, "", bobs[name]),
            "orchestrator": AgentProfile(cast.orchestrator, "", ScriptedBackend([])),
        }
        return pipeline.build_rig(
            cast, profiles=profiles, store=store, peers=store, messages=bus, instance=name,
            composer=pipeline.real_composer(cast),
        )

    assert isinstance(store, Peers)
    a, b = daemon("a"), daemon("b")
    root = cast.user_says("start", kind=11, tags=[["p", cast.alice.pubkey]])
    await a.dispatcher.handle(root)
    await a.quiet()
    await b.dispatcher.handle(cast.user_says("again", tags=[["E", root.id, "", root.pubkey], ["p", cast.alice.pubkey]]))
    await b.quiet()
    await a.dispatcher.handle(cast.user_says("third", tags=[["E", root.id, "", root.pubkey], ["p", cast.alice.pubkey]]))
    await a.quiet()

    thread_id = ThreadManager.key(root.id, "alice", "bob")
    assert await stored_items(store, thread_id) == [
        ("alice", "question 1"), ("bob", "answer 1 from a"),
        ("alice", "question 1"), ("bob", "answer 1 from b"),
        ("alice", "question 2"), ("bob", "answer 2 from a"),
    ]
    seen = [m.content for m in bobs["a"].requests[-1].messages if hasattr(m, "content")]
    assert seen == ["question 1", "answer 1 from a", "question 1", "answer 1 from b", "question 2"]
    assert META_PREFIX + thread_id in store.leased
    await a.settle()
    await b.settle()


async def test_a_save_from_a_stale_copy_adds_to_the_stored_thread_under_its_lease() -> None:
    """Two daemons hold the same thread; one saves an exchange, then the other saves its own from its copy
    loaded before: the stored thread holds both (the second save loaded it again under the thread's lease),
    and the second daemon's copy is brought up to it."""
    store = SharedMemoryStore()
    first, second = ThreadManager(store=store), ThreadManager(store=store)
    mine = await first.get_thread("c", "alice", "bob")
    theirs = await second.get_thread("c", "alice", "bob")

    await first.add_items_and_save(mine, [{"from": "alice", "content": "q1", "event_id": "1"}])
    await second.add_items_and_save(theirs, [{"from": "alice", "content": "q2", "event_id": "2"}])

    assert await stored_items(store, "c__alice__bob") == [("alice", "q1"), ("alice", "q2")]
    assert [item["content"] for item in theirs.items] == ["q1", "q2"]
    assert store.leased.count("thread:c__alice__bob") == 2


async def test_a_failed_shared_save_keeps_its_items_for_the_next_save_once() -> None:
    """On a shared store, items whose save failed stay in the cached thread across a reload and are stored
    once with the next successful save, after what another daemon stored meanwhile."""

    class FailingOnce(SharedMemoryStore):
        fail = True

        async def set_meta(self, key: str, value: str) -> None:
            if self.fail:
                self.fail = False
                raise OSError("disk full")
            await super().set_meta(key, value)

    store = FailingOnce()
    first, other = ThreadManager(store=store), ThreadManager(store=store)
    thread = await first.get_thread("c", "alice", "bob")
    with pytest.raises(ThreadPersistenceError, match="disk full"):
        await first.add_items_and_save(thread, [{"from": "alice", "content": "lost?", "event_id": "1"}])
    theirs = await other.get_thread("c", "alice", "bob")
    await other.add_items_and_save(theirs, [{"from": "alice", "content": "other", "event_id": "2"}])

    again = await first.get_thread("c", "alice", "bob")
    assert again is thread
    assert [item["content"] for item in again.items] == ["other", "lost?"]
    await first.add_items_and_save(again, [{"from": "bob", "content": "next", "event_id": "3"}])
    assert await stored_items(store, "c__alice__bob") == [("alice", "other"), ("alice", "lost?"), ("bob", "next")]


async def test_a_thread_left_out_of_the_cache_during_its_exchange_still_adds_to_the_stored_one() -> None:
    """On a shared store, a thread whose cache entry was dropped while its exchange ran (over max_cached) is
    saved by adding what it holds past the stored thread's start, so the exchange another daemon stored
    meanwhile stays."""
    store = SharedMemoryStore()
    first, other = ThreadManager(store=store, max_cached=1), ThreadManager(store=store)
    thread = await first.get_thread("c", "alice", "bob")
    await first.add_items_and_save(thread, [{"from": "alice", "content": "q1", "event_id": "1"}])
    await first.get_thread("c", "alice", "carol")  # another exchange meanwhile: this one leaves the cache
    await first.add_items_and_save(await first.get_thread("c", "alice", "carol"), [{"from": "alice", "content": "x"}])
    theirs = await other.get_thread("c", "alice", "bob")
    await other.add_items_and_save(theirs, [{"from": "alice", "content": "q2", "event_id": "2"}])

    await first.add_items_and_save(thread, [{"from": "bob", "content": "a1", "event_id": "3"}])

    assert await stored_items(store, "c__alice__bob") == [("alice", "q1"), ("alice", "q2"), ("bob", "a1")]


async def test_a_single_daemon_store_keeps_serving_the_cached_thread() -> None:
    """A store no other daemon shares (not a Peers) is read once per thread: later gets return the cached
    object without reading the store, and saves write the whole thread without a lease."""
    store = SharedMemoryStore()
    threads = ThreadManager(store=store, shared=False)
    thread = await threads.get_thread("c", "alice", "bob")
    reads = store.meta_reads
    await threads.add_items_and_save(thread, [{"from": "alice", "content": "q", "event_id": "1"}])

    assert await threads.get_thread("c", "bob", "alice") is thread
    assert store.meta_reads == reads
    assert store.leased == []
    assert not isinstance(MemoryStore(), Peers)
