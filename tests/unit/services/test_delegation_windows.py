"""What lands between an exchange's saves (docs/ARCHITECTURE.md, "Delegation threads"): a stop naming the
asked agent while the request is saved, a deletion of the conversation before its thread is saved."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from tenex_daemon import NostrEvent
from tenex_daemon.core.agents import Agent
from tenex_daemon.core.vocabulary import KIND_STOP, TAG_DELEGATION
from tenex_daemon.services.dispatcher import HandleResult
from tenex_daemon.services.threads import META_PREFIX, ThreadManager
from tenex_daemon.testing.fakes import ScriptedBackend
from tests.conftest import Cast
from tests.unit.services.test_delegation import Rig, ask, make_rig, settle, tool_result
from tests.unit.services.test_tool_loop import text


def on_published(
    rig: Rig, when: Callable[[NostrEvent], bool], then: Callable[[str], Awaitable[None]]
) -> None:
    """Run ``then`` (given the conversation id) once the outbox has taken an event ``when`` picks: the
    event is saved in history by then, and the exchange has not gone on yet."""
    outbox = rig.runner.outbox
    add = outbox.add

    async def add_then(
        conversation_id: str, event: NostrEvent, *, agent_slug: str, trigger_id: str | None = None
    ) -> None:
        await add(conversation_id, event, agent_slug=agent_slug, trigger_id=trigger_id)
        if when(event):
            await then(conversation_id)

    outbox.add = add_then  # type: ignore[method-assign]


async def test_a_stop_landing_while_the_request_is_saved_keeps_the_asked_agent_from_answering(
    cast: Cast
) -> None:
    """A stop naming Bob that lands after Alice's request passed the stop check and before Bob's answer can
    be cancelled (the request being saved and published) still stops him: his model is not run, nothing of
    his is saved or published, and Alice's call is refused as one asking a stopped agent."""
    rig = make_rig(cast, ScriptedBackend([ask("c1", "bob", "What is 2+2?"), text("done")]),
                   ScriptedBackend([text("4 (after the stop)")]))
    stops: list[HandleResult] = []

    async def stop_bob(conversation_id: str) -> None:
        stop = cast.factory.event(
            cast.user, "", kind=KIND_STOP, tags=[["e", conversation_id], ["p", cast.bob.pubkey]]
        )
        stops.append(await rig.dispatcher.handle(stop))

    def alices_request(event: NostrEvent) -> bool:
        return event.pubkey == cast.alice.pubkey and event.tag_value(TAG_DELEGATION) is not None

    on_published(rig, alices_request, stop_bob)
    root = cast.user_says("Alice, ask Bob", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await settle(rig)

    assert len(stops) == 1
    assert rig.bob.requests == []
    result = tool_result(rig.alice)
    assert result.is_error
    assert "bob was stopped" in result.content
    assert [e.content for e in rig.publisher.published] == ["What is 2+2?", "done"]
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert all(e.pubkey != cast.bob.pubkey for e in conversation.history)


@pytest.mark.parametrize("deleted_by", ["this-daemon", "another-daemon"])
async def test_a_conversation_deleted_before_its_thread_is_saved_leaves_no_thread_stored(
    cast: Cast, deleted_by: str
) -> None:
    """The conversation is deleted after Bob's answer is saved and before the pair's thread is: by this
    daemon (the API: deletion, then its cached threads forgotten) or by another daemon sharing the store
    (deletion only, nothing forgotten here); no thread of it is stored or cached afterwards."""
    rig = make_rig(cast, ScriptedBackend([ask("c1", "bob", "What is 2+2?"), text("x")]),
                   ScriptedBackend([text("SECRET 4")]))
    other = make_rig(cast, ScriptedBackend([]), store=rig.store)

    async def delete(conversation_id: str) -> None:
        if deleted_by == "this-daemon":
            assert await rig.manager.delete_conversation(conversation_id)
            rig.threads.forget_conversation(conversation_id)
        else:
            assert await other.manager.delete_conversation(conversation_id)

    on_published(rig, lambda e: e.pubkey == cast.bob.pubkey, delete)
    root = cast.user_says("Alice, ask Bob", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await settle(rig)

    assert [e.content for e in rig.publisher.published][:2] == ["What is 2+2?", "SECRET 4"]
    assert await rig.manager.get_conversation(root.id) is None
    thread_id = ThreadManager.key(root.id, "alice", "bob")
    assert await rig.store.get_meta(META_PREFIX + thread_id) is None
    assert thread_id not in rig.threads.cached()


async def test_a_stop_landing_while_the_stops_are_read_again_cancels_the_answer_before_it_starts(
    cast: Cast
) -> None:
    """A stop naming Bob recorded just after his registered answer read the stops again finds it and cancels
    it before his model starts: the stop names Bob (the person is told), and Alice's call is refused."""
    rig = make_rig(cast, ScriptedBackend([ask("c1", "bob", "What is 2+2?"), text("done")]),
                   ScriptedBackend([text("4 (after the stop)")]))
    delegation = rig.runner.delegation
    assert delegation is not None
    check = delegation._refuse_if_stopped
    stops: list[HandleResult] = []

    async def check_then_stop(asker: Agent, asked: Agent, cid: str, trigger: NostrEvent) -> None:
        await check(asker, asked, cid, trigger)
        if len(delegation._answering) == 1:  # the answer's own reading, not the exchange's first
            tags = [["e", cid], ["p", cast.bob.pubkey]]
            stop = cast.factory.event(cast.user, "", kind=KIND_STOP, tags=tags)
            stops.append(await rig.dispatcher.handle(stop))

    delegation._refuse_if_stopped = check_then_stop  # type: ignore[method-assign]
    root = cast.user_says("Alice, ask Bob", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await settle(rig)

    [stop] = stops
    assert stop.agents == ("bob",)
    assert rig.bob.requests == []
    assert "bob was stopped" in tool_result(rig.alice).content
    assert [(e.pubkey, e.content) for e in rig.publisher.published][1:] == [
        (cast.bob.pubkey, "Stopped: Bob."), (cast.alice.pubkey, "done")
    ]
