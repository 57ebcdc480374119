"""Conversations' titles and summaries: made off the request path by a model (or the fallback text),
stored, and published as kind 513 by the project key; a person's title wins; nothing is lost to a restart."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable

import pytest

from tenex_daemon import MemoryStore, NostrEvent
from tenex_daemon.adapters.nostr.metadata_event import ConversationMetadataComposer
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.core.conversation import TASK_SESSION_EXPIRED, Conversation, TitleSource
from tenex_daemon.core.llm import CompletionRequest, CompletionResult, LLMBackend
from tenex_daemon.core.ports import Store
from tenex_daemon.core.vocabulary import KIND_CONVERSATION_METADATA, KIND_TASK
from tenex_daemon.services.description_text import (
    NO_DESCRIPTION,
    Description,
    fallback_summary,
    parse_description,
    transcript,
)
from tenex_daemon.services.descriptions import DescriptionJobs
from tenex_daemon.testing.fakes import FailingBackend, FakePublisher, ScriptedBackend, StuckBackend
from tests.conftest import Cast
from tests.pipeline import Rig, build_rig

PROJECT_D = "demo"
ANSWER = json.dumps({"title": "Planning the spring product launch", "summary": "The person asked for a plan."})


def said(text: str) -> CompletionResult:
    """A model's answer saying ``text``."""
    return CompletionResult(text=text, model="scripted")


class GatedBackend:
    """A model that answers ``text`` only once ``release`` is set; ``asked`` is set on each call."""

    name = "gated"

    def __init__(self, text: str = ANSWER) -> None:
        self.text = text
        self.asked = asyncio.Event()
        self.release = asyncio.Event()
        self.requests: list[CompletionRequest] = []

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Record the request, then wait for the release."""
        self.requests.append(request)
        self.asked.set()
        await self.release.wait()
        return said(self.text)


async def instant(_seconds: float) -> None:
    """A wait that is over at once: every timeout and backoff has passed."""
    await asyncio.sleep(0)


async def until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait until ``predicate()`` holds."""
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110 - polls the service's counters
            await asyncio.sleep(0.002)


def jobs_for(
    rig: Rig,
    cast: Cast,
    *,
    summarizer: LLMBackend | None = None,
    backends: dict[str, LLMBackend] | None = None,
    publisher: FakePublisher | None = None,
    after: int = 3,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    owner: bool = True,
) -> DescriptionJobs:
    """The description service over the rig's manager, publishing through ``publisher`` (the rig's by
    default) and signing with the cast's project key; started."""
    composer = ConversationMetadataComposer(
        Signer.from_text(cast.project.secret, label="project"), (cast.user.pubkey, PROJECT_D) if owner else None
    )
    jobs = DescriptionJobs(
        rig.manager,
        composer,
        publisher if publisher is not None else rig.publisher,
        backends=backends if backends is not None else {},
        summarizer=summarizer,
        describe_after_exchanges=after,
        publish_retry_start_s=0.001,
        publish_retry_cap_s=0.002,
        idle=lambda: rig.scheduler.in_flight == 0,
        sleep=sleep,
    )
    jobs.start()
    return jobs


async def talk(rig: Rig, cast: Cast, exchanges: int, *, title: str | None = None) -> str:
    """A conversation of ``exchanges`` person/Alice pairs stored through the manager; return its id."""
    tags = [["p", cast.alice.pubkey], *([["title", title]] if title else [])]
    root = cast.user_says("Help me plan the spring product launch for our app please", kind=11, tags=tags)
    await rig.manager.create_conversation(root)
    rig.clock.advance(1000)
    await rig.manager.add_event(root.id, cast.alice_says("Sure, what is the date?", tags=[["e", root.id]]))
    for n in range(1, exchanges):
        rig.clock.advance(1000)
        await rig.manager.add_event(root.id, cast.user_says(f"Question {n}", tags=[["e", root.id]]))
        rig.clock.advance(1000)
        await rig.manager.add_event(root.id, cast.alice_says(f"Answer {n}", tags=[["e", root.id]]))
    return root.id


async def stored(rig: Rig, conversation_id: str) -> Conversation:
    """The conversation as stored now."""
    conversation = await rig.manager.get_conversation(conversation_id)
    assert conversation is not None
    return conversation


def metadata_events(publisher: FakePublisher, conversation_id: str) -> list[NostrEvent]:
    """The kind-513 events published for the conversation."""
    return [
        e for e in publisher.published if e.kind == KIND_CONVERSATION_METADATA and e.tag_value("e") == conversation_id
    ]


