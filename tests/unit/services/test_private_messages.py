"""Private conversations (NIP-17) through the daemon's pipeline: a person's gift-wrapped message to an agent
starts or continues a private conversation stored decrypted, the agent answers with an unsigned kind-14
rumor (published only gift-wrapped) and nothing else of it goes out; the allow-list applies to the rumor's
author; public events never join it; the answer setting refuses what it excludes."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import pytest
import structlog.testing
from nostr_sdk import Keys, PublicKey, UnsignedEvent, nip59_make_gift_wrap
from pydantic import ValidationError

from tenex_daemon import ConversationManager
from tenex_daemon.adapters.nostr.classifier import classify_event, conversation_lane
from tenex_daemon.adapters.nostr.metadata_event import ConversationMetadataComposer
from tenex_daemon.adapters.nostr.private import (
    GiftWraps,
    OpenedWrap,
    PrivateReplyComposer,
    make_rumor,
    wrap_recipients,
)
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.app.settings import AnswerMode, DaemonSettings
from tenex_daemon.core.classify import EventClass
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.llm import CompletionResult, ToolCall, ToolResult
from tenex_daemon.services.descriptions import DescriptionJobs
from tenex_daemon.services.dispatcher import Outcome
from tenex_daemon.services.orchestrator import LLMOrchestrator, RuleBasedOrchestrator
from tenex_daemon.services.private_messages import (
    AGENT_PRIVATE_COPY,
    PRIVATE_MESSAGES_OFF,
    PRIVATE_NOT_ONE_TO_ONE,
    PUBLIC_MENTIONS_OFF,
    Intake,
    plan_private_conversations,
)
from tenex_daemon.services.tools import RunEffects, ToolContext, ToolRegistry
from tenex_daemon.testing import KeyPair, make_agent
from tenex_daemon.testing.fakes import PlainComposer, ScriptedBackend, signers_for
from tests.conftest import Cast
from tests.pipeline import Rig, build_rig, cast_keys
from tests.unit.services.test_run_lease import LeasePeers
from tests.unit.services.test_stopping import GatedBackend
from tests.unit.services.test_tool_loop import calls
from tests.unit.services.test_tool_loop import text as says

MINUTE_MS = 60_000


class RecordingPartials:
    """A partial-text publisher that records what it is given (nothing, for a private conversation)."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    async def partial(self, agent_slug: str, conversation_id: str, trigger_id: str, text: str, sequence: int) -> None:
        """Record the text."""
        self.sent.append(text)


def private_rig(cast: Cast, **options: Any) -> tuple[Rig, Intake]:
    """The pipeline with the daemon's private composer (over the fake one), and the daemon's intake over
    the agents' real keys."""
    keys = cast_keys(cast)
    composer = PrivateReplyComposer(PlainComposer(keys), {a.slug: a.pubkey for a in cast.agents})
    rig = build_rig(cast, composer=composer, **options)
    return rig, Intake(GiftWraps(signers_for(keys)), rig.manager.agents)


def wrap(sender: KeyPair, to: str, content: str, *, tags: list[list[str]] | None = None, at: int = 1_790_000_000) -> NostrEvent:
    """A NIP-17 message from ``sender`` to ``to``, gift-wrapped by nostr-sdk the way a client does."""
    rumor = {"pubkey": sender.pubkey, "created_at": at, "kind": 14, "content": content,
             "tags": tags if tags is not None else [["p", to]]}
    made = nip59_make_gift_wrap(Keys.parse(sender.secret), PublicKey.parse(to), UnsignedEvent.from_json(json.dumps(rumor)))
    return NostrEvent.model_validate_json(made.as_json())


def admitted(intake: Intake, event: NostrEvent) -> NostrEvent:
    """What the intake hands the dispatcher for ``event`` (the test fails on a refusal)."""
    result = intake.admit(event)
    assert isinstance(result, NostrEvent), result
    return result


