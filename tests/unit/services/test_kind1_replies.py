"""Kind-1 conversations through the daemon's pipeline with the real composer: agents answer with kind 1
(NIP-10), their relay echoes are duplicates, and what the runner and delegation publish has the
conversation's kind; replies carry what their tokens cost when the agent has prices."""

from __future__ import annotations

from tenex_daemon.adapters.nostr.classifier import classify_event
from tenex_daemon.core.classify import EventClass
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.llm import CompletionResult, LLMBackend
from tenex_daemon.core.pricing import TokenPrices
from tenex_daemon.services.agent_runner import AgentProfile
from tenex_daemon.services.dispatcher import Outcome
from tenex_daemon.testing.fakes import FailingBackend, ScriptedBackend
from tests import pipeline
from tests.conftest import Cast
from tests.unit.services.test_delegation import ask, make_rig, settle
from tests.unit.services.test_tool_loop import calls, text


def note_to_alice(cast: Cast, content: str, *tags: list[str]) -> NostrEvent:
    """A person's kind-1 note p-tagging Alice (with threading ``tags`` first, if any)."""
    return cast.user_says(content, kind=1, tags=[*tags, ["p", cast.alice.pubkey]])


def e_tags(event: NostrEvent) -> list[list[str]]:
    """The event's ``e`` tags, as written."""
    return [t for t in event.tags if t[0] == "e"]


def rig_for(cast: Cast, backend: LLMBackend, prices: TokenPrices | None = None) -> pipeline.Rig:
    """The pipeline with the real composer, every agent thinking through ``backend`` at ``prices``."""
    profiles = {a.slug: AgentProfile(a, f"You are {a.name}.", backend, prices=prices) for a in cast.agents}
    return pipeline.build_rig(cast, profiles=profiles, composer=pipeline.real_composer(cast))


async def test_a_kind_1_thread_is_answered_in_kind_1_and_the_echoes_are_duplicates(cast: Cast) -> None:
    """A note and a NIP-10 reply to the agent's answer are both answered with kind 1 (`e` root, then `e` reply
    to the trigger, `p` the person); the relay's echo of each answer is a duplicate that runs nobody."""
    rig = rig_for(cast, ScriptedBackend([text("First answer."), text("Second answer.")]))
    note = note_to_alice(cast, "hello alice")

    assert (await rig.dispatcher.handle(note)).outcome is Outcome.SCHEDULED
    await rig.quiet()
    [first] = rig.publisher.published
    echo = await rig.dispatcher.handle(first)
    follow_up = note_to_alice(cast, "and then?", ["e", note.id, "", "root"], ["e", first.id, "", "reply"])
    assert (await rig.dispatcher.handle(follow_up)).outcome is Outcome.SCHEDULED
    await rig.settle()
    second = rig.publisher.published[-1]

    assert echo.outcome is Outcome.DUPLICATE
    assert (first.kind, second.kind) == (1, 1)
    assert e_tags(first) == [["e", note.id, "", "root"]]
    assert e_tags(second) == [["e", note.id, "", "root"], ["e", follow_up.id, "", "reply"]]
    assert first.tag_values("p") == second.tag_values("p") == [cast.user.pubkey]
    assert (await rig.dispatcher.handle(second)).outcome is Outcome.DUPLICATE
    conversation = await rig.manager.get_conversation(note.id)
    assert conversation is not None
    assert [e.id for e in conversation.history] == [note.id, first.id, follow_up.id, second.id]
    assert [e.kind for e in rig.publisher.published] == [1, 1]


async def test_a_channels_later_note_is_answered_under_the_channel_root(cast: Cast) -> None:
    """A second top-level note joins the person's open channel conversation: its answer's `e` root is the
    channel's first note and its `e` reply the second note."""
    rig = rig_for(cast, ScriptedBackend([text("One."), text("Two.")]))
    first = note_to_alice(cast, "first note")
    await rig.dispatcher.handle(first)
    await rig.quiet()
    later = note_to_alice(cast, "second top-level note")

    joined = await rig.dispatcher.handle(later)
    await rig.settle()

    assert joined.conversation_id == first.id
    answer = rig.publisher.published[-1]
    assert answer.kind == 1
    assert e_tags(answer) == [["e", first.id, "", "root"], ["e", later.id, "", "reply"]]