def tags_of(event: NostrEvent) -> dict[str, str]:
    """The event's tags as name -> first value."""
    return {tag[0]: tag[1] for tag in event.tags}


async def described_and_published(rig: Rig, jobs: DescriptionJobs, conversation_id: str) -> Conversation:
    """Wait until the conversation is described for its current content and its 513 is accepted."""

    async def done() -> bool:
        c = await stored(rig, conversation_id)
        return c.described_at == c.last_activity and c.description_published

    async with asyncio.timeout(5):
        while not await done():  # noqa: ASYNC110 - polls the stored conversation
            await asyncio.sleep(0.002)
    await until(lambda: jobs.queued == 0 and jobs.unpublished == 0)
    return await stored(rig, conversation_id)


# --- parsing ------------------------------------------------------------------------------------


def test_a_bare_json_answer_is_read() -> None:
    """A JSON object with title and summary gives both, as written."""
    made = parse_description('{"title": "Fixing the login bug", "summary": "A bug was found. It was fixed."}')
    assert made == Description("Fixing the login bug", "A bug was found. It was fixed.")


def test_json_in_a_code_fence_with_chatter_around_it_is_read() -> None:
    """Chatter before and after a fenced JSON object (keys in any case) does not stop the parser."""
    text = (
        "Sure! Here is the JSON you asked for:\n```json\n"
        '{"Title": "Choosing a database for analytics", "Summary": "They compared two databases."}\n```\n'
        "Let me know if you need anything else."
    )
    assert parse_description(text) == Description(
        "Choosing a database for analytics", "They compared two databases."
    )


def test_title_and_summary_lines_are_read() -> None:
    """Markdown ``**Title:**`` and ``Summary:`` lines are read; a summary goes on over the next line."""
    text = (
        "Here you go.\n**Title:** \"Moving the blog to a new host\"\n\n**Summary:** The person wanted to move.\n"
        "The agent listed the steps.\n\nHope this helps!"
    )
    assert parse_description(text) == Description(
        "Moving the blog to a new host", "The person wanted to move. The agent listed the steps."
    )


def test_a_small_models_escaped_and_nested_answer_is_read() -> None:
    """HTML entities left by a chat template are undone, and a summary nested in an object is found; a
    summary object with no text under a summary key gives no summary (what SmolLM2-135M answers)."""
    escaped = "{&#34;title&#34;: &#34;Vegetarian Lasagna&#34;, &#34;summary&#34;: {&#34;type&#34;: &#34;recipe&#34;}}"
    nested = '{"title": "Spring Launch", "summary": {"type": "x", "description": "A launch was planned."}}'
    assert parse_description(escaped) == Description("Vegetarian Lasagna", None)
    assert parse_description(nested) == Description("Spring Launch", "A launch was planned.")


def test_the_whole_members_of_an_answer_cut_at_its_token_limit_are_read() -> None:
    """A JSON answer cut off at the token limit (it does not parse) still gives the members written whole
    before the cut, escapes undone; a member cut mid-string gives nothing (SmolLM2-135M answers so)."""
    cut = '{\n  "title": "Miso\'s \\"vet\\" visit",\n  "summary": {\n    "date": "Friday",\n  "response": {"id": "58'
    cut_in_summary = '{"title": "Planning the spring launch", "summary": "The person asked for'
    assert parse_description(cut) == Description('Miso\'s "vet" visit', None)
    assert parse_description(cut_in_summary) == Description("Planning the spring launch", None)


def test_overlong_answers_are_clipped() -> None:
    """A title is clipped to 8 words (no closing full stop), a summary to 3 sentences."""
    long_title = "One two three four five six seven eight nine ten."
    summary = "First. Second! Third? Fourth. Fifth."
    made = parse_description(json.dumps({"title": long_title, "summary": summary}))
    assert made == Description("One two three four five six seven eight", "First. Second! Third?")


@pytest.mark.parametrize(
    "answer",
    [
        "I cannot help with that.",
        "",
        "{not json at all",
        '{"title": "...", "summary": "..."}',
        '{"title": "<title>", "summary": "Summary:"}',
        '{"title": 42, "summary": ["a list"]}',
    ],
)
def test_garbage_gives_nothing(answer: str) -> None:
    """Chatter, broken JSON, the prompt's own placeholders echoed back or values that are not text give no
    title and no summary (the fallback text is used)."""
    assert parse_description(answer) == NO_DESCRIPTION


