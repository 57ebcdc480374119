"""The embedded relay: nostr-sdk's LocalRelay next to the daemon, events kept in LMDB under the home.

The relay runs in a child process (``python -m tenex_daemon.app.embedded_relay``). nostr-sdk's LMDB
backend is a Python object to the relay: every event the relay checks or saves calls back into
Python, on an asyncio loop. In the daemon's process those calls would queue behind the daemon's
work on its loop (or, on a thread of their own, wait for the GIL), and the daemon's work behind
them; in a process of its own the relay has its own interpreter and can use another core.

The child lives as long as its standard input is open: the daemon holds the other end, so the
relay stops when the daemon stops, however it stops (a SIGKILL included). If the relay process
dies on its own, :meth:`EmbeddedRelay.supervise` starts it again (same port, same LMDB files); one that
lives but no longer answers (stopped, deadlocked) is found by a probe every ``PROBE_INTERVAL_S``, killed
after ``PROBE_FAILURES`` unanswered probes in a row, and started again the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
from websockets.asyncio.client import connect
from websockets.exceptions import WebSocketException

from tenex_daemon.core.errors import TenexError

log = structlog.get_logger(__name__)

READY = "ready"
START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 5.0
RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
"""Waits before each restart in a row of failed ones (the last repeats)."""
STABLE_S = 60.0
"""A relay that ran this long counts as healthy again: the next restart waits the shortest time."""
PROBE_INTERVAL_S = 10.0
"""How often :meth:`EmbeddedRelay.supervise` asks a running relay whether it answers."""
PROBE_TIMEOUT_S = 5.0
"""How long one probe waits for the relay's answer."""
PROBE_FAILURES = 3
"""Unanswered probes in a row after which a relay whose process lives is killed and started again (one
slow moment under load is no hang)."""
PROBE_SUB = "tenexd-liveness"
PROBE_REQ = json.dumps(["REQ", PROBE_SUB, {"ids": ["0" * 64], "limit": 1}])
"""The probe: a REQ for an event that does not exist. Its EOSE comes after the relay looked it up in its
database, whose calls run on the relay process's own asyncio loop: an answer proves that loop turns, where a
TCP connection alone would not (the kernel accepts those for a stopped process)."""
EXITED = "exited"
UNRESPONSIVE = "unresponsive"
"""Why a relay was started again (``reason`` in the log, :attr:`EmbeddedRelay.last_restart_reason`): its
process exited, or it lived but did not answer ``PROBE_FAILURES`` probes in a row (killed with SIGKILL)."""


def relay_url(host: str, port: int) -> str:
    """The websocket URL of a relay listening on ``host`` (an IPv6 address in brackets) and ``port``."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"ws://{host}:{port}"


LIMITS = frozenset({errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM})
"""The errors of a process that could not be made which a limit of the system explains."""
LIMITS_HINT = ": check the open-file and process limits (ulimit -n, ulimit -u)"

VMEM_HINT = (
    " (its LMDB database reserves a large address space, not memory: a virtual memory limit, ulimit -v or "
    "systemd's LimitAS, refuses it; leave that limit unset)"
)
"""Said after the relay's own error when it could not map its database."""


class EmbeddedRelayError(TenexError, RuntimeError):
    """The embedded relay could not be started (the command line says so in one line, as for any
    :class:`TenexError`)."""


