"""Live status and stop, end to end: a real relay, the daemon as a subprocess, a model that thinks for a
while (a scripted OpenAI-compatible server), and a person's client on the relay watching kind 24133 and
sending kind 24134 (docs/PROTOCOL.md)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tenex_daemon.adapters.nostr.relay_pool import PoolSettings, ReceivedEvent, RelayPool
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.app.status import read_status
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.testing import KeyPair
from tests.contract.postgres_server import find_bin_dir, shared_server
from tests.e2e.harness import DaemonProcess, Home, run_cli, scripted_agent
from tests.e2e.test_outbox import until_asked, until_logged
from tests.faults.test_daemons_on_postgres import twin
from tests.integration.nostr.harness import LocalRelayServer
from tests.llm_servers import ScriptedServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DAEMON_ENV = {"TENEX_DAEMON__STREAM_PARTIALS": "false"}
STRANGER = KeyPair.from_seed(4242)


ANSWER_WINDOW_S = 3.0
"""How long a test waits, once it lets the model answer, for a reply a stop failed to prevent."""


def thinking_planner(home: Home, server: ScriptedServer, think: float | asyncio.Event) -> None:
    """The planner answers "Here is the plan." through ``server``: after ``think`` seconds, or once the test
    sets ``think`` (an event: a stop's test then races no deadline, however slow the machine)."""
    delay_s, gate = (0.0, think) if isinstance(think, asyncio.Event) else (think, None)
    scripted_agent(home, "planner", server, "Here is the plan.", delay_s=delay_s, gate=gate, timeout_s=120)


class Person:
    """The owner's client on the relay: asks the planner, sends stops, records replies and statuses."""

    def __init__(self, relay: LocalRelayServer, home: Home) -> None:
        self.home = home
        self.owner = Signer.from_text(home.owner_secret)
        self.replies: list[NostrEvent] = []
        self.statuses: list[NostrEvent] = []
        self.client = RelayPool([relay.url], on_event=self._on_event, settings=PoolSettings(publish_timeout=10.0))

    async def _on_event(self, received: ReceivedEvent) -> None:
        event = received.event
        (self.statuses if event.kind == 24133 else self.replies).append(event)

    async def start(self) -> None:
        """Connect; subscribe to the planner's replies and the project's statuses."""
        await self.client.start()
        await self.client.subscribe("watch", [
            {"kinds": [1111], "authors": [self.home.agent("planner")]},
            {"kinds": [24133], "authors": [self.home.project]},
        ])
        assert await self.client.wait_connected(within=10)

    async def ask(self, text: str) -> NostrEvent:
        """Publish a new conversation to the planner; return its root."""
        event = self.owner.sign(11, text, [["p", self.home.agent("planner")]])
        await self.client.publish(event)
        return event

    async def stop(self, root: NostrEvent, signer: Signer | None = None) -> None:
        """Publish a stop request for the conversation (as the owner unless ``signer`` is given)."""
        stop = (signer or self.owner).sign(24134, "", [["e", root.id], ["p", self.home.agent("planner")]])
        await self.client.publish(stop)

    def replies_to(self, root: NostrEvent) -> list[NostrEvent]:
        """The planner's replies in the conversation."""
        return [e for e in self.replies if e.tag_value("E") == root.id]

    def statuses_of(self, root: NostrEvent) -> list[NostrEvent]:
        """The statuses naming the conversation, oldest first."""
        return sorted((e for e in self.statuses if e.tag_value("e") == root.id), key=lambda e: e.created_at)

    async def until(self, check: Callable[[], bool], within: float) -> None:
        """Wait until ``check()`` holds."""
        async with asyncio.timeout(within):
            while not check():  # noqa: ASYNC110 - the pool's callback fills the lists
                await asyncio.sleep(0.05)


@dataclass
class Running:
    """The daemon and the person's client."""

    daemon: DaemonProcess
    person: Person


@contextlib.asynccontextmanager
async def running(
    relay: LocalRelayServer, home: Home, server: ScriptedServer, think: float | asyncio.Event
) -> AsyncIterator[Running]:
    """A daemon whose planner thinks (``think``: :func:`thinking_planner`), and the person's client; both
    stopped at the end."""
    thinking_planner(home, server, think)
    daemon = DaemonProcess(home, env=DAEMON_ENV)
    await daemon.start()
    person = Person(relay, home)
    await person.start()
    try:
        yield Running(daemon, person)
    finally:
        await person.client.stop()
        await daemon.stop()
        daemon.kill()


async def test_a_client_sees_the_agent_working_then_idle_and_a_strangers_stop_does_nothing(
    relay: LocalRelayServer, home: Home, scripted_server: ScriptedServer
) -> None:
    """While the planner thinks, a kind-24133 status signed by the project names the conversation's root,
    the planner and the person; once it answered, a status names nobody. A stranger's stop meanwhile is
    refused and counted: the planner's answer still arrives."""
    async with running(relay, home, scripted_server, 3.0) as live:
        person = live.person
        root = await person.ask("Plan the launch")
        await until_asked(scripted_server, 1)
        await person.stop(root, Signer.from_text(STRANGER.secret))
        await person.until(lambda: bool(person.replies_to(root)), within=30)
        await person.until(lambda: len(person.statuses_of(root)) >= 2, within=10)
        status = read_status(home.path / "run" / "status.json", stale_after_s=30).data

    assert [e.content for e in person.replies_to(root)] == ["Here is the plan."], live.daemon.log_tail()
    busy, idle = person.statuses_of(root)[:2]
    assert busy.pubkey == home.project
    assert busy.has_valid_id()
    assert busy.tag_values("p") == [home.agent("planner")]
    assert busy.tag_value("P") == home.owner
    assert busy.tag_value("a") is not None
    assert idle.tag_values("p") == []
    assert idle.tag_value("e") == root.id
    assert status is not None
    assert status["events"]["rejected"].get("author_not_allowed", 0) >= 1


async def test_the_owners_stop_cancels_the_thinking_agent_and_only_the_notice_is_published(
    relay: LocalRelayServer, home: Home, scripted_server: ScriptedServer
) -> None:
    """A kind-24134 stop from the owner while the planner thinks cancels its run: the only reply is the
    notice ("Stopped: Planner.", a system error) and the status goes idle; `tenexd conversations stop` does
    the same through the running daemon's control API."""
    answer = asyncio.Event()  # the model answers once both stops are done: had a run gone on, it replies then
    async with running(relay, home, scripted_server, answer) as live:
        person = live.person
        root = await person.ask("Plan the launch")
        await until_asked(scripted_server, 1)
        await person.stop(root)
        await person.until(lambda: bool(person.replies_to(root)), within=30)

        second = await person.ask("Plan the retrospective")
        await until_asked(scripted_server, 2)
        code, out = await run_cli(home, "conversations", "stop", second.id)
        await person.until(lambda: bool(person.replies_to(second)), within=30)
        answer.set()
        await asyncio.sleep(ANSWER_WINDOW_S)
        await person.until(lambda: any(not e.tag_values("p") for e in person.statuses_of(root)), within=10)

    for conversation in (root, second):
        replies = person.replies_to(conversation)
        assert [e.content for e in replies] == ["Stopped: Planner."], live.daemon.log_tail()
        assert replies[0].has_tag("error", "system")
    assert code == 0, out
    assert "stopped planner" in out
    assert person.statuses_of(root)[0].tag_values("p") == [home.agent("planner")]


@dataclass
class Sharing:
    """Two daemons on one PostgreSQL database, each reading its own relay, and the owner's client on each
    relay (``people[n]`` talks to ``daemons[n]``)."""

    daemons: list[DaemonProcess]
    people: list[Person]

    def logs(self) -> str:
        """The tail of both daemons' logs."""
        return "\n".join(d.log_tail(20) for d in self.daemons)


@contextlib.asynccontextmanager
async def sharing_a_database(
    relay: LocalRelayServer, home: Home, tmp_path: Path, server: ScriptedServer, answer: asyncio.Event
) -> AsyncIterator[Sharing]:
    """Two daemons (``home`` and its twin) whose planner thinks until ``answer`` is set, sharing a new
    database of the session's PostgreSQL server; all stopped at the end."""
    if find_bin_dir() is None:
        pytest.skip("PostgreSQL is not installed; scripts/setup.d/20-postgres.sh installs it")
    thinking_planner(home, server, answer)
    dsn = await shared_server().create_database()
    env = {
        **DAEMON_ENV,
        "TENEX_STORAGE__KIND": '"postgres"',
        "TENEX_STORAGE__DSN": f'"{dsn}"',
        "TENEX_DAEMON__STOP_WAIT_S": "6",  # a loaded machine's daemon answers a told stop in time
    }
    other_relay = LocalRelayServer(tmp_path / "relay-b-lmdb")
    await other_relay.start()
    other_home = twin(home, tmp_path / "home-b")
    config = other_home.path / "config.toml"
    config.write_text(config.read_text().replace(relay.url, other_relay.url))
    shared = Sharing(
        [DaemonProcess(home, env=env), DaemonProcess(other_home, env=env)],
        [Person(relay, home), Person(other_relay, home)],
    )
    try:
        for daemon, person in zip(shared.daemons, shared.people, strict=True):
            await daemon.start()
            await person.start()
        yield shared
    finally:
        for person in shared.people:
            await person.client.stop()
        for daemon in shared.daemons:
            await daemon.stop()
            daemon.kill()
        other_relay.stop()


async def test_a_stop_reaches_the_runs_of_every_daemon_sharing_a_database(
    relay: LocalRelayServer, home: Home, tmp_path: Path, scripted_server: ScriptedServer
) -> None:
    """Two daemons on one PostgreSQL database, each reading its own relay, run the planner in two
    conversations each; the owner's stop of each reaches first the daemon that does not run it, then the
    one that does: every run is cancelled (each conversation's only reply is the notice), and the stop is
    recorded once per request."""
    answer = asyncio.Event()  # the model answers once every stop is done: had a run gone on, it replies then
    asked: list[tuple[NostrEvent, int]] = []
    async with sharing_a_database(relay, home, tmp_path, scripted_server, answer) as shared:
        daemons, people = shared.daemons, shared.people
        for n in range(4):
            asked.append((await people[n % 2].ask(f"Plan launch {n}"), n % 2))
        await until_asked(scripted_server, len(asked))
        for root, runner in asked:
            stop = people[0].owner.sign(24134, "", [["e", root.id], ["p", home.agent("planner")]])
            await people[1 - runner].client.publish(stop)  # the daemon with nothing to stop takes it first
            await until_logged(daemons[1 - runner], stop.id, within=10)
            await asyncio.sleep(0.5)  # its handling ends (before this change: marked processed for all)
            await people[runner].client.publish(stop)

        def answered() -> bool:
            return all(people[runner].replies_to(root) for root, runner in asked)

        await people[0].until(answered, within=30)
        answer.set()
        await asyncio.sleep(ANSWER_WINDOW_S)
        code, out = await run_cli(home, "conversations", "show", asked[0][0].id, "--json")
        logs = shared.logs()

    for root, runner in asked:
        assert [e.content for e in people[runner].replies_to(root)] == ["Stopped: Planner."], logs
    assert code == 0, out
    stops = json.loads(out)["metadata"]["extra"]["stops"]
    assert [(s["agents"], s["event_id"] is not None) for s in stops] == [(["planner"], True)], stops


async def test_tenexd_conversations_stop_reaches_the_run_another_daemon_holds(
    relay: LocalRelayServer, home: Home, tmp_path: Path, scripted_server: ScriptedServer
) -> None:
    """Two daemons share a PostgreSQL database and the planner thinks on the second: `tenexd conversations
    stop`, which reaches the first daemon's control API, stops it there (told through the database): the
    only reply is the notice, the command names the planner, and the stop is recorded once."""
    answer = asyncio.Event()  # the model answers once the stop is done: had the run gone on, it replies then
    async with sharing_a_database(relay, home, tmp_path, scripted_server, answer) as shared:
        person = shared.people[1]
        root = await person.ask("Plan the launch")
        await until_asked(scripted_server, 1)
        code, out = await run_cli(home, "conversations", "stop", root.id)
        await person.until(lambda: bool(person.replies_to(root)), within=30)
        answer.set()
        await asyncio.sleep(ANSWER_WINDOW_S)
        shown, record = await run_cli(home, "conversations", "show", root.id, "--json")
        logs = shared.logs()

    assert [e.content for e in person.replies_to(root)] == ["Stopped: Planner."], logs
    assert code == 0, out
    assert f"stopped planner in {root.id}" in out, out
    assert shown == 0, record
    stops = json.loads(record)["metadata"]["extra"]["stops"]
    assert [(s["by"], s["agents"], s["event_id"]) for s in stops] == [("owner", ["planner"], None)], stops