async def test_a_long_conversation_is_cut_for_the_prompt(cast: Cast) -> None:
    """Over the size limit the transcript keeps the first message and the newest, saying how many were left out."""
    rig = build_rig(cast)
    cid = await talk(rig, cast, 40)
    text = transcript(await stored(rig, cid), rig.manager.agents, max_chars=400)
    assert len(text) <= 400
    assert text.startswith("Person: Help me plan the spring product launch")
    assert "messages left out]" in text
    assert text.endswith("Alice: Answer 39")


# --- describing and publishing ------------------------------------------------------------------


async def test_an_ended_conversation_is_described_and_published_as_kind_513(cast: Cast) -> None:
    """Ending a conversation makes the model's title and summary stored (source model) and published once as
    kind 513 by the project key, with the e, title, summary, status ended and project a tags."""
    rig = build_rig(cast)
    summarizer = ScriptedBackend([said(f"Here it is: {ANSWER}")])
    jobs = jobs_for(rig, cast, summarizer=summarizer)
    cid = await talk(rig, cast, 1)

    await rig.manager.end_conversation(cid, by="owner")
    conversation = await described_and_published(rig, jobs, cid)

    assert (conversation.title, conversation.title_source) == ("Planning the spring product launch", TitleSource.MODEL)
    assert conversation.summary == "The person asked for a plan."
    [event] = metadata_events(rig.publisher, cid)
    assert event.pubkey == cast.project.pubkey
    assert event.tags == [
        ["e", cid],
        ["title", "Planning the spring product launch"],
        ["summary", "The person asked for a plan."],
        ["status", "ended"],
        ["a", f"31933:{cast.user.pubkey}:{PROJECT_D}"],
    ]
    assert "Person: Help me plan the spring product launch" in summarizer.requests[0].messages[0].content
    assert dict(jobs.described) == {"model": 1}
    assert jobs.published == 1
    await jobs.stop()


async def test_the_persons_title_tag_wins_over_the_models(cast: Cast) -> None:
    """A root's ``title`` tag stays the title (source tag); the model's summary is stored and published with it."""
    rig = build_rig(cast)
    jobs = jobs_for(rig, cast, summarizer=ScriptedBackend([said(ANSWER)]))
    cid = await talk(rig, cast, 1, title="Launch plan (mine)")

    await rig.manager.end_conversation(cid, by="owner")
    conversation = await described_and_published(rig, jobs, cid)

    assert (conversation.title, conversation.title_source) == ("Launch plan (mine)", TitleSource.TAG)
    assert conversation.summary == "The person asked for a plan."
    [event] = metadata_events(rig.publisher, cid)
    assert tags_of(event)["title"] == "Launch plan (mine)"
    await jobs.stop()


async def test_a_titleless_active_conversation_is_described_after_n_exchanges(cast: Cast) -> None:
    """Three exchanges (the default) in a titleless conversation give it a title and summary, published with
    status active, through the first agent's own backend when no summarizer is configured."""
    rig = build_rig(cast)
    alice_model = ScriptedBackend([said(ANSWER)])
    jobs = jobs_for(rig, cast, backends={"bob": FailingBackend(), "alice": alice_model})
    cid = await talk(rig, cast, 3)

    jobs.wake(cid)  # what each saved reply does
    conversation = await described_and_published(rig, jobs, cid)

    assert conversation.title_source is TitleSource.MODEL
    assert not conversation.is_ended
    [event] = metadata_events(rig.publisher, cid)
    assert tags_of(event)["status"] == "active"
    assert len(alice_model.requests) == 1
    await jobs.stop()


async def test_nothing_is_described_one_exchange_short(cast: Cast) -> None:
    """With one exchange fewer than ``describe_after_exchanges`` no model is asked and nothing is stored."""
    rig = build_rig(cast)
    summarizer = ScriptedBackend([said(ANSWER)])
    jobs = jobs_for(rig, cast, summarizer=summarizer, after=3)
    cid = await talk(rig, cast, 2)

    jobs.wake(cid)
    await until(lambda: jobs.queued == 0)

    conversation = await stored(rig, cid)
    assert (conversation.described_at, conversation.title_source, conversation.summary) == (None, None, None)
    assert summarizer.requests == []
    assert rig.publisher.published == []
    await jobs.stop()