def _port_taken(host: str, port: int) -> bool:
    """Whether another socket listens on (``host``, ``port``): binding it as the relay will (address reuse
    on, so a port left in TIME_WAIT by a relay that just stopped is not taken) fails with EADDRINUSE."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError:
        return False  # the relay's own start says what is wrong with the host
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


class EmbeddedRelay:
    """A real Nostr relay on ``ws://host:port``, run by the daemon (``tenexd run --embedded-relay``)."""

    def __init__(
        self, db_path: Path, host: str = "127.0.0.1", port: int = 7777, *,
        probe_interval_s: float = PROBE_INTERVAL_S, probe_timeout_s: float = PROBE_TIMEOUT_S,
        probe_failures: int = PROBE_FAILURES,
    ) -> None:
        self.db_path = db_path
        self.host = host
        self.port = port
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.probe_failures = probe_failures
        self._next_probe = 0.0
        self._missed_probes = 0
        self._process: subprocess.Popen[bytes] | None = None
        self.log_path = db_path.parent / f"{db_path.name}.log"
        """Where the relay process's error output goes (read back when it fails to start)."""
        self.restarts = 0
        """How many times :meth:`supervise` started the relay again after it died."""
        self.failed_restarts = 0
        """How many of :meth:`supervise`'s tries to start it again failed (each is tried again)."""
        self.unresponsive_kills = 0
        """How many times :meth:`supervise` killed a relay process that lived but did not answer."""
        self.last_restart_reason: str | None = None
        """Why :meth:`supervise` last started the relay again (:data:`EXITED` or :data:`UNRESPONSIVE`)."""
        self._stopped = False
        self._log_from = 0
        """Where the error log stood when the running process started: what it wrote is read from there."""

    @property
    def url(self) -> str:
        """The relay's websocket URL."""
        return relay_url(self.host, self.port)

    @property
    def pid(self) -> int | None:
        """The relay process's id while it runs."""
        return self._process.pid if self._process is not None else None

    async def start(self) -> None:
        """Start the relay process; returns once the port accepts connections. A port another program
        holds is refused at once, in one line saying how to choose another."""
        self._stopped = False
        if _port_taken(self.host, self.port):
            raise EmbeddedRelayError(
                f"embedded relay on {self.url} failed to start: port {self.port} is in use by another "
                "program (Address already in use); stop it, or give the relay another port "
                "(relays.embedded_port in config.toml, or TENEX_RELAYS__EMBEDDED_PORT)"
            )
        self.db_path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.db_path, 0o700)  # the events, private ones' wraps among them: the owner's only
        command = [
            sys.executable, "-m", "tenex_daemon.app.embedded_relay",
            "--path", str(self.db_path), "--host", self.host, "--port", str(self.port),
        ]
        pipe = subprocess.PIPE
        try:
            errors = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as exc:
            raise EmbeddedRelayError(f"embedded relay on {self.url} failed to start: {exc}") from None
        try:
            os.fchmod(errors, 0o600)
            self._log_from = os.fstat(errors).st_size
            # a process group of its own: a Ctrl-C meant for the daemon never reaches it, not even while it
            # imports, before it ignores the stop signals; it stops when the daemon closes its input
            process = await asyncio.to_thread(
                subprocess.Popen, command, stdin=pipe, stdout=pipe, stderr=errors, process_group=0
            )
        except OSError as exc:  # out of file descriptors or processes: said in one line, with what to check
            limits = LIMITS_HINT if exc.errno in LIMITS else ""
            raise EmbeddedRelayError(
                f"embedded relay on {self.url} failed to start: its process could not be made ({exc}){limits}"
            ) from None
        finally:
            os.close(errors)
        self._process = process
        assert process.stdout is not None
        try:
            line = await asyncio.wait_for(asyncio.to_thread(process.stdout.readline), START_TIMEOUT_S)
        except TimeoutError:
            await asyncio.to_thread(self._end)
            raise EmbeddedRelayError(
                f"embedded relay on {self.url} did not start in {START_TIMEOUT_S:.0f} s"
            ) from None
        if line.decode("utf-8", "replace").strip() != READY:
            await asyncio.to_thread(self._end)
            said = _last_lines(process, self.log_path, self._log_from)
            hint = VMEM_HINT if "Cannot allocate memory" in said else ""
            raise EmbeddedRelayError(f"embedded relay on {self.url} failed to start: {said}{hint}")
        try:
            await self._wait_listening()
        except BaseException:
            await asyncio.to_thread(self._end)
            raise
        self._next_probe = time.monotonic() + self.probe_interval_s
        self._missed_probes = 0
        log.info("embedded_relay_started", url=self.url, path=str(self.db_path), pid=process.pid)

    async def _wait_listening(self, within: float = 10.0) -> None:
        deadline = time.monotonic() + within
        while True:
            try:
                _, writer = await asyncio.open_connection(self.host, self.port)
            except OSError:
                if time.monotonic() > deadline:
                    raise EmbeddedRelayError(f"embedded relay did not listen on {self.url}") from None
                await asyncio.sleep(0.05)
                continue
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            return

    async def supervise(
        self, on_restarted: Callable[[str], None] | None = None, poll_s: float = 1.0
    ) -> None:
        """Start the relay again whenever its process exits without :meth:`stop`, or lives but does
        not answer (:meth:`_unresponsive`: killed first); runs until cancelled (cancel it before
        calling :meth:`stop`). Restarts in a row wait longer each time (``RESTART_BACKOFF_S``); each
        is logged with its reason, the exit status and the relay's last error lines, then told to
        ``on_restarted(url)`` (the daemon's connection to it need not wait out its reconnect backoff).
        The probes run here, between restarts: never during one."""
        failures = 0
        started = time.monotonic()
        while True:
            await asyncio.sleep(poll_s)
            process = self._process
            if process is None or self._stopped:
                return  # stopped on purpose
            status = process.poll()
            reason = EXITED
            if status is None:
                if not await self._unresponsive(process):
                    continue
                reason = UNRESPONSIVE
                with contextlib.suppress(subprocess.TimeoutExpired):
                    status = await asyncio.to_thread(process.wait, STOP_TIMEOUT_S)
            log.error(
                "embedded_relay_died",
                url=self.url,
                pid=process.pid,
                reason=reason,
                exit_status=status,
                last_lines=await asyncio.to_thread(_last_lines, process, self.log_path, self._log_from),
            )
            self._process = None
            _close_pipes(process)
            if time.monotonic() - started > STABLE_S:
                failures = 0
            while True:
                wait_s = RESTART_BACKOFF_S[min(failures, len(RESTART_BACKOFF_S) - 1)]
                await asyncio.sleep(wait_s)
                if self._stopped:
                    return
                failures += 1
                try:
                    await self.start()
                    break
                except (EmbeddedRelayError, OSError) as exc:  # the port still taken, say: tried again
                    self.failed_restarts += 1
                    log.error("embedded_relay_restart_failed", url=self.url, error=str(exc), attempt=failures)
            self.restarts += 1
            self.last_restart_reason = reason
            started = time.monotonic()
            log.warning(
                "embedded_relay_restarted", url=self.url, pid=self.pid, reason=reason, restarts=self.restarts
            )
            if on_restarted is not None:
                on_restarted(self.url)

    async def _unresponsive(self, process: subprocess.Popen[bytes]) -> bool:
        """Probe the running relay when a probe is due (every ``probe_interval_s``); once
        ``probe_failures`` probes in a row went unanswered, kill its process with SIGKILL (a stopped
        process acts on no other signal) and return True: :meth:`supervise` starts it again."""
        if time.monotonic() < self._next_probe:
            return False
        answered = await self._answers()
        self._next_probe = time.monotonic() + self.probe_interval_s
        if answered:
            self._missed_probes = 0
            return False
        self._missed_probes += 1
        log.warning(
            "embedded_relay_probe_unanswered", url=self.url, pid=process.pid,
            missed=self._missed_probes, limit=self.probe_failures, timeout_s=self.probe_timeout_s,
        )
        if self._missed_probes < self.probe_failures or self._stopped or process is not self._process:
            return False
        log.error(
            "embedded_relay_unresponsive", url=self.url, pid=process.pid, reason=UNRESPONSIVE,
            missed=self._missed_probes, note="killed with SIGKILL to start it again",
        )
        process.kill()
        self.unresponsive_kills += 1
        return True

    async def _answers(self) -> bool:
        """Whether the relay answers :data:`PROBE_REQ` with its EOSE (or a CLOSED: it answered) within
        ``probe_timeout_s``: a websocket opened, a lookup in its database, closed again."""
        answered = False
        with contextlib.suppress(TimeoutError, OSError, WebSocketException, ValueError):
            async with asyncio.timeout(self.probe_timeout_s):
                async with connect(
                    self.url, open_timeout=None, ping_interval=None, close_timeout=1.0, proxy=None,
                    compression=None,
                ) as ws:
                    await ws.send(PROBE_REQ)
                    while not answered:
                        frame = json.loads(await ws.recv())
                        answered = isinstance(frame, list) and frame[:2] in (["EOSE", PROBE_SUB],
                                                                             ["CLOSED", PROBE_SUB])
        return answered

    def stop(self) -> None:
        """Stop the relay process (the LMDB files stay); waits for it to exit (blocking: from a
        coroutine, call it in a thread). A :meth:`supervise` running meanwhile starts nothing."""
        self._stopped = True
        self._end()

    def _end(self) -> None:
        """End the relay process, if any (a start that failed ends its own this way: a
        :meth:`supervise` running tries again, where :meth:`stop` would make it give up)."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.stdin is not None:
            with contextlib.suppress(OSError):
                process.stdin.close()  # the child's cue to shut down
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("embedded_relay_killed", url=self.url, note=f"no exit within {STOP_TIMEOUT_S:.0f} s")
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()
        log.info("embedded_relay_stopped", url=self.url)


def _close_pipes(process: subprocess.Popen[bytes]) -> None:
    for pipe in (process.stdin, process.stdout):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()


def _last_lines(process: subprocess.Popen[bytes], log_path: Path, since: int = 0) -> str:
    """The last lines the failed child wrote to its log past ``since`` (where the log stood when it started:
    an earlier run's lines are not its), or its exit status."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=STOP_TIMEOUT_S)
    try:
        with log_path.open("rb") as log_file:
            size = log_path.stat().st_size  # cut short meanwhile (a copytruncate): read what is there
            log_file.seek(max(min(since, size), size - 4000))
            text = log_file.read().decode("utf-8", "replace")
    except OSError:
        text = ""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-3:]) or f"exit status {process.returncode}"


