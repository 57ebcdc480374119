"""The embedded relay's liveness probe: a relay whose process lives but no longer answers is killed and
started again by its supervisor, and the daemon's pool delivers to it again."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from dataclasses import replace
from pathlib import Path

import pytest
from websockets.asyncio.client import connect

from tenex_daemon.adapters.nostr.relay_pool import RelayPool
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.app.embedded_relay import UNRESPONSIVE, EmbeddedRelay

from .conftest import FAST
from .harness import free_port

pytestmark = pytest.mark.integration


async def test_a_stopped_relay_is_killed_started_again_and_the_pool_delivers_to_it(tmp_path: Path) -> None:
    """A relay process stopped with SIGSTOP (alive, its port still taking connections in the kernel) is not
    restarted while it answers its probes, is killed after 3 unanswered probes in a row and started again
    (counted as a restart, its reason ``unresponsive``), and an event the pool published while it hung is
    accepted by the new process and served from it; before, the relay hung for good and the publish with it."""
    relay = EmbeddedRelay(
        tmp_path / "relay", port=free_port(), probe_interval_s=0.2, probe_timeout_s=1.0, probe_failures=3
    )
    await relay.start()
    slow = replace(FAST, backoff_base=30.0, backoff_cap=30.0, stable_after=3600.0)
    hung: int | None = None
    try:
        async with RelayPool([relay.url], store=MemoryStore(), settings=slow) as pool:
            assert await pool.wait_connected(within=10)
            supervisor = asyncio.create_task(relay.supervise(pool.retry_now, poll_s=0.05))
            try:
                await asyncio.sleep(1.5)  # about 7 probes of a healthy relay: none of them kills it
                assert (relay.restarts, relay.unresponsive_kills) == (0, 0)
                hung = relay.pid
                assert hung is not None
                os.kill(hung, signal.SIGSTOP)
                event = Signer.generate().sign(1, "published while the relay hung")
                result = await pool.publish(event, timeout=30)
                assert result.accepted_by == (relay.url,)
                assert (relay.restarts, relay.unresponsive_kills) == (1, 1)
                assert relay.last_restart_reason == UNRESPONSIVE
                assert relay.pid not in (None, hung)
                with pytest.raises(ProcessLookupError):
                    os.kill(hung, 0)  # killed and reaped
                async with connect(relay.url) as ws:
                    await ws.send(json.dumps(["REQ", "kept", {"ids": [event.id]}]))
                    frame = json.loads(await asyncio.wait_for(ws.recv(), 10))
                assert frame[:2] == ["EVENT", "kept"]
                assert frame[2]["id"] == event.id
            finally:
                supervisor.cancel()
                await asyncio.gather(supervisor, return_exceptions=True)
    finally:
        if hung is not None:  # a test that failed leaves no stopped process behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(hung, signal.SIGKILL)
        await asyncio.to_thread(relay.stop)
    assert relay.pid is None