async def test_a_saved_reply_wakes_the_service(cast: Cast) -> None:
    """The agent reply that completes the third exchange, saved by the pipeline, gets the conversation described."""
    rig = build_rig(cast)
    jobs = jobs_for(rig, cast, summarizer=ScriptedBackend([said(ANSWER)]))
    cid = await talk(rig, cast, 2)
    rig.clock.advance(1000)
    thread = [["E", cid, "", cast.user.pubkey], ["K", "11"], ["e", cid], ["p", cast.alice.pubkey]]
    question = cast.user_says("One more question", tags=thread)

    await rig.dispatcher.handle(question)

    conversation = await described_and_published(rig, jobs, cid)
    assert conversation.title_source is TitleSource.MODEL
    await rig.settle()
    await jobs.stop()


@pytest.mark.parametrize(
    ("backend", "failure"),
    [(FailingBackend(), "backend_rate_limit"), (ScriptedBackend([said("I am not sure what you mean.")]), "unparseable")],
)
async def test_a_failing_or_unreadable_model_gives_the_fallback_text(
    cast: Cast, backend: LLMBackend, failure: str
) -> None:
    """A model error or an answer with no title and summary gives the fallback: the first words of the
    person's first message as title (source fallback) and a plain sentence as summary; it is published."""
    rig = build_rig(cast)
    jobs = jobs_for(rig, cast, summarizer=backend)
    cid = await talk(rig, cast, 1)

    await rig.manager.end_conversation(cid, by="owner")
    conversation = await described_and_published(rig, jobs, cid)

    assert conversation.title == "Help me plan the spring product…"
    assert conversation.title_source is TitleSource.FALLBACK
    assert conversation.summary == (
        "A conversation of 2 messages between a person and Alice. It began with: “Help me plan the spring "
        "product launch for our app please”."
    )
    assert len(metadata_events(rig.publisher, cid)) == 1
    assert dict(jobs.described) == {"fallback": 1}
    await jobs.stop()


async def test_a_title_without_a_summary_is_followed_by_a_plain_summary_question(cast: Cast) -> None:
    """A model that gives only a title is asked once more for the summary alone, in plain sentences, and
    both are the model's."""
    backend = ScriptedBackend(
        [said('{"title": "Spring product launch plan"}'), said("They planned the launch. Alice wrote a plan.")]
    )
    rig = build_rig(cast)
    jobs = jobs_for(rig, cast, summarizer=backend)
    cid = await talk(rig, cast, 1)

    await rig.manager.end_conversation(cid, by="owner")
    conversation = await described_and_published(rig, jobs, cid)

    assert conversation.title == "Spring product launch plan"
    assert conversation.summary == "They planned the launch. Alice wrote a plan."
    assert len(backend.requests) == 2
    assert "Write only the sentences." in str(backend.requests[1].messages[-1].content)
    await jobs.stop()


async def test_a_model_that_never_answers_times_out_to_the_fallback(cast: Cast) -> None:
    """A summarizer that never answers is cut at the timeout (a fake wait that is over at once) and the
    fallback text is stored and published."""
    rig = build_rig(cast)
    stuck = StuckBackend()
    jobs = jobs_for(rig, cast, summarizer=stuck, sleep=instant)
    cid = await talk(rig, cast, 1)

    await rig.manager.end_conversation(cid, by="owner")
    conversation = await described_and_published(rig, jobs, cid)

    assert stuck.asked.is_set()
    assert conversation.title_source is TitleSource.FALLBACK
    assert len(metadata_events(rig.publisher, cid)) == 1
    await jobs.stop()


async def test_a_conversation_described_while_active_is_published_again_as_ended(cast: Cast) -> None:
    """Described after three exchanges (status active), then ended with nothing said since: the model is not
    asked again and a second 513 with the same title says status ended."""
    rig = build_rig(cast)
    summarizer = ScriptedBackend([said(ANSWER)])
    jobs = jobs_for(rig, cast, summarizer=summarizer)
    cid = await talk(rig, cast, 3)
    jobs.wake(cid)
    await described_and_published(rig, jobs, cid)

    await rig.manager.end_conversation(cid, by="owner")
    await until(lambda: len(metadata_events(rig.publisher, cid)) == 2 and jobs.unpublished == 0)

    first, second = metadata_events(rig.publisher, cid)
    assert [tags_of(first)["status"], tags_of(second)["status"]] == ["active", "ended"]
    assert tags_of(first)["title"] == tags_of(second)["title"] == "Planning the spring product launch"
    assert len(summarizer.requests) == 1
    assert (await stored(rig, cid)).description_published
    await jobs.stop()