async def test_a_private_message_starts_a_private_conversation_answered_by_a_rumor(cast: Cast) -> None:
    """The person's wrapped message is stored decrypted as the root of a private conversation (channel
    ``dm:alice:<person>``); Alice's answer is saved as an unsigned kind-14 rumor p-tagging the person and
    e-tagging the message, handed to the outbox only as that rumor; no typing indicator, no partial text."""
    partials = RecordingPartials()
    rig, intake = private_rig(cast, partials=partials, partial_interval_s=0.001)
    rumor = admitted(intake, wrap(cast.user, cast.alice.pubkey, "What is the launch date?"))
    assert classify_event(rumor).kind is EventClass.PRIVATE
    result = await rig.dispatcher.handle(rumor)
    assert (result.outcome, result.agents) == (Outcome.SCHEDULED, ("alice",))
    await rig.quiet()
    conversation = await rig.manager.get_conversation(rumor.id)
    assert conversation is not None
    assert conversation.private
    assert conversation.channel == f"dm:alice:{cast.user.pubkey}"
    question, answer = conversation.history
    assert question == rumor
    assert question.sig == ""
    assert (answer.kind, answer.pubkey, answer.sig) == (14, cast.alice.pubkey, "")
    assert answer.tags[:2] == [["p", cast.user.pubkey], ["e", rumor.id, "", "reply"]]
    assert answer.has_valid_id()
    assert rig.publisher.published == [answer]  # the daemon's GiftWrapPublisher turns it into wraps
    assert rig.publisher.typing_events == []
    assert partials.sent == []
    await rig.settle()


async def test_private_messages_continue_by_channel_and_by_reply(cast: Cast) -> None:
    """A second message joins the open private conversation; after the idle timeout one starts a new one;
    a message replying (``e``) to an answer in the old conversation continues the old one."""
    rig, intake = private_rig(cast, idle_timeout_min=30)
    first = admitted(intake, wrap(cast.user, cast.alice.pubkey, "first", at=1_790_000_000))
    await rig.dispatcher.handle(first)
    second = admitted(intake, wrap(cast.user, cast.alice.pubkey, "second", at=1_790_000_010))
    assert (await rig.dispatcher.handle(second)).conversation_id == first.id
    await rig.quiet()
    old = await rig.manager.get_conversation(first.id)
    assert old is not None
    assert [e.content for e in old.history if e.pubkey == cast.user.pubkey] == ["first", "second"]
    old_answer = old.history[-1]
    rig.clock.advance(31 * MINUTE_MS)
    later = admitted(intake, wrap(cast.user, cast.alice.pubkey, "a new day", at=1_790_003_000))
    assert (await rig.dispatcher.handle(later)).conversation_id == later.id
    await rig.quiet()
    reply = admitted(intake, wrap(cast.user, cast.alice.pubkey, "about that answer",
                                  tags=[["p", cast.alice.pubkey], ["e", old_answer.id, "", "reply"]], at=1_790_003_100))
    assert (await rig.dispatcher.handle(reply)).conversation_id == first.id
    await rig.settle()


async def test_an_answer_carries_the_newest_subject_the_person_gave_the_chat(cast: Cast) -> None:
    """The person names the chat, renames it, then writes without a subject: each answer carries the newest
    subject (NIP-17 clients show the newest one, so an answer with the first would rename the chat back)."""
    rig, intake = private_rig(cast)
    alice = cast.alice.pubkey
    for at, text, subject in [(0, "first", "Old topic"), (10, "renaming", "New topic"), (20, "third", None)]:
        tags = [["p", alice], *([["subject", subject]] if subject else [])]
        await rig.dispatcher.handle(admitted(intake, wrap(cast.user, alice, text, tags=tags, at=1_790_000_000 + at)))
        await rig.quiet()
    await rig.settle()

    assert [e.tag_value("subject") for e in rig.publisher.published] == ["Old topic", "New topic", "New topic"]