async def test_a_completion_in_a_kind_1_conversation_reads_as_a_reply_of_it(cast: Cast) -> None:
    """An agent's kind-1 completion p-tags the person and the orchestrator; the classifier reads it as a reply
    of the conversation (the `root` marker), and its echo is a duplicate."""
    backend = ScriptedBackend([calls(("c1", "complete", {"summary": "Done."})), text("Done.")])
    rig = rig_for(cast, backend)
    note = note_to_alice(cast, "do the thing")

    await rig.dispatcher.handle(note)
    await rig.quiet()
    completion = next(e for e in rig.publisher.published if e.pubkey == cast.alice.pubkey)
    classified = classify_event(completion)
    echo = await rig.dispatcher.handle(completion)
    await rig.settle()

    assert completion.kind == 1
    assert completion.has_tag("tool", "complete")
    assert completion.tag_values("p") == [cast.user.pubkey, cast.orchestrator.pubkey]
    assert (classified.kind, classified.conversation_id) == (EventClass.REPLY, note.id)
    assert echo.outcome is Outcome.DUPLICATE


async def test_an_error_reply_in_a_kind_1_conversation_is_a_kind_1(cast: Cast) -> None:
    """When the backend fails, the reply saying so is a kind 1 tagged `["error", "system"]`, threaded under
    the note."""
    rig = rig_for(cast, FailingBackend())
    note = note_to_alice(cast, "hello")

    await rig.dispatcher.handle(note)
    await rig.settle()

    [reply] = rig.publisher.published
    assert reply.kind == 1
    assert reply.has_tag("error", "system")
    assert e_tags(reply) == [["e", note.id, "", "root"]]


async def test_delegation_copies_in_a_kind_1_conversation_are_kind_1(cast: Cast) -> None:
    """Both published sides of a send_message exchange and the final answer are kind 1 in a kind-1
    conversation, each threaded under the note (the answer to the request names the request as reply), each
    p-tagging the person and the agent it addresses."""
    rig = make_rig(
        cast,
        ScriptedBackend([ask("c1", "bob", "What is 2+2?"), text("Bob says 4.")]),
        ScriptedBackend([text("4")]),
    )
    note = note_to_alice(cast, "Alice, ask Bob for 2+2.")

    await rig.dispatcher.handle(note)
    await settle(rig)

    request, answer, reply = rig.publisher.published
    assert [e.kind for e in (request, answer, reply)] == [1, 1, 1]
    assert request.tag_value("delegation") == answer.tag_value("delegation") is not None
    assert e_tags(request) == [["e", note.id, "", "root"]]
    assert e_tags(answer) == [["e", note.id, "", "root"], ["e", request.id, "", "reply"]]
    # a kind-1 event p-tags the person and the agent it addresses
    assert (request.tag_values("p"), answer.tag_values("p")) == (
        [cast.user.pubkey, cast.bob.pubkey], [cast.user.pubkey, cast.alice.pubkey]
    )
    assert e_tags(reply) == [["e", note.id, "", "root"]]


async def test_replies_carry_their_cost_when_the_agent_has_prices(cast: Cast) -> None:
    """With prices per million tokens the reply is tagged `llm-cost-usd` = its prompt and completion tokens
    at those prices; without prices it carries no cost."""
    answer = CompletionResult(text="Priced.", model="m", prompt_tokens=1200, completion_tokens=300)
    priced = rig_for(cast, ScriptedBackend([answer]), TokenPrices(3.0, 15.0))
    unpriced = rig_for(cast, ScriptedBackend([answer]))

    for rig in (priced, unpriced):
        await rig.dispatcher.handle(note_to_alice(cast, "what does it cost?"))
        await rig.settle()

    assert priced.publisher.published[0].tag_value("llm-cost-usd") == "0.0081"
    assert unpriced.publisher.published[0].tag_value("llm-cost-usd") is None
    assert unpriced.publisher.published[0].tag_value("llm-prompt-tokens") == "1200"