async def test_a_reopened_conversation_is_published_again_as_active(cast: Cast) -> None:
    """An ended conversation, described and published as ended, that a person writes in again is published
    once more with the same title and status active (clients kept it as ended), the model not asked again;
    the mark that its 513 is due is stored with the message that reopened it."""
    rig = build_rig(cast)
    summarizer = ScriptedBackend([said(ANSWER)])
    jobs = jobs_for(rig, cast, summarizer=summarizer)
    cid = await talk(rig, cast, 1)
    await rig.manager.end_conversation(cid, by="owner")
    await described_and_published(rig, jobs, cid)
    await jobs.stop()  # the job is down while the person writes: only the stored mark says what is due
    rig.clock.advance(1000)
    thread = [["E", cid, "", cast.user.pubkey], ["K", "11"], ["e", cid], ["p", cast.alice.pubkey]]

    await rig.manager.add_event(cid, cast.user_says("One more thing", tags=thread))

    reopened = await rig.store.load(cid)
    assert reopened is not None
    assert not reopened.is_ended
    assert not reopened.description_published
    jobs = jobs_for(rig, cast, summarizer=summarizer)
    assert await jobs.recover() == 1
    await until(lambda: len(metadata_events(rig.publisher, cid)) == 2 and jobs.unpublished == 0)
    first, second = metadata_events(rig.publisher, cid)
    assert [tags_of(first)["status"], tags_of(second)["status"]] == ["ended", "active"]
    assert tags_of(first)["title"] == tags_of(second)["title"] == "Planning the spring product launch"
    assert len(summarizer.requests) == 1
    assert (await stored(rig, cid)).description_published
    await jobs.stop()


async def test_a_reopening_message_gets_the_description_published_as_active_without_a_reply(cast: Cast) -> None:
    """A person's message that reopens a described conversation wakes the description job itself: its 513
    goes out again saying active though no agent answers the message."""
    rig = build_rig(cast)
    jobs = jobs_for(rig, cast, summarizer=ScriptedBackend([said(ANSWER)]))
    cid = await talk(rig, cast, 1)
    await rig.manager.end_conversation(cid, by="owner")
    await described_and_published(rig, jobs, cid)
    rig.clock.advance(1000)
    thread = [["E", cid, "", cast.user.pubkey], ["K", "11"], ["e", cid]]

    await rig.manager.add_event(cid, cast.user_says("Back again", tags=thread))

    await until(lambda: len(metadata_events(rig.publisher, cid)) == 2 and jobs.unpublished == 0)
    assert [tags_of(e)["status"] for e in metadata_events(rig.publisher, cid)] == ["ended", "active"]
    await jobs.stop()


async def test_an_expired_task_session_written_in_again_is_not_published_again(cast: Cast) -> None:
    """An expired task session that takes an event (a rebuild merging one it lacked) keeps its description
    marked published: its 513 must never speak for the task's thread again (the next session does)."""
    rig = build_rig(cast)
    task = cast.user_says("Fix the login bug", kind=KIND_TASK, tags=[["p", cast.alice.pubkey]])
    await rig.manager.create_conversation(task, task_id=task.id)
    await rig.manager.end_conversation(task.id, by="idle", reason=TASK_SESSION_EXPIRED)
    await rig.manager.describe(
        task.id, title=None, summary="The login bug.", source=TitleSource.FALLBACK,
        for_activity=(await stored(rig, task.id)).last_activity,
    )
    await rig.manager.description_published(task.id)
    rig.clock.advance(1000)

    await rig.manager.add_event(task.id, cast.alice_says("Looking into it", tags=[["e", task.id]]))

    assert (await stored(rig, task.id)).description_published


