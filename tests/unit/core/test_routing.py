"""The orchestrator's routing context and turn bookkeeping (docs/CONTEXT.md, "The orchestrator's view")."""

from __future__ import annotations

import json

import pytest

from tenex_daemon import ConversationManager, UnknownAgentError
from tenex_daemon.testing import FakeClock
from tests.conftest import Cast


async def test_routing_context_shape_with_no_turns(manager: ConversationManager, cast: Cast) -> None:
    """A fresh conversation gives the user request, an empty history and no current routing."""
    cid = (await manager.create_conversation(cast.user_says("Build me a website", kind=11))).id

    context = await manager.build_orchestrator_routing_context(cid)

    assert context == {
        "user_request": "Build me a website", "latest_user_message": "Build me a website",
        "routing_history": [], "current_routing": None,
    }
    assert json.loads(json.dumps(context)) == context


async def test_latest_user_message_is_the_newest_a_person_wrote_up_to_the_trigger(
    manager: ConversationManager, cast: Cast
) -> None:
    """A follow-up reaches the orchestrator: ``latest_user_message`` is the newest person's message with
    content up to the trigger (an agent's trigger, a foreign agent's included, looks back past it; a
    later message is not shown), while ``user_request`` stays the first message."""
    root = cast.user_says("Build me a website", kind=11)
    cid = (await manager.create_conversation(root)).id
    thread = [["E", root.id, "", root.pubkey], ["K", "11"]]
    answer = cast.alice_says("Which colours?", tags=thread)
    follow_up = cast.user_says("Make it blue", tags=thread)
    empty = cast.user_says("", tags=thread)
    completion = cast.alice_says("Done, blue", tags=[*thread, ["tool", "complete"]])
    later = cast.user_says("And a logo", tags=thread)
    for event in (answer, follow_up, empty, completion, later):
        await manager.add_event(cid, event)
    foreign_agent = cast.factory.event(cast.other_user, "Another bot here", tags=[*thread, ["net-time", "3"]])

    at_answer = await manager.build_orchestrator_routing_context(cid, answer)
    at_completion = await manager.build_orchestrator_routing_context(cid, completion)
    at_later = await manager.build_orchestrator_routing_context(cid, later)
    unsaved = cast.user_says("Not stored yet", tags=thread)
    at_unsaved = await manager.build_orchestrator_routing_context(cid, unsaved)
    at_foreign_agent = await manager.build_orchestrator_routing_context(cid, foreign_agent)

    assert at_answer["latest_user_message"] == "Build me a website"
    assert at_completion["latest_user_message"] == "Make it blue"
    assert at_later["latest_user_message"] == "And a logo"
    assert at_unsaved["latest_user_message"] == "Not stored yet"
    assert at_foreign_agent["latest_user_message"] == "And a logo"
    assert {c["user_request"] for c in (at_answer, at_completion, at_later, at_unsaved)} == {"Build me a website"}


async def test_open_turn_is_current_and_completed_turns_are_history(
    manager: ConversationManager, cast: Cast, clock: FakeClock
) -> None:
    """Completed turns appear in routing_history in order; the open turn is current_routing."""
    cid = (await manager.create_conversation(cast.user_says("Build it", kind=11))).id
    t1_time = clock.now
    await manager.start_orchestrator_turn(cid, "plan", ["alice", "bob"], reason="needs a plan")
    clock.advance(1_000)
    assert await manager.add_completion_to_turn(cid, "alice", "plan part A")
    clock.advance(1_000)
    assert await manager.add_completion_to_turn(cid, "bob", "plan part B")
    clock.advance(1_000)
    t2_time = clock.now
    await manager.start_orchestrator_turn(cid, "execute", ["alice"], reason="build")

    context = await manager.build_orchestrator_routing_context(cid)

    assert context["routing_history"] == [
        {
            "phase": "plan",
            "agents": ["alice", "bob"],
            "completions": [
                {"agent": "alice", "message": "plan part A", "timestamp": t1_time + 1_000},
                {"agent": "bob", "message": "plan part B", "timestamp": t1_time + 2_000},
            ],
            "reason": "needs a plan",
            "timestamp": t1_time,
        }
    ]
    assert context["current_routing"] == {
        "phase": "execute",
        "agents": ["alice"],
        "completions": [],
        "reason": "build",
        "timestamp": t2_time,
    }


async def test_duplicate_completion_is_not_double_counted(manager: ConversationManager, cast: Cast) -> None:
    """An agent completing twice in one turn counts once, and the turn stays open for the others."""
    cid = (await manager.create_conversation(cast.user_says("Go", kind=11))).id
    await manager.start_orchestrator_turn(cid, "execute", ["alice", "bob"])

    first = await manager.add_completion_to_turn(cid, "alice", "done")
    second = await manager.add_completion_to_turn(cid, "alice", "done again")

    context = await manager.build_orchestrator_routing_context(cid)
    assert (first, second) == (True, False)
    assert context["routing_history"] == []
    assert [c["agent"] for c in context["current_routing"]["completions"]] == ["alice"]


