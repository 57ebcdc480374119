"""Concurrency: many add_event calls at once lose nothing; PostgreSQL leases are exclusive across clients."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from tenex_daemon.adapters.storage.filesystem import FileSystemStore, FsyncPolicy
from tenex_daemon.adapters.storage.postgres import PostgresStore
from tenex_daemon.adapters.storage.postgres_sessions import listener_name
from tenex_daemon.core.ports import Store
from tenex_daemon.core.search import SearchQuery
from tenex_daemon.services.conversation_manager import ConversationManager
from tests.conftest import Cast
from tests.contract.postgres_server import PostgresServer
from tests.pipeline import build_rig

pytestmark = pytest.mark.integration


@pytest.fixture(params=["fs-always", "fs-batch", "postgres"])
async def durable_store(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[Store, Store]]:
    """A durable store and a second, unopened instance over the same data (for the reopen check)."""
    kind: str = request.param
    if kind == "postgres":
        server: PostgresServer = request.getfixturevalue("postgres_server")
        dsn = await server.create_database()
        first: Store = PostgresStore(dsn)
        second: Store = PostgresStore(dsn)
    else:
        policy: FsyncPolicy = "always" if kind == "fs-always" else "batch"
        first = FileSystemStore(tmp_path / "home", fsync=policy)
        second = FileSystemStore(tmp_path / "home", fsync=policy)
    await first.open()
    yield first, second
    await first.close()
    await second.close()


async def test_200_concurrent_add_events_over_10_conversations(
    durable_store: tuple[Store, Store], cast: Cast
) -> None:
    """200 concurrent add_event calls over 10 conversations are all accepted, in submission order, durably."""
    store, reopened = durable_store
    manager = ConversationManager(store, cast.agents, cast.project.pubkey)
    roots = [cast.user_says(f"conversation {i}", kind=11) for i in range(10)]
    for root in roots:
        await manager.create_conversation(root)
    submitted: dict[str, list[str]] = {root.id: [root.id] for root in roots}
    calls = []
    for n in range(200):
        root = roots[n % 10]
        speaker = (cast.user_says, cast.alice_says, cast.bob_says)[n % 3]
        event = speaker(f"message {n}")
        submitted[root.id].append(event.id)
        calls.append(manager.add_event(root.id, event))
    results = await asyncio.gather(*calls)
    assert all(results)
    for root in roots:
        conversation = await manager.get_conversation(root.id)
        assert conversation is not None
        assert [e.id for e in conversation.history] == submitted[root.id]
    await store.close()
    await reopened.open()
    for root in roots:
        loaded = await reopened.load(root.id)
        assert loaded is not None
        assert [e.id for e in loaded.history] == submitted[root.id]


async def test_two_postgres_clients_never_hold_one_lease_together(postgres_server: PostgresServer) -> None:
    """Two PostgresStore clients racing for one conversation's lease never hold it at the same time."""
    dsn = await postgres_server.create_database()
    clients = [PostgresStore(dsn), PostgresStore(dsn)]
    for client in clients:
        await client.open()
    holders: list[int] = []
    overlaps = 0
    entries = 0

    async def contend(client_index: int) -> None:
        nonlocal overlaps, entries
        for _ in range(10):
            async with clients[client_index].lease("conversation-1"):
                holders.append(client_index)
                if len(holders) > 1:
                    overlaps += 1
                entries += 1
                await asyncio.sleep(0.005)
                holders.remove(client_index)

    try:
        async with asyncio.timeout(60):
            await asyncio.gather(*(contend(i % 2) for i in range(8)))
    finally:
        for client in clients:
            await client.close()
    assert overlaps == 0
    assert entries == 80


async def test_two_daemons_accept_each_event_exactly_once(postgres_server: PostgresServer, cast: Cast) -> None:
    """Two managers on two PostgresStore clients racing to add the same events accept each exactly once."""
    dsn = await postgres_server.create_database()
    stores = [PostgresStore(dsn), PostgresStore(dsn)]
    for store in stores:
        await store.open()
    managers = [ConversationManager(store, cast.agents, cast.project.pubkey) for store in stores]
    root = cast.user_says("shared conversation", kind=11)
    await managers[0].create_conversation(root)
    events = [cast.user_says(f"hello {i}") for i in range(30)]
    try:
        results = await asyncio.gather(
            *(manager.add_event(root.id, event) for event in events for manager in managers)
        )
        conversation = await stores[1].load(root.id)
    finally:
        for store in stores:
            await store.close()
    assert sum(results) == len(events)
    assert conversation is not None
    assert sorted(e.id for e in conversation.history[1:]) == sorted(e.id for e in events)