async def test_a_reply_in_the_chat_of_the_agent_the_orchestrator_routed_to_continues_the_conversation(
    cast: Cast,
) -> None:
    """The person writes privately to the orchestrator, which routes Alice; Alice answers in her own chat with
    the person (the rumor is hers), and the person replies there (``p`` Alice, ``e`` her answer): the reply
    joins the same conversation and Alice answers it, with the first exchange in her context."""
    rig, intake = private_rig(cast)
    first = admitted(intake, wrap(cast.user, cast.orchestrator.pubkey, "please help", at=1_790_000_000))
    await rig.dispatcher.handle(first)
    await rig.quiet()
    conversation = await rig.manager.get_conversation(first.id)
    assert conversation is not None
    answer = conversation.history[-1]
    assert answer.pubkey == cast.alice.pubkey

    tags = [["p", cast.alice.pubkey], ["e", answer.id, "", "reply"]]
    follow_up = admitted(intake, wrap(cast.user, cast.alice.pubkey, "and then?", tags=tags, at=1_790_000_100))
    result = await rig.dispatcher.handle(follow_up)
    await rig.quiet()
    await rig.settle()

    assert (result.conversation_id, result.agents) == (first.id, ("alice",))
    conversation = await rig.manager.get_conversation(first.id)
    assert conversation is not None
    assert [e.pubkey for e in conversation.history] == [cast.user.pubkey, cast.alice.pubkey] * 2


async def test_a_message_in_the_routed_agents_chat_continues_the_conversation_unless_that_chat_has_its_own(
    cast: Cast,
) -> None:
    """After Alice answered the person's private message to the orchestrator, the person's next message in
    Alice's chat, with no ``e`` tag (as clients write them), continues that conversation; a chat with Alice
    that has an open conversation of its own keeps it."""
    rig, intake = private_rig(cast)
    alice = cast.alice.pubkey
    own = admitted(intake, wrap(cast.user, alice, "our own chat", at=1_790_000_000))
    await rig.dispatcher.handle(own)
    await rig.quiet()
    routed = admitted(intake, wrap(cast.user, cast.orchestrator.pubkey, "please help", at=1_790_000_010))
    await rig.dispatcher.handle(routed)
    await rig.quiet()
    kept = await rig.dispatcher.handle(admitted(intake, wrap(cast.user, alice, "still ours", at=1_790_000_020)))
    await rig.quiet()

    rig.clock.advance(31 * MINUTE_MS)  # Alice's own conversation goes idle; the routed one is asked again
    again = admitted(intake, wrap(cast.user, cast.orchestrator.pubkey, "more help", at=1_790_002_000))
    assert (await rig.dispatcher.handle(again)).conversation_id != routed.id  # idle too: a new one
    await rig.quiet()
    result = await rig.dispatcher.handle(admitted(intake, wrap(cast.user, alice, "and then?", at=1_790_002_100)))
    await rig.quiet()
    await rig.settle()

    assert kept.conversation_id == own.id
    assert (result.conversation_id, result.agents) == (again.id, ("alice",))


async def test_a_strangers_private_message_is_ignored_and_the_same_rumor_is_taken_once(cast: Cast) -> None:
    """The allow-list applies to the unwrapped author: a stranger's private message stores nothing and runs
    nobody; the owner's rumor delivered in two wraps (a resend) is one event."""
    rig, intake = private_rig(cast)
    stranger = admitted(intake, wrap(cast.other_user, cast.alice.pubkey, "let me in"))
    result = await rig.dispatcher.handle(stranger)
    assert (result.outcome, result.reason) == (Outcome.IGNORED, "author_not_allowed")
    assert await rig.manager.get_conversation(stranger.id) is None
    once = admitted(intake, wrap(cast.user, cast.alice.pubkey, "hello", at=1_790_000_500))
    twice = admitted(intake, wrap(cast.user, cast.alice.pubkey, "hello", at=1_790_000_500))
    assert once == twice
    assert (await rig.dispatcher.handle(once)).outcome is Outcome.SCHEDULED
    assert (await rig.dispatcher.handle(twice)).outcome is Outcome.DUPLICATE
    await rig.settle()
    assert len(rig.publisher.published) == 1