@pytest.mark.parametrize("described_before", [True, False])
async def test_an_expired_task_session_is_settled_once_and_not_queued_at_each_start(
    cast: Cast, described_before: bool
) -> None:
    """A task session that expires (described and published while active, or never described) publishes no
    513 and ends marked published, so the next starts find no description work left in it."""
    rig = build_rig(cast)
    jobs = jobs_for(rig, cast, summarizer=ScriptedBackend([said(ANSWER)]), after=1)
    task = cast.user_says("Fix the login bug", kind=KIND_TASK, tags=[["p", cast.alice.pubkey]])
    await rig.manager.create_conversation(task, task_id=task.id)
    rig.clock.advance(1000)
    await rig.manager.add_event(task.id, cast.alice_says("Looking into it", tags=[["e", task.id]]))
    if described_before:
        await rig.manager.describe(
            task.id, title=None, summary="The login bug.", source=TitleSource.FALLBACK,
            for_activity=(await stored(rig, task.id)).last_activity,
        )
        await rig.manager.description_published(task.id)
    sent = len(metadata_events(rig.publisher, task.id))

    await rig.manager.end_conversation(task.id, by="idle", reason=TASK_SESSION_EXPIRED)
    await until(lambda: jobs.queued == 0 and jobs.unpublished == 0)
    await jobs.stop()

    conversation = await stored(rig, task.id)
    assert conversation.description_published
    assert conversation.summary
    assert len(metadata_events(rig.publisher, task.id)) == sent
    for _ in range(2):
        again = jobs_for(rig, cast)
        assert await again.recover() == 0
        await again.stop()


async def test_a_refused_publish_is_retried_and_marked_only_once_accepted(cast: Cast) -> None:
    """While no relay accepts the 513 the description stays unpublished; it is tried again with backoff and
    marked published once a relay took it."""
    rig = build_rig(cast)
    relays = FakePublisher(fail=True)
    jobs = jobs_for(rig, cast, summarizer=ScriptedBackend([said(ANSWER)]), publisher=relays)
    cid = await talk(rig, cast, 1)

    await rig.manager.end_conversation(cid, by="owner")
    await until(lambda: jobs.retries >= 3)

    assert not (await stored(rig, cid)).description_published
    assert jobs.unpublished == 1
    relays.fail = False
    conversation = await described_and_published(rig, jobs, cid)
    assert conversation.description_published
    assert len(metadata_events(relays, cid)) == 1
    await jobs.stop()


async def test_a_relay_that_connects_ends_a_description_s_wait_to_retry(cast: Cast) -> None:
    """A 513 waiting out its retry (an hour long here) is published at once when a relay (re)connects, as
    the outbox's entries are."""
    rig = build_rig(cast)
    relays = FakePublisher(fail=True)
    waiting = asyncio.Event()

    async def an_hour(seconds: float) -> None:
        waiting.set()
        await asyncio.sleep(3600)

    jobs = jobs_for(rig, cast, summarizer=ScriptedBackend([said(ANSWER)]), publisher=relays, sleep=an_hour)
    cid = await talk(rig, cast, 1)
    await rig.manager.end_conversation(cid, by="owner")
    await asyncio.wait_for(waiting.wait(), 5)
    relays.fail = False

    jobs.relay_connected()

    conversation = await asyncio.wait_for(described_and_published(rig, jobs, cid), 5)
    assert conversation.description_published
    assert len(metadata_events(relays, cid)) == 1
    await jobs.stop()


async def test_an_end_made_while_no_daemon_ran_is_published_at_the_next_start(cast: Cast) -> None:
    """A conversation described and published as active, then ended with no daemon listening (the CLI
    over the store, or a daemon killed before its job): the next start publishes its kind 513 again,
    saying ended."""
    store: Store = MemoryStore()
    rig = build_rig(cast, store=store)
    cid = await talk(rig, cast, 4)
    jobs = jobs_for(rig, cast, summarizer=ScriptedBackend([said(ANSWER)]))
    await jobs.recover()
    await described_and_published(rig, jobs, cid)
    await jobs.stop()
    assert [tags_of(e)["status"] for e in metadata_events(rig.publisher, cid)] == ["active"]

    await build_rig(cast, store=store).manager.end_conversation(cid, by="owner", reason="done")
    after = build_rig(cast, store=store)
    jobs = jobs_for(after, cast, summarizer=ScriptedBackend([said(ANSWER)]))
    await jobs.recover()

    conversation = await described_and_published(after, jobs, cid)
    assert conversation.is_ended
    assert [tags_of(e)["status"] for e in metadata_events(after.publisher, cid)] == ["ended"]
    await jobs.stop()


