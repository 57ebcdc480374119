"""`scripts/run`: bootstrap, a demo home, the daemon with its embedded relay; `tenexd send` gets a reply."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tenex_daemon.app.status import read_status
from tests.e2e.harness import REPO, TENEXD

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def output(log: Path) -> str:
    """What scripts/run printed so far."""
    return log.read_text(errors="replace")


async def wait_running(home: Path, proc: subprocess.Popen[bytes], log: Path, within: float) -> None:
    """Wait until the home's status file says the daemon started by ``proc`` runs."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"scripts/run exited with {proc.returncode}:\n{output(log)}")
        data = read_status(home / "run" / "status.json", stale_after_s=10.0).data
        if data is not None and data.get("state") == "running":
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"the daemon did not report running within {within}s:\n{output(log)}")


async def send(home: Path, text: str, log: Path) -> list[dict[str, Any]]:
    """`tenexd send TEXT --to planner --json`; assert it exits 0 and return its JSON lines."""
    sender = await asyncio.create_subprocess_exec(
        str(TENEXD), "--home", str(home), "send", text, "--to", "planner", "--timeout", "90", "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(sender.communicate(), 120)
    assert sender.returncode == 0, err.decode() + output(log)
    return [json.loads(line) for line in out.decode().splitlines() if line.strip()]


async def test_scripts_run_serves_a_demo_home_that_answers_tenexd_send(tmp_path: Path) -> None:
    """scripts/run creates the demo home, serves its embedded relay, and a planner reply reaches `tenexd send`;
    after the relay process is killed, the daemon starts it again and the next `send` is answered too."""
    home, log = tmp_path / "demo-home", tmp_path / "run.log"
    port = free_port()
    env = {**os.environ, "TENEX_HOME": str(home), "TENEX_RELAYS__EMBEDDED_PORT": str(port)}
    with log.open("wb") as sink:
        proc = subprocess.Popen(  # noqa: ASYNC220 - a long-lived child stopped below by pid
            [str(REPO / "scripts" / "run")], cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: teardown stops bootstrap's children too
        )
    try:
        await wait_running(home, proc, log, within=300.0)
        printed = output(log)
        assert f"ws://127.0.0.1:{port}" in printed
        assert "tenexd --home" in printed
        assert "send" in printed

        lines = await send(home, "Plan a picnic for Saturday", log)
        replies = [line for line in lines if "reply" in line]
        assert [r["agent"] for r in replies] == ["planner"]
        assert replies[0]["reply"]["content"]
        assert lines[-1]["answered"] is True
        assert lines[-1]["relays"] == [f"ws://127.0.0.1:{port}"]

        # the relay process dies: the daemon starts it again, reconnects, and answers again
        status = read_status(home / "run" / "status.json", stale_after_s=10.0).data
        assert status is not None
        relay_pid = status["embedded_relay_pid"]
        os.kill(relay_pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status = read_status(home / "run" / "status.json", stale_after_s=10.0).data or {}
            relays = status.get("relays") or []
            if status.get("embedded_relay_restarts") == 1 and relays and relays[0].get("state") == "connected":
                break
            await asyncio.sleep(0.2)
        assert status.get("embedded_relay_restarts") == 1, output(log)
        assert status.get("embedded_relay_last_restart_reason") == "exited"
        assert status.get("embedded_relay_pid") not in (None, relay_pid)
        lines = await send(home, "And on Sunday?", log)
        assert [line["agent"] for line in lines if "reply" in line] == ["planner"]

        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:  # noqa: ASYNC110 - polling a child
            await asyncio.sleep(0.1)
        assert proc.returncode == 0, output(log)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