async def test_two_daemons_with_a_reply_each_of_a_thread_whose_root_is_missing_start_one_conversation(
    postgres_server: PostgresServer, cast: Cast
) -> None:
    """Two daemons sharing a database each take in a different reply of one thread whose root no relay
    has, at once: one conversation is started for the thread and both replies are in it (before, each
    daemon started its own and the agent answered in two conversations)."""
    dsn = await postgres_server.create_database()
    stores = [PostgresStore(dsn), PostgresStore(dsn)]
    for store in stores:
        await store.open()
    rigs = [
        build_rig(cast, store=store, peers=store, journal_key=f"runs.pending.{name}", instance=name)
        for store, name in zip(stores, ("a", "b"), strict=True)
    ]
    missing = "ab" * 32
    tags = [["E", missing, "", cast.user.pubkey], ["e", missing, "", "root"], ["p", cast.alice.pubkey]]
    replies = [cast.user_says(f"reply {n} in a thread whose root is gone", tags=tags) for n in range(2)]
    try:
        await asyncio.gather(*(rig.dispatcher.handle(reply) for rig, reply in zip(rigs, replies, strict=True)))
        for rig in rigs:
            await rig.settle()
        rows = await stores[0].search(SearchQuery())
        conversation = await stores[0].load(rows[0].id)
    finally:
        for store in stores:
            await store.close()
    assert len(rows) == 1
    assert conversation is not None
    assert {reply.id for reply in replies} <= {event.id for event in conversation.history}


@pytest.fixture
async def clients(postgres_server: PostgresServer) -> AsyncIterator[list[PostgresStore]]:
    """Two open PostgresStore clients of one fresh database (two daemons' stores), closed afterwards."""
    dsn = await postgres_server.create_database()
    opened = [PostgresStore(dsn), PostgresStore(dsn)]
    for client in opened:
        await client.open()
    yield opened
    for client in opened:
        await client.close()


async def test_two_daemons_never_run_one_conversations_agents_at_once(clients: list[PostgresStore]) -> None:
    """With daemons sharing PostgreSQL, a run holds its conversation's run lease: another daemon's run in
    that conversation waits until it ends (holding no connection meanwhile), a run in another
    conversation does not wait, and the short step lease intake uses stays free during the run."""
    from tenex_daemon.services.runs import RunRequest, RunScheduler

    events: list[str] = []
    release = asyncio.Event()

    async def run_first(request: RunRequest) -> None:
        events.append(f"start {request.trigger_id}")
        await release.wait()
        events.append(f"end {request.trigger_id}")

    async def run_second(request: RunRequest) -> None:
        events.append(f"start {request.trigger_id}")

    first = RunScheduler(clients[0], run_first, peers=clients[0])
    second = RunScheduler(clients[1], run_second, peers=clients[1])
    try:
        await first.submit(RunRequest("c1", "a1", "alice"))
        while "start a1" not in events:  # noqa: ASYNC110 - the run has taken its lease
            await asyncio.sleep(0.01)
        await second.submit(RunRequest("c1", "b1", "bob"))
        await second.submit(RunRequest("c2", "b2", "bob"))
        async with asyncio.timeout(10):
            while "start b2" not in events:  # noqa: ASYNC110 - another conversation runs at once
                await asyncio.sleep(0.01)
            async with clients[1].lease("c1"):  # intake's step lease is not the run's
                events.append("step c1")
        await asyncio.sleep(0.3)
        assert "start b1" not in events
    finally:
        release.set()
        await first.drain(10.0)
        await second.drain(10.0)

    assert events.index("end a1") < events.index("start b1")
    assert events.index("step c1") < events.index("end a1")


class CountingPeers:
    """A store's ``Peers`` that counts the names (run leases) held at once."""

    def __init__(self, store: PostgresStore) -> None:
        self.store = store
        self.held = 0
        self.most_held = 0
        self.names_lost = 0

    @asynccontextmanager
    async def try_take(self, name: str, on_lost: Callable[[], None] | None = None) -> AsyncIterator[bool]:
        async with self.store.try_take(name, on_lost) as taken:
            self.held += 1
            self.most_held = max(self.most_held, self.held)
            try:
                yield taken
            finally:
                self.held -= 1

    def alive(self, name: str) -> AbstractAsyncContextManager[None]:
        return self.store.alive(name)

    async def keys_with_prefix(self, prefix: str) -> list[str]:
        return await self.store.keys_with_prefix(prefix)

    async def forget(self, key: str) -> None:
        await self.store.forget(key)


