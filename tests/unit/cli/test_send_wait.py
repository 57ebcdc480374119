"""How `tenexd send`'s wait for an answer ends: at the awaited agent's answer (exit 0), at the daemon's notice
that the runs were stopped, whoever signed it (exit 1, `stopped: ...`), or at the timeout (exit 1, saying how
to read an answer that comes later). The relays are scripted: what a relay would deliver after the publish."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tenex_daemon.adapters.nostr.composer import SignedReplyComposer
from tenex_daemon.adapters.nostr.relay_pool import Filter, PoolSettings, PublishResult, ReceivedEvent
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.app.home import init_home, load_agents, load_project_pubkey
from tenex_daemon.app.settings import load_settings
from tenex_daemon.app.wiring import build_store
from tenex_daemon.cli import send as send_module
from tenex_daemon.cli.main import app
from tenex_daemon.cli.send import _Answers
from tenex_daemon.core.agents import Agent
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.ports import ReplySpec
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.testing import KeyPair, sign_event

RELAY = "ws://relay.test"


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A home made by init (its owner key generated), its relay the scripted one."""
    path = tmp_path / "home"
    init_home(path, relays=[RELAY])
    return path


class ScriptedRelays:
    """Stands in for the relay pool: connected at once, no event to fetch, every publish taken; then it
    delivers the events ``answer(published event)`` returns, as a relay would."""

    def __init__(self, answer: Callable[[NostrEvent], list[NostrEvent]]) -> None:
        """Answer each published event with ``answer(event)``."""
        self._answer = answer
        self._deliveries: set[asyncio.Task[None]] = set()
        self.published: list[NostrEvent] = []

    def __call__(
        self, urls: list[str], *, on_event: Callable[[ReceivedEvent], Any], settings: PoolSettings
    ) -> ScriptedRelays:
        """Be the pool ``send`` makes."""
        self._on_event = on_event
        return self

    async def start(self) -> None:
        """Nothing to connect."""

    async def wait_connected(self, count: int, timeout: float) -> bool:  # noqa: ASYNC109 - the pool's signature
        """Connected at once."""
        return True

    async def fetch_event(self, event_id: str, timeout: float) -> NostrEvent | None:  # noqa: ASYNC109
        """No relay has it."""
        return None

    async def subscribe(self, subscription_id: str, filters: list[Filter]) -> None:
        """Every answer is delivered anyway."""

    async def publish(self, event: NostrEvent, timeout: float) -> PublishResult:  # noqa: ASYNC109
        """Take the event, then deliver its scripted answers."""
        self.published.append(event)
        for reply in self._answer(event):
            task = asyncio.create_task(self._on_event(ReceivedEvent(reply, RELAY, "tenexd-send", time.time())))
            self._deliveries.add(task)
            task.add_done_callback(self._deliveries.discard)
        return PublishResult(event.id, accepted_by=(RELAY,))

    async def stop(self) -> None:
        """Nothing to close."""


def agent_reply(home: Path, slug: str, trigger: NostrEvent, content: str, *, error: bool = False) -> NostrEvent:
    """The reply ``slug`` signs to ``trigger`` as the daemon composes it (a stop notice: ``error``, as
    tenex_daemon/services/stopping.py makes it)."""
    settings = load_settings(home)
    signer = Signer.from_file(settings.agent_key_path(slug))
    assert settings.owner is not None
    spec = ReplySpec(
        agent_slug=slug, trigger=trigger, root=trigger, content=content, destinations=(settings.owner,),
        phase="chat", net_time_seconds=0, error=error,
    )
    return SignedReplyComposer({slug: signer}, None).compose(spec)


