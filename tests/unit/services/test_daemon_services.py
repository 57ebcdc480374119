"""Targeting, classification dispatch, agent runs and run scheduling, with fakes for Nostr I/O."""

from __future__ import annotations

import asyncio

import pytest

from tenex_daemon import MemoryStore
from tenex_daemon.adapters.llm.offline import OfflineBackend
from tenex_daemon.adapters.nostr.classifier import classify_event, conversation_lane
from tenex_daemon.core.agents import AgentDirectory
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.llm import BackendError, CompletionRequest, CompletionResult, LLMBackend
from tenex_daemon.core.targeting import SkipReason, agent_chain_length, choose_target, mentioned_agent
from tenex_daemon.services import dispatcher as dispatcher_module
from tenex_daemon.services.dispatcher import Outcome
from tenex_daemon.services.orchestrator import RuleBasedOrchestrator
from tenex_daemon.services.runs import PENDING_RUNS_KEY, RunRequest, RunScheduler
from tenex_daemon.testing import make_agent
from tenex_daemon.testing.fakes import FailingBackend, ScriptedBackend
from tests import pipeline
from tests.conftest import Cast

Rig = pipeline.Rig


def make_rig(
    cast: Cast,
    *,
    hop_limit: int = 3,
    backend: LLMBackend | None = None,
    owner: str | None = None,
    typing_delay_s: float = 0.0,
) -> Rig:
    """The daemon's pipeline (build_pipeline) with fakes at the Nostr edge."""
    return pipeline.build_rig(
        cast, backend=backend, owner=owner, hop_limit=hop_limit, typing_delay_s=typing_delay_s
    )


async def settle(rig: Rig) -> None:
    """Wait for every scheduled run to finish and its reply to be published."""
    await rig.settle()


def test_choose_target_rules(cast: Cast) -> None:
    """First p-tagged agent wins; project or nobody goes to the orchestrator; a stranger's p-tag goes nowhere."""
    directory = AgentDirectory(cast.agents, cast.project.pubkey)
    to_bob = cast.user_says("hi", tags=[["p", cast.bob.pubkey], ["p", cast.alice.pubkey]])
    to_project = cast.user_says("hi", tags=[["p", cast.project.pubkey]])
    to_nobody = cast.user_says("hi")
    to_stranger = cast.user_says("hi", tags=[["p", cast.other_user.pubkey]])
    alice_self = cast.alice_says("me", tags=[["p", cast.alice.pubkey], ["p", cast.bob.pubkey]])

    assert choose_target(to_bob, directory).agent == cast.bob
    assert choose_target(to_project, directory).via_orchestrator
    assert choose_target(to_nobody, directory).agent == cast.orchestrator
    assert choose_target(to_stranger, directory).skip is SkipReason.ADDRESSED_ELSEWHERE
    assert choose_target(alice_self, directory).agent == cast.bob



def test_an_agents_private_completion_goes_to_the_orchestrator_by_its_tag(cast: Cast) -> None:
    """An agent's kind-14 rumor tagged as a completion goes to the orchestrator though it p-tags the person
    only; the same tag on a person's rumor, on the orchestrator's own, or on a public event p-tagging the
    person only changes nothing."""
    directory = AgentDirectory(cast.agents, cast.project.pubkey)
    done = [["p", cast.user.pubkey], ["tool", "complete"]]
    private = cast.alice_says("done", kind=14, tags=done)
    persons = cast.user_says("done", kind=14, tags=[["p", cast.alice.pubkey], ["tool", "complete"]])
    own = cast.factory.event(cast.orchestrator_keys, "done", kind=14, tags=done)
    public = cast.alice_says("done", kind=1111, tags=done)

    assert choose_target(private, directory).agent == cast.orchestrator
    assert choose_target(persons, directory).agent == cast.alice
    assert choose_target(own, directory).skip is SkipReason.ADDRESSED_ELSEWHERE
    assert choose_target(public, directory).skip is SkipReason.ADDRESSED_ELSEWHERE

