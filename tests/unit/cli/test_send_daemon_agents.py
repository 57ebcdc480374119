"""`tenexd send` and `tenexd context` ask the home's running daemon which agents it serves (its status document
lists them): one added with `agents add` after the daemon started is not served until a restart, so they
refuse it at once (exit 2) saying so, instead of waiting out --timeout and hinting a conversation nobody holds.
With no daemon answering, `send` says the daemon is not running when there is no relay to publish to; after
a wait in vain it names a conversation only when the daemon holds the message."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.app.control_api import ControlServer
from tenex_daemon.app.home import init_home, load_agents, load_project_pubkey
from tenex_daemon.app.metrics import Metrics
from tenex_daemon.app.settings import load_settings
from tenex_daemon.app.status import DaemonState, new_status, write_status
from tenex_daemon.cli import send as send_module
from tenex_daemon.cli.client import unserved_reason
from tenex_daemon.cli.main import app
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.services.conversation_manager import ConversationManager
from tests.unit.cli.test_send_private_reply import Touched
from tests.unit.cli.test_send_wait import RELAY, ScriptedRelays

RESTART = (
    "error: the running daemon does not serve agent 'reviewer' (it serves: orchestrator, planner, executor): it "
    "was started before the agent was added to config.toml (or its key changed), and reads its agents only at "
    "start; restart the daemon"
)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A home made by init (its owner key generated, so `send` may sign), its relay the scripted one."""
    path = tmp_path / "home"
    init_home(path, relays=[RELAY])
    return path


def tenexd(home: Path, *args: str) -> tuple[int, str]:
    """Run ``tenexd --home HOME ARGS``; return (exit code, stderr with its lines joined)."""
    result = CliRunner().invoke(app, ["--home", str(home), *args], catch_exceptions=False)
    return result.exit_code, " ".join(result.stderr.split())


@dataclass
class StartedDaemon:
    """A ControlTarget serving ``manager``, whose status lists the agents it serves, as a daemon does: those
    the home had when it started."""

    manager: ConversationManager
    agents: list[dict[str, str]]
    metrics: Metrics = field(default_factory=Metrics)

    def status(self) -> dict[str, Any]:
        """A running status naming the agents served."""
        return {"state": "running", "agents": self.agents}


def started_daemon(home: Path) -> StartedDaemon:
    """A daemon of ``home`` started now: it serves the agents the home has now, over an empty store."""
    settings = load_settings(home)
    agents = load_agents(settings)
    manager = ConversationManager(MemoryStore(), agents, load_project_pubkey(settings))
    return StartedDaemon(manager, [{"slug": a.slug, "name": a.name, "pubkey": a.pubkey} for a in agents])


