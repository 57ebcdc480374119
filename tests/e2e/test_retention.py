"""The retention sweeper really runs in the daemon: a real relay, a nostr-tools client, tenexd as a
subprocess with a tiny idle timeout and sweep interval (docs/ARCHITECTURE.md, "Conversation lifecycle")."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.e2e.harness import DaemonProcess, Home, node_client, run_cli
from tests.integration.nostr.harness import LocalRelayServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

IDLE_TIMEOUT_MIN = 0.02
"""1.2 seconds."""
SWEEP_INTERVAL_MIN = 0.01
"""0.6 seconds."""


@pytest.fixture
async def sweeping_daemon(home: Home) -> AsyncIterator[DaemonProcess]:
    """A running tenexd whose conversations end after 1.2 idle seconds, swept every 0.6 s."""
    process = DaemonProcess(
        home,
        env={
            "TENEX_CONVERSATIONS__IDLE_TIMEOUT_MIN": str(IDLE_TIMEOUT_MIN),
            "TENEX_CONVERSATIONS__SWEEP_INTERVAL_MIN": str(SWEEP_INTERVAL_MIN),
        },
    )
    await process.start()
    yield process
    try:
        await process.stop()
    finally:
        process.kill()


async def show(home: Home, conversation_id: str) -> dict[str, Any]:
    """``tenexd conversations show ID --json`` (through the daemon's control API)."""
    code, out = await run_cli(home, "conversations", "show", conversation_id, "--json")
    assert code == 0, out
    shown: dict[str, Any] = json.loads(out)
    return shown


async def test_an_idle_conversation_is_ended_by_the_daemons_sweeper(
    relay: LocalRelayServer, home: Home, sweeping_daemon: DaemonProcess
) -> None:
    """A conversation answered by an agent and then left idle past the (1.2 s) idle timeout is ended by
    "idle" for "idle_timeout" within a few sweeps, and `tenexd status --json` counts the sweeps and
    the conversation ended."""
    planner = home.agent("planner")
    answer = await node_client({
        "op": "converse",
        "relay": relay.url,
        "secret": home.owner_secret,
        "template": {"kind": 11, "content": "Plan a picnic", "tags": [["p", planner]]},
        "reply_authors": [planner],
        "want": 1,
        "timeout_ms": 5000,
    })
    assert len(answer["replies"]) == 1, sweeping_daemon.log_tail()
    conversation_id = answer["published"]["id"]

    deadline = time.monotonic() + 20
    shown = await show(home, conversation_id)
    while shown["status"] != "ended" and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        shown = await show(home, conversation_id)

    assert shown["status"] == "ended", sweeping_daemon.log_tail()
    assert (shown["ended_by"], shown["end_reason"]) == ("idle", "idle_timeout")
    assert shown["ended_at"] - shown["activity_at"] >= IDLE_TIMEOUT_MIN * 60_000
    code, out = await run_cli(home, "status", "--json")
    assert code == 0, out
    retention = json.loads(out)["status"]["retention"]
    assert retention["sweeps"] >= 2
    assert retention["totals"]["ended_idle"] >= 1
    assert retention["totals"]["errors"] == 0
    assert retention["last_sweep_at"] is not None