async def test_a_public_event_never_joins_a_private_conversation(cast: Cast) -> None:
    """A public comment naming a private conversation's root (or one of its events) is ignored: only the
    person's wrapped messages join it, and nothing of it is answered in the clear."""
    rig, intake = private_rig(cast)
    rumor = admitted(intake, wrap(cast.user, cast.alice.pubkey, "private"))
    await rig.dispatcher.handle(rumor)
    await rig.quiet()
    public = cast.user_says("and in public?", tags=[["E", rumor.id, "", cast.user.pubkey], ["K", "14"],
                                                    ["p", cast.alice.pubkey]])
    result = await rig.dispatcher.handle(public)
    assert (result.outcome, result.reason) == (Outcome.IGNORED, "private_conversation")
    conversation = await rig.manager.get_conversation(rumor.id)
    assert conversation is not None
    assert len(conversation.history) == 2
    await rig.settle()
    assert [e.kind for e in rig.publisher.published] == [14]


def test_the_intake_refuses_agent_copies_group_messages_and_what_the_setting_excludes(cast: Cast) -> None:
    """An agent's own rumor coming back (its copy), a group message, a rumor in the clear, and what
    ``daemon.answer`` excludes (public mentions, or private messages) are refused with their reasons."""
    wraps = GiftWraps(signers_for(cast_keys(cast)))
    rig, intake = private_rig(cast)
    directory = rig.manager.agents
    own = make_rumor(cast.alice.pubkey, "my answer", [["p", cast.user.pubkey]], 1_790_000_000)
    assert intake.admit(wraps.wrap(own, cast.alice.pubkey)) == AGENT_PRIVATE_COPY
    group = wrap(cast.user, cast.alice.pubkey, "hi all", tags=[["p", cast.alice.pubkey], ["p", cast.other_user.pubkey]])
    assert intake.admit(group) == PRIVATE_NOT_ONE_TO_ONE
    assert intake.admit(own) == "private_message_in_the_clear"
    mention = cast.user_says("public", kind=11, tags=[["p", cast.alice.pubkey]])
    private_only = Intake(wraps, directory, public=False, private=True)
    assert private_only.admit(mention) == PUBLIC_MENTIONS_OFF
    assert isinstance(private_only.admit(wrap(cast.user, cast.alice.pubkey, "dm")), NostrEvent)
    public_only = Intake(wraps, directory, public=True, private=False)
    assert public_only.admit(wrap(cast.user, cast.alice.pubkey, "dm")) == PRIVATE_MESSAGES_OFF
    assert public_only.admit(mention) == mention
    assert conversation_lane(group) == f"wrap:{cast.alice.pubkey}"  # one agent's wraps arrive in order


def test_the_answer_setting_reads_both_public_or_private(monkeypatch: pytest.MonkeyPatch) -> None:
    """``daemon.answer`` is ``both`` by default, takes ``public`` or ``private``, and refuses anything else."""
    assert DaemonSettings().answer is AnswerMode.BOTH
    assert (AnswerMode.BOTH.public, AnswerMode.BOTH.private) == (True, True)
    assert (AnswerMode("public").public, AnswerMode("public").private) == (True, False)
    assert (DaemonSettings(answer=AnswerMode.PRIVATE).answer.public, AnswerMode.PRIVATE.private) == (False, True)
    assert DaemonSettings.model_validate({"answer": "private"}).answer is AnswerMode.PRIVATE
    with pytest.raises(ValidationError):
        DaemonSettings.model_validate({"answer": "secret"})


async def test_a_private_conversation_is_never_described_nor_its_title_published(cast: Cast) -> None:
    """The description service skips a private conversation: no model is asked, no title or summary is
    stored, no kind-513 event is published, even once it has ended."""
    rig, intake = private_rig(cast)
    model = ScriptedBackend([])
    jobs = DescriptionJobs(
        rig.manager,
        ConversationMetadataComposer(Signer.from_text(cast.project.secret, label="project"), None),
        rig.publisher,
        backends={"alice": model},
        summarizer=model,
        describe_after_exchanges=1,
        idle=lambda: True,
    )
    jobs.start()
    try:
        rumor = admitted(intake, wrap(cast.user, cast.alice.pubkey, "a secret"))
        await rig.dispatcher.handle(rumor)
        await rig.quiet()
        await rig.manager.end_conversation(rumor.id, by="owner", reason="done")
        jobs.ended(rumor.id)
        jobs.wake(rumor.id)
        async with asyncio.timeout(5):
            while jobs.queued:  # noqa: ASYNC110 - polls the service's queue
                await asyncio.sleep(0.002)
        await asyncio.sleep(0.05)
    finally:
        await jobs.stop()
    conversation = await rig.manager.get_conversation(rumor.id)
    assert conversation is not None
    assert (conversation.summary, conversation.title_source) == (None, None)
    assert model.requests == []
    assert [e.kind for e in rig.publisher.published] == [14]
    await rig.settle()