async def test_completion_events_close_the_turn_once(manager: ConversationManager, cast: Cast) -> None:
    """Agent events tagged ["tool","complete"] record completions; a repeated one is ignored; the turn closes."""
    cid = (await manager.create_conversation(cast.user_says("Go", kind=11))).id
    await manager.start_orchestrator_turn(cid, "execute", ["alice", "bob"])
    done_a = cast.alice_says("alice done", tags=[["tool", "complete"]])
    again_a = cast.alice_says("alice done twice", tags=[["tool", "complete"]])
    done_b = cast.bob_says("bob done", tags=[["tool", "complete"]])

    await manager.add_event(cid, done_a)
    preview = await manager.build_orchestrator_routing_context(cid, trigger=again_a)
    await manager.add_event(cid, again_a)
    await manager.add_event(cid, done_b)

    context = await manager.build_orchestrator_routing_context(cid, trigger=done_b)
    assert [c["agent"] for c in preview["current_routing"]["completions"]] == ["alice"]
    assert context["current_routing"] is None
    assert len(context["routing_history"]) == 1
    completions = context["routing_history"][0]["completions"]
    assert [(c["agent"], c["message"]) for c in completions] == [("alice", "alice done"), ("bob", "bob done")]


async def test_trigger_completion_is_previewed_in_current_routing(
    manager: ConversationManager, cast: Cast
) -> None:
    """A completion trigger not yet stored shows once in current_routing."""
    cid = (await manager.create_conversation(cast.user_says("Go", kind=11))).id
    await manager.start_orchestrator_turn(cid, "execute", ["alice", "bob"])
    trigger = cast.alice_says("finished", tags=[["tool", "complete"]])

    context = await manager.build_orchestrator_routing_context(cid, trigger=trigger)

    assert context["current_routing"]["completions"] == [
        {"agent": "alice", "message": "finished", "timestamp": trigger.created_at * 1000}
    ]


async def test_a_late_completion_answering_an_earlier_trigger_is_not_previewed(
    manager: ConversationManager, cast: Cast
) -> None:
    """A completion that answers another event than the open turn's trigger (a late answer to the root) is
    not shown in current_routing, as it is not counted for the turn when it is recorded."""
    root = cast.user_says("build", kind=11)
    await manager.create_conversation(root)
    follow = cast.user_says("and paint", tags=[["E", root.id]])
    await manager.add_event(root.id, follow)
    await manager.start_orchestrator_turn(root.id, "chat", ["alice"], "paint", trigger_id=follow.id)
    late = cast.alice_says("built", tags=[["E", root.id], ["e", root.id], ["tool", "complete"]])

    context = await manager.build_orchestrator_routing_context(root.id, late)
    await manager.add_event(root.id, late)

    conversation = await manager.get_conversation(root.id)
    assert conversation is not None
    assert conversation.orchestrator_turns[-1].completions == []
    assert context["current_routing"]["completions"] == []


async def test_completion_without_open_turn_is_ignored(manager: ConversationManager, cast: Cast) -> None:
    """add_completion_to_turn returns False when no turn is open or the agent was not routed."""
    cid = (await manager.create_conversation(cast.user_says("Go", kind=11))).id
    assert not await manager.add_completion_to_turn(cid, "alice", "nothing open")
    await manager.start_orchestrator_turn(cid, "chat", ["bob"])
    assert not await manager.add_completion_to_turn(cid, "alice", "not routed")


async def test_new_turn_supersedes_an_open_one(manager: ConversationManager, cast: Cast) -> None:
    """Starting a turn while one is open moves the open one, with its partial completions, to history."""
    cid = (await manager.create_conversation(cast.user_says("Go", kind=11))).id
    await manager.start_orchestrator_turn(cid, "execute", ["alice", "bob"])
    await manager.add_completion_to_turn(cid, "alice", "half")
    await manager.start_orchestrator_turn(cid, "chat", ["bob"])

    context = await manager.build_orchestrator_routing_context(cid)

    assert [e["phase"] for e in context["routing_history"]] == ["execute"]
    assert context["current_routing"]["agents"] == ["bob"]


async def test_turn_to_unknown_agent_is_refused(manager: ConversationManager, cast: Cast) -> None:
    """Routing to an agent that is not configured raises UnknownAgentError."""
    cid = (await manager.create_conversation(cast.user_says("Go", kind=11))).id
    with pytest.raises(UnknownAgentError, match="nobody"):
        await manager.start_orchestrator_turn(cid, "chat", ["nobody"])
