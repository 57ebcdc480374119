"""Kind-1 channels and task sessions: which conversation an event joins, at every time boundary
(docs/ARCHITECTURE.md, "Conversation lifecycle"), with a controllable clock."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.core.conversation import Conversation, TitleSource
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.llm import CompletionRequest, CompletionResult
from tenex_daemon.core.vocabulary import KIND_STOP, KIND_TASK
from tenex_daemon.services.dispatcher import HandleResult, Outcome
from tenex_daemon.services.lifecycle import channel_meta_key, task_meta_key
from tenex_daemon.services.runs import RunRequest
from tenex_daemon.testing.fakes import ScriptedBackend, WriteBeforeLease
from tests import pipeline
from tests.conftest import Cast
from tests.unit.services.test_stopping import GatedBackend

MINUTE = 60_000
HOUR = 60 * MINUTE


def rig_for(cast: Cast, **options: float) -> tuple[pipeline.Rig, ScriptedBackend]:
    backend = ScriptedBackend([CompletionResult(text="noted", model="scripted")])
    return pipeline.build_rig(cast, backend=backend, **options), backend  # type: ignore[arg-type]


def note_to(cast: Cast, content: str, pubkey: str) -> NostrEvent:
    return cast.user_says(content, kind=1, tags=[["p", pubkey]])


async def conversation(rig: pipeline.Rig, cid: str | None) -> Conversation:
    assert cid is not None
    found = await rig.manager.get_conversation(cid)
    assert found is not None
    return found


async def test_a_note_29_minutes_after_the_last_activity_continues_the_conversation(cast: Cast) -> None:
    """A person's second top-level note to an agent, 29 minutes after the agent's answer, joins the same
    conversation, and the agent's request shows the first note and its own answer before it."""
    rig, backend = rig_for(cast)
    first = await rig.dispatcher.handle(note_to(cast, "my cat is called Miso", cast.alice.pubkey))
    await rig.quiet()
    rig.clock.advance(29 * MINUTE)

    second = await rig.dispatcher.handle(note_to(cast, "what is my cat called?", cast.alice.pubkey))
    await rig.quiet()

    assert second.outcome is Outcome.SCHEDULED
    assert second.conversation_id == first.conversation_id
    shown = [(m.role, m.content) for m in backend.requests[-1].messages]
    assert shown[:2] == [("user", "my cat is called Miso"), ("assistant", "noted")]
    assert shown[-1] == ("user", "what is my cat called?")
    assert len((await conversation(rig, first.conversation_id)).history) == 4


async def test_a_note_31_minutes_after_the_last_activity_ends_the_old_and_starts_a_new_one(cast: Cast) -> None:
    """After 31 idle minutes the open conversation is ended by "idle" and the note starts a new one that
    the channel now points at; the agent's request holds only the new note."""
    rig, backend = rig_for(cast)
    first = await rig.dispatcher.handle(note_to(cast, "my cat is called Miso", cast.alice.pubkey))
    await rig.quiet()
    rig.clock.advance(31 * MINUTE)

    second = await rig.dispatcher.handle(note_to(cast, "new topic: taxes", cast.alice.pubkey))
    await rig.quiet()

    assert second.conversation_id != first.conversation_id
    old = await conversation(rig, first.conversation_id)
    assert old.is_ended
    assert old.ended_by == "idle"
    assert old.end_reason == "idle_timeout"
    new = await conversation(rig, second.conversation_id)
    assert new.channel == f"alice:{cast.user.pubkey}"
    assert [(m.role, m.content) for m in backend.requests[-1].messages] == [("user", "new topic: taxes")]
    key = channel_meta_key(f"alice:{cast.user.pubkey}")
    assert await rig.store.get_meta(key) == second.conversation_id


async def test_the_idle_clock_counts_from_the_last_activity_not_the_start(cast: Cast) -> None:
    """Notes every 20 minutes keep one conversation open for an hour: activity, not age, decides."""
    rig, _ = rig_for(cast)
    ids = []
    for n in range(4):
        ids.append((await rig.dispatcher.handle(note_to(cast, f"note {n}", cast.alice.pubkey))).conversation_id)
        await rig.quiet()
        rig.clock.advance(20 * MINUTE)

    assert len(set(ids)) == 1