async def test_an_ended_private_conversation_is_not_queued_for_a_description_at_every_start(cast: Cast) -> None:
    """An ended private conversation, skipped by the description service, is stamped as needing nothing until
    it changes: the next starts' recovery does not queue it (and load it) again."""
    rig, intake = private_rig(cast)

    def jobs() -> DescriptionJobs:
        made = DescriptionJobs(
            rig.manager,
            ConversationMetadataComposer(Signer.from_text(cast.project.secret, label="project"), None),
            rig.publisher,
            backends={},
            idle=lambda: True,
        )
        made.start()
        return made

    rumor = admitted(intake, wrap(cast.user, cast.alice.pubkey, "a secret"))
    await rig.dispatcher.handle(rumor)
    await rig.quiet()
    await rig.manager.end_conversation(rumor.id, by="owner", reason="done")
    first = jobs()
    assert await first.recover() == 1
    async with asyncio.timeout(5):
        while first.queued:  # noqa: ASYNC110 - polls the service's queue
            await asyncio.sleep(0.002)
    await first.stop()

    again = jobs()
    assert await again.recover() == 0
    await again.stop()
    conversation = await rig.manager.get_conversation(rumor.id)
    assert conversation is not None
    assert (conversation.summary, conversation.title) == (None, "Untitled Conversation")
    await rig.settle()


async def test_nothing_a_private_conversation_says_reaches_the_logs_through_its_routing(cast: Cast) -> None:
    """A private message routed by a model: its END answer is refused with the person's message quoted to
    the model only, and neither that message nor the model's reason for choosing Alice (which speaks of it)
    is in any log line; a public conversation's routing reason is still logged."""
    said, why = "my test results came back", "they ask about their test results"
    end = CompletionResult(text='{"agents": ["END"], "reason": "nothing to do"}')
    model = ScriptedBackend([end, CompletionResult(text=json.dumps({"agents": ["alice"], "reason": why}))])

    def orchestrator(manager: ConversationManager) -> LLMOrchestrator:
        return LLMOrchestrator(manager, model, RuleBasedOrchestrator(manager.agents, "alice"), default_agent="alice")

    rig, intake = private_rig(cast, orchestrator=orchestrator)
    with structlog.testing.capture_logs() as logs:
        await rig.dispatcher.handle(admitted(intake, wrap(cast.user, cast.orchestrator.pubkey, said)))
        await rig.quiet()
    await rig.settle()

    assert said in str(model.requests[1].messages[-1])  # the model was told what it must answer
    assert [entry.get("reason") for entry in logs if entry["event"] == "routing_decision"] == [None]
    assert not [entry for entry in logs if said in repr(entry) or why in repr(entry)]

    public = build_rig(cast, orchestrator=orchestrator)
    with structlog.testing.capture_logs() as logs:
        await public.dispatcher.handle(cast.user_says("a public question", kind=11))
        await public.quiet()
    await public.settle()
    assert [entry.get("reason") for entry in logs if entry["event"] == "routing_decision"] == [why]


