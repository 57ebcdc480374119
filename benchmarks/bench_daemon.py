"""Benchmark: what tenexd costs per reply (CPU, and latency over the relay's own round trip).

The relay is nostr-sdk's LocalRelay with its in-memory database, in a process of its own
(``benchmarks/memory_relay.py``): no Python runs in it, so it is the floor, not the bottleneck
(the embedded relay's LMDB database calls back into Python for every event, which at 100
concurrent conversations measured the relay rather than tenexd). The daemon runs in a process
of its own, as ``tenexd run`` does (default settings, offline backend, a fresh home), connected
to that relay; a person's clients run in the benchmark's process, kept lean
(``benchmarks/relay_client.py``: events signed before the clock starts, no signature checks), so
that the round trips measure the relay and not the client. Each run starts a fresh relay and
daemon and measures, through 127.0.0.1:

- the relay's own round trip: a client publishes an event and receives it back on its
  subscription (the floor every reply pays twice: request in, reply out), one at a time and
  ``--concurrent`` at once; also publish -> another connection;
- the reply latency: a client publishes a kind 11 p-tagging an agent and waits for the agent's
  kind-1111 reply, one conversation at a time and ``--concurrent`` at once;
- overhead = reply latency - 2 x relay round trip at the same load (p50 and p99 each);
- daemon CPU per reply: the daemon process's CPU time (every thread), read by the process
  itself before and after each batch of replies, over the replies; the relay's likewise, from
  /proc (10 ms ticks). Two parts of it are printed too: the system (kernel) time, and the time
  in Python's cyclic garbage collector (timed by the daemon process through ``gc.callbacks``);
- inside tenexd: trigger taken in from the relay -> reply sent to it, the daemon's own measure
  (``tenexd status``, /metrics), which leaves the relay out entirely.

``--calls`` measures instead how many Python function calls the daemon's event loop makes per reply
(cProfile, on while each batch of replies runs: the commit thread is not counted, and a coroutine
counts once per resumption). Unlike the times, the count hardly changes with the machine's load, so
it compares two commits on a shared machine; the profiler slows the run, so no time is printed then.

Targets: daemon CPU per reply <= 2 ms; overhead at 1 conversation p50 < 5 ms, p99 < 20 ms; at
100 concurrent p50 < 20 ms, p99 < 80 ms. ``--runs N`` (default 3) repeats the whole, printing
each run, then each figure of every run and their median.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import multiprocessing
import os
import resource
import socket
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple

import structlog

import tenex_daemon
from benchmarks.common import emit_figures, print_table
from benchmarks.memory_relay import MemoryRelay
from benchmarks.relay_client import BenchClient, Prepared
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.app.daemon import Daemon
from tenex_daemon.app.home import init_home
from tenex_daemon.app.settings import load_settings

LOG_LEVEL = 40
FSYNC = "batch"
SETTLE_S = 0.2
"""Wait after a batch's last reply: its OK, typing indicator and journal writes count in the batch's CPU."""
QUIET_S = 0.5
QUIET_TRIES = 60
QUIET_CALLS = 500
"""``--calls``: a load's count ends once the daemon made fewer than this many calls in ``QUIET_S`` (its
timers only): what follows the replies (statuses, OKs, journal and outbox writes) is counted whole."""


def percentile(samples: list[float], q: float) -> float:
    """Return the q-quantile (0..1) of the samples, nearest rank (the median for 0.5)."""
    if q == 0.5:
        return statistics.median(samples)
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


class CpuTimes(NamedTuple):
    """The daemon process's CPU so far, seconds: user and system (every thread), and the part of
    it spent in the cyclic garbage collector."""

    user: float
    system: float
    gc: float

    def __sub__(self, other: tuple[float, ...]) -> CpuTimes:
        return CpuTimes(*(mine - theirs for mine, theirs in zip(self, other, strict=True)))


class _GcClock:
    """Adds up the wall time of every garbage collection in this process (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._started = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.total_s += time.perf_counter() - self._started


class DaemonProcess:
    """The daemon in a process of its own (as ``tenexd run``), connected to the benchmark's relay;
    the benchmark's clients run in this one and a pipe asks the daemon for its own figures."""

    def __init__(self, home_parent: Path, relay_url: str, fsync: str) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_daemon_main, args=(child, str(home_parent), relay_url, fsync), daemon=True
        )
        self.counting = False
        """``--calls``: the daemon counts its event loop's Python calls while each batch runs."""
        self.code = ""
        """Where the daemon process imported tenexd from (a before/after comparison checks it)."""

    async def start(self) -> tuple[Path, str]:
        """Start it; return the owner's key file and the planner's pubkey once it serves."""
        self._process.start()
        answer = await self._ask(None)
        if isinstance(answer, str):
            raise RuntimeError(answer)
        key_file, planner, self.code = answer
        return Path(key_file), str(planner)

    async def _ask(self, command: str | None) -> Any:
        if command is not None:
            self._conn.send(command)
        return await asyncio.to_thread(self._conn.recv)

    async def latencies(self) -> list[float]:
        """The daemon's own reply latencies so far (trigger taken in -> reply sent), seconds."""
        found: list[float] = await self._ask("latencies")
        return found

    async def cpu_seconds(self) -> CpuTimes:
        """CPU time the daemon process has used so far (user and system, every thread; GC)."""
        found: CpuTimes = await self._ask("cpu")
        return found

    async def count_calls(self, on: bool | None) -> int:
        """Turn the call count on or off (``--calls``; None: leave it); return the calls counted so far."""
        found: int = await self._ask({True: "calls on", False: "calls off", None: "calls"}[on])
        return found

    @asynccontextmanager
    async def counted(self, load: Load) -> AsyncIterator[None]:
        """``--calls``: count the calls of the block and of what follows it until the daemon is quiet
        (:data:`QUIET_CALLS`), into ``load``; nothing without ``--calls``."""
        if not self.counting:
            yield
            return
        start = await self.count_calls(True)
        yield
        last = await self.count_calls(None)
        for _ in range(QUIET_TRIES):
            await asyncio.sleep(QUIET_S)
            now = await self.count_calls(None)
            if now - last < QUIET_CALLS:
                break
            last = now
        else:
            print(f"warning: the daemon was not quiet after {QUIET_TRIES * QUIET_S:g} s; counted up to then")
        load.calls += await self.count_calls(False) - start

    async def stop(self) -> None:
        """Stop the daemon (it drains) and wait for the process."""
        await self._ask("stop")
        await asyncio.to_thread(self._process.join, 30)


