"""A burst from a real client to a slow agent through a real relay: one call answers the waiting messages."""

from __future__ import annotations

import asyncio

import pytest

from tests.e2e.harness import Home
from tests.e2e.test_outbox import slow_planner_running, until_asked, until_logged
from tests.integration.nostr.harness import LocalRelayServer
from tests.llm_servers import OPENAI_PATH, ScriptedServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_three_quick_messages_cost_two_calls_and_the_second_holds_everything(
    relay: LocalRelayServer, home: Home, scripted_server: ScriptedServer
) -> None:
    """Three messages sent while the agent thinks about the first: the model is asked twice, the second
    request (recorded by the scripted server) holds all three messages in order and the agent's first
    answer, and the person gets one reply to the first message and one to the last, none twice."""
    thinking = asyncio.Event()  # the model answers the first once the daemon took in the other two
    async with slow_planner_running(relay, home, scripted_server, thinking) as (daemon, person):
        first = await person.ask("Plan a picnic")
        await until_asked(scripted_server, 1)
        root_tags = [["E", first, "", person.owner.pubkey], ["K", "11"], ["e", first], ["p", home.agent("planner")]]
        second = person.owner.sign(1111, "For six people", root_tags)
        third = person.owner.sign(1111, "On Saturday", root_tags)
        for event in (second, third):
            await person.client.publish(event)
        for event in (second, third):
            await until_logged(daemon, event.id, within=30)
        thinking.set()
        await person.wait_for_reply(first, within=30)
        await person.wait_for_reply(third.id, within=30)
        await asyncio.sleep(2.0)  # a third call, if any, would come now

    calls = [body for path, body in scripted_server.requests if path == OPENAI_PATH]
    assert len(calls) == 2, daemon.log_tail()
    contents = [m["content"] for m in calls[1]["messages"] if m["role"] != "system"]
    assert contents[-1] == "On Saturday"
    for said in ("Plan a picnic", "For six people", "Here is the plan."):
        assert any(said in content for content in contents), contents
    assert len(person.replies[first]) == 1
    assert len(person.replies[third.id]) == 1
    assert not person.replies[second.id]