def test_rebuilding_replays_the_rumors_into_the_conversations_the_daemon_made(cast: Cast) -> None:
    """The rumors of the agents' wraps are replayed as the daemon took them in: answers join the message
    they answer (even one dated a second before it), a message after the idle timeout starts a conversation,
    one replying into the earlier conversation continues it, a stranger's and the agent's copies for others
    are left out."""
    directory = build_rig(cast).manager.agents
    person, alice = cast.user, cast.alice.pubkey
    t = 1_790_000_000

    def said(at: int, text: str, *extra: list[str]) -> OpenedWrap:
        return OpenedWrap(make_rumor(person.pubkey, text, [["p", alice], *extra], at), alice)

    def answered(at: int, message: OpenedWrap, recipient: str = alice) -> OpenedWrap:
        tags = [["p", person.pubkey], ["e", message.rumor.id, "", "reply"]]
        return OpenedWrap(make_rumor(alice, f"re: {message.rumor.content}", tags, at), recipient)

    first = said(t, "first")
    first_answer = answered(t - 1, first)  # the agent's clock is a second behind
    second = said(t + 60, "second")
    second_answer = answered(t + 61, second)
    later = said(t + 3 * 3600, "a new day")
    back = said(t + 3 * 3600 + 5, "about the second", ["e", second_answer.rumor.id, "", "reply"])
    stranger = OpenedWrap(make_rumor(cast.other_user.pubkey, "hi", [["p", alice]], t), alice)
    opened = [later, back, second_answer, answered(t + 61, second, person.pubkey), first_answer,
              second, first, stranger]
    skipped: Counter[str] = Counter()

    threads = plan_private_conversations(opened, directory, {person.pubkey}, 30 * MINUTE_MS, skipped)

    channel = f"dm:alice:{person.pubkey}"
    assert [(t.channel, [e.content for e in t.events]) for t in threads] == [
        (channel, ["first", "re: first", "second", "re: second", "about the second"]),
        (channel, ["a new day"]),
    ]
    assert skipped == Counter({"author_not_allowed": 1})


def test_rebuilding_keeps_a_reply_in_the_routed_agents_chat_in_the_conversation_it_answers(cast: Cast) -> None:
    """Replayed, the person's message to the orchestrator, Alice's answer to it (routed to her), the person's
    reply in Alice's chat (``e`` her answer) and their next message there (no ``e``) are one conversation, as
    the daemon took them in."""
    directory = build_rig(cast).manager.agents
    person, alice, orchestrator = cast.user, cast.alice.pubkey, cast.orchestrator.pubkey
    t = 1_790_000_000
    asked = OpenedWrap(make_rumor(person.pubkey, "please help", [["p", orchestrator]], t), orchestrator)
    answer_tags = [["p", person.pubkey], ["e", asked.rumor.id, "", "reply"]]
    answer = OpenedWrap(make_rumor(alice, "here", answer_tags, t + 1), alice)
    reply_tags = [["p", alice], ["e", answer.rumor.id, "", "reply"]]
    reply = OpenedWrap(make_rumor(person.pubkey, "and then?", reply_tags, t + 60), alice)
    plain = OpenedWrap(make_rumor(person.pubkey, "one more", [["p", alice]], t + 120), alice)

    threads = plan_private_conversations(
        [plain, reply, answer, asked], directory, {person.pubkey}, 30 * MINUTE_MS, Counter()
    )

    assert [(t.channel, [e.content for e in t.events]) for t in threads] == [
        (f"dm:orchestrator:{person.pubkey}", ["please help", "here", "and then?", "one more"]),
    ]