def send(home: Path, monkeypatch: pytest.MonkeyPatch, relays: ScriptedRelays, *args: str) -> tuple[int, str, str]:
    """Run ``tenexd --home HOME send ARGS`` through ``relays``; return (exit code, stdout, stderr)."""
    monkeypatch.setattr(send_module, "RelayPool", relays)
    result = CliRunner().invoke(app, ["--home", str(home), "send", *args], catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize(
    ("author", "notice"),
    [("orchestrator", "Stopped: Planner, Executor."), ("planner", "Stopped: Planner.")],
)
def test_a_stop_notice_ends_the_wait_at_once_with_exit_1_saying_the_runs_were_stopped(
    home: Path, monkeypatch: pytest.MonkeyPatch, author: str, notice: str
) -> None:
    """`send --to planner` answered by the daemon's stop notice (several agents stopped: the orchestrator's;
    the planner alone: the planner's own) prints it, ends at once instead of waiting out --timeout, exits 1
    with `stopped: ...` naming the agents stopped, and --json says `stopped` and not `answered`."""
    relays = ScriptedRelays(lambda sent: [agent_reply(home, author, sent, notice, error=True)])

    started = time.monotonic()
    code, printed, said = send(home, monkeypatch, relays, "Plan it", "--to", "planner", "--timeout", "20")
    took = time.monotonic() - started
    as_json = send(home, monkeypatch, relays, "Plan it", "--to", "planner", "--timeout", "20", "--json")

    names = notice.removeprefix("Stopped: ").rstrip(".")
    assert code == 1, said
    assert took < 10, took
    assert f"[{author.title()}] {notice}" in printed
    assert f"stopped: the runs of {names} were stopped before planner answered" in said
    assert "no reply" not in said
    summary = json.loads(as_json[1].splitlines()[-1])
    assert (as_json[0], summary["answered"], summary["stopped"]) == (1, False, True)


def test_the_awaited_answer_still_ends_the_wait_with_exit_0(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's own answer (not a stop notice) ends `send --to planner` with exit 0 and no `stopped`."""
    relays = ScriptedRelays(lambda sent: [agent_reply(home, "planner", sent, "Saturday at noon.")])

    code, printed, said = send(home, monkeypatch, relays, "Plan it", "--to", "planner", "--timeout", "20", "--json")

    lines = printed.splitlines()
    assert code == 0, said
    assert json.loads(lines[0])["reply"]["content"] == "Saturday at noon."
    assert (json.loads(lines[-1])["answered"], json.loads(lines[-1])["stopped"]) == (True, False)


async def test_which_stop_notices_end_the_wait_and_that_an_answer_that_came_stays_answered() -> None:
    """`_Answers`: a stop notice naming the awaited agent ends the wait unanswered (`stopped` is the notice)
    whoever signs it; one naming only another agent does not; without --to any stop notice does; an answer
    that came counts even when a stop notice follows it."""
    orchestrator = Agent(slug="orchestrator", name="O", pubkey="0" * 64, orchestrator=True)
    planner = Agent(slug="planner", name="P", pubkey="1" * 64)
    executor = Agent(slug="executor", name="E", pubkey="2" * 64)
    agents = [orchestrator, planner, executor]
    someone = KeyPair.from_seed(76)
    both = sign_event(someone, "Stopped: P, E.", kind=1111, tags=[["error", "system"]])
    other = sign_event(someone, "Stopped: E.", kind=1111, tags=[["error", "system"]])
    answer = sign_event(someone, "done", kind=1111)

    answered = _Answers(agents, planner, "planner", None)
    answered.add(planner, answer)
    answered.add(orchestrator, both)
    stopped = _Answers(agents, planner, "planner", None)
    stopped.add(orchestrator, both)
    elsewhere = _Answers(agents, planner, "planner", None)
    elsewhere.add(executor, other)
    routed = _Answers(agents, orchestrator, None, None)
    routed.add(executor, other)

    assert await answered.wait(0.01)
    assert (await stopped.wait(5), stopped.stopped) == (False, both)
    assert (await elsewhere.wait(0.05), elsewhere.stopped) == (False, None)
    assert (await routed.wait(5), routed.stopped) == (False, other)


def take_in(home: Path, event: NostrEvent) -> list[NostrEvent]:
    """Store ``event`` as a new conversation of the home's store, as its daemon takes a message in (from a
    thread of its own: the caller is inside `send`'s event loop); no answer to deliver."""

    async def go() -> None:
        settings = load_settings(home)
        store = build_store(settings)
        await store.open()
        try:
            manager = ConversationManager(store, load_agents(settings), load_project_pubkey(settings))
            await manager.create_conversation(event)
        finally:
            await store.close()

    thread = threading.Thread(target=asyncio.run, args=(go(),))
    thread.start()
    thread.join()
    return []


@pytest.mark.parametrize("taken_in", [True, False], ids=["taken-in", "not-taken-in"])
@pytest.mark.parametrize("args", [["--to", "planner"], ["--to", "planner", "--kind", "1"]], ids=["kind-11", "kind-1"])
def test_a_wait_in_vain_says_how_to_read_the_answer_later(
    home: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], taken_in: bool
) -> None:
    """When no answer comes within --timeout, `send` exits 1 saying the answer may still come: the command
    that shows the conversation by its short id (with the --home given) when the home holds the message (a
    new kind-11 root, or a kind-1 note), and a longer --timeout; when the home holds no conversation with it
    (no daemon took it in), no conversation is named (`conversations show` would find none), and it says so,
    and that the daemon is not running."""
    relays = ScriptedRelays(lambda sent: take_in(home, sent) if taken_in else [])

    code, _, said = send(home, monkeypatch, relays, "Plan it", *args, "--timeout", "0.3")

    sent = relays.published[0]
    said = " ".join(said.split())
    assert code == 1
    show = f"tenexd --home {home} conversations show {sent.id[:12]}, or " if taken_in else ""
    assert f"no reply from planner within 0.3 s (the answer may still come: {show}send with a longer --timeout N)" in said
    if not taken_in:
        assert "conversations show" not in said
        assert (
            "this home holds no conversation with the message: its daemon is not running, see "
            f"`tenexd --home {home} status`"
        ) in said
