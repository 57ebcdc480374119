"""An agent's answer every relay refuses for good (docs/ARCHITECTURE.md, "Delivery"): the person is told why
by a notice from the agent, the answer stays saved, and it is not tried again."""

from __future__ import annotations

from tenex_daemon.core.llm import CompletionResult
from tenex_daemon.core.vocabulary import TAG_ERROR
from tenex_daemon.testing.fakes import FakePublisher, ScriptedBackend
from tests import pipeline
from tests.conftest import Cast


async def test_an_answer_the_relays_refuse_for_good_is_replaced_by_a_notice_to_the_person(cast: Cast) -> None:
    """Alice's answer is over the relays' size limit: what goes out is her notice naming the relays' reason,
    a reply to the person's message tagged as a system error and addressed to the person; the answer stays
    saved in the conversation, before the notice; the outbox counts one refusal and holds nothing."""
    publisher = FakePublisher(refuse_over=1000)
    backend = ScriptedBackend([CompletionResult(text="word " * 400, model="scripted")])
    rig = pipeline.build_rig(cast, backend=backend, publisher=publisher)
    root = cast.user_says("Tell me everything", kind=11, tags=[["p", cast.alice.pubkey]])

    await rig.dispatcher.handle(root)
    await rig.settle()

    assert [e.pubkey for e in publisher.published] == [cast.alice.pubkey]
    notice = publisher.published[0]
    assert notice.content == (
        "Alice's answer could not be published: the relays refused it "
        "(blocked: event size (2000 chars) exceeds 1000)."
    )
    assert notice.has_tag(TAG_ERROR, "system")
    assert notice.tag_values("p") == [cast.user.pubkey]
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert [e.content for e in conversation.history] == ["Tell me everything", "word " * 400, notice.content]
    outbox = rig.pipeline.outbox
    assert (outbox.refused, outbox.depth, outbox.retries) == (1, 0, 0)


async def test_a_refused_notice_gets_no_notice_of_its_own(cast: Cast) -> None:
    """When the relays refuse the notice too (they refuse everything longer than the notice), nothing more is
    sent or saved: two refusals, no loop."""
    publisher = FakePublisher(refuse_over=10)
    backend = ScriptedBackend([CompletionResult(text="a long answer", model="scripted")])
    rig = pipeline.build_rig(cast, backend=backend, publisher=publisher)
    root = cast.user_says("Hello", kind=11, tags=[["p", cast.alice.pubkey]])

    await rig.dispatcher.handle(root)
    await rig.settle()

    assert publisher.published == []
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert len(conversation.history) == 3  # the root, the answer and the one notice
    assert rig.pipeline.outbox.refused == 2


async def test_the_notice_of_a_refused_last_answer_leaves_the_conversation_ended(cast: Cast) -> None:
    """An agent ends the conversation with an answer the relays refuse for its size: the daemon's notice
    to the person is saved, and the conversation stays ended by that agent with its reason (a notice
    says what the daemon did; nobody wrote anything new, so it reopens nothing)."""
    from tests.unit.services.test_tool_loop import calls, text

    backend = ScriptedBackend([calls(("c1", "end_conversation", {"reason": "done"})), text("B" * 500)])
    rig = pipeline.build_rig(cast, backend=backend, publisher=FakePublisher(refuse_over=100))
    root = cast.user_says("thanks, bye", kind=11, tags=[["p", cast.alice.pubkey]])

    await rig.dispatcher.handle(root)
    await rig.settle()

    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert [e.has_tag(TAG_ERROR, "system") for e in conversation.history] == [False, False, True]
    assert (conversation.is_ended, conversation.ended_by, conversation.end_reason) == (True, "alice", "done")


async def test_a_refused_send_message_request_is_named_as_a_message_to_the_asked_agent(cast: Cast) -> None:
    """Alice's send_message question to Bob is over the relays' size limit: the person's notice names it as
    Alice's message to Bob, not as her answer, while her short answer goes out."""
    from tenex_daemon.services.agent_runner import AgentProfile
    from tests.unit.services.test_tool_loop import calls, text

    question = "Q" * 1500
    alice = ScriptedBackend([calls(("c1", "send_message", {"to": "bob", "message": question})), text("Done.")])
    profiles = {
        "alice": AgentProfile(cast.alice, "", alice),
        "bob": AgentProfile(cast.bob, "", ScriptedBackend([text("4")])),
        "orchestrator": AgentProfile(cast.orchestrator, "", ScriptedBackend([])),
    }
    publisher = FakePublisher(refuse_over=1000)
    rig = pipeline.build_rig(
        cast, profiles=profiles, publisher=publisher, composer=pipeline.real_composer(cast)
    )
    root = cast.user_says("Alice, ask Bob", kind=11, tags=[["p", cast.alice.pubkey]])

    await rig.dispatcher.handle(root)
    await rig.settle()

    notices = [e for e in publisher.published if e.has_tag(TAG_ERROR, "system")]
    assert [n.content for n in notices] == [
        "Alice's message to Bob could not be published: the relays refused it "
        "(blocked: event size (1500 chars) exceeds 1000)."
    ]
    assert [e.content for e in publisher.published if e.pubkey == cast.alice.pubkey][-1] == "Done."