async def test_runs_waiting_in_more_conversations_than_the_pools_hold_all_finish_holding_no_lease(
    postgres_server: PostgresServer,
) -> None:
    """With daemons sharing PostgreSQL, runs waiting in more conversations than the pools have connections
    all finish, and no more run leases (connections) are held at once than runs may run: a waiting run
    holds none, so the running ones always get their step leases (runs waiting under the cap with their
    run lease on every lease connection hung for good)."""
    from tenex_daemon.services.runs import RunRequest, RunScheduler

    dsn = await postgres_server.create_database()
    store = PostgresStore(dsn, lease_pool_size=6, name_pool_size=5)
    await store.open()
    peers = CountingPeers(store)
    finished: list[str] = []

    async def run(request: RunRequest) -> None:
        async with store.lease(request.conversation_id):  # a step of the run
            await asyncio.sleep(0.01)
        finished.append(request.conversation_id)

    scheduler = RunScheduler(store, run, max_concurrent=3, peers=peers)
    try:
        for n in range(30):
            await scheduler.submit(RunRequest(f"c{n}", f"t{n}", "alice"))
        async with asyncio.timeout(30):
            while len(finished) < 30:  # noqa: ASYNC110 - every run ends
                await asyncio.sleep(0.05)
    finally:
        await scheduler.drain(5.0)  # a run still waiting for a connection is cancelled
        await store.close()
    assert sorted(finished) == sorted(f"c{n}" for n in range(30))
    assert peers.most_held == 3


async def test_a_run_waiting_for_another_daemons_run_lease_gives_its_place_back(
    clients: list[PostgresStore],
) -> None:
    """A run whose conversation another daemon is running does not keep its place under the cap while it
    waits: with one place, a run in another conversation goes first, and the waiting one runs once the
    other daemon's run ends."""
    from tenex_daemon.services.runs import RunRequest, RunScheduler

    events: list[str] = []
    release = asyncio.Event()

    async def run_first(request: RunRequest) -> None:
        events.append(f"start {request.trigger_id}")
        await release.wait()

    async def run_second(request: RunRequest) -> None:
        events.append(f"start {request.trigger_id}")

    first = RunScheduler(clients[0], run_first, peers=clients[0])
    second = RunScheduler(clients[1], run_second, max_concurrent=1, peers=clients[1])
    try:
        await first.submit(RunRequest("c1", "a1", "alice"))
        async with asyncio.timeout(10):
            while "start a1" not in events:  # noqa: ASYNC110 - the run has taken its lease
                await asyncio.sleep(0.01)
            await second.submit(RunRequest("c1", "b1", "bob"))
            await asyncio.sleep(0.2)  # b1 is polling for c1's run lease
            await second.submit(RunRequest("c2", "b2", "bob"))
            while "start b2" not in events:  # noqa: ASYNC110 - the one place is free for another conversation
                await asyncio.sleep(0.01)
        assert "start b1" not in events
        release.set()
        async with asyncio.timeout(10):
            while "start b1" not in events:  # noqa: ASYNC110 - the waiting run goes once the lease is free
                await asyncio.sleep(0.01)
    finally:
        release.set()
        await first.drain(5.0)
        await second.drain(5.0)  # a run still waiting is cancelled
    assert events == ["start a1", "start b2", "start b1"]