async def _serve(path: Path, host: str, port: int) -> None:
    """The child: run the relay until standard input closes."""
    import nostr_sdk
    from nostr_sdk import nostr_sdk as nostr_sdk_ffi

    # LMDB calls back into Python from the relay's threads: on this loop.
    nostr_sdk_ffi.uniffi_set_event_loop(asyncio.get_running_loop())
    db: Any = await nostr_sdk.NostrLmdb.open(str(path))
    relay: Any = (
        nostr_sdk.LocalRelayBuilder()
        .addr(host)
        .port(port)
        .database(db)
        .rate_limit(nostr_sdk.RateLimit(max_reqs=1000, notes_per_minute=100_000))
        .build()
    )
    await relay.run()
    sys.stdout.write(READY + "\n")
    sys.stdout.flush()
    # nobody reads the pipe after this line: anything printed later goes to the error log
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    await asyncio.to_thread(sys.stdin.buffer.read)  # until the daemon closes it, or dies
    relay.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the relay process."""
    parser = argparse.ArgumentParser(description="tenexd's embedded relay (started by the daemon)")
    parser.add_argument("--path", type=Path, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    # In a process group of its own, a terminal's Ctrl-C does not reach it; a stop signal sent to every
    # process (kill of the group, systemd's KillMode=control-group) might: the relay stays up while the
    # daemon drains (its replies still go out), and stops after it, when its standard input closes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    asyncio.run(_serve(args.path, args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