def test_mentions_and_chains(cast: Cast) -> None:
    """@slug and @Name pick an agent; the agent chain counts agent events at the end of history."""
    directory = AgentDirectory(cast.agents)
    assert mentioned_agent("please @Bob look", directory) == cast.bob
    assert mentioned_agent("ask @alice and @bob", directory) == cast.alice
    assert mentioned_agent("nobody here", directory) is None
    history = [cast.user_says("u"), cast.alice_says("a"), cast.bob_says("b")]
    assert agent_chain_length(history, directory) == 2


def test_a_mention_is_a_whole_handle() -> None:
    """``@devops`` names the agent devops, never dev (a handle inside a longer one), an address such as
    ``ops@dev.example`` names nobody, and of two handles at one place the longer wins (``@Dev Team``); a
    mention followed at once by text written without spaces (Chinese) still names its agent."""
    dev, _ = make_agent("dev", "Dev", 41)
    devops, _ = make_agent("devops", "Devops", 42)
    team, _ = make_agent("team", "Dev Team", 43)
    directory = AgentDirectory([dev, devops, team])

    assert mentioned_agent("@devops please deploy", directory) == devops
    assert mentioned_agent("@dev, please build", directory) == dev
    assert mentioned_agent("mail ops@dev.example", directory) is None
    assert mentioned_agent("ask @Dev Team now", directory) == team
    assert mentioned_agent("(@dev-ops) and @dev.", directory) == dev
    assert mentioned_agent("请@dev帮忙", directory) == dev  # text without spaces may follow at once


def test_classification(cast: Cast) -> None:
    """kind 11 and bare kind 1 start conversations, 1934 a task, 1111 with a root replies, other kinds are ignored."""
    root = cast.user_says("root", kind=11)
    task = cast.user_says("task", kind=1934)
    reply = cast.user_says("re", tags=[["E", root.id, "", root.pubkey], ["K", "11"], ["e", root.id]])
    task_reply = cast.user_says("re", tags=[["E", task.id, "", task.pubkey], ["K", "1934"]])
    note = cast.user_says("note", kind=1)
    orphan = cast.user_says("orphan")
    reaction = cast.user_says("+", kind=7)

    assert classify_event(root).kind.value == "new_conversation"
    assert classify_event(task).kind.value == "task"
    assert (classify_event(reply).kind.value, classify_event(reply).conversation_id) == ("reply", root.id)
    assert classify_event(task_reply).is_task
    assert classify_event(note).kind.value == "new_conversation"
    assert classify_event(orphan).reason == "reply_without_root"
    assert classify_event(reaction).reason == "unsupported_kind:7"


async def test_user_message_to_agent_gets_one_saved_and_published_reply(cast: Cast) -> None:
    """A p-tagged agent answers once; its reply is in history before it is published, addressed to the user."""
    rig = make_rig(cast)
    root = cast.user_says("Hello Bob", kind=11, tags=[["p", cast.bob.pubkey]])

    result = await rig.dispatcher.handle(root)
    await settle(rig)

    assert (result.outcome, result.agents) == (Outcome.SCHEDULED, ("bob",))
    assert len(rig.publisher.published) == 1
    reply = rig.publisher.published[0]
    assert reply.pubkey == cast.bob.pubkey
    assert reply.tag_values("p") == [cast.user.pubkey]
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert [e.id for e in conversation.history] == [root.id, reply.id]
    assert rig.publisher.typing_events == [("bob", True), ("bob", False)]
    assert await rig.store.get_meta(PENDING_RUNS_KEY) == "[]"


async def test_unaddressed_message_is_routed_by_the_orchestrator(cast: Cast) -> None:
    """With nobody p-tagged, an @mention picks the agent, else the default; a plain reply (no `complete`)
    is not a completion (docs/CONTEXT.md), so the turn stays open."""
    rig = make_rig(cast)
    root = cast.user_says("Plan this, @bob", kind=11)

    result = await rig.dispatcher.handle(root)
    await settle(rig)

    assert result.agents == ("bob",)
    context = await rig.manager.build_orchestrator_routing_context(root.id)
    assert context["routing_history"] == []
    assert context["current_routing"]["agents"] == ["bob"]
    assert context["current_routing"]["completions"] == []
    follow = cast.user_says("anything", tags=[["E", root.id, "", root.pubkey], ["K", "11"]])
    assert (await rig.dispatcher.handle(follow)).agents == ("alice",)


