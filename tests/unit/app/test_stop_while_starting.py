"""A stop asked for while the daemon starts (Ctrl-C just after `scripts/run`): the runs the start takes
up again are not waited for (README, "The daemon")."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from tenex_daemon.adapters.llm.offline import OfflineBackend
from tenex_daemon.adapters.nostr.relay_pool import RelayPool
from tenex_daemon.app.daemon import Daemon
from tenex_daemon.app.home import init_home, load_agents, load_project_pubkey
from tenex_daemon.app.settings import load_settings
from tenex_daemon.app.wiring import build_store
from tenex_daemon.core.llm import CompletionRequest, CompletionResult
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.services.descriptions import DescriptionJobs
from tenex_daemon.services.runs import PENDING_RUNS_KEY
from tenex_daemon.testing import EventFactory, KeyPair


async def journal_a_run(home: Path) -> str:
    """A conversation to the planner whose run a crashed daemon left journaled; its id."""
    settings = load_settings(home, {})
    store = build_store(settings)
    await store.open()
    try:
        manager = ConversationManager(store, load_agents(settings), load_project_pubkey(settings))
        planner = manager.agents.get("planner")
        root = EventFactory().event(KeyPair.from_seed(1), "Plan it", kind=11, tags=[["p", planner.pubkey]])
        await manager.create_conversation(root)
        entry = {"conversation_id": root.id, "trigger_id": root.id, "agent_slug": "planner"}
        await store.set_meta(PENDING_RUNS_KEY, json.dumps([entry]))
        return root.id
    finally:
        await store.close()


async def journaled(home: Path) -> list[dict[str, str]]:
    """The home's stored run journal."""
    store = build_store(load_settings(home, {}))
    await store.open()
    try:
        entries: list[dict[str, str]] = json.loads(await store.get_meta(PENDING_RUNS_KEY) or "[]")
        return entries
    finally:
        await store.close()


async def test_a_stop_asked_while_starting_does_not_wait_for_the_runs_the_start_took_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped while starting, just after its start took up a journaled run (its model slow), a daemon stops
    at once, not after the 30 s grace period, and the run stays journaled for the next start."""
    asked = asyncio.Event()
    daemons: list[Daemon] = []
    stopped: list[float] = []
    recover_descriptions = DescriptionJobs.recover

    async def connected(self: RelayPool, count: int = 1, within: float = 10.0) -> bool:
        return True

    async def no_announcement(self: Daemon, signers: object) -> None:
        return None

    async def stop_once_asked(self: DescriptionJobs) -> int:
        # the start holds here, after it took the journaled run up, until that run's model is asked: a stop
        # asked before the run got that far (a loaded machine) would not prove the run is not waited for
        await asyncio.wait_for(asked.wait(), 15)
        daemons[0].request_stop()  # the start goes on to its end: the stop is seen once it has
        stopped.append(time.monotonic())
        return await recover_descriptions(self)

    async def slow_model(self: OfflineBackend, request: CompletionRequest) -> CompletionResult:
        asked.set()
        await asyncio.Event().wait()
        raise AssertionError("never answers")

    monkeypatch.setattr(RelayPool, "wait_connected", connected)
    monkeypatch.setattr(Daemon, "_announce", no_announcement)
    monkeypatch.setattr(DescriptionJobs, "recover", stop_once_asked)
    monkeypatch.setattr(OfflineBackend, "complete", slow_model)
    home = tmp_path / "h"
    init_home(home, relays=["ws://127.0.0.1:1"])
    conversation_id = await journal_a_run(home)
    daemons.append(Daemon(load_settings(home, {"TENEX_DAEMON__GRACE_PERIOD_S": "30"})))

    await asyncio.wait_for(daemons[0].run(), 30)

    assert asked.is_set()  # the start took the run up before it saw the stop
    assert time.monotonic() - stopped[0] < 10
    assert [e["conversation_id"] for e in await journaled(home) if "agent_slug" in e] == [conversation_id]


async def test_a_stop_while_the_relays_do_not_answer_ends_the_start_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM to a daemon starting while no relay answers ends it in well under a second: the start's wait for
    a relay (10 s) and its announcements (5 s) give way to the stop (it took up to 15 s), and the journaled run
    is taken up by nobody, left for the next start."""
    asked = asyncio.Event()

    async def model(self: OfflineBackend, request: CompletionRequest) -> CompletionResult:
        asked.set()
        raise AssertionError("no run starts")

    monkeypatch.setattr(OfflineBackend, "complete", model)
    home = tmp_path / "h"
    init_home(home, relays=["ws://127.0.0.1:1"])  # nothing listens there
    conversation_id = await journal_a_run(home)
    daemon = Daemon(load_settings(home, {}))
    running = asyncio.create_task(daemon.run())
    await asyncio.sleep(1.0)  # starting: waiting for a relay

    daemon.request_stop()
    stopped = time.monotonic()
    await asyncio.wait_for(running, 20)

    assert time.monotonic() - stopped < 2
    assert not asked.is_set()
    assert daemon.state == "stopped"
    assert [e["conversation_id"] for e in await journaled(home) if "agent_slug" in e] == [conversation_id]
