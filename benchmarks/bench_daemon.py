"""Benchmark: tenexd's reply overhead (event in -> reply out, offline backend) over a real relay.

The daemon runs as deployed with ``--embedded-relay``: a process of its own, nostr-sdk's LocalRelay in a
child of it; the clients run in the benchmark's process. One run measures, through that relay on
127.0.0.1:
- the relay's own round trip: a client publishes an event and receives it back on its
  subscription (the floor every reply pays twice: request in, reply out);
- the reply latency: a client publishes a kind-11 p-tagging an agent and waits for the
  agent's kind-1111 reply, with 1 conversation at a time and with 100 at once.
Overhead = reply latency - 2 x the relay round trip (p50 and p99). Targets: p50 < 10 ms,
p99 < 50 ms over that floor. The same runs also give the time spent inside tenexd, from the
trigger taken in from the relay to the reply sent to it (the daemon's own reply-latency
measure, also in `tenexd status` and /metrics), which leaves the relay out entirely.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import structlog

from benchmarks.common import print_table
from tenex_daemon.adapters.nostr.relay_pool import PoolSettings, ReceivedEvent, RelayPool
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.app.daemon import Daemon
from tenex_daemon.app.embedded_relay import EmbeddedRelay
from tenex_daemon.app.home import init_home
from tenex_daemon.app.settings import load_settings

LOG_LEVEL = 40
TIMEOUT_S = 30.0
FSYNC = "batch"


def percentile(samples: list[float], q: float) -> float:
    """Return the q-quantile (0..1) of the samples, nearest rank."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


class Client:
    """A person's client: publishes and waits for events by id (roots) or by thread (replies)."""

    def __init__(self, url: str, signer: Signer) -> None:
        self.signer = signer
        self.waiters: dict[str, asyncio.Future[float]] = {}
        self.sent = 0
        self.pool = RelayPool([url], on_event=self._on_event, settings=PoolSettings(publish_timeout=30.0))

    async def _on_event(self, received: ReceivedEvent) -> None:
        event = received.event
        key = event.tag_value("E") if event.kind == 1111 else event.id
        future = self.waiters.get(key or "")
        if future is not None and not future.done():
            future.set_result(time.perf_counter())

    async def round_trip(
        self, kind: int, content: str, tags: list[list[str]], *, listener: Client | None = None
    ) -> float:
        """Publish and return seconds until the answer arrives: the echo, or a reply in its thread.

        With ``listener`` the echo is awaited on that client's own connection instead.
        """
        self.sent += 1  # identical events in one second would share an id
        event = self.signer.sign(kind, f"{content} #{self.sent}", tags)
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        waiters = (listener or self).waiters
        waiters[event.id] = future
        started = time.perf_counter()
        await self.pool.publish(event)
        answered = await asyncio.wait_for(future, TIMEOUT_S)
        del waiters[event.id]
        return answered - started


class DaemonProcess:
    """The daemon as deployed (``tenexd run --embedded-relay``): a process of its own, its relay
    in a child of that, and the bench's clients in this one; a pipe asks it for its latencies."""

    def __init__(self, home_parent: Path, fsync: str) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_daemon_main, args=(child, str(home_parent), fsync), daemon=True
        )

    async def start(self) -> tuple[str, Path, str]:
        """Start it; return the relay URL, the owner's key file and the planner's pubkey."""
        self._process.start()
        url, key_file, planner = await self._ask(None)
        return str(url), Path(key_file), str(planner)

    async def _ask(self, command: str | None) -> Any:
        if command is not None:
            self._conn.send(command)
        return await asyncio.to_thread(self._conn.recv)

    async def latencies(self) -> list[float]:
        """The daemon's own reply latencies so far (trigger taken in -> reply sent), seconds."""
        found: list[float] = await self._ask("latencies")
        return found

    async def stop(self) -> None:
        """Stop the daemon (it drains) and wait for the process."""
        await self._ask("stop")
        await asyncio.to_thread(self._process.join, 30)


def _daemon_main(conn: Connection, home_parent: str, fsync: str) -> None:

    asyncio.run(_run_daemon(conn, Path(home_parent), fsync))