async def test_channels_are_per_person_and_per_agent(cast: Cast) -> None:
    """A note to another agent, or from another person, starts its own conversation: channels never mix."""
    rig, _ = rig_for(cast, idle_timeout_min=30)
    to_alice = await rig.dispatcher.handle(note_to(cast, "hello alice", cast.alice.pubkey))
    to_bob = await rig.dispatcher.handle(note_to(cast, "hello bob", cast.bob.pubkey))
    other = cast.factory.event(cast.other_user, "hello alice, from someone else", kind=1, tags=[["p", cast.alice.pubkey]])
    rig_other = pipeline.build_rig(cast, whitelist=[cast.other_user.pubkey], store=rig.store, clock=rig.clock)
    from_other = await rig_other.dispatcher.handle(other)
    await rig.quiet()
    await rig_other.quiet()

    assert len({to_alice.conversation_id, to_bob.conversation_id, from_other.conversation_id}) == 3


async def test_after_an_ended_conversation_the_next_note_starts_a_new_one(cast: Cast) -> None:
    """A conversation ended by its agent or the owner is not continued, even one minute later."""
    rig, _ = rig_for(cast)
    first = await rig.dispatcher.handle(note_to(cast, "one", cast.alice.pubkey))
    await rig.quiet()
    assert first.conversation_id is not None
    await rig.manager.end_conversation(first.conversation_id, by="owner", reason="done")
    rig.clock.advance(MINUTE)

    second = await rig.dispatcher.handle(note_to(cast, "two", cast.alice.pubkey))

    assert second.conversation_id != first.conversation_id
    assert (await conversation(rig, first.conversation_id)).ended_by == "owner"


async def test_a_reply_into_an_ended_conversation_reopens_it(cast: Cast) -> None:
    """A NIP-10 reply to an ended conversation's root reopens it: the end fields are cleared and the agent answers."""
    rig, _ = rig_for(cast)
    first = await rig.dispatcher.handle(note_to(cast, "one", cast.alice.pubkey))
    await rig.quiet()
    cid = first.conversation_id
    assert cid is not None
    await rig.manager.end_conversation(cid, by="alice", reason="finished")
    rig.clock.advance(3 * HOUR)

    reply = cast.user_says("one more thing", kind=1, tags=[["e", cid, "", "root"], ["p", cast.alice.pubkey]])
    result = await rig.dispatcher.handle(reply)
    await rig.quiet()

    assert result.outcome is Outcome.SCHEDULED
    assert result.conversation_id == cid
    reopened = await conversation(rig, cid)
    assert not reopened.is_ended
    assert reopened.ended_by is None
    assert reopened.end_reason is None
    assert reopened.last_activity > rig.clock.now_ms() - MINUTE


async def test_a_note_delivered_twice_is_stored_once(cast: Cast) -> None:
    """A relay delivering a channel's second note again adds nothing and runs nobody."""
    rig, _ = rig_for(cast)
    await rig.dispatcher.handle(note_to(cast, "one", cast.alice.pubkey))
    second = note_to(cast, "two", cast.alice.pubkey)
    await rig.dispatcher.handle(second)
    await rig.quiet()

    again = await rig.dispatcher.handle(second)

    assert again.outcome is Outcome.DUPLICATE
    assert len((await conversation(rig, again.conversation_id)).history) == 4


async def test_two_notes_arriving_together_join_one_conversation(cast: Cast) -> None:
    """Two notes handled at once (different relay lanes) start one conversation, not two."""
    rig, _ = rig_for(cast)
    results = await asyncio.gather(
        rig.dispatcher.handle(note_to(cast, "one", cast.alice.pubkey)),
        rig.dispatcher.handle(note_to(cast, "two", cast.alice.pubkey)),
    )
    await rig.quiet()

    assert results[0].conversation_id == results[1].conversation_id


async def test_notes_to_nobody_form_the_persons_channel_with_the_orchestrator(cast: Cast) -> None:
    """Top-level notes that name no agent (routed by the orchestrator) share the person's "*" channel."""
    rig, _ = rig_for(cast)
    first = await rig.dispatcher.handle(cast.user_says("plan my week", kind=1))
    second = await rig.dispatcher.handle(cast.user_says("and the weekend", kind=1))
    await rig.quiet()

    assert first.conversation_id == second.conversation_id
    assert (await conversation(rig, first.conversation_id)).channel == f"*:{cast.user.pubkey}"