async def test_stranger_triggers_nothing(cast: Cast) -> None:
    """An author outside the allow-list is ignored with its reason and nothing is stored or run."""
    rig = make_rig(cast)
    event = cast.factory.event(cast.other_user, "let me in", kind=11, tags=[["p", cast.bob.pubkey]])

    result = await rig.dispatcher.handle(event)

    assert (result.outcome, result.reason) == (Outcome.IGNORED, "author_not_allowed")
    assert await rig.manager.get_conversation(event.id) is None
    assert rig.publisher.published == []


async def test_duplicate_event_is_answered_once(cast: Cast) -> None:
    """The same root delivered twice (two relays) makes one conversation and one reply."""
    rig = make_rig(cast)
    root = cast.user_says("once", kind=11, tags=[["p", cast.alice.pubkey]])

    first = await rig.dispatcher.handle(root)
    second = await rig.dispatcher.handle(root)
    await settle(rig)

    assert (first.outcome, second.outcome) == (Outcome.SCHEDULED, Outcome.DUPLICATE)
    assert len(rig.publisher.published) == 1


async def test_agent_never_answers_itself_and_chains_stop_at_the_hop_limit(cast: Cast) -> None:
    """Agents p-tagging each other run until the chain exceeds the hop limit; an agent's own event never triggers it."""
    rig = make_rig(cast, hop_limit=2)
    root = cast.user_says("start", kind=11, tags=[["p", cast.project.pubkey]])
    await rig.dispatcher.handle(root)
    await settle(rig)
    thread = [["E", root.id, "", root.pubkey], ["K", "11"]]

    a1 = await rig.dispatcher.handle(cast.alice_says("bob, you", tags=[*thread, ["p", cast.bob.pubkey]]))
    b1 = await rig.dispatcher.handle(cast.bob_says("alice, you", tags=[*thread, ["p", cast.alice.pubkey]]))
    a2 = await rig.dispatcher.handle(cast.alice_says("bob again", tags=[*thread, ["p", cast.bob.pubkey]]))
    own = await rig.dispatcher.handle(
        cast.bob_says("talking to myself", tags=[*thread, ["p", cast.bob.pubkey]])
    )

    assert a1.outcome is Outcome.SCHEDULED
    assert (b1.outcome, b1.reason) == (Outcome.STORED, "hop_limit")
    assert (a2.outcome, a2.reason) == (Outcome.STORED, "hop_limit")
    assert own.reason in ("hop_limit", "own_event")
    await settle(rig)


async def test_reply_with_unknown_root_starts_the_conversation(cast: Cast) -> None:
    """A reply whose root cannot be fetched starts its own conversation and is answered."""
    rig = make_rig(cast)
    missing_root = "ab" * 32
    reply = cast.user_says(
        "about that thread",
        tags=[["E", missing_root, "", cast.user.pubkey], ["K", "11"], ["p", cast.alice.pubkey]],
    )

    result = await rig.dispatcher.handle(reply)
    await settle(rig)

    assert result.conversation_id == reply.id
    assert len(rig.publisher.published) == 1


async def test_backend_failure_becomes_an_error_reply(cast: Cast) -> None:
    """A failing backend gives the user a reply tagged ["error","system"] naming the failure; the conversation stays consistent."""
    rig = make_rig(cast, backend=FailingBackend())
    root = cast.user_says("hello", kind=11, tags=[["p", cast.alice.pubkey]])

    await rig.dispatcher.handle(root)
    await settle(rig)

    reply = rig.publisher.published[0]
    assert reply.has_tag("error", "system")
    assert "rate_limit" in reply.content
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert len(conversation.history) == 2
    assert not conversation.execution_time.is_active