def _daemon_main(conn: Connection, home_parent: str, relay_url: str, fsync: str) -> None:
    profile_to = os.environ.get("TENEX_BENCH_PROFILE")
    if not profile_to:
        asyncio.run(_run_daemon(conn, Path(home_parent), relay_url, fsync))
        return
    with cProfile.Profile() as profile:  # the daemon's own profile, for finding where its CPU per reply goes
        asyncio.run(_run_daemon(conn, Path(home_parent), relay_url, fsync))
    profile.dump_stats(profile_to)


async def _run_daemon(conn: Connection, home_parent: Path, relay_url: str, fsync: str) -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(LOG_LEVEL))
    result = init_home(home_parent / "home", relays=[relay_url])
    env = {"TENEX_DAEMON__HEARTBEAT_INTERVAL_S": "3600", "TENEX_STORAGE__FSYNC": f'"{fsync}"'}
    daemon = Daemon(load_settings(result.home, env))
    gc_clock = _GcClock()
    counter = cProfile.Profile()  # enabled only while a batch runs with --calls
    task = asyncio.create_task(daemon.run())
    ready = asyncio.create_task(daemon.wait_ready())
    await asyncio.wait([task, ready], return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():
        ready.cancel()
        conn.send(f"the daemon stopped before serving: {task.exception()!r}")
        return
    planner = next(a.pubkey for a in result.agents if a.label == "planner")
    conn.send((str(result.owner.key_file), planner, str(Path(tenex_daemon.__file__).parent)))
    while True:
        command = await asyncio.to_thread(conn.recv)
        if command == "latencies":
            conn.send(daemon.reply_latencies())
        elif command == "cpu":
            usage = resource.getrusage(resource.RUSAGE_SELF)  # microseconds, where os.times has ticks
            conn.send(CpuTimes(usage.ru_utime, usage.ru_stime, gc_clock.total_s))
        elif command in ("calls on", "calls off", "calls"):  # on the loop's thread: the one profiled
            if command == "calls on":
                counter.enable()
            elif command == "calls off":
                counter.disable()
            conn.send(sum(entry.callcount for entry in counter.getstats()))
        else:
            daemon.request_stop()
            await task
            conn.send("stopped")
            return


@dataclass
class Load:
    """One load level: the relay's round trips and the replies measured at it."""

    label: str
    floor: list[float] = field(default_factory=list)
    replies: list[float] = field(default_factory=list)
    inside: list[float] = field(default_factory=list)
    daemon_cpu_s: float = 0.0
    daemon_system_s: float = 0.0
    daemon_gc_s: float = 0.0
    relay_cpu_s: float = 0.0
    calls: int = 0
    """``--calls``: the daemon's event loop's Python calls over the batches."""

    def overhead(self, q: float) -> float:
        """Reply latency over twice the relay round trip at quantile ``q``, seconds."""
        return percentile(self.replies, q) - 2 * percentile(self.floor, q)


@dataclass
class Run:
    """What one run measured."""

    apart: list[float]
    loads: tuple[Load, Load]
    code: str = ""

    def figures(self) -> dict[str, float]:
        """The headline figures of this run, in milliseconds."""
        single, many = self.loads
        replies = len(single.replies) + len(many.replies)
        found = {
            "daemon CPU per reply": (single.daemon_cpu_s + many.daemon_cpu_s) / replies * 1e3,
            "of which system (kernel)": (single.daemon_system_s + many.daemon_system_s) / replies * 1e3,
            "of which garbage collection": (single.daemon_gc_s + many.daemon_gc_s) / replies * 1e3,
            "relay CPU per reply": (single.relay_cpu_s + many.relay_cpu_s) / replies * 1e3,
        }
        for load in self.loads:
            found[f"overhead p50, {load.label}"] = load.overhead(0.5) * 1e3
            found[f"overhead p99, {load.label}"] = load.overhead(0.99) * 1e3
        for load in self.loads:
            found[f"relay round trip p50, {load.label}"] = percentile(load.floor, 0.5) * 1e3
            found[f"relay round trip p99, {load.label}"] = percentile(load.floor, 0.99) * 1e3
        for load in (each for each in self.loads if each.inside):
            found[f"inside tenexd p50, {load.label}"] = percentile(load.inside, 0.5) * 1e3
            found[f"inside tenexd p99, {load.label}"] = percentile(load.inside, 0.99) * 1e3
        return found


TARGETS_MS = {
    "daemon CPU per reply": 2.0,
    "overhead p50, 1 conversation": 5.0,
    "overhead p99, 1 conversation": 20.0,
    "overhead p50, 100 concurrent": 20.0,
    "overhead p99, 100 concurrent": 80.0,
}
"""Figure name -> the most it may be (ms); the concurrent ones hold for 100 conversations at once."""


async def measure(
    samples: int, concurrent: int, fsync: str, home_parent: Path, *, calls: bool = False
) -> Run:
    """One run: a fresh relay and daemon (its home a new folder in ``home_parent``), the clients
    here; measure every load level."""
    home = Path(tempfile.mkdtemp(prefix="run-", dir=home_parent))
    relay = MemoryRelay(_free_port())
    await relay.start()
    try:
        daemon = DaemonProcess(home, relay.url, fsync)
        daemon.counting = calls
        key_file, planner = await daemon.start()
        try:
            run = await _measure_through(relay, daemon, key_file, planner, samples, concurrent)
            run.code = daemon.code
            return run
        finally:
            await daemon.stop()
    finally:
        await asyncio.to_thread(relay.stop)


async def _measure_through(
    relay: MemoryRelay, daemon: DaemonProcess, key_file: Path, planner: str, samples: int, concurrent: int
) -> Run:
    owner = Signer.from_file(key_file)
    client = BenchClient(relay.url, owner)
    listener = BenchClient(relay.url, owner)  # a second connection: a publish seen by another client
    for each in (client, listener):
        await each.start([{"kinds": [1, 1111], "authors": [owner.pubkey, planner]}])

    def ping() -> Prepared:
        return client.prepare(1, "ping", [])

    def request() -> Prepared:
        return client.prepare(11, "hello planner", [["p", planner]])

    async def sequential(make: Callable[[], Prepared], seen_by: BenchClient | None = None) -> list[float]:
        found = []
        for _ in range(samples):
            found.append(await client.round_trip(make(), listener=seen_by))
        return found

    async def together(make: Callable[[], Prepared]) -> list[float]:
        prepared = [make() for _ in range(concurrent)]  # all signed before the first is sent
        return list(await asyncio.gather(*(client.round_trip(each) for each in prepared)))

    async def replies(load: Load, batch: Callable[[], Awaitable[list[float]]]) -> None:
        """Time one batch of replies, with the daemon's and the relay's CPU over it."""
        before = len(await daemon.latencies())
        cpu, relay_cpu = await daemon.cpu_seconds(), relay.cpu_seconds()
        load.replies.extend(await batch())
        await asyncio.sleep(SETTLE_S)
        used = await daemon.cpu_seconds() - cpu
        load.daemon_cpu_s += used.user + used.system
        load.daemon_system_s += used.system
        load.daemon_gc_s += used.gc
        load.relay_cpu_s += relay.cpu_seconds() - relay_cpu
        load.inside.extend((await daemon.latencies())[before:])

    try:
        for _ in range(5):
            await client.round_trip(ping())
            await client.round_trip(request())
        single, many = Load("1 conversation"), Load(f"{concurrent} concurrent")
        single.floor = await sequential(ping)
        apart = await sequential(ping, listener)
        async with daemon.counted(single):
            await replies(single, lambda: sequential(request))
        async with daemon.counted(many):  # pings reach no agent: the daemon does nothing for them
            for _ in range(max(1, samples // concurrent) + 1):
                many.floor.extend(await together(ping))
                await replies(many, lambda: together(request))
    finally:
        await client.stop()
        await listener.stop()
    return Run(apart, (single, many))


def print_run(run: Run, title: str) -> None:
    """One run's table: every measure with its p50 and p99, overheads and CPU per reply."""

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.2f}"

    def row(label: str, samples: list[float], *rest: str) -> list[object]:
        return [label, len(samples), ms(percentile(samples, 0.5)), ms(percentile(samples, 0.99)), *rest]

    rows = [row("relay publish -> another connection", run.apart, "", "", "", "")]
    for load in run.loads:
        per_reply = len(load.replies)
        rows.append(row(f"relay round trip, {load.label}", load.floor, "", "", "", ""))
        rows.append(row(
            f"reply, {load.label}", load.replies, ms(load.overhead(0.5)), ms(load.overhead(0.99)),
            ms(load.daemon_cpu_s / per_reply), ms(load.relay_cpu_s / per_reply),
        ))
        if load.inside:
            rows.append(row(f"inside tenexd, {load.label}", load.inside, "", "", "", ""))
    print_table(
        title,
        ["measure", "n", "p50", "p99", "overhead p50", "overhead p99", "daemon CPU/reply", "relay CPU/reply"],
        rows,
    )


def print_summary(runs: list[Run]) -> dict[str, float]:
    """Each headline figure of every run and their median, against its target; returns the medians."""
    figures = [run.figures() for run in runs]
    limits = TARGETS_MS
    medians: dict[str, float] = {}
    rows: list[list[object]] = []
    for name in figures[0]:
        values = [each[name] for each in figures]
        medians[name] = statistics.median(values)
        limit = limits.get(name)
        verdict = "" if limit is None else ("met" if medians[name] <= limit else "MISSED")
        target = "" if limit is None else f"<= {limit:g}" if name.startswith("daemon CPU") else f"< {limit:g}"
        rows.append([name, *(f"{v:.2f}" for v in values), f"{medians[name]:.2f}", target, verdict])
    print_table(
        f"tenexd per reply, median of {len(runs)} runs (ms; offline backend, in-memory relay)",
        ["figure", *(f"run {n}" for n in range(1, len(runs) + 1)), "median", "target", ""],
        rows,
    )
    return medians


def print_calls(runs: list[Run]) -> dict[str, float]:
    """``--calls``: the event loop's Python calls per reply at each load, every run and their median."""
    figures: dict[str, list[float]] = {}
    for run in runs:
        for load in run.loads:
            per_reply = load.calls / max(1, len(load.replies))
            figures.setdefault(f"python calls per reply, {load.label}", []).append(per_reply)
    medians = {name: statistics.median(values) for name, values in figures.items()}
    print_table(
        f"tenexd's event loop, Python calls per reply, median of {len(runs)} runs (cProfile; offline"
        " backend)",
        ["figure", *(f"run {n}" for n in range(1, len(runs) + 1)), "median"],
        [[name, *(f"{v:,.0f}" for v in values), f"{medians[name]:,.0f}"] for name, values in figures.items()],
    )
    return medians


async def main(samples: int, concurrent: int, runs: int, fsync: str = FSYNC, *, calls: bool = False) -> None:
    """Measure ``runs`` times (fresh relay and daemon each), print each run, then the medians
    (``calls``: the event loop's Python calls per reply instead of times)."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(LOG_LEVEL))
    measured: list[Run] = []
    # Every run's home is kept until the last run ends: deleting one (about a thousand files and
    # folders) made the next run's file work cost several times the kernel time on an ext4 disk
    # mounted with discard (docs/BENCHMARKS.md, "Why the kernel's part rose from run to run: the
    # benchmark deleted each run's home").
    with tempfile.TemporaryDirectory(prefix="bench-daemon-") as homes:
        for n in range(1, runs + 1):
            run = await measure(samples, concurrent, fsync, Path(homes), calls=calls)
            if not calls:
                title = f"run {n} of {runs}: tenexd replies through an in-memory relay (offline backend; ms)"
                print_run(run, title)
            measured.append(run)
    if calls:
        emit_figures("daemon calls", print_calls(measured))
        print("a coroutine counts once per resumption; the store's commit thread is not counted")
        print(f"tenexd code: {', '.join(sorted({run.code for run in measured}))}")
        return
    medians = print_summary(measured)
    emit_figures("daemon", medians)
    print("overhead = reply latency - 2 x relay round trip at the same load (request in, reply out)")
    print("CPU per reply = process CPU time (user + system) over the reply batches / replies")
    print("of which system = the kernel's part; of which garbage collection = time in Python's cyclic GC")
    print("inside tenexd = trigger taken in from the relay -> reply sent to it (store fsyncs included)")
    print(
        f"relay: nostr-sdk LocalRelay, in-memory database, own process; store policy: "
        f"storage.fsync = {fsync!r}; relay connections ACK every frame at once (TCP_QUICKACK)"
    )
    print(f"tenexd code: {', '.join(sorted({run.code for run in measured}))}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--samples", type=int, default=100, help="replies and round trips per load level")
    parser.add_argument("--concurrent", type=int, default=100, help="conversations at once")
    parser.add_argument("--runs", type=int, default=3, help="fresh relay and daemon each; medians printed")
    parser.add_argument("--fsync", choices=["always", "batch"], default=FSYNC, help="store fsync policy")
    parser.add_argument(
        "--calls", action="store_true", help="count the event loop's Python calls per reply instead of timing"
    )
    args = parser.parse_args()
    if args.calls and os.environ.get("TENEX_BENCH_PROFILE"):
        parser.error("--calls counts with a profiler of its own: unset TENEX_BENCH_PROFILE")
    asyncio.run(main(args.samples, args.concurrent, args.runs, args.fsync, calls=args.calls))