async def test_a_reply_naming_a_later_channel_note_as_root_joins_that_conversation(cast: Cast) -> None:
    """A client that threads under the channel's second note (not its root) still reaches the conversation."""
    rig, _ = rig_for(cast)
    first = await rig.dispatcher.handle(note_to(cast, "one", cast.alice.pubkey))
    second = note_to(cast, "two", cast.alice.pubkey)
    await rig.dispatcher.handle(second)
    await rig.quiet()

    reply = cast.user_says("three", kind=1, tags=[["e", second.id, "", "root"], ["p", cast.alice.pubkey]])
    result = await rig.dispatcher.handle(reply)

    assert result.conversation_id == first.conversation_id


async def test_a_kind_11_thread_is_its_own_conversation_and_never_merges(cast: Cast) -> None:
    """Threads stay conversations by their root: two kind-11 roots a minute apart are two conversations."""
    rig, _ = rig_for(cast)
    first = await rig.dispatcher.handle(cast.user_says("thread one", kind=11, tags=[["p", cast.alice.pubkey]]))
    rig.clock.advance(MINUTE)
    second = await rig.dispatcher.handle(cast.user_says("thread two", kind=11, tags=[["p", cast.alice.pubkey]]))
    await rig.quiet()

    assert first.conversation_id != second.conversation_id
    assert (await conversation(rig, first.conversation_id)).channel is None


# --- task sessions ----------------------------------------------------------------------------


def task_reply(cast: Cast, task: NostrEvent, content: str) -> NostrEvent:
    tags = [["E", task.id, "", task.pubkey], ["K", str(KIND_TASK)], ["e", task.id], ["p", cast.alice.pubkey]]
    return cast.user_says(content, tags=tags)


