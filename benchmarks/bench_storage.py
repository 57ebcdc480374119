"""Storage benchmark: tenexd's stores next to their peers, in one run, at equal durability.

Every contender makes each commit durable before it is acknowledged: FileSystemStore
fsyncs (per event, or per group commit in ``batch``), PostgreSQL runs with ``fsync=on`` and
``synchronous_commit=on``, the SQLite peers with ``PRAGMA synchronous=FULL``, and the
rewrite-the-whole-JSON-file store (TENEX's TypeScript pattern) fsyncs each rewrite.

Measured (medians of ``--repeat`` runs):

* append throughput, one writer (sequential appends to one conversation) and 16 writers
  (16 conversations appended to concurrently, as a daemon does);
* reading back a 1,000-event conversation from a freshly opened store;
* start-up time, RSS and bytes on disk of a FileSystemStore home of 10,000 conversations /
  1,000,000 events (``--scale`` shrinks it), and bytes on disk at a tenth of that size.

Peers are optional imports (``benchmarks/run_storage.sh`` installs them in their own venv);
a missing peer is reported as such, never silently skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib
import json
import logging
import os
import resource
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from benchmarks.common import emit_figures
from tenex_daemon.adapters.storage.filesystem import FileSystemStore, FsyncPolicy
from tenex_daemon.adapters.storage.postgres import PostgresStore
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.events import NostrEvent, compute_event_id

if TYPE_CHECKING:  # annotations only: the A/B script runs this file against older trees too
    from tenex_daemon.core.ports import Store

WRITERS = 16
CONTENT = "Please look at the relay reconnect logic; it drops subscriptions after a timeout. " * 2


def make_event(n: int, pubkey: str) -> NostrEvent:
    """A realistic event (hashed id; the signature is random hex: no store verifies it)."""
    content = f"{CONTENT}#{n}"
    tags = [["e", "a" * 64, "", "root"], ["p", pubkey]]
    created_at = 1_700_000_000 + n
    event_id = compute_event_id(pubkey, created_at, 1111, tags, content)
    return NostrEvent.model_construct(
        id=event_id, pubkey=pubkey, created_at=created_at, kind=1111, tags=tags, content=content,
        sig=hashlib.sha512(event_id.encode()).hexdigest(),
    )


def pubkey_of(n: int) -> str:
    """A deterministic 64-hex public key."""
    return hashlib.sha256(f"author-{n}".encode()).hexdigest()


def new_conversation(n: int) -> Conversation:
    """A conversation rooted at event ``n`` (one event of history)."""
    root = make_event(10_000_000 + n, pubkey_of(0))
    conversation = Conversation(id=root.id, title=f"Conversation {n}", created_at=n, updated_at=n)
    conversation.append(root)
    return conversation


# --- contenders ----------------------------------------------------------------------------------


class Contender:
    """One store under test: open, create a conversation, append one event, read back, close."""

    name = "?"
    note = ""

    async def open(self, folder: Path) -> None:
        """Prepare an empty store under ``folder``."""

    async def close(self) -> None:
        """Release everything."""

    async def create(self, conversation: Conversation) -> None:
        """Store a new conversation."""

    async def append(self, conversation_id: str, event: NostrEvent) -> None:
        """Durably append one event."""

    async def read(self, conversation_id: str) -> int:
        """Read a whole conversation from a freshly opened store; return its event count."""
        return 0


class TenexContender(Contender):
    """A tenexd Store."""

    def __init__(self, name: str, factory: Callable[[Path], Awaitable[Store]]) -> None:
        self.name = name
        self._factory = factory
        self._folder = Path()
        self.store: Store | None = None

    async def open(self, folder: Path) -> None:
        """Open a store in ``folder``."""
        self._folder = folder
        self.store = await self._factory(folder)
        await self.store.open()

    async def close(self) -> None:
        """Close the store."""
        if self.store is not None:
            await self.store.close()
            self.store = None

    async def create(self, conversation: Conversation) -> None:
        """Create through the store."""
        assert self.store is not None
        await self.store.create(conversation)

    async def append(self, conversation_id: str, event: NostrEvent) -> None:
        """append_event."""
        assert self.store is not None
        await self.store.append_event(conversation_id, event)

    async def read(self, conversation_id: str) -> int:
        """Reopen (cold cache) and load."""
        await self.close()
        self.store = await self._factory(self._folder)
        await self.store.open()
        started = time.perf_counter()
        conversation = await self.store.load(conversation_id)
        self.read_seconds = time.perf_counter() - started
        assert conversation is not None
        return len(conversation.history)


class JsonRewriteContender(Contender):
    """TENEX TypeScript's pattern: the whole conversation JSON rewritten (temp, fsync, rename) per event."""

    name = "JSON rewrite per event"

    async def open(self, folder: Path) -> None:
        """Make the folder."""
        self._folder = folder
        await asyncio.to_thread(folder.mkdir, parents=True, exist_ok=True)
        self._histories: dict[str, list[str]] = {}

    def _write(self, conversation_id: str) -> None:
        path = self._folder / f"{conversation_id}.json"
        tmp = path.with_suffix(".tmp")
        data = json.dumps({"id": conversation_id, "history": self._histories[conversation_id]}).encode()
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        fd = os.open(self._folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    async def create(self, conversation: Conversation) -> None:
        """Write the first version of the file."""
        self._histories[conversation.id] = [e.model_dump_json() for e in conversation.history]
        await asyncio.to_thread(self._write, conversation.id)

    async def append(self, conversation_id: str, event: NostrEvent) -> None:
        """Add to memory, rewrite the whole file."""
        self._histories[conversation_id].append(event.model_dump_json())
        await asyncio.to_thread(self._write, conversation_id)

    async def read(self, conversation_id: str) -> int:
        """Read and parse the whole file."""
        started = time.perf_counter()
        data = json.loads((self._folder / f"{conversation_id}.json").read_bytes())
        events = [NostrEvent.model_validate_json(item) for item in data["history"]]
        self.read_seconds = time.perf_counter() - started
        return len(events)


class AgentsSessionContender(Contender):
    """OpenAI Agents SDK ``SQLiteSession`` (WAL, ``synchronous=FULL`` set on every connection)."""

    name = "OpenAI Agents SQLiteSession"

    def __init__(self) -> None:
        module: Any = importlib.import_module("agents.memory.sqlite_session")
        self._cls: Any = module.SQLiteSession
        original = self._cls._configure_connection

        def configure(conn: sqlite3.Connection) -> None:
            original(conn)
            conn.execute("PRAGMA synchronous=FULL")

        self._cls._configure_connection = staticmethod(configure)
        self._sessions: dict[str, Any] = {}

    async def open(self, folder: Path) -> None:
        """Use one database file."""
        await asyncio.to_thread(folder.mkdir, parents=True, exist_ok=True)
        self._db = folder / "agents.db"
        self._sessions = {}
        conn = sqlite3.connect(self._db)
        self.note = f"synchronous={conn.execute('PRAGMA synchronous').fetchone()[0]} (2 = FULL) by default"
        conn.close()

    def _session(self, conversation_id: str) -> Any:
        session = self._sessions.get(conversation_id)
        if session is None:
            session = self._sessions[conversation_id] = self._cls(conversation_id, str(self._db))
        return session

    async def close(self) -> None:
        """Close every session."""
        for session in self._sessions.values():
            session.close()
        self._sessions = {}

    async def create(self, conversation: Conversation) -> None:
        """Add the root as the first item."""
        await self._session(conversation.id).add_items([self._item(e) for e in conversation.history])

    @staticmethod
    def _item(event: NostrEvent) -> dict[str, Any]:
        return {"role": "user", "content": event.content, "id": event.id, "pubkey": event.pubkey}

    async def append(self, conversation_id: str, event: NostrEvent) -> None:
        """add_items with one item (one committed transaction)."""
        await self._session(conversation_id).add_items([self._item(event)])

    async def read(self, conversation_id: str) -> int:
        """get_items on a fresh session object."""
        await self.close()
        started = time.perf_counter()
        items = await self._session(conversation_id).get_items()
        self.read_seconds = time.perf_counter() - started
        return len(items)


class LangGraphContender(Contender):
    """LangGraph ``SqliteSaver``: one checkpoint per event whose messages channel holds the history."""

    name = "LangGraph SqliteSaver"

    def __init__(self) -> None:
        self._saver_cls: Any = importlib.import_module("langgraph.checkpoint.sqlite").SqliteSaver
        self._base: Any = importlib.import_module("langgraph.checkpoint.base")

    async def open(self, folder: Path) -> None:
        """One database, WAL (set by the saver), synchronous=FULL."""
        await asyncio.to_thread(folder.mkdir, parents=True, exist_ok=True)
        self._conn = sqlite3.connect(folder / "langgraph.db", check_same_thread=False)
        self._saver: Any = self._saver_cls(self._conn)
        self._saver.setup()
        self._conn.execute("PRAGMA synchronous=FULL")
        self.note = f"synchronous={self._conn.execute('PRAGMA synchronous').fetchone()[0]}"
        self._threads: dict[str, tuple[dict[str, Any], list[dict[str, Any]], int]] = {}

    async def close(self) -> None:
        """Close the connection."""
        self._conn.close()

    def _put(self, thread_id: str) -> None:
        config, messages, step = self._threads[thread_id]
        checkpoint = self._base.empty_checkpoint()
        checkpoint["channel_values"] = {"messages": list(messages)}
        checkpoint["channel_versions"] = {"messages": step}
        new_config = self._saver.put(config, checkpoint, {"source": "loop", "step": step}, {"messages": step})
        self._threads[thread_id] = (new_config, messages, step + 1)

    async def create(self, conversation: Conversation) -> None:
        """First checkpoint."""
        config = {"configurable": {"thread_id": conversation.id, "checkpoint_ns": ""}}
        self._threads[conversation.id] = (config, [self._message(e) for e in conversation.history], 1)
        await asyncio.to_thread(self._put, conversation.id)

    @staticmethod
    def _message(event: NostrEvent) -> dict[str, Any]:
        return {"role": "user", "content": event.content, "id": event.id}

    async def append(self, conversation_id: str, event: NostrEvent) -> None:
        """A new checkpoint with the message added (as a graph step with add_messages does)."""
        self._threads[conversation_id][1].append(self._message(event))
        await asyncio.to_thread(self._put, conversation_id)

    async def read(self, conversation_id: str) -> int:
        """get_tuple of the latest checkpoint on a fresh saver."""
        saver = self._saver_cls(self._conn)
        started = time.perf_counter()
        found = saver.get_tuple({"configurable": {"thread_id": conversation_id, "checkpoint_ns": ""}})
        self.read_seconds = time.perf_counter() - started
        return len(found.checkpoint["channel_values"]["messages"])


# --- measurements --------------------------------------------------------------------------------


@dataclass
class Row:
    """One line of the results table."""

    name: str
    seq_per_s: float | None = None
    conc_per_s: float | None = None
    read_ms: float | None = None
    note: str = ""


def _fresh_folder(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)


async def measure_appends(contender: Contender, folder: Path, writers: int, per_writer: int) -> float:
    """Appends per second with ``writers`` conversations appended to concurrently."""
    await asyncio.to_thread(_fresh_folder, folder)
    await contender.open(folder)
    try:
        conversations = [new_conversation(i) for i in range(writers)]
        for conversation in conversations:
            await contender.create(conversation)
        batches = [[make_event(w * 1_000_000 + i, pubkey_of(1 + i % 3)) for i in range(per_writer)]
                   for w in range(writers)]

        async def writer(conversation: Conversation, events: list[NostrEvent]) -> None:
            for event in events:
                await contender.append(conversation.id, event)

        started = time.perf_counter()
        await asyncio.gather(*(writer(c, b) for c, b in zip(conversations, batches, strict=True)))
        elapsed = time.perf_counter() - started
    finally:
        await contender.close()
    return writers * per_writer / elapsed


async def measure_read(contender: Contender, folder: Path, events: int) -> float:
    """Milliseconds to read back an ``events``-event conversation from a fresh store."""
    await asyncio.to_thread(_fresh_folder, folder)
    await contender.open(folder)
    try:
        conversation = new_conversation(0)
        for i in range(events - 1):
            conversation.append(make_event(i, pubkey_of(1 + i % 3)))
        history = conversation.history
        first = Conversation(id=conversation.id, title=conversation.title)
        first.append(history[0])
        await contender.create(first)
        for event in history[1:]:
            await contender.append(conversation.id, event)
        count = await contender.read(conversation.id)
        assert count == events, (contender.name, count)
        seconds: float = contender.read_seconds  # type: ignore[attr-defined]
    finally:
        await contender.close()
    return seconds * 1000


def median(values: list[float]) -> float:
    """The median."""
    return statistics.median(values)


# --- the big home --------------------------------------------------------------------------------


async def generate_home(home: Path, conversations: int, per_conversation: int) -> float:
    """Write a FileSystemStore home through the store (batch mode); return seconds taken."""
    started = time.perf_counter()
    store = FileSystemStore(home, fsync="batch", cache_size=8)
    await store.open()
    pending: list[Awaitable[None]] = []
    for c in range(conversations):
        conversation = new_conversation(c)
        for i in range(per_conversation - 1):
            conversation.append(make_event(c * 1000 + i, pubkey_of(1 + (c + i) % 5)))
        pending.append(store.create(conversation))
        if len(pending) >= 64:
            await asyncio.gather(*pending)
            pending = []
    await asyncio.gather(*pending)
    await store.close()
    return time.perf_counter() - started


def disk_bytes(folder: Path) -> tuple[int, int]:
    """(sum of file sizes, bytes allocated on disk) under ``folder``."""
    apparent = allocated = 0
    for root, _, files in os.walk(folder):
        for name in files:
            st = os.stat(os.path.join(root, name))
            apparent += st.st_size
            allocated += st.st_blocks * 512
    return apparent, allocated


STARTUP_PROBE = """
import asyncio, json, logging, sys, time
t0 = time.perf_counter()
import structlog
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
from tenex_daemon.adapters.storage.filesystem import FileSystemStore
from tenex_daemon.core.search import SearchQuery
t1 = time.perf_counter()
async def main():
    store = FileSystemStore(sys.argv[1])
    t2 = time.perf_counter()
    await store.open()
    t3 = time.perf_counter()
    rows = await store.search(SearchQuery(limit=10))
    conversation = await store.load(rows[0].id)
    t4 = time.perf_counter()
    # VmHWM, not ru_maxrss: the latter keeps the parent's peak across fork and exec
    status = open("/proc/self/status").read().splitlines()
    rss = int(next(x for x in status if x.startswith("VmHWM:")).split()[1]) * 1024
    print("RESULT " + json.dumps({"import_s": t1 - t0, "open_s": t3 - t2, "first_load_s": t4 - t3,
                      "conversations": len(store), "rss": rss, "repairs": len(store.recovery),
                      "events_first": len(conversation.history)}), flush=True)
    await store.close()
asyncio.run(main())
"""


def probe_startup(home: Path) -> dict[str, Any]:
    """Open the home in a fresh process; return its timings and peak RSS."""
    done = subprocess.run(
        [sys.executable, "-c", STARTUP_PROBE, str(home)], capture_output=True, text=True, check=False,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    if done.returncode != 0:
        raise RuntimeError(f"the start-up probe failed ({done.returncode}):\n{done.stderr[-3000:]}")
    out = done.stdout
    [line] = [x for x in out.splitlines() if x.startswith("RESULT ")]
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return result


# --- main ----------------------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 0) -> str:
    """A number for the table, or a dash."""
    return "-" if value is None else f"{value:,.{digits}f}"


async def run(args: argparse.Namespace) -> None:
    """Run every measurement and print the tables."""
    work = Path(tempfile.mkdtemp(prefix="tenexd-bench-", dir=args.dir))
    server: Any = None
    contenders: list[Contender] = []

    def fs(policy: FsyncPolicy) -> Callable[[Path], Awaitable[Store]]:
        async def factory(folder: Path) -> Store:
            return FileSystemStore(folder, fsync=policy)
        return factory

    contenders.append(TenexContender("FileSystemStore batch", fs("batch")))
    contenders.append(TenexContender("FileSystemStore always", fs("always")))
    try:
        from tests.contract.postgres_server import PostgresServer

        server = PostgresServer.start()

        async def pg(folder: Path) -> Store:
            marker = folder / "dsn"
            if not marker.exists():
                marker.write_text(await server.create_database())
            return PostgresStore(marker.read_text(), pool_size=WRITERS + 2, lease_pool_size=2)

        contenders.append(TenexContender("PostgresStore", pg))
    except Exception as exc:  # a missing server is reported, not hidden
        print(f"PostgresStore: not measured ({exc})", file=sys.stderr)
    missing: list[str] = []
    for peer in (AgentsSessionContender, LangGraphContender):
        try:
            contenders.append(peer())
        except ImportError as exc:
            missing.append(f"{peer.name}: not installed ({exc.name}); run benchmarks/run_storage.sh")
    contenders.append(JsonRewriteContender())

    seq_n = max(50, int(1000 * args.scale_appends))
    conc_n = max(10, int(200 * args.scale_appends))
    rows: list[Row] = []
    try:
        for contender in contenders:
            row = Row(contender.name)
            seq = [await measure_appends(contender, work / "a", 1, seq_n) for _ in range(args.repeat)]
            conc = [await measure_appends(contender, work / "b", WRITERS, conc_n) for _ in range(args.repeat)]
            read = [await measure_read(contender, work / "r", 1000) for _ in range(args.repeat)]
            row.seq_per_s, row.conc_per_s, row.read_ms = median(seq), median(conc), median(read)
            row.note = contender.note
            rows.append(row)
            print(f"  measured {contender.name}", file=sys.stderr, flush=True)
    finally:
        if server is not None:
            server.stop()

    print()
    print(f"Append throughput and read-back, fsync per commit, medians of {args.repeat} runs "
          f"({seq_n} sequential appends; {WRITERS} writers x {conc_n} appends)")
    header = f"{'store':<30} {'1 writer /s':>12} {f'{WRITERS} writers /s':>14} {'read 1,000 ev ms':>17}  note"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row.name:<30} {fmt(row.seq_per_s):>12} {fmt(row.conc_per_s):>14} {fmt(row.read_ms, 1):>17}  "
              f"{row.note}")
    for line in missing:
        print(line)
    batch = next(r for r in rows if r.name == "FileSystemStore batch")
    peers = [r for r in rows if not r.name.startswith(("FileSystemStore", "PostgresStore"))]
    assert batch.conc_per_s is not None
    for peer_row in peers:
        assert peer_row.conc_per_s is not None
        assert peer_row.seq_per_s is not None
        print(f"FileSystemStore batch vs {peer_row.name}: {batch.conc_per_s / peer_row.conc_per_s:.1f}x "
              f"({WRITERS} writers), {(batch.seq_per_s or 0) / peer_row.seq_per_s:.1f}x (1 writer)")

    conversations = max(10, int(10_000 * args.scale))
    per_conversation = 100
    print()
    print(f"FileSystemStore home: {conversations:,} conversations x {per_conversation} events "
          f"= {conversations * per_conversation:,} events")
    sizes = []
    for count in (max(1, conversations // 10), conversations):
        home = work / f"home-{count}"
        seconds = await generate_home(home, count, per_conversation)
        apparent, allocated = disk_bytes(home)
        sizes.append((count * per_conversation, apparent, allocated, seconds, home))
    print(f"{'events':>12} {'bytes (apparent)':>18} {'bytes (allocated)':>18} "
          f"{'bytes/event':>12} {'generated in s':>15}")
    for events, apparent, allocated, seconds, _ in sizes:
        print(f"{events:>12,} {apparent:>18,} {allocated:>18,} {apparent / events:>12,.1f} {seconds:>15,.1f}")
    ratio = (sizes[1][1] / sizes[0][1]) / (sizes[1][0] / sizes[0][0])
    print(f"growth: {ratio:.3f} (1.000 = exactly linear in events)")
    big_home = sizes[-1][4]
    probes = [probe_startup(big_home) for _ in range(args.repeat)]
    open_s = median([p["open_s"] for p in probes])
    import_s = median([p["import_s"] for p in probes])
    load_s = median([p["first_load_s"] for p in probes])
    rss = median([p["rss"] for p in probes])
    print(f"start-up (open: index read + stat checks) {open_s:.3f} s; imports {import_s:.3f} s; "
          f"first search+load {load_s * 1000:.1f} ms; peak RSS {rss / 2**20:.1f} MiB; "
          f"conversations {probes[0]['conversations']:,}; repairs {probes[0]['repairs']}")
    print(f"targets: start-up < 2 s: {'met' if open_s + import_s < 2 else 'MISSED'}; "
          f"RSS < 150 MiB: {'met' if rss < 150 * 2**20 else 'MISSED'}; "
          f"batch >= 2x every peer ({WRITERS} writers): "
          f"{'met' if all(batch.conc_per_s >= 2 * (p.conc_per_s or 0) for p in peers) else 'MISSED'}")
    print(f"(bench process peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)")
    figures: dict[str, float | None] = {}
    for row in rows:
        figures[f"{row.name}: appends/s, 1 writer"] = row.seq_per_s
        figures[f"{row.name}: appends/s, {WRITERS} writers"] = row.conc_per_s
        figures[f"{row.name}: read 1,000 events, ms"] = row.read_ms
    figures["home: bytes/event"] = sizes[-1][1] / sizes[-1][0]
    figures["home: start-up open, s"] = open_s
    figures["home: imports, s"] = import_s
    figures["home: first search+load, ms"] = load_s * 1000
    figures["home: peak RSS, MiB"] = rss / 2**20
    emit_figures("storage", figures)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    """Parse arguments and run."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--scale", type=float, default=1.0, help="home size (1.0 = 10,000 x 100 events)")
    parser.add_argument("--scale-appends", type=float, default=1.0, help="append workload size")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (median)")
    parser.add_argument("--dir", default=None, help="where to put the data (default: temp)")
    parser.add_argument("--keep", action="store_true", help="keep the generated data")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
