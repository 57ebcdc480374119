"""Real parts for the Nostr integration tests: relays and a nostr-tools client, started and stopped here.

- :class:`LocalRelayServer`: nostr-sdk's ``LocalRelay`` in a child process (LMDB storage),
  plain or requiring NIP-42 auth; killed and restarted on the same port and database path.
- :class:`NostrRelayProcess`: PyPI ``nostr-relay`` as a subprocess in its own virtual
  environment (``scripts/setup.d/30-nostr-relay.sh``), sqlite file kept across restarts,
  killed by pid.
- :class:`NodeTool`: ``tests/node/nostr_tool.mjs`` (nostr-tools on Node).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from tenex_daemon.adapters.nostr.relay_pool import ReceivedEvent

REPO = Path(__file__).resolve().parents[3]
NODE_DIR = REPO / "tests" / "node"
NODE_TOOL = NODE_DIR / "nostr_tool.mjs"
NOSTR_RELAY_VENV = REPO / ".cache" / "nostr-relay-venv"


def must_have_setup() -> bool:
    """Whether a missing external part is a failure (CI, scripts/test) rather than a skip."""
    return bool(os.environ.get("CI") or os.environ.get("TENEX_REQUIRE_TEST_PARTS"))


def missing(what: str) -> None:
    """Skip (or fail, under CI) because an external test part is not installed."""
    message = f"{what}; run scripts/test (or scripts/setup.d/*.sh) to install it"
    if must_have_setup():
        pytest.fail(message)
    pytest.skip(message)


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def _accepts(port: int) -> bool:
    """Whether something accepts a TCP connection on 127.0.0.1:port now (the connection is closed)."""
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def wait_port_closed(port: int, within: float = 30.0) -> None:
    """Wait until nothing accepts TCP connections on 127.0.0.1:port any more."""
    deadline = time.monotonic() + within
    while await _accepts(port):
        if time.monotonic() > deadline:
            raise TimeoutError(f"port {port} still accepts connections after {within}s")
        await asyncio.sleep(0.05)


async def wait_port(port: int, within: float = 30.0) -> None:
    """Wait until something accepts TCP connections on 127.0.0.1:port."""
    deadline = time.monotonic() + within
    while not await _accepts(port):
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing listens on port {port} after {within}s")
        await asyncio.sleep(0.1)


class LocalRelayServer:
    """nostr-sdk's LocalRelay with LMDB storage at ``db_path``, in a child process
    (``local_relay_child``); stopping it kills the process, so the relay is gone at once."""

    def __init__(self, db_path: Path, *, auth: bool = False, port: int | None = None) -> None:
        self.db_path = db_path
        self.auth = auth
        self.port = port or free_port()
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The relay's websocket URL."""
        return f"ws://127.0.0.1:{self.port}"

    async def start(self) -> None:
        """Start the relay process (the rate limit raised far above the tests' needs)."""
        command = [
            sys.executable, "-m", "tests.integration.nostr.local_relay_child",
            "--path", str(self.db_path), "--port", str(self.port),
        ] + (["--auth"] if self.auth else [])
        pipe = subprocess.PIPE
        proc = await asyncio.to_thread(subprocess.Popen, command, stdin=pipe, stdout=pipe, cwd=REPO)
        self._proc = proc
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
        assert line.strip() == b"ready", f"LocalRelay did not start (exit {proc.poll()})"
        await wait_port(self.port)

    def stop(self) -> None:
        """Kill the relay process and wait for it (the LMDB files stay)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()

    async def restart(self, down_for: float = 0.0) -> None:
        """Kill the relay, stay down for ``down_for`` seconds, start again on the same port and path."""
        self.stop()
        await wait_port_closed(self.port)
        await asyncio.sleep(down_for)
        await self.start()


class NostrRelayProcess:
    """PyPI nostr-relay as a subprocess with a sqlite file that survives restarts."""

    def __init__(self, workdir: Path, *, port: int | None = None) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.proc: asyncio.subprocess.Process | None = None
        self.config = workdir / "nostr-relay.yaml"
        self.log_file = workdir / "nostr-relay.log"

    @property
    def url(self) -> str:
        """The relay's websocket URL."""
        return f"ws://127.0.0.1:{self.port}"

    def _write_config(self) -> None:
        db = self.workdir / "relay.sqlite3"
        self.config.write_text(
            "DEBUG: false\n"
            "storage:\n"
            f"  sqlalchemy.url: sqlite+aiosqlite:///{db}\n"
            "  validators:\n"
            "    - nostr_relay.validators.is_not_too_large\n"
            "    - nostr_relay.validators.is_signed\n"
            "    - nostr_relay.validators.is_recent\n"
            "gunicorn:\n"
            f"  bind: 127.0.0.1:{self.port}\n"
            "  workers: 1\n"
            "  loglevel: warning\n"
            "max_event_size: 1048576\n"
            "oldest_event: 315360000\n"
            "message_timeout: 1800\n"
            "subscription_limit: 64\n"
            "max_limit: 6000\n"
        )

    async def start(self) -> None:
        """Start the server and wait until it listens."""
        executable = NOSTR_RELAY_VENV / "bin" / "nostr-relay"
        if not executable.exists():
            missing(f"the nostr-relay virtual environment is missing at {NOSTR_RELAY_VENV}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._write_config()
        with self.log_file.open("ab") as log_handle:
            self.proc = await asyncio.create_subprocess_exec(
                str(executable), "-c", str(self.config), "serve", "--use-uvicorn",
                stdout=log_handle, stderr=asyncio.subprocess.STDOUT, cwd=self.workdir,
                start_new_session=True,
            )
        try:
            await wait_port(self.port, within=60)
        except TimeoutError:
            await self.kill()
            raise

    async def kill(self) -> None:
        """SIGKILL the server by pid (its own process group) and reap it."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        await asyncio.wait_for(self.proc.wait(), 10)
        self.proc = None

    async def restart(self, down_for: float = 0.0) -> None:
        """Kill, stay down for ``down_for`` seconds, start again on the same port and sqlite file."""
        await self.kill()
        await asyncio.sleep(down_for)
        await self.start()


class NodeTool:
    """Runs ``tests/node/nostr_tool.mjs`` (nostr-tools on Node) with one JSON request."""

    def __init__(self) -> None:
        if not (NODE_DIR / "node_modules" / "nostr-tools").is_dir():
            missing("tests/node/node_modules is missing (nostr-tools)")

    async def start(self, request: dict[str, Any]) -> asyncio.subprocess.Process:
        """Start the tool with ``request`` on stdin; read its JSON lines with :meth:`lines`."""
        proc = await asyncio.create_subprocess_exec(
            "node", str(NODE_TOOL), cwd=NODE_DIR,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(request).encode())
        await proc.stdin.drain()
        proc.stdin.close()
        return proc

    @staticmethod
    async def lines(proc: asyncio.subprocess.Process) -> AsyncIterator[dict[str, Any]]:
        """Yield each JSON line the tool prints until it exits."""
        assert proc.stdout is not None
        async for raw in proc.stdout:
            if raw.strip():
                yield json.loads(raw)

    async def call(self, request: dict[str, Any], within: float = 60.0) -> dict[str, Any]:
        """Run one request to completion (at most ``within`` seconds); return its last JSON line."""
        proc = await self.start(request)
        try:
            stdout, stderr = await asyncio.wait_for(proc.communicate(), within)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise
        if proc.returncode != 0:
            raise RuntimeError(f"nostr_tool.mjs failed: {stderr.decode()[-2000:]}")
        # split on "\n" only: str.splitlines() would also split inside U+2028 in the JSON
        lines = [json.loads(line) for line in stdout.decode().split("\n") if line.strip()]
        result: dict[str, Any] = lines[-1]
        if request.get("op") == "publish":
            result["lines"] = lines
        return result


class Collector:
    """A consumer that records every delivered event, and lets a test wait for a count."""

    def __init__(self) -> None:
        self.received: list[ReceivedEvent] = []
        self._changed = asyncio.Event()

    async def __call__(self, item: ReceivedEvent) -> None:
        """Record one delivery."""
        self.received.append(item)
        self._changed.set()

    @property
    def ids(self) -> list[str]:
        """Delivered event ids in order."""
        return [r.event.id for r in self.received]

    async def wait_for(self, predicate: Callable[[Collector], bool], within: float = 20.0) -> bool:
        """Wait up to ``within`` seconds until ``predicate(self)`` holds; False on timeout."""
        deadline = time.monotonic() + within
        while not predicate(self):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(remaining, 0.5))
        return True


ConnectionHandler = Callable[["FakeRelay", ServerConnection], Awaitable[None]]


class FakeRelay:
    """A tiny scripted websockets relay: each connection runs ``handler``; received frames are recorded."""

    def __init__(self, handler: ConnectionHandler) -> None:
        self.handler = handler
        self.port = free_port()
        self.received: list[list[Any]] = []
        self.connections = 0
        self._server: Server | None = None
        self._changed = asyncio.Event()

    @property
    def url(self) -> str:
        """The fake relay's websocket URL."""
        return f"ws://127.0.0.1:{self.port}"

    async def __aenter__(self) -> FakeRelay:
        self._server = await serve(self._serve, "127.0.0.1", self.port, max_size=None)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, ws: ServerConnection) -> None:
        self.connections += 1
        with contextlib.suppress(ConnectionClosed):
            await self.handler(self, ws)

    async def recv(self, ws: ServerConnection) -> list[Any]:
        """Receive one frame from the client, record it and return it parsed."""
        frame = json.loads(await ws.recv())
        self.received.append(frame)
        self._changed.set()
        return list(frame)

    def frames(self, kind: str) -> list[list[Any]]:
        """Every recorded client frame of one type (``REQ``, ``EVENT``, ``AUTH``...)."""
        return [f for f in self.received if f and f[0] == kind]

    async def wait_frames(self, kind: str, count: int, within: float = 10.0) -> list[list[Any]]:
        """Wait until ``count`` frames of a type were received; return them."""
        deadline = time.monotonic() + within
        while len(self.frames(kind)) < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{len(self.frames(kind))} {kind} frames, expected {count}")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(remaining, 0.5))
        return self.frames(kind)