async def test_send_and_context_refuse_at_once_an_agent_added_after_the_daemon_started(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a daemon started before `agents add reviewer`, `send --to reviewer` (public or --private) and
    `context ID --agent reviewer` exit 2 at once saying the daemon was started before the agent was added and
    to restart it, nothing signed nor any relay opened; an agent it serves is sent to as before."""
    daemon = started_daemon(home)
    root = await daemon.manager.create_conversation(owner_root(home))
    assert tenexd(home, "agents", "add", "reviewer")[0] == 0
    touched = Touched(monkeypatch)

    async with ControlServer(daemon, load_settings(home).control_socket_path):
        started = time.monotonic()
        public = await asyncio.to_thread(tenexd, home, "send", "hi", "--to", "reviewer", "--timeout", "8")
        private = await asyncio.to_thread(tenexd, home, "send", "hi", "--to", "reviewer", "--private")
        context = await asyncio.to_thread(tenexd, home, "context", root.id, "--agent", "reviewer")
        took = time.monotonic() - started
        served = await asyncio.to_thread(tenexd, home, "send", "hi", "--to", "planner", "--timeout", "0.2")

    for code, said in (public, private, context):
        assert code == 2, said
        assert said.startswith(RESTART), said
    assert took < 8, took
    assert touched.signed == []
    assert touched.pools == [[RELAY]]  # the planner's send only
    assert served[0] == 1, served


def owner_root(home: Path) -> NostrEvent:
    """A kind-11 root the home's owner signed, p-tagging the planner."""
    settings = load_settings(home)
    planner = next(a for a in load_agents(settings) if a.slug == "planner")
    owner = Signer.from_file(settings.owner_key_path, label="owner")
    return owner.sign(11, "Plan a picnic", [["p", planner.pubkey]])


def test_only_a_daemon_that_lists_its_agents_and_lacks_the_one_named_refuses_it() -> None:
    """`unserved_reason`: none without a daemon, or when its status lists no agents (another version's); none
    for an agent it serves with that key; a reason for one it does not serve, or serves with another key
    (removed and added again since it started)."""
    served = {"state": "running", "agents": [{"slug": "planner", "name": "Planner", "pubkey": "1" * 64}]}

    assert unserved_reason(None, "reviewer") is None
    assert unserved_reason({"state": "running"}, "reviewer") is None
    assert unserved_reason(served, "planner", "1" * 64) is None
    assert unserved_reason(served, "planner") is None
    assert (unserved_reason(served, "reviewer") or "").startswith("the running daemon does not serve agent 'reviewer'")
    assert "agent 'planner'" in (unserved_reason(served, "planner", "2" * 64) or "")


def test_send_with_no_relay_and_no_daemon_says_the_daemon_is_not_running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no daemon answering and no relay configured, `send` exits 1 saying the daemon is not running (and
    how to give a relay), before anything is signed or a relay opened."""
    path = tmp_path / "home"
    init_home(path)
    touched = Touched(monkeypatch)

    code, said = tenexd(path, "send", "hi")

    assert code == 1
    assert said.startswith(
        f"error: no relay to publish to: the daemon is not running (see `tenexd --home {path} status`), and no "
        "relay is configured: pass --relay URL"
    )
    assert (touched.signed, touched.pools) == ([], [])


def test_send_with_no_relay_and_a_daemon_that_does_not_answer_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the home's status file saying its daemon runs (its process lives: stuck, or still starting) and
    nothing answering on its control API, `send` with no relay exits 1 saying the daemon does not answer,
    not that it is not running (what `status` contradicts)."""
    path = tmp_path / "home"
    init_home(path)
    settings = load_settings(path)
    status = new_status("0.0.0", home=str(path))
    status["state"] = DaemonState.RUNNING.value
    write_status(settings.status_path, status)
    touched = Touched(monkeypatch)

    code, said = tenexd(path, "send", "hi")

    assert code == 1
    assert said.startswith(
        f"error: no relay to publish to: the daemon (pid {os.getpid()}) does not answer on its control API "
        f"(stuck, or still starting?) (see `tenexd --home {path} status`)"
    )
    assert (touched.signed, touched.pools) == ([], [])


@pytest.mark.parametrize("taken_in", [True, False], ids=["taken-in", "not-taken-in"])
async def test_a_wait_in_vain_names_the_conversation_only_when_the_daemon_holds_the_message(
    home: Path, monkeypatch: pytest.MonkeyPatch, taken_in: bool
) -> None:
    """With the daemon answering, a wait in vain names `conversations show` of the message's conversation when
    the daemon took the message in; when it did not, it names none (that command would find none) and says
    the daemon has not taken it in."""
    daemon = started_daemon(home)
    loop = asyncio.get_running_loop()

    def answer(sent: NostrEvent) -> list[NostrEvent]:
        if taken_in:  # the daemon takes it in, on its own loop
            asyncio.run_coroutine_threadsafe(daemon.manager.create_conversation(sent), loop).result()
        return []

    relays = ScriptedRelays(answer)
    monkeypatch.setattr(send_module, "RelayPool", relays)

    async with ControlServer(daemon, load_settings(home).control_socket_path):
        code, said = await asyncio.to_thread(tenexd, home, "send", "Plan it", "--to", "planner", "--timeout", "0.3")

    sent = relays.published[0]
    assert code == 1
    if taken_in:
        assert f"(the answer may still come: tenexd --home {home} conversations show {sent.id[:12]}, or send" in said
    else:
        assert "conversations show" not in said
        assert "this home holds no conversation with the message: its daemon has not taken it in" in said