async def test_daemons_sharing_a_database_hear_what_each_tells_even_after_a_broken_connection(
    postgres_server: PostgresServer,
) -> None:
    """Two PostgreSQL clients hear each other's messages on a channel (the teller too) and nothing told on
    another; once the server ends the hearing connection, the client listens again on a new one and hears
    what is told after that."""
    dsn = await postgres_server.create_database()
    first, second = PostgresStore(dsn), PostgresStore(dsn)
    await first.open()
    await second.open()
    killed: list[int] = []
    heard: dict[str, list[str]] = {"first": [], "second": []}
    arrived = asyncio.Event()

    def hearing(name: str) -> Callable[[str], None]:
        def on_message(message: str) -> None:
            heard[name].append(message)
            arrived.set()

        return on_message

    async def until_heard(count: int) -> None:
        while len(heard["first"]) < count or len(heard["second"]) < count:
            arrived.clear()
            await asyncio.wait_for(arrived.wait(), 10)

    try:
        async with first.hear("stops", hearing("first")), second.hear("stops", hearing("second")):
            await first.tell("stops", "one")
            await second.tell("other channel", "not heard")
            await second.tell("stops", "two")
            await until_heard(2)
            killed = await listeners(first)
            async with first.pool.acquire() as conn:  # the server ends both listening connections
                await conn.execute("SELECT pg_terminate_backend(pid) FROM unnest($1::int[]) AS pid", killed)
            async with asyncio.timeout(20):  # each notices on its next check and listens on a new one
                while len(set(await listeners(first)) - set(killed)) < 2:  # noqa: ASYNC110 - polls the server
                    await asyncio.sleep(0.1)
            await first.tell("stops", "three")
            await until_heard(3)
    finally:
        await first.close()
        await second.close()

    assert len(killed) == 2
    assert heard["first"] == heard["second"] == ["one", "two", "three"]
    assert "not heard" not in heard["first"] + heard["second"]


async def listeners(store: PostgresStore) -> list[int]:
    """The server processes of the connections listening on the channel ``stops`` in the store's database."""
    async with store.pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND application_name = $1",
            listener_name("stops"),
        )
    return [int(row["pid"]) for row in rows]


async def test_a_run_lease_is_taken_again_after_a_broken_connection_or_reported_lost(
    postgres_server: PostgresServer,
) -> None:
    """A run lease kept through a broken connection (``try_take`` with ``on_lost``): when the server ends
    the session holding it, it is taken again on a new one (another client cannot take it then); when
    another session gets it first (it was waiting for it), the holder is told it is lost."""
    dsn = await postgres_server.create_database()
    mine, theirs = PostgresStore(dsn), PostgresStore(dsn)
    await mine.open()
    await theirs.open()
    lost = asyncio.Event()
    try:
        async with mine.try_take("run:c", on_lost=lost.set) as taken:
            first = await lock_holders(theirs)
            await end_backends(theirs, first)
            async with asyncio.timeout(20):  # the keeper notices on its next check and takes it again
                while (await lock_holders(theirs)) in ([], first):  # noqa: ASYNC110 - polls the server
                    await asyncio.sleep(0.05)
            async with theirs.try_take("run:c") as taken_by_them:
                pass
            kept_through_a_break = not lost.is_set()
            waiter = await asyncpg.connect(dsn)  # another session waits for the lock: it gets it first
            waiting = asyncio.create_task(waiter.execute("SELECT pg_advisory_lock(hashtextextended('run:c', 0))"))
            async with asyncio.timeout(10):
                while not await lock_holders(theirs, granted=False):  # noqa: ASYNC110 - polls the server
                    await asyncio.sleep(0.02)
            await end_backends(theirs, await lock_holders(theirs))
            await asyncio.wait_for(waiting, 10)
            await asyncio.wait_for(lost.wait(), 15)
            await waiter.close()
    finally:
        await mine.close()
        await theirs.close()

    assert taken
    assert len(first) == 1
    assert not taken_by_them
    assert kept_through_a_break
    assert lost.is_set()


async def lock_holders(store: PostgresStore, *, granted: bool = True) -> list[int]:
    """The server processes holding (or, not ``granted``, waiting for) an advisory lock in the store's
    database (only the test takes any)."""
    async with store.pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted = $1 AND database = "
            "(SELECT oid FROM pg_database WHERE datname = current_database()) ORDER BY pid",
            granted,
        )
    return [int(row["pid"]) for row in rows]


async def end_backends(store: PostgresStore, pids: list[int]) -> None:
    """Have the server end these processes (as a restart ends every connection)."""
    async with store.pool.acquire() as conn:
        await conn.execute("SELECT pg_terminate_backend(pid) FROM unnest($1::int[]) AS pid", pids)