class SessionThenFailure:
    """A backend with sessions (as claude-code): answers with session ``sess-1``, fails once (429), then answers
    again; records what each call was given."""

    name = "sessions"

    def __init__(self) -> None:
        self.requests: list[CompletionRequest] = []

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """The first and third calls answer; the second fails."""
        self.requests.append(request)
        if len(self.requests) == 2:
            raise BackendError("rate_limit", "429 Too Many Requests")
        return CompletionResult(text=f"answer {len(self.requests)}", session_id="sess-1")


async def talk_to_alice(cast: Cast, backend: LLMBackend, first: str, *then: str) -> Rig:
    """The production pipeline with the real composer: a person's thread to alice (``first``), then each of
    ``then`` in it, each answered before the next."""
    rig = pipeline.build_rig(cast, backend=backend, composer=pipeline.real_composer(cast))
    root = cast.user_says(first, kind=11, tags=[["p", cast.alice.pubkey]])
    thread = [["E", root.id, "", root.pubkey], ["K", "11"], ["p", cast.alice.pubkey]]
    for event in (root, *(cast.user_says(text, tags=thread) for text in then)):
        await rig.dispatcher.handle(event)
        await rig.quiet()
    return rig


async def test_a_run_that_failed_leaves_the_agent_without_its_session(cast: Cast) -> None:
    """After an error reply the next call starts a session with the whole context, the message that failed
    in it: resumed, the session would be sent only what follows the agent's last reply (the error reply), and
    the failed message would never reach it (before, the next call resumed ``sess-1``)."""
    backend = SessionThenFailure()

    rig = await talk_to_alice(cast, backend, "hello", "my budget is 40 euros", "what was my budget?")

    first, failed, after = backend.requests
    assert (first.session_id, failed.session_id, after.session_id) == (None, "sess-1", None)
    assert any("my budget is 40 euros" in str(m.content) for m in after.messages)
    assert rig.publisher.published[1].has_tag("error", "system")
    sessions = [[t[1] for t in reply.tags if t[0] == "claude-session"] for reply in rig.publisher.published]
    assert sessions == [["sess-1"], [], ["sess-1"]]


async def test_an_empty_answer_in_the_session_keeps_it(cast: Cast) -> None:
    """An answer with no text (an error reply) that the backend gave in its session ``sess-2``: that session
    took the message in, so it is kept, as the error reply's ``claude-session`` tag says."""
    backend = ScriptedBackend([CompletionResult(text="", session_id="sess-2"), CompletionResult(text="ok")])

    rig = await talk_to_alice(cast, backend, "hello", "are you there?")

    assert rig.publisher.published[0].has_tag("error", "system")
    assert rig.publisher.published[0].tag_value("claude-session") == "sess-2"
    assert backend.requests[-1].session_id == "sess-2"


async def test_unpublished_reply_is_still_saved(cast: Cast) -> None:
    """When no relay accepts the reply it stays in history (nothing said is lost) and the run finishes."""
    rig = make_rig(cast)
    rig.publisher.fail = True
    root = cast.user_says("hello", kind=11, tags=[["p", cast.alice.pubkey]])

    await rig.dispatcher.handle(root)
    await settle(rig)

    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert len(conversation.history) == 2
    assert rig.scheduler.failed == 0