async def test_a_private_conversation_cannot_be_read_from_a_public_one(cast: Cast) -> None:
    """``get_conversation`` in a public conversation neither lists the person's ended private conversation
    nor reads it by id (the same words as an unknown id); from another private conversation it can."""
    rig, intake = private_rig(cast)
    secret = admitted(intake, wrap(cast.user, cast.alice.pubkey, "my secret", at=1_790_000_000))
    await rig.dispatcher.handle(secret)
    await rig.quiet()
    await rig.manager.end_conversation(secret.id, by="owner", reason="done")
    public = cast.user_says("in public", kind=11, tags=[["p", cast.bob.pubkey]])
    await rig.manager.create_conversation(public)
    later = admitted(intake, wrap(cast.user, cast.alice.pubkey, "again", at=1_790_009_000))
    rig.clock.advance(31 * MINUTE_MS)
    await rig.dispatcher.handle(later)
    await rig.settle()

    async def ask(current: str, trigger: NostrEvent, arguments: dict[str, Any]) -> ToolResult:
        context = ToolContext(rig.manager, current, cast.alice, RunEffects(), trigger=trigger)
        return await ToolRegistry.default().execute(ToolCall("c", "get_conversation", arguments), context)

    listed = await ask(public.id, public, {"list_recent": True})
    assert secret.id not in listed.content
    refused = await ask(public.id, public, {"id": secret.id})
    unknown = await ask(public.id, public, {"id": "ab" * 32})
    assert refused.is_error
    assert refused.content == unknown.content.replace("ab" * 32, secret.id)
    assert secret.id in (await ask(later.id, later, {"list_recent": True})).content
    read = await ask(later.id, later, {"id": secret.id})
    assert not read.is_error
    assert "my secret" in read.content


async def test_a_private_completion_p_tags_the_person_only_and_still_reaches_the_orchestrator(cast: Cast) -> None:
    """The orchestrator routes the person's private message to Alice; her completion is a rumor p-tagging the
    person alone (a NIP-17 client shows it in their chat with Alice, not in a group chat with the
    orchestrator, where their reply would not be one-to-one), and the orchestrator still takes it: its model
    is asked again and hands Bob the work."""
    model = ScriptedBackend([
        CompletionResult(text='{"agents": ["alice"], "reason": "alice does it"}'),
        CompletionResult(text='{"agents": ["bob"], "reason": "bob checks it"}'),
    ])

    def orchestrator(manager: ConversationManager) -> LLMOrchestrator:
        return LLMOrchestrator(manager, model, RuleBasedOrchestrator(manager.agents, "alice"), default_agent="alice")

    backend = ScriptedBackend([calls(("c1", "complete", {"summary": "Done."})), says("Checked.")])
    rig, intake = private_rig(cast, backend=backend, orchestrator=orchestrator)
    first = admitted(intake, wrap(cast.user, cast.orchestrator.pubkey, "please do it"))
    await rig.dispatcher.handle(first)
    await rig.quiet()
    await rig.settle()

    conversation = await rig.manager.get_conversation(first.id)
    assert conversation is not None
    completion = conversation.history[1]
    assert (completion.pubkey, completion.kind) == (cast.alice.pubkey, 14)
    assert completion.has_tag("tool", "complete")
    assert completion.tag_values("p") == [cast.user.pubkey]
    assert wrap_recipients(completion) == [cast.user.pubkey, cast.alice.pubkey]
    assert len(model.requests) == 2  # asked for the message, then for the completed work
    assert [e.pubkey for e in conversation.history] == [cast.user.pubkey, cast.alice.pubkey, cast.bob.pubkey]


async def test_a_private_message_to_a_conversation_whose_run_outlasts_the_idle_timeout_joins_it(cast: Cast) -> None:
    """Alice's run on a private message is still under way 31 minutes later: the person's next message joins
    that conversation, where the answer is still to come, as a kind-1 channel's note does; it is not ended
    with the answer then saved into an ended conversation the new one never shows."""
    backend = GatedBackend()
    rig, intake = private_rig(cast, backend=backend, idle_timeout_min=30)
    first = admitted(intake, wrap(cast.user, cast.alice.pubkey, "a long job", at=1_790_000_000))
    await rig.dispatcher.handle(first)
    await backend.asked.wait()
    rig.clock.advance(31 * MINUTE_MS)

    later = admitted(intake, wrap(cast.user, cast.alice.pubkey, "and another thing", at=1_790_001_900))
    joined = await rig.dispatcher.handle(later)
    backend.release.set()
    await rig.settle()

    assert joined.conversation_id == first.id
    conversation = await rig.manager.get_conversation(first.id)
    assert conversation is not None
    assert not conversation.is_ended