async def test_a_daemons_name_is_kept_through_a_broken_and_a_silent_connection(
    postgres_server: PostgresServer,
) -> None:
    """A daemon's name (``alive``) is taken again after the server ends the session holding it, and after
    that session's connection goes silent (a network that stops carrying it): the check times out, the
    silent session is ended and a new one holds the name, which another client never finds free
    meanwhile but for a moment (a peer believes a name dead only once it stayed free for seconds). Once
    every connection is silent again, the daemon still lets go of its name and closes its store in seconds,
    not forever."""
    dsn = await postgres_server.create_database()
    proxy = FreezingProxy(postgres_server.port)
    await proxy.start()
    mine = PostgresStore(dsn.replace(f":{postgres_server.port}/", f":{proxy.port}/"))
    theirs = PostgresStore(dsn)
    await mine.open()
    await theirs.open()
    found_free: list[float] = []
    watching = True
    watcher: asyncio.Task[None] | None = None

    async def watch() -> None:  # another daemon asking, all along, whether the name is free
        while watching:
            async with theirs.try_take("daemon:a") as free:
                if free:
                    found_free.append(asyncio.get_running_loop().time())
            await asyncio.sleep(0.02)

    try:
        async with mine.alive("daemon:a"):
            first = await lock_holders(theirs)
            await end_backends(theirs, first)
            async with asyncio.timeout(20):
                while (await lock_holders(theirs)) in ([], first):  # noqa: ASYNC110 - polls the server
                    await asyncio.sleep(0.05)
            second = await lock_holders(theirs)
            watcher = asyncio.create_task(watch())
            proxy.freeze()  # every connection open now stops carrying data; new ones still work
            async with asyncio.timeout(30):  # a check times out (5 s), the silent session is ended
                while (await lock_holders(theirs)) in ([], second):  # noqa: ASYNC110 - polls the server
                    await asyncio.sleep(0.05)
            await asyncio.sleep(1)
            watching = False
            await watcher
            third = await lock_holders(theirs)
            proxy.freeze()  # silent again, and the daemon shuts down meanwhile
            started = asyncio.get_running_loop().time()
        await asyncio.wait_for(mine.close(), 30)
        closing_took = asyncio.get_running_loop().time() - started
    finally:
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        await proxy.close()
        await mine.close()
        await theirs.close()

    assert len(first) == 1
    assert len(second) == 1
    assert second != first
    assert len(third) == 1
    assert third != second
    assert max(found_free, default=0) - min(found_free, default=0) < 0.5
    assert closing_took < 20


class FreezingProxy:
    """A TCP proxy to 127.0.0.1:``target`` whose open connections :meth:`freeze` stops carrying data
    (their sockets stay open, as with a network that drops every packet); later ones carry it."""

    def __init__(self, target: int) -> None:
        self._target = target
        self._server: asyncio.Server | None = None
        self._pumps: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self.port = 0

    async def start(self) -> None:
        """Listen on a free port of 127.0.0.1."""
        self._server = await asyncio.start_server(self._connected, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self._target)
        except OSError:
            writer.close()
            return
        self._writers.append(upstream_writer)
        for source, sink in ((reader, upstream_writer), (upstream_reader, writer)):
            task = asyncio.create_task(self._pump(source, sink))
            self._pumps.add(task)
            task.add_done_callback(self._pumps.discard)

    @staticmethod
    async def _pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):  # a side that cut its connection (a reset)
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()
        sink.close()

    def freeze(self) -> None:
        """Stop carrying the data of every connection open now."""
        for task in list(self._pumps):
            task.cancel()

    async def close(self) -> None:
        """Stop listening and close every connection."""
        pumps = list(self._pumps)
        self.freeze()
        await asyncio.gather(*pumps, return_exceptions=True)
        for writer in self._writers:
            writer.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def test_every_pools_connections_ask_the_server_to_notice_a_dead_daemon_within_seconds(
    postgres_server: PostgresServer,
) -> None:
    """The connections of each pool (queries, conversation leases, names) carry the server's TCP keepalive
    (idle 10 s, then a probe every 5 s, 3 unanswered end the session), so a daemon whose machine died
    without closing them has its sessions, and the locks they hold, ended within about 25 s."""
    dsn = await postgres_server.create_database()
    store = PostgresStore(dsn)
    await store.open()
    try:
        seen = [await _keepalive_of(pool) for pool in (store.pool, store._lease_pool, store._name_pool)]
    finally:
        await store.close()

    assert seen == [("10", "5", "3")] * 3


async def _keepalive_of(pool: Any) -> tuple[str, ...]:
    """The keepalive settings of a connection of ``pool`` (the test server is reached over TCP)."""
    names = ("tcp_keepalives_idle", "tcp_keepalives_interval", "tcp_keepalives_count")
    async with pool.acquire() as conn:
        return tuple([str(await conn.fetchval(f"SHOW {name}")) for name in names])
