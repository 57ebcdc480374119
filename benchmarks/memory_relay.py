"""nostr-sdk's LocalRelay with its in-memory database, in a process of its own, for the daemon benchmark.

``python -m benchmarks.memory_relay --port N`` prints ``ready`` once the relay serves and runs
until its standard input closes (the benchmark holds the other end, so the relay goes with it
however the benchmark ends), as the test relay of ``tests/integration/nostr`` and the embedded
relay of ``tenexd run --embedded-relay`` do.

Why not the embedded relay: its LMDB database is a Python object to the relay, so every event
it checks and saves calls back into Python (twice per event, on the child's asyncio loop); at
100 concurrent conversations those calls, not tenexd, set the pace. The builder's default
database (no ``.database(...)``) is nostr-sdk's own in-memory one (up to 75,000 events): no
Python runs in this process once the relay serves, and the benchmark measures tenexd against
a relay that costs what a native relay costs. ``scripts/run`` keeps LMDB: events there must
survive a restart.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

READY = "ready"
START_TIMEOUT_S = 30.0
REPO = Path(__file__).resolve().parents[1]


class MemoryRelay:
    """The relay process, started and stopped by the benchmark (``ws://127.0.0.1:port``)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The relay's websocket URL."""
        return f"ws://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The relay process's id (it must be running)."""
        assert self._process is not None, "the relay is not running"
        return self._process.pid

    async def start(self) -> None:
        """Start the process; return once the relay accepts connections."""
        command = [sys.executable, "-m", "benchmarks.memory_relay", "--port", str(self.port)]
        pipe = subprocess.PIPE
        process = await asyncio.to_thread(subprocess.Popen, command, stdin=pipe, stdout=pipe, cwd=REPO)
        self._process = process
        assert process.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(process.stdout.readline), START_TIMEOUT_S)
        if line.strip() != READY.encode():
            self.stop()
            raise RuntimeError(f"the memory relay did not start (exit status {process.poll()})")
        await _wait_listening(self.port, START_TIMEOUT_S)

    def cpu_seconds(self) -> float:
        """CPU time the relay process has used so far (user + system, every thread), from /proc."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        # after "pid (comm)": state is field 0, utime field 11, stime field 12 (proc(5))
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        """Close the relay's standard input (its cue to stop) and wait for it; kill it if it lingers."""
        process, self._process = self._process, None
        if process is None:
            return
        assert process.stdin is not None
        assert process.stdout is not None
        with contextlib.suppress(OSError):
            process.stdin.close()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()


async def _wait_listening(port: int, within: float) -> None:
    deadline = time.monotonic() + within
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on port {port} after {within:.0f} s") from None
            await asyncio.sleep(0.05)
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return


async def serve(port: int) -> None:
    """The child: run the relay until standard input closes."""
    import nostr_sdk

    relay: Any = (
        nostr_sdk.LocalRelayBuilder()
        .addr("127.0.0.1")
        .port(port)
        .rate_limit(nostr_sdk.RateLimit(max_reqs=1000, notes_per_minute=1_000_000))
        .build()
    )
    await relay.run()
    sys.stdout.write(READY + "\n")
    sys.stdout.flush()
    await asyncio.to_thread(sys.stdin.buffer.read)  # until the benchmark closes it, or dies
    relay.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="nostr-sdk LocalRelay, in-memory database")
    parser.add_argument("--port", type=int, required=True)
    asyncio.run(serve(parser.parse_args().port))