async def test_work_left_by_a_crash_is_found_and_done_at_start(cast: Cast) -> None:
    """After a restart (a new pipeline over the same store), recover() finds an ended conversation never
    described and a description stored but never published, and finishes both, each published once."""
    store: Store = MemoryStore()
    before = build_rig(cast, store=store)
    ended = await talk(before, cast, 1)
    await before.manager.end_conversation(ended, by="owner")  # no service listened: the job is pending
    unpublished = await talk(before, cast, 4, title="Unpublished one")
    await before.manager.describe(
        unpublished, title=None, summary="Made before the crash.", source=TitleSource.MODEL,
        for_activity=(await stored(before, unpublished)).last_activity,
    )
    untouched = await talk(before, cast, 1)

    after = build_rig(cast, store=store)
    summarizer = ScriptedBackend([said(ANSWER)])
    jobs = jobs_for(after, cast, summarizer=summarizer)
    queued = await jobs.recover()

    assert queued == 2
    assert (await described_and_published(after, jobs, ended)).title_source is TitleSource.MODEL
    republished = await described_and_published(after, jobs, unpublished)
    assert republished.summary == "Made before the crash."
    assert tags_of(metadata_events(after.publisher, unpublished)[0])["summary"] == "Made before the crash."
    assert len(metadata_events(after.publisher, ended)) == 1
    assert len(summarizer.requests) == 1
    assert (await stored(after, untouched)).described_at is None
    await jobs.stop()


async def test_a_conversation_waits_in_the_queue_once(cast: Cast) -> None:
    """Woken many times while the worker is busy with another job, a conversation is described once."""
    rig = build_rig(cast)
    gated = GatedBackend()
    jobs = jobs_for(rig, cast, summarizer=gated)
    first = await talk(rig, cast, 1)
    second = await talk(rig, cast, 1)
    await rig.manager.end_conversation(first, by="owner")
    await asyncio.wait_for(gated.asked.wait(), 5)

    await rig.manager.end_conversation(second, by="owner")
    for _ in range(5):
        jobs.wake(second)
    assert jobs.queued == 2
    gated.release.set()
    await described_and_published(rig, jobs, second)

    assert len(gated.requests) == 2
    assert len(metadata_events(rig.publisher, second)) == 1
    await jobs.stop()


async def test_no_owner_means_no_project_a_tag(cast: Cast) -> None:
    """Without a project (no owner configured) the 513 carries no ``a`` tag."""
    rig = build_rig(cast)
    jobs = jobs_for(rig, cast, summarizer=ScriptedBackend([said(ANSWER)]), owner=False)
    cid = await talk(rig, cast, 1)
    await rig.manager.end_conversation(cid, by="owner")
    await described_and_published(rig, jobs, cid)
    [event] = metadata_events(rig.publisher, cid)
    assert "a" not in tags_of(event)
    await jobs.stop()


# --- never on a reply's path --------------------------------------------------------------------


async def timed_reply(rig: Rig, cast: Cast, text: str) -> float:
    """Seconds from a person's new conversation to Alice's reply published (through the whole pipeline)."""
    root = cast.user_says(text, kind=11, tags=[["p", cast.alice.pubkey]])
    started = time.perf_counter()
    await rig.dispatcher.handle(root)
    await until(lambda: any(e.tag_value("e") == root.id for e in rig.publisher.published))
    return time.perf_counter() - started


async def test_a_reply_is_not_delayed_by_a_summary_in_progress(cast: Cast) -> None:
    """While a description job waits on a summarizer that does not answer, a person's message is answered
    as fast as one with no job in progress (well within a generous margin), and the job is still waiting."""
    rig = build_rig(cast)
    gated = GatedBackend()
    jobs = jobs_for(rig, cast, summarizer=gated)
    baseline = min([await timed_reply(rig, cast, f"warm-up {n}") for n in range(3)])
    ended = await talk(rig, cast, 1)
    await rig.manager.end_conversation(ended, by="owner")
    await asyncio.wait_for(gated.asked.wait(), 5)

    during = min([await timed_reply(rig, cast, f"while summarizing {n}") for n in range(3)])

    assert not gated.release.is_set()
    assert len(gated.requests) == 1
    assert (await stored(rig, ended)).described_at is None  # the summary job is still blocked
    assert during < baseline + 0.5, (baseline, during)
    gated.release.set()
    await described_and_published(rig, jobs, ended)
    await rig.settle()
    await jobs.stop()


