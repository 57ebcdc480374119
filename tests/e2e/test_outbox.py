"""Nothing said is lost on its way out: a reply saved while the relay is down reaches the person once,
whether the relay comes back while the daemon runs or the daemon is killed before it could publish."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator

import pytest

from tenex_daemon.adapters.nostr.relay_pool import PoolSettings, ReceivedEvent, RelayPool
from tenex_daemon.adapters.nostr.signer import Signer
from tests.e2e.harness import DaemonProcess, Home, scripted_agent
from tests.integration.nostr.harness import LocalRelayServer
from tests.llm_servers import OPENAI_PATH, ScriptedServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

THINK_S = 2.0
DAEMON_ENV = {"TENEX_DAEMON__STREAM_PARTIALS": "false", "TENEX_RELAYS__PUBLISH_TIMEOUT_S": "2"}
"""No partials (the scripted model answers whole); a publish gives up after 2 s, so a relay down for 8 s
makes it fail and the outbox try again."""


def slow_planner(home: Home, server: ScriptedServer, gate: asyncio.Event | None = None) -> None:
    """The planner thinks THINK_S seconds through a scripted OpenAI-compatible server; with ``gate``, until
    the test sets it instead."""
    delay_s = THINK_S if gate is None else 0.0
    scripted_agent(home, "planner", server, "Here is the plan.", delay_s=delay_s, gate=gate, timeout_s=120)


class Person:
    """A client on the relay: asks the planner and counts the planner's replies per question."""

    def __init__(self, relay: LocalRelayServer, home: Home) -> None:
        self.home = home
        self.owner = Signer.from_text(home.owner_secret)
        self.replies: defaultdict[str, set[str]] = defaultdict(set)
        self.client = RelayPool(
            [relay.url], on_event=self._on_event, settings=PoolSettings(publish_timeout=10.0)
        )

    async def _on_event(self, received: ReceivedEvent) -> None:
        parent = received.event.tag_value("e")
        if parent is not None:
            self.replies[parent].add(received.event.id)

    async def start(self) -> None:
        """Connect and subscribe to the planner's replies."""
        await self.client.start()
        await self.client.subscribe("replies", [{"kinds": [1111], "authors": [self.home.agent("planner")]}])
        assert await self.client.wait_connected(within=10)

    async def ask(self, text: str) -> str:
        """Publish a question to the planner; return its id."""
        event = self.owner.sign(11, text, [["p", self.home.agent("planner")]])
        await self.client.publish(event)
        return event.id

    async def wait_for_reply(self, question: str, within: float) -> None:
        """Wait until at least one reply to ``question`` arrived, then a moment for a second one."""
        async with asyncio.timeout(within):
            while not self.replies[question]:  # noqa: ASYNC110 - the pool's callback fills it
                await asyncio.sleep(0.1)
        await asyncio.sleep(1.5)


@contextlib.asynccontextmanager
async def slow_planner_running(
    relay: LocalRelayServer, home: Home, server: ScriptedServer, gate: asyncio.Event | None = None
) -> AsyncIterator[tuple[DaemonProcess, Person]]:
    """A daemon whose planner thinks through ``server`` (slow_planner), and a person on the relay;
    both stopped at the end."""
    slow_planner(home, server, gate)
    daemon = DaemonProcess(home, env=DAEMON_ENV)
    await daemon.start()
    person = Person(relay, home)
    await person.start()
    try:
        yield daemon, person
    finally:
        await person.client.stop()
        await daemon.stop()
        daemon.kill()


async def until_asked(server: ScriptedServer, count: int) -> None:
    """Wait until the model has been asked ``count`` times."""
    async with asyncio.timeout(30):
        while len([p for p, _ in server.requests if p == OPENAI_PATH]) < count:  # noqa: ASYNC110
            await asyncio.sleep(0.05)


async def until_logged(daemon: DaemonProcess, text: str, within: float) -> None:
    """Wait until the daemon's log contains ``text``; fail with the log's tail after ``within`` s."""
    try:
        async with asyncio.timeout(within):
            while text not in daemon.log_path.read_text():  # noqa: ASYNC110 - the daemon writes it
                await asyncio.sleep(0.1)
    except TimeoutError:
        pytest.fail(f"{text!r} not logged within {within} s\n{daemon.log_tail()}")


async def test_a_reply_made_while_the_relay_is_down_arrives_once_when_it_is_back(
    relay: LocalRelayServer, home: Home, scripted_server: ScriptedServer
) -> None:
    """The relay dies while the agent thinks and comes back 8 s later: the reply, saved meanwhile and kept
    in the outbox, reaches the person exactly once."""
    async with slow_planner_running(relay, home, scripted_server) as (daemon, person):
        question = await person.ask("Plan the launch")
        await until_asked(scripted_server, 1)  # the agent thinks
        await relay.restart(down_for=8.0)
        await person.wait_for_reply(question, within=60)

    assert len(person.replies[question]) == 1, daemon.log_tail()
    assert "outbox_retry" in daemon.log_path.read_text()


async def test_a_reply_saved_but_not_published_before_a_sigkill_arrives_once_after_restart(
    relay: LocalRelayServer, home: Home, scripted_server: ScriptedServer
) -> None:
    """The daemon saves the reply while the relay is down and is SIGKILLed before any relay took it; after
    the relay and the daemon start again, the reply reaches the person exactly once."""
    async with slow_planner_running(relay, home, scripted_server) as (daemon, person):
        question = await person.ask("Plan the retrospective")
        await until_asked(scripted_server, 1)
        relay.stop()
        await until_logged(daemon, "outbox_retry", within=30)  # the reply is saved, its publish failed
        daemon.kill()  # SIGKILL: the reply is saved and was never published
        await relay.start()
        await daemon.start()
        await person.wait_for_reply(question, within=60)

    assert len(person.replies[question]) == 1, daemon.log_tail()
    asked = len([p for p, _ in scripted_server.requests if p == OPENAI_PATH])
    assert asked == 1, "the saved reply is published again, the model is not asked again"