async def _run_daemon(conn: Connection, home_parent: Path, fsync: str) -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(LOG_LEVEL))
    relay = EmbeddedRelay(home_parent / "relay", port=_free_port())
    await relay.start()
    result = init_home(home_parent / "home", relays=[relay.url])
    env = {"TENEX_DAEMON__HEARTBEAT_INTERVAL_S": "3600", "TENEX_STORAGE__FSYNC": f'"{fsync}"'}
    daemon = Daemon(load_settings(result.home, env))
    task = asyncio.create_task(daemon.run())
    await daemon.wait_ready()
    planner = next(a.pubkey for a in result.agents if a.label == "planner")
    conn.send((relay.url, str(result.owner.key_file), planner))
    while True:
        command = await asyncio.to_thread(conn.recv)
        if command == "latencies":
            conn.send(daemon.reply_latencies())
            continue
        daemon.request_stop()
        await task
        await asyncio.to_thread(relay.stop)
        conn.send("stopped")
        return


async def main(samples: int, concurrent: int, fsync: str = FSYNC) -> None:
    """Start a daemon (and its relay) in a process of their own, measure from here, print the table."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(LOG_LEVEL))
    with tempfile.TemporaryDirectory() as tmp:
        daemon = DaemonProcess(Path(tmp), fsync)
        url, key_file, planner = await daemon.start()
        owner = Signer.from_file(key_file)
        client = Client(url, owner)
        listener = Client(url, owner)  # a second connection: a publish seen by another client
        for each in (client, listener):
            await each.pool.start()
            await each.pool.subscribe("bench", [{"kinds": [1, 1111], "authors": [owner.pubkey, planner]}])
            await each.pool.wait_connected(within=10)
        await asyncio.sleep(0.2)

        async def echo() -> float:
            return await client.round_trip(1, "ping", [])

        async def reply() -> float:
            return await client.round_trip(11, "hello planner", [["p", planner]])

        for _ in range(5):
            await echo()
            await reply()
        floor = [await echo() for _ in range(samples)]
        apart = [await client.round_trip(1, "ping", [], listener=listener) for _ in range(samples)]
        before = len(await daemon.latencies())
        single = [await reply() for _ in range(samples)]
        await asyncio.sleep(0.2)  # the last reply's OK
        single_inside = (await daemon.latencies())[before:]
        many: list[float] = []
        many_floor: list[float] = []
        many_inside: list[float] = []
        rounds = max(1, samples // concurrent) + 1
        for _ in range(rounds):
            many_floor.extend(await asyncio.gather(*(echo() for _ in range(concurrent))))
            before = len(await daemon.latencies())
            many.extend(await asyncio.gather(*(reply() for _ in range(concurrent))))
            await asyncio.sleep(0.5)
            many_inside.extend((await daemon.latencies())[before:])

        await client.pool.stop()
        await listener.pool.stop()
        await daemon.stop()

    rows: list[list[object]] = []
    measures = (
        ("1 conversation", floor, single, single_inside),
        (f"{concurrent} concurrent", many_floor, many, many_inside),
    )
    rows.append([
        "relay publish -> another connection", len(apart), f"{statistics.median(apart) * 1e3:.2f}",
        f"{percentile(apart, 0.99) * 1e3:.2f}", "", "",
    ])
    for label, base, data, inside in measures:
        rtt50, rtt99 = statistics.median(base), percentile(base, 0.99)
        rows.append(
            [f"relay round trip, {label}", len(base), f"{rtt50 * 1e3:.2f}", f"{rtt99 * 1e3:.2f}", "", ""]
        )
        p50, p99 = statistics.median(data), percentile(data, 0.99)
        rows.append(
            [
                f"reply, {label}",
                len(data),
                f"{p50 * 1e3:.2f}",
                f"{p99 * 1e3:.2f}",
                f"{(p50 - 2 * rtt50) * 1e3:.2f}",
                f"{(p99 - 2 * rtt99) * 1e3:.2f}",
            ]
        )
        if inside:
            rows.append([
                f"inside tenexd, {label}", len(inside), f"{statistics.median(inside) * 1e3:.2f}",
                f"{percentile(inside, 0.99) * 1e3:.2f}", "", "",
            ])
    print_table(
        "tenexd reply overhead through a real relay (offline backend; ms)",
        ["measure", "n", "p50", "p99", "overhead p50", "overhead p99"],
        rows,
    )
    print(
        "overhead = latency - 2 x relay round trip (request in, reply out); targets: p50 < 10 ms, p99 < 50 ms"
    )
    print("inside tenexd = trigger taken in from the relay -> reply sent to it (store fsyncs included)")
    print(
        f"store policy: storage.fsync = {fsync!r}; relay connections ACK every frame at once (TCP_QUICKACK)"
    )


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--concurrent", type=int, default=100)
    parser.add_argument("--fsync", choices=["always", "batch"], default=FSYNC, help="store fsync policy")
    args = parser.parse_args()
    asyncio.run(main(args.samples, args.concurrent, args.fsync))