async def test_journaled_runs_are_recovered_after_a_crash(cast: Cast) -> None:
    """A run journaled but not finished by a previous process is carried out by recover()."""
    rig = make_rig(cast)
    root = cast.user_says("hello", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.manager.create_conversation(root)
    await rig.store.set_meta(
        PENDING_RUNS_KEY,
        f'[{{"conversation_id":"{root.id}","trigger_id":"{root.id}","agent_slug":"alice","via_orchestrator":false}}]',
    )

    recovered = await rig.scheduler.recover()
    await settle(rig)

    assert [r.agent_slug for r in recovered] == ["alice"]
    assert len(rig.publisher.published) == 1
    assert await rig.store.get_meta(PENDING_RUNS_KEY) == "[]"


async def test_a_recovered_run_whose_reply_was_saved_is_not_answered_again(cast: Cast) -> None:
    """A run still journaled after its reply was saved (a crash between the two) answers nothing new:
    the saved reply is published again (relays keep one copy per id), and no second one is made."""
    rig = make_rig(cast)
    root = cast.user_says("hello", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await settle(rig)
    assert len(rig.publisher.published) == 1
    journal = f'[{{"conversation_id":"{root.id}","trigger_id":"{root.id}","agent_slug":"alice"}}]'
    await rig.store.set_meta(PENDING_RUNS_KEY, journal)  # as if the run's end was never recorded

    recovered = await rig.scheduler.recover()
    await settle(rig)

    assert [r.agent_slug for r in recovered] == ["alice"]
    assert [e.id for e in rig.publisher.published] == [rig.publisher.published[0].id] * 2
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert len(conversation.history) == 2
    assert await rig.store.get_meta(PENDING_RUNS_KEY) == "[]"


async def test_a_recovered_run_in_a_kind_1_conversation_finds_its_saved_reply(cast: Cast) -> None:
    """A kind-1 reply names the thread's root in its first ``e`` tag and its trigger in the one marked
    ``reply``: a run redone after a crash still finds the reply it saved to a later message, and
    publishes that one again instead of answering the message twice."""
    rig = pipeline.build_rig(cast, composer=pipeline.real_composer(cast))
    root = cast.user_says("hello", kind=1, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await rig.quiet()
    first_answer = rig.publisher.published[0]
    follow_up = cast.user_says("and then?", kind=1, tags=[
        ["e", root.id, "", "root"], ["e", first_answer.id, "", "reply"], ["p", cast.alice.pubkey],
    ])
    await rig.dispatcher.handle(follow_up)
    await rig.quiet()
    second_answer = rig.publisher.published[1]
    assert (second_answer.kind, second_answer.tag_value("e")) == (1, root.id)  # the root comes first
    journal = f'[{{"conversation_id":"{root.id}","trigger_id":"{follow_up.id}","agent_slug":"alice"}}]'
    await rig.store.set_meta(PENDING_RUNS_KEY, journal)  # as if the second run's end was never recorded

    await rig.scheduler.recover()
    await settle(rig)

    assert [e.id for e in rig.publisher.published] == [first_answer.id, second_answer.id, second_answer.id]
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    assert len(conversation.history) == 4


class LoadsFailAfterCreate(MemoryStore):
    """A memory store whose next ``failures`` loads fail once a conversation is created (its database
    restarting right after it accepted an event)."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures
        self._armed = False

    async def create(self, conversation: Conversation) -> None:
        """Create it, then fail the next loads."""
        await super().create(conversation)
        self._armed = True

    async def load(self, conversation_id: str) -> Conversation | None:
        """Fail while armed and failures are left, else load."""
        if self._armed and self.failures > 0:
            self.failures -= 1
            raise ConnectionError("the database system is starting up")
        return await super().load(conversation_id)


async def test_an_accepted_event_whose_dispatch_failed_is_dispatched_again_in_place(
    cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the store fails right after accepting a new conversation's root (a database restart), its
    dispatch is tried again where it failed and the agent answers once: the relays' later copies are
    duplicates, so nothing else would dispatch the event before the next start."""
    monkeypatch.setattr(dispatcher_module, "DISPATCH_RETRY_S", (0.01, 0.01, 0.01), raising=False)
    store = LoadsFailAfterCreate(failures=2)
    rig = pipeline.build_rig(cast, store=store)
    root = cast.user_says("hello", kind=11, tags=[["p", cast.alice.pubkey]])

    result = await rig.dispatcher.handle(root)
    await settle(rig)

    assert store.failures == 0
    assert result.outcome is Outcome.SCHEDULED
    assert [event.pubkey for event in rig.publisher.published] == [cast.alice.pubkey]
    assert await store.get_meta(PENDING_RUNS_KEY) == "[]"


async def test_a_recovered_run_that_had_only_asked_another_agent_answers(cast: Cast) -> None:
    """A send_message request the agent made (delegation-tagged) is not its answer: the recovered run
    replies; the saved request, maybe never published before the crash, goes out again."""
    rig = make_rig(cast)
    root = cast.user_says("hello", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.manager.create_conversation(root)
    asked = cast.alice_says("Bob, what do you think?", tags=[["e", root.id], ["delegation", "t1"]])
    await rig.manager.add_event(root.id, asked)
    journal = f'[{{"conversation_id":"{root.id}","trigger_id":"{root.id}","agent_slug":"alice"}}]'
    await rig.store.set_meta(PENDING_RUNS_KEY, journal)

    await rig.scheduler.recover()
    await settle(rig)

    replies = [e for e in rig.publisher.published if e.id != asked.id]
    assert len(replies) == 1
    assert replies[0].pubkey == cast.alice.pubkey
    assert replies[0].tag_value("e") == root.id
    assert [e.id for e in rig.publisher.published].count(asked.id) == 1


async def test_runs_are_serial_within_a_conversation_and_capped(cast: Cast) -> None:
    """Runs of one conversation never overlap; runs across conversations do, up to the cap."""
    active: dict[str, int] = {}
    peak = {"total": 0, "now": 0}
    overlaps: list[str] = []
    store = MemoryStore()

    async def run(request: RunRequest) -> None:
        active[request.conversation_id] = active.get(request.conversation_id, 0) + 1
        if active[request.conversation_id] > 1:
            overlaps.append(request.conversation_id)
        peak["now"] += 1
        peak["total"] = max(peak["total"], peak["now"])
        await asyncio.sleep(0.01)
        peak["now"] -= 1
        active[request.conversation_id] -= 1

    scheduler = RunScheduler(store, run, max_concurrent=3)
    for c in range(6):
        for n in range(4):  # four agents: messages to one agent waiting together would be one burst run
            await scheduler.submit(RunRequest(f"c{c}", f"t{n}", f"agent{n}"))
    await scheduler.drain(10.0)

    assert overlaps == []
    assert peak["total"] == 3
    assert scheduler.completed == 24


async def test_drain_cancels_overdue_runs_and_keeps_them_journaled(cast: Cast) -> None:
    """Runs still going after the grace period are cancelled and stay in the journal for the next start."""
    store = MemoryStore()

    async def slow(request: RunRequest) -> None:
        await asyncio.sleep(30)

    scheduler = RunScheduler(store, slow)
    await scheduler.submit(RunRequest("c", "t", "alice"))
    cancelled = await scheduler.drain(0.05)

    assert cancelled == 1
    assert "alice" in (await store.get_meta(PENDING_RUNS_KEY) or "")
    assert not await scheduler.submit(RunRequest("c", "t2", "alice"))


def test_unknown_default_agent_is_refused(cast: Cast) -> None:
    """Configuring a default agent that does not exist fails at start with its name."""
    with pytest.raises(LookupError, match="nobody"):
        RuleBasedOrchestrator(AgentDirectory(cast.agents), "nobody")


class CountingStore(MemoryStore):
    """A MemoryStore whose set_meta is slow and counted, as an fsynced write would be."""

    def __init__(self) -> None:
        super().__init__()
        self.meta_writes = 0

    async def set_meta(self, key: str, value: str) -> None:
        self.meta_writes += 1
        await asyncio.sleep(0.005)
        await super().set_meta(key, value)


async def test_journal_writes_are_coalesced_and_never_stale() -> None:
    """50 concurrent submits share a few journal writes, which hold every one of them; none is stale."""
    store = CountingStore()
    release = asyncio.Event()

    async def run(request: RunRequest) -> None:
        await release.wait()

    scheduler = RunScheduler(store, run, max_concurrent=50)
    submitted = await asyncio.gather(
        *(scheduler.submit(RunRequest(f"c{i}", f"t{i:02d}", "alice")) for i in range(50))
    )
    await scheduler.journaled()
    writes_for_submits = store.meta_writes
    journaled = await store.get_meta(PENDING_RUNS_KEY) or "[]"
    release.set()
    await scheduler.drain(10.0)

    assert all(submitted)
    assert writes_for_submits < 10
    assert all(f'"t{i:02d}"' in journaled for i in range(50))
    assert await store.get_meta(PENDING_RUNS_KEY) == "[]"
    assert store.meta_writes < 30


class SlowBackend:
    """The offline backend after a pause, like a model that takes a while."""

    name = "slow"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Wait, then answer like the offline backend."""
        await asyncio.sleep(self.seconds)
        return await OfflineBackend().complete(request)


@pytest.mark.parametrize(
    ("backend_s", "delay_s", "expected"), [(0.0, 5.0, []), (0.2, 0.05, [("bob", True), ("bob", False)])]
)
async def test_typing_shows_only_for_runs_longer_than_the_delay(
    cast: Cast, backend_s: float, delay_s: float, expected: list[tuple[str, bool]]
) -> None:
    """A reply sooner than the typing delay (instant, 5 s) sends no typing pair; one later than it (200 ms,
    50 ms) sends start then stop."""
    rig = make_rig(cast, backend=SlowBackend(backend_s), typing_delay_s=delay_s)
    root = cast.user_says("Hello Bob", kind=11, tags=[["p", cast.bob.pubkey]])

    await rig.dispatcher.handle(root)
    await settle(rig)

    assert len(rig.publisher.published) == 1
    assert rig.publisher.typing_events == expected


class UsageBackend:
    """Answers with fixed token usage, like a provider that reports it."""

    name = "usage"

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Reply with 100 prompt and 7 completion tokens."""
        return CompletionResult(text="noted", prompt_tokens=100, completion_tokens=7)


async def test_token_usage_is_added_up_per_agent_and_conversation(cast: Cast) -> None:
    """Two runs reporting 100 + 7 tokens leave the agent's totals at 200 + 14, summed in the conversation JSON."""
    from tenex_daemon.app.control_api import conversation_json

    rig = make_rig(cast, backend=UsageBackend())
    root = cast.user_says("Hello Bob", kind=11, tags=[["p", cast.bob.pubkey]])
    await rig.dispatcher.handle(root)
    again = cast.user_says("Again, Bob", tags=[["E", root.id], ["e", root.id], ["p", cast.bob.pubkey]])
    await rig.dispatcher.handle(again)
    await settle(rig)  # drains the scheduler: both runs are done after it

    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None
    state = conversation.agent_states["bob"]
    assert (state.prompt_tokens, state.completion_tokens) == (200, 14)
    assert conversation_json(conversation)["tokens"] == {
        "prompt": 200, "completion": 14, "by_agent": {"bob": {"prompt": 200, "completion": 14}}
    }


def test_the_pool_lane_and_the_dispatcher_classify_alike_from_the_event_alone(cast: Cast) -> None:
    """The pool's lane key is the conversation the dispatcher's classification names, computed from the
    event alone (no cache shared between them): a reply's lane is its root, a root's lane itself."""
    root = cast.user_says("Hello", kind=11)
    reply = cast.user_says("re", tags=[["E", root.id, "", root.pubkey], ["K", "11"], ["e", root.id]])
    notes = [cast.user_says(f"note {n}", kind=1) for n in range(3)]

    assert conversation_lane(reply) == root.id == classify_event(reply).conversation_id
    assert classify_event(reply) == classify_event(reply)
    assert conversation_lane(root) == root.id
    assert [conversation_lane(note) for note in notes] == [note.id for note in notes]


async def test_two_daemons_racing_for_one_new_conversation_both_succeed_and_one_answers(cast: Cast) -> None:
    """Two pipelines on one store (two daemons on one database) handle the same new root at once: no
    error, one schedules the run and the other reports a duplicate, so the agent answers once."""
    store = MemoryStore()
    first, second = pipeline.build_rig(cast, store=store), pipeline.build_rig(cast, store=store)
    root = cast.user_says("Hello", kind=11, tags=[["p", cast.alice.pubkey]])

    results = await asyncio.gather(first.dispatcher.handle(root), second.dispatcher.handle(root))
    await first.settle()
    await second.settle()

    assert sorted(r.outcome.value for r in results) == ["duplicate", "scheduled"]
    assert len(first.publisher.published) + len(second.publisher.published) == 1