async def test_a_private_conversations_invalid_routing_answers_are_logged_by_kind_only(cast: Cast) -> None:
    """The orchestrator's model answers a private message twice with an agent it made up from the message's
    words: the model is told what was wrong, the logs say only the kind of mistake (never the made-up
    name), and the default agent answers."""
    invented = "my-lab-results-came-back"
    wrong = CompletionResult(text=json.dumps({"agents": [invented], "reason": "r"}))
    model = ScriptedBackend([wrong, wrong])

    def orchestrator(manager: ConversationManager) -> LLMOrchestrator:
        return LLMOrchestrator(manager, model, RuleBasedOrchestrator(manager.agents, "alice"), default_agent="alice")

    rig, intake = private_rig(cast, orchestrator=orchestrator)
    with structlog.testing.capture_logs() as logs:
        result = await rig.dispatcher.handle(admitted(intake, wrap(cast.user, cast.orchestrator.pubkey, "hello")))
        await rig.quiet()
    await rig.settle()

    assert result.agents == ("alice",)
    assert invented in str(model.requests[1].messages[-1])
    assert [e["error"] for e in logs if e["event"] == "orchestrator_answer_invalid"] == ["unknown_agent"] * 2
    assert not [entry for entry in logs if invented in repr(entry)]


async def test_a_private_message_replying_into_a_public_conversation_never_joins_it(cast: Cast) -> None:
    """An agent's slug is ``dm``, so its public kind-1 channel with a person reads ``dm:<person>``; the
    person's private message e-tagging that public conversation's answer starts a private conversation of
    its own: it never joins the public one, whose replies go out in the clear."""
    dm, dm_keys = make_agent("dm", "DM Bot", 14)
    keys = {"dm": dm_keys, "bob": cast.bob_keys, "orchestrator": cast.orchestrator_keys}
    agents = [dm, cast.bob, cast.orchestrator]
    composer = PrivateReplyComposer(PlainComposer(keys), {a.slug: a.pubkey for a in agents})
    rig = build_rig(cast, agents=agents, composer=composer, default_agent="dm")
    intake = Intake(GiftWraps(signers_for(keys)), rig.manager.agents)
    note = cast.user_says("hello in public", kind=1, tags=[["p", dm.pubkey]])
    await rig.dispatcher.handle(note)
    await rig.quiet()
    public = await rig.manager.get_conversation(note.id)
    assert public is not None
    assert not public.private
    answer = public.history[-1]

    secret = admitted(intake, wrap(cast.user, dm.pubkey, "my secret", tags=[["p", dm.pubkey], ["e", answer.id]]))
    joined = await rig.dispatcher.handle(secret)
    await rig.quiet()

    assert joined.conversation_id == secret.id
    private = await rig.manager.get_conversation(secret.id)
    assert private is not None
    assert private.private
    assert not [e for e in rig.publisher.published if "my secret" in e.content and e.sig]
    await rig.settle()


async def test_a_private_answer_another_daemon_saved_meanwhile_is_not_sent_again_from_here(cast: Cast) -> None:
    """With daemons sharing a database, another daemon answered the private message while this one's model
    worked: this run keeps that answer and hands nothing to its outbox (its own gift wraps of the same
    rumor would reach the person a second time; the other daemon's outbox sends its own)."""
    backend = GatedBackend()
    rig, intake = private_rig(cast, backend=backend, peers=LeasePeers())
    rumor = admitted(intake, wrap(cast.user, cast.alice.pubkey, "What is the launch date?"))
    await rig.dispatcher.handle(rumor)
    await asyncio.wait_for(backend.asked.wait(), 5)
    tags = [["p", cast.user.pubkey], ["e", rumor.id, "", "reply"]]
    elsewhere = make_rumor(cast.alice.pubkey, "Monday (the other daemon)", tags, rumor.created_at + 1)
    await rig.manager.add_event(rumor.id, elsewhere)

    backend.release.set()
    await rig.settle()

    conversation = await rig.manager.get_conversation(rumor.id)
    assert conversation is not None
    assert [e.content for e in conversation.history] == ["What is the launch date?", "Monday (the other daemon)"]
    assert [e for e in rig.publisher.published if e.pubkey == cast.alice.pubkey] == []