async def test_activity_keeps_a_task_session_alive_past_24_hours_from_its_start(cast: Cast) -> None:
    """Events 23 hours apart stay in the task's first session: the TTL runs from the last activity."""
    rig, _ = rig_for(cast, task_session_ttl_h=24)
    task = cast.user_says("Fix the login bug", kind=KIND_TASK, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(task)
    await rig.quiet()
    results = []
    for n in range(2):
        rig.clock.advance(23 * HOUR)
        results.append(await rig.dispatcher.handle(task_reply(cast, task, f"update {n}")))
        await rig.quiet()

    assert [r.conversation_id for r in results] == [task.id, task.id]
    session = await conversation(rig, task.id)
    assert session.task_id == task.id
    assert rig.manager.expires_at(session) == session.last_activity + 24 * HOUR


async def test_an_expired_task_session_is_archived_and_the_next_event_starts_a_linked_one(cast: Cast) -> None:
    """25 hours after the last activity the next event starts a new session linked to the old, which is
    ended and archived; later events for the task go to the new session."""
    rig, backend = rig_for(cast, task_session_ttl_h=24)
    task = cast.user_says("Fix the login bug", kind=KIND_TASK, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(task)
    await rig.quiet()
    rig.clock.advance(25 * HOUR)

    result = await rig.dispatcher.handle(task_reply(cast, task, "is it fixed?"))
    await rig.quiet()
    rig.clock.advance(HOUR)
    later = await rig.dispatcher.handle(task_reply(cast, task, "thanks"))
    await rig.quiet()

    assert result.outcome is Outcome.SCHEDULED
    assert result.conversation_id != task.id
    new = await conversation(rig, result.conversation_id)
    assert new.task_id == task.id
    assert new.previous_session == task.id
    old = await conversation(rig, task.id)
    assert old.archived
    assert old.end_reason == "task_session_expired"
    assert later.conversation_id == result.conversation_id
    assert await rig.store.get_meta(task_meta_key(task.id)) == result.conversation_id
    assert [(m.role, m.content) for m in backend.requests[1].messages] == [("user", "is it fixed?")]



async def test_a_task_session_with_a_run_under_way_does_not_expire_under_it(cast: Cast) -> None:
    """A run still under way 25 hours after the session's last activity (a slow model, a run redone after a
    downtime): the task's next event joins that session rather than ending and archiving it, and the run's
    answer is saved there."""
    backend = GatedBackend()
    rig = pipeline.build_rig(cast, backend=backend, task_session_ttl_h=24)
    task = cast.user_says("Fix the login bug", kind=KIND_TASK, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(task)
    await asyncio.wait_for(backend.asked.wait(), 5)
    rig.clock.advance(25 * HOUR)

    follow_up = await rig.dispatcher.handle(task_reply(cast, task, "any news?"))
    backend.release.set()
    await rig.quiet()
    await rig.settle()

    assert follow_up.conversation_id == task.id
    session = await conversation(rig, task.id)
    assert not session.archived
    assert session.end_reason is None
    assert "answer 1" in [e.content for e in session.history if e.pubkey == cast.alice.pubkey]

async def task_in_its_second_session(
    rig: pipeline.Rig, cast: Cast, tags: list[list[str]] | None = None
) -> tuple[NostrEvent, HandleResult]:
    """The person's task to Alice (with ``tags``), answered; 25 hours later (the rig's task sessions live
    24) a reply that starts its second session: the task and that reply's result, the rig quiet."""
    task = cast.user_says("Fix the login bug", kind=KIND_TASK, tags=[["p", cast.alice.pubkey], *(tags or [])])
    await rig.dispatcher.handle(task)
    await rig.quiet()
    rig.clock.advance(25 * HOUR)
    second = await rig.dispatcher.handle(task_reply(cast, task, "is it fixed?"))
    await rig.quiet()
    return task, second


async def test_a_task_s_title_given_by_the_person_is_the_title_of_its_later_sessions(cast: Cast) -> None:
    """The title tag the person gave the task stays the title of the session a later reply starts (as the
    person's, which no model's title replaces), so the task's thread keeps the person's title."""
    rig, _ = rig_for(cast, task_session_ttl_h=24)
    task, later = await task_in_its_second_session(rig, cast, [["title", "Login bug"]])
    await rig.settle()

    session = await conversation(rig, later.conversation_id)
    assert session.id != task.id
    assert (session.title, session.title_source) == ("Login bug", TitleSource.TAG)


async def test_a_task_whose_session_was_deleted_goes_on_in_its_current_or_a_new_one(cast: Cast) -> None:
    """Deleting a task's first session (retention) leaves its current session taking the task's replies;
    deleting the current one makes the next reply start a new session, never reopen the expired first."""
    rig, _ = rig_for(cast, task_session_ttl_h=24)
    task, second = await task_in_its_second_session(rig, cast)
    assert await rig.manager.delete_conversation(task.id)  # the first session, ended and archived

    rig.clock.advance(10 * MINUTE)
    joined = await rig.dispatcher.handle(task_reply(cast, task, "still there?"))
    await rig.quiet()
    assert (joined.outcome, joined.conversation_id) == (Outcome.SCHEDULED, second.conversation_id)

    await rig.manager.end_conversation(second.conversation_id or "", by="owner")
    assert await rig.manager.delete_conversation(second.conversation_id or "")
    rig.clock.advance(48 * HOUR)
    third = await rig.dispatcher.handle(task_reply(cast, task, "new work"))
    await rig.settle()
    assert third.outcome is Outcome.SCHEDULED
    assert third.conversation_id not in (task.id, second.conversation_id)
    session = await conversation(rig, third.conversation_id)
    assert (session.task_id, session.previous_session) == (task.id, None)
    assert await rig.store.get_meta(task_meta_key(task.id)) == third.conversation_id


async def test_a_session_started_after_the_current_one_was_deleted_keeps_the_tasks_title(cast: Cast) -> None:
    """When a task's current session was deleted and its first is still stored, the session the next reply
    starts keeps the title the person gave the task and links back to the first session."""
    rig, _ = rig_for(cast, task_session_ttl_h=24)
    task, second = await task_in_its_second_session(rig, cast, [["title", "Login bug"]])
    await rig.manager.end_conversation(second.conversation_id or "", by="owner")
    assert await rig.manager.delete_conversation(second.conversation_id or "")

    rig.clock.advance(MINUTE)
    third = await rig.dispatcher.handle(task_reply(cast, task, "new work"))
    await rig.settle()

    session = await conversation(rig, third.conversation_id)
    assert session.id not in (task.id, second.conversation_id)
    assert (session.title, session.title_source) == ("Login bug", TitleSource.TAG)
    assert session.previous_session == task.id


@pytest.mark.parametrize(("hours", "same"), [(23.9, True), (24.1, False)])
async def test_the_task_ttl_boundary(cast: Cast, hours: float, same: bool) -> None:
    """Just under the TTL the session continues; just over it a new one starts."""
    rig, _ = rig_for(cast, task_session_ttl_h=24)
    task = cast.user_says("Write the docs", kind=KIND_TASK, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(task)
    await rig.quiet()
    session = await conversation(rig, task.id)
    rig.clock.advance(int(hours * HOUR) - (rig.clock.now_ms() - session.last_activity))

    result = await rig.dispatcher.handle(task_reply(cast, task, "status?"))

    assert (result.conversation_id == task.id) is same


async def test_a_late_reply_to_a_deleted_conversation_does_not_bring_it_back(cast: Cast) -> None:
    """Once a conversation is deleted (retention, an operator), a reply to its root is ignored with the
    reason, marked processed, and the conversation stays gone."""
    rig, backend = rig_for(cast)
    root = cast.user_says("old topic", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await rig.quiet()
    await rig.manager.end_conversation(root.id, by="owner")
    assert await rig.manager.delete_conversation(root.id, only_ended=True)

    late = cast.user_says("one more", kind=1, tags=[["e", root.id, "", "root"], ["p", cast.alice.pubkey]])
    result = await rig.dispatcher.handle(late)

    assert result.outcome is Outcome.IGNORED
    assert result.reason == "conversation_deleted"
    assert await rig.manager.get_conversation(root.id) is None
    assert await rig.store.is_processed(late.id)
    assert len(backend.requests) == 1


async def test_retention_never_deletes_a_conversation_reopened_meanwhile(cast: Cast) -> None:
    """delete_conversation(only_ended=True) checks under the lock: a conversation a message reopened is kept."""
    rig, _ = rig_for(cast)
    first = await rig.dispatcher.handle(note_to(cast, "one", cast.alice.pubkey))
    await rig.quiet()
    cid = first.conversation_id
    assert cid is not None
    await rig.manager.end_conversation(cid, by="owner")
    reply = cast.user_says("back again", kind=1, tags=[["e", cid, "", "root"], ["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(reply)
    await rig.quiet()

    assert not await rig.manager.delete_conversation(cid, only_ended=True)
    assert await rig.manager.get_conversation(cid) is not None


class SlowStreamer:
    """Streams "Working" at once, answers "done" a moment later, or holds its answer while ``hold`` is
    set until ``release``; records whether a call was cancelled."""

    name = "slow"

    def __init__(self, hold: bool = False) -> None:
        self.hold = hold
        self.asked = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = False

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Stream, wait, answer."""
        if request.on_chunk is not None:
            await request.on_chunk("Working")
        self.asked.set()
        try:
            await (self.release.wait() if self.hold else asyncio.sleep(0.05))
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return CompletionResult(text="done", model="slow")


@dataclass
class ThreadLog:
    """Records the thread each partial reply and each live status names."""

    partial_threads: list[str] = field(default_factory=list)
    status_roots: list[str] = field(default_factory=list)

    async def partial(
        self, agent_slug: str, conversation_id: str, trigger_id: str, text: str, sequence: int
    ) -> None:
        """Record the partial's thread."""
        self.partial_threads.append(conversation_id)

    async def working(
        self, conversation_id: str, root_id: str, person: str | None, agents: tuple[str, ...]
    ) -> None:
        """Record the status's root."""
        self.status_roots.append(root_id)


async def later_session(rig: pipeline.Rig, cast: Cast, task: NostrEvent, content: str) -> tuple[NostrEvent, str]:
    """Start the task, let its session expire, and write ``content`` in its thread: (that message, the new
    session's id)."""
    await rig.dispatcher.handle(task)
    await rig.quiet()
    rig.clock.advance(25 * HOUR)
    message = task_reply(cast, task, content)
    result = await rig.dispatcher.handle(message)
    assert result.conversation_id is not None
    assert result.conversation_id != task.id
    return message, result.conversation_id


async def test_a_later_task_sessions_reply_typing_partials_and_status_stay_in_the_tasks_thread(cast: Cast) -> None:
    """A task's later session starts at the person's comment, but the agent's reply takes the task as its
    NIP-22 root (E, K 1934, P: it shows in the task's thread, parent e the comment), and its typing
    indicators, partial replies and live status name the task."""
    log = ThreadLog()
    rig = pipeline.build_rig(
        cast,
        backend=SlowStreamer(),
        composer=pipeline.real_composer(cast),
        partials=log,
        status=log,
        partial_interval_s=0.01,
        task_session_ttl_h=24,
    )
    task = cast.user_says("Fix the login bug", kind=KIND_TASK, tags=[["p", cast.alice.pubkey]])
    message, session = await later_session(rig, cast, task, "is it fixed?")
    await rig.settle()

    reply = rig.publisher.published[-1]
    assert reply.content == "done"
    assert reply.kind == 1111
    assert reply.tags[:4] == [["E", task.id, "", task.pubkey], ["K", str(KIND_TASK)], ["P", task.pubkey],
                              ["e", message.id, "", cast.user.pubkey]]
    assert (await conversation(rig, session)).contains_event(reply.id)
    assert set(rig.publisher.typing_threads) == {task.id}
    assert log.partial_threads
    assert set(log.partial_threads) == {task.id}
    assert set(log.status_roots) == {task.id}


async def test_a_stop_naming_the_task_stops_the_run_of_its_current_session(cast: Cast) -> None:
    """Clients name a task's thread: a stop whose e is the task cancels the run in the task's current
    session (not the archived first one, where nothing runs)."""
    backend = SlowStreamer()
    rig = pipeline.build_rig(cast, backend=backend, task_session_ttl_h=24)
    task = cast.user_says("Fix the login bug", kind=KIND_TASK, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(task)
    await rig.quiet()
    backend.hold = True
    backend.asked.clear()
    rig.clock.advance(25 * HOUR)
    result = await rig.dispatcher.handle(task_reply(cast, task, "is it fixed?"))
    await asyncio.wait_for(backend.asked.wait(), 5)

    stop = cast.factory.event(cast.user, "", kind=KIND_STOP, tags=[["e", task.id]])
    stopped = await rig.dispatcher.handle(stop)
    await rig.settle()

    assert stopped.agents == ("alice",)
    assert stopped.conversation_id == result.conversation_id
    assert backend.cancelled


async def test_a_conversation_started_by_a_comment_whose_root_is_unknown_replies_in_that_roots_thread(
    cast: Cast,
) -> None:
    """A comment whose root cannot be fetched starts a conversation rooted at itself; the agent's reply names
    the thread's root the comment names (as NIP-22 has a reply to a comment keep its root, so clients show
    it in that thread), and the person's answer to that reply (copying its root) continues the same
    conversation."""
    rig = pipeline.build_rig(cast, backend=SlowStreamer(), composer=pipeline.real_composer(cast))
    unknown = "ab" * 32
    comment = cast.user_says(
        "picking this up", tags=[["E", unknown, "", cast.user.pubkey], ["K", "11"], ["e", unknown], ["p", cast.alice.pubkey]]
    )
    first = await rig.dispatcher.handle(comment)
    await rig.quiet()
    reply = rig.publisher.published[-1]
    answer = cast.user_says(
        "thanks", tags=[["E", unknown, "", cast.user.pubkey], ["K", "11"], ["e", reply.id], ["p", cast.alice.pubkey]]
    )
    second = await rig.dispatcher.handle(answer)
    await rig.settle()

    assert first.conversation_id == comment.id
    assert reply.tags[:3] == [["E", unknown, "", cast.user.pubkey], ["K", "11"], ["P", cast.user.pubkey]]
    assert second.conversation_id == comment.id


async def test_an_agent_s_end_of_the_conversation_is_saved_with_its_reply(cast: Cast) -> None:
    """An agent's end_conversation is recorded in the same write as its reply: with every later write of
    the conversation failing (a crash right after the reply), the stored conversation holds the reply and
    is ended by the agent, with its reason."""
    from tenex_daemon import MemoryStore
    from tests.unit.services.test_tool_loop import calls, text

    class NoSecondWrite(MemoryStore):
        armed = False

        async def save_state(self, conversation: Conversation) -> None:
            if self.armed:
                raise OSError("the daemon died here")
            await super().save_state(conversation)

    store = NoSecondWrite()
    backend = ScriptedBackend([calls(("c1", "end_conversation", {"reason": "all done"})), text("Bye!")])
    rig = pipeline.build_rig(cast, backend=backend, store=store)
    root = cast.user_says("thanks, that is all", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.manager.create_conversation(root)
    store.armed = True

    await rig.runner.run(RunRequest(root.id, root.id, "alice"))

    stored = await store.load(root.id)
    assert stored is not None
    assert [e.content for e in stored.history] == ["thanks, that is all", "Bye!"]
    assert (stored.is_ended, stored.ended_by, stored.end_reason) == (True, "alice", "all done")


class EndsWhenReleased:
    """Alice's model: her first run is held until ``release``, then ends the conversation and says "Goodbye!";
    each later run answers the newest message."""

    name = "ends"

    def __init__(self) -> None:
        self.requests: list[CompletionRequest] = []
        self.asked, self.release = asyncio.Event(), asyncio.Event()

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Answer as the class says."""
        from tests.unit.services.test_tool_loop import calls, text

        self.requests.append(request)
        if len(self.requests) == 1:
            self.asked.set()
            await self.release.wait()
            return calls(("c1", "end_conversation", {"reason": "done"}))
        if len(self.requests) == 2:
            return text("Goodbye!")
        return text(f"answer to: {request.messages[-1].content}")


async def test_an_agents_end_does_not_end_a_conversation_a_person_wrote_in_after_what_it_answered(
    cast: Cast,
) -> None:
    """A person writes "one more question" while Alice, answering their "that's all", ends the conversation:
    the end is not recorded (the new message waits for its answer), so the answer goes into an open
    conversation and the person's next note a minute later continues it."""
    backend = EndsWhenReleased()
    rig = pipeline.build_rig(cast, backend=backend)
    first = await rig.dispatcher.handle(note(cast, "thanks, that's all"))
    await asyncio.wait_for(backend.asked.wait(), 5)
    rig.clock.advance(1_000)
    second = await rig.dispatcher.handle(note(cast, "oh wait, one more question!"))
    backend.release.set()
    await rig.quiet()
    rig.clock.advance(60_000)
    third = await rig.dispatcher.handle(note(cast, "and after that?"))
    await rig.quiet()

    conversation = await rig.manager.get_conversation(first.conversation_id or "")
    assert conversation is not None
    assert second.conversation_id == third.conversation_id == first.conversation_id
    assert not conversation.is_ended
    assert [e.content for e in conversation.history][:4] == [
        "thanks, that's all", "oh wait, one more question!", "Goodbye!", "answer to: oh wait, one more question!"
    ]


class PointerWriteFails(MemoryStore):
    """A store whose next write of a pointer (a small value whose key starts with ``armed``) fails once, as a
    crash right after the conversation it points to was created would leave it."""

    def __init__(self) -> None:
        super().__init__()
        self.armed: str | None = None

    async def set_meta(self, key: str, value: str) -> None:
        if self.armed is not None and key.startswith(self.armed):
            self.armed = None
            raise OSError("the process died here")
        await super().set_meta(key, value)


def note(cast: Cast, text: str) -> NostrEvent:
    """The person's kind-1 note to Alice (a channel's)."""
    return cast.user_says(text, kind=1, tags=[["p", cast.alice.pubkey]])


async def a_channel_conversation_without_its_pointer(
    cast: Cast,
) -> tuple[pipeline.Rig, PointerWriteFails, HandleResult, NostrEvent]:
    """A channel's first conversation, then (31 minutes on) a note that starts its second, whose pointer write
    fails as a crash right after its creation would leave it: (rig, store, the first note's result, the
    second note)."""
    store = PointerWriteFails()
    rig = pipeline.build_rig(cast, store=store)
    first = await rig.dispatcher.handle(note(cast, "topic one"))
    await rig.quiet()
    rig.clock.advance(31 * MINUTE)
    store.armed = "channel."
    second = note(cast, "topic two, part 1")
    with pytest.raises(OSError, match="died"):
        await rig.dispatcher.handle(second)
    return rig, store, first, second


async def test_a_channel_conversation_whose_pointer_was_never_written_becomes_the_channels_on_redelivery(
    cast: Cast,
) -> None:
    """A new channel conversation is created but its pointer write fails (a crash): when the note comes again
    its dispatch is redone, the pointer is written then, and the person's next note a minute later joins
    that conversation rather than starting a third."""
    rig, _, first, second = await a_channel_conversation_without_its_pointer(cast)
    again = await rig.dispatcher.handle(second)  # the relay pool hands it over again
    await rig.quiet()
    rig.clock.advance(MINUTE)
    third = await rig.dispatcher.handle(note(cast, "topic two, part 2"))
    await rig.settle()

    assert first.conversation_id != second.id
    assert (again.outcome, again.conversation_id) == (Outcome.SCHEDULED, second.id)
    assert third.conversation_id == second.id


async def test_a_task_session_whose_pointer_was_never_written_becomes_the_tasks_current_on_redelivery(
    cast: Cast,
) -> None:
    """A task's next session is created but its pointer write fails (a crash): once its event's dispatch is
    redone the session is the task's current one, so the task's next event joins it, not a third session."""
    store = PointerWriteFails()
    rig = pipeline.build_rig(cast, store=store, task_session_ttl_h=24)
    task = cast.user_says("Fix the login bug", kind=KIND_TASK, tags=[["p", cast.alice.pubkey]])

    def reply(text: str) -> NostrEvent:
        tags = [["E", task.id, "", cast.user.pubkey], ["K", str(KIND_TASK)], ["e", task.id], ["k", str(KIND_TASK)],
                ["p", cast.alice.pubkey]]
        return cast.user_says(text, tags=tags)

    await rig.dispatcher.handle(task)
    await rig.quiet()
    rig.clock.advance(25 * HOUR)
    session = reply("is it fixed?")
    store.armed = "task."
    with pytest.raises(OSError, match="died"):
        await rig.dispatcher.handle(session)
    await rig.dispatcher.handle(session)
    await rig.quiet()
    rig.clock.advance(HOUR)
    later = await rig.dispatcher.handle(reply("and the signup bug?"))
    await rig.settle()

    assert await store.get_meta(task_meta_key(task.id)) == session.id
    assert later.conversation_id == session.id


async def test_a_note_whose_channel_conversation_got_a_reply_as_it_was_being_ended_joins_it(cast: Cast) -> None:
    """The channel's conversation looks idle to a new note, but a reply in its thread comes just before the
    idle end: it is not ended, and the note joins it (before, a second open conversation was started in
    the channel)."""
    store = WriteBeforeLease()
    rig = pipeline.build_rig(cast, store=store)
    first = await rig.dispatcher.handle(cast.user_says("topic one", kind=1, tags=[["p", cast.alice.pubkey]]))
    await rig.quiet()
    assert first.conversation_id is not None
    rig.clock.advance(31 * MINUTE)
    in_thread = cast.user_says("one more thing", tags=[["e", first.conversation_id, "", "root"]])
    store.write_before(first.conversation_id, in_thread, rig.clock.now)

    note = await rig.dispatcher.handle(cast.user_says("topic one, later", kind=1, tags=[["p", cast.alice.pubkey]]))
    await rig.settle()

    assert note.conversation_id == first.conversation_id
    conversation = await rig.manager.get_conversation(first.conversation_id)
    assert conversation is not None
    assert not conversation.is_ended


async def test_a_note_to_a_channel_whose_run_outlasts_the_idle_timeout_joins_that_conversation(cast: Cast) -> None:
    """The channel conversation's run is still under way 31 minutes after the note that started it (a slow
    run, or one recovered after downtime): the person's next note joins that conversation, where the
    answer is still to come, rather than ending it and starting another."""
    backend = GatedBackend()
    rig = pipeline.build_rig(cast, backend=backend)
    first = await rig.dispatcher.handle(cast.user_says("a long job", kind=1, tags=[["p", cast.alice.pubkey]]))
    await backend.asked.wait()
    rig.clock.advance(31 * MINUTE)

    later = await rig.dispatcher.handle(cast.user_says("and another thing", kind=1, tags=[["p", cast.alice.pubkey]]))
    backend.release.set()
    await rig.settle()

    assert later.conversation_id == first.conversation_id
    assert first.conversation_id is not None
    conversation = await rig.manager.get_conversation(first.conversation_id)
    assert conversation is not None
    assert not conversation.is_ended


async def test_after_a_crash_the_channel_pointer_is_written_before_new_notes_come(cast: Cast) -> None:
    """The process dies between a channel conversation's creation and its pointer's write; at the next start
    the pointer is written while the interrupted dispatches are looked at, before the subscription brings
    anything, so the person's next note joins that conversation even if it comes before the redone
    dispatch."""
    rig, store, _, second = await a_channel_conversation_without_its_pointer(cast)

    restarted = pipeline.build_rig(cast, store=store, clock=rig.clock)
    await restarted.scheduler.recover()
    redo = await restarted.dispatcher.stored_dispatches(restarted.scheduler.dispatches_to_redo())
    rig.clock.advance(MINUTE)
    third = await restarted.dispatcher.handle(note(cast, "topic two, part 2"))
    for event_id in redo:
        await restarted.dispatcher.redispatch(event_id)
    await restarted.settle()

    assert redo == [second.id]
    assert third.conversation_id == second.id