async def test_a_task_sessions_513_names_the_task_and_an_expired_session_publishes_none(cast: Cast) -> None:
    """Clients show a task's sessions in the task's thread: a session's kind-513 names the task; a session
    that expired (the next message started a new one) is described but publishes none, so its late 513 can
    never replace the current session's."""
    rig = build_rig(cast)
    jobs = jobs_for(rig, cast, summarizer=ScriptedBackend([said(ANSWER), said(ANSWER)]))
    task = cast.user_says("Fix the login bug", kind=KIND_TASK, tags=[["p", cast.alice.pubkey]])
    await rig.manager.create_conversation(task, task_id=task.id)
    later = cast.user_says("is it fixed?", tags=[["E", task.id, "", task.pubkey], ["K", str(KIND_TASK)], ["e", task.id]])
    await rig.manager.create_conversation(later, task_id=task.id, previous_session=task.id)

    await rig.manager.end_conversation(task.id, by="idle", reason=TASK_SESSION_EXPIRED)
    await until(lambda: jobs.queued == 0 and jobs.unpublished == 0)
    await rig.manager.end_conversation(later.id, by="owner")
    await described_and_published(rig, jobs, later.id)

    expired = await stored(rig, task.id)
    assert expired.described_at == expired.last_activity
    published = metadata_events(rig.publisher, task.id)
    assert [(tags_of(e)["status"], tags_of(e)["summary"]) for e in published] == [("ended", expired.summary)]
    assert jobs.published == 1  # the later session's
    assert metadata_events(rig.publisher, later.id) == []
    await jobs.stop()


async def test_a_description_every_relay_refuses_for_good_is_not_tried_again(cast: Cast) -> None:
    """A kind 513 that every relay refuses for good (``blocked:``) is given up once, logged and counted, not
    retried forever; the description stays stored, unpublished."""
    rig = build_rig(cast)
    publisher = FakePublisher(refuse_kinds=frozenset({KIND_CONVERSATION_METADATA}))
    jobs = jobs_for(rig, cast, summarizer=ScriptedBackend([said(ANSWER)]), publisher=publisher)
    cid = await talk(rig, cast, 1)

    await rig.manager.end_conversation(cid, by="owner")
    await until(lambda: jobs.refused == 1)
    await asyncio.sleep(0.05)  # the retry cap is 2 ms: a retry would have come many times by now

    conversation = await stored(rig, cid)
    assert conversation.summary == "The person asked for a plan."
    assert not conversation.description_published
    assert (jobs.refused, jobs.retries, jobs.published) == (1, 0, 0)
    assert metadata_events(publisher, cid) == []
    await jobs.stop()


async def test_the_fallback_summary_counts_what_was_said_not_the_daemons_notices(cast: Cast) -> None:
    """A stop's notice (a system-error reply) is no message of the conversation: a person's one message and
    Alice's stop notice make "1 message", and Alice is not named for it."""
    rig = build_rig(cast)
    root = cast.user_says("Write the report", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.manager.create_conversation(root)
    notice = cast.alice_says("Stopped: Alice.", tags=[["e", root.id], ["error", "system"]])
    await rig.manager.add_event(root.id, notice)
    conversation = await stored(rig, root.id)

    assert fallback_summary(conversation, rig.manager.agents) == (
        "A conversation of 1 message between a person. It began with: “Write the report”."
    )


async def test_a_conversation_settled_here_and_ended_by_another_daemon_is_published_active_when_reopened_here(
    cast: Cast,
) -> None:
    """Two daemons share a store: A described an active conversation and settled it; B's sweeper ends it and
    publishes ``ended``; a person's message A takes in reopens it, and A publishes ``active`` again, though it
    had settled that conversation before (it never saw the end)."""
    a = build_rig(cast)
    b = build_rig(cast, store=a.store, clock=a.clock)
    cid = await talk(a, cast, 3)
    jobs_a = jobs_for(a, cast, summarizer=ScriptedBackend([CompletionResult(text=ANSWER)]))
    jobs_b = jobs_for(b, cast, summarizer=ScriptedBackend([CompletionResult(text=ANSWER)]), publisher=a.publisher)
    jobs_a.wake(cid)
    await until(lambda: jobs_a.published == 1)
    jobs_a.wake(cid)  # a later reply: the conversation is settled on A now
    await until(lambda: jobs_a.queued == 0)
    a.clock.advance(31 * 60_000)
    await b.manager.end_conversation(cid, by="idle", reason="idle_timeout")
    await until(lambda: jobs_b.published == 1)
    a.clock.advance(1_000)

    await a.manager.add_event(cid, cast.user_says("back again", tags=[["e", cid]]))
    await until(lambda: jobs_a.published == 2)
    await jobs_a.stop()
    await jobs_b.stop()

    assert [tags_of(e)["status"] for e in metadata_events(a.publisher, cid)] == ["active", "ended", "active"]
