"""Stops and threads reaching a conversation by another id than its root's. A reply whose root cannot be found (docs/PROTOCOL.md, "Tags tenexd reads"): it starts the conversation,
the agents' replies keep the thread's root as NIP-22 clients show it, and the thread's later replies join
that conversation rather than each starting one."""

from __future__ import annotations

import asyncio

from tenex_daemon.app.control.views import conversation_json
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.vocabulary import KIND_COMMENT, KIND_NOTE, KIND_STOP, KIND_TASK
from tenex_daemon.services.dispatcher import Outcome
from tenex_daemon.testing import FakeClock
from tests import pipeline
from tests.conftest import Cast
from tests.unit.services.test_live_status import StatusLog
from tests.unit.services.test_stopping import GatedBackend

MISSING_ROOT = "ab" * 32


class NothingFound:
    """Relays that hold no event."""

    async def fetch_event(self, event_id: str) -> NostrEvent | None:
        """Nothing."""
        return None


def comment(cast: Cast, text: str, parent_id: str) -> NostrEvent:
    """The person's NIP-22 comment in the thread of the missing kind-11 root, replying to ``parent_id``."""
    tags = [
        ["E", MISSING_ROOT, "", cast.user.pubkey], ["K", "11"], ["P", cast.user.pubkey],
        ["e", parent_id, "", cast.user.pubkey], ["k", "11" if parent_id == MISSING_ROOT else "1111"],
        ["p", cast.alice.pubkey],
    ]
    return cast.factory.event(cast.user, text, kind=KIND_COMMENT, tags=tags)


async def two_replies_in_one_conversation(
    rig: pipeline.Rig, cast: Cast, first: NostrEvent, second: NostrEvent
) -> list[NostrEvent]:
    """Take in ``first`` (a reply naming the missing root: it starts a conversation whose thread is that
    root) and then ``second`` (the thread's next reply: it joins it); return Alice's two replies."""
    started = await rig.dispatcher.handle(first)
    await rig.quiet()
    joined = await rig.dispatcher.handle(second)
    await rig.settle()
    assert started.outcome is Outcome.SCHEDULED
    assert (joined.outcome, joined.conversation_id) == (Outcome.SCHEDULED, first.id)
    conversation = await rig.manager.get_conversation(first.id)
    assert conversation is not None
    assert conversation.thread_id == MISSING_ROOT
    replies = [e for e in rig.publisher.published if e.pubkey == cast.alice.pubkey]
    assert len(replies) == 2
    return replies


async def test_a_thread_whose_root_is_missing_stays_one_conversation_in_its_own_thread(cast: Cast) -> None:
    """The first comment starts the conversation; Alice's reply names the missing root as its root (E, K 11,
    P), the comment as its parent, and its typing names the thread; a second comment, replying to the first,
    joins the same conversation, and Alice's second run is shown both messages."""
    rig = pipeline.build_rig(cast, fetcher=NothingFound(), composer=pipeline.real_composer(cast))
    first = comment(cast, "What about the budget?", MISSING_ROOT)
    second = comment(cast, "And the dates?", first.id)

    replies = await two_replies_in_one_conversation(rig, cast, first, second)

    for reply, trigger in zip(replies, (first, second), strict=True):
        assert reply.kind == KIND_COMMENT
        assert reply.tags[:5] == [
            ["E", MISSING_ROOT, "", cast.user.pubkey], ["K", "11"], ["P", cast.user.pubkey],
            ["e", trigger.id, "", cast.user.pubkey], ["k", "1111"],
        ]
    assert set(rig.publisher.typing_threads) == {MISSING_ROOT}
    conversation = await rig.manager.get_conversation(first.id)
    assert conversation is not None
    assert [e.id for e in conversation.history] == [first.id, replies[0].id, second.id, replies[1].id]
    assert await rig.manager.get_conversation(second.id) is None


def note_reply(cast: Cast, text: str, parent_id: str) -> NostrEvent:
    """The person's kind-1 NIP-10 reply in the thread of the missing kind-1 root, replying to ``parent_id``."""
    tags = [["e", MISSING_ROOT, "", "root"], ["e", parent_id, "", "reply"], ["p", cast.alice.pubkey]]
    return cast.factory.event(cast.user, text, kind=KIND_NOTE, tags=tags)


async def test_a_kind_1_thread_whose_root_is_missing_is_answered_in_that_thread(cast: Cast) -> None:
    """A kind-1 reply whose thread root no relay has starts the conversation: Alice's replies name the missing
    root with marker root and the trigger with marker reply (NIP-10), and her typing and live status name the
    thread's root, never the trigger; the thread's next reply joins the conversation."""
    status = StatusLog()
    rig = pipeline.build_rig(cast, fetcher=NothingFound(), composer=pipeline.real_composer(cast), status=status)
    first = note_reply(cast, "What about the budget?", "cd" * 32)
    second = note_reply(cast, "And the dates?", first.id)

    replies = await two_replies_in_one_conversation(rig, cast, first, second)

    for reply, trigger in zip(replies, (first, second), strict=True):
        assert reply.kind == KIND_NOTE
        threading = [t for t in reply.tags if t[0] == "e"]
        assert threading == [["e", MISSING_ROOT, "", "root"], ["e", trigger.id, "", "reply"]]
    assert set(rig.publisher.typing_threads) == {MISSING_ROOT}
    assert status.sent
    assert {root for _, root, _, _ in status.sent} == {MISSING_ROOT}


async def test_a_stop_naming_the_missing_root_stops_the_conversation_it_started(cast: Cast) -> None:
    """A client names the thread it shows, the missing root: a stop (24134) naming it stops Alice's run in
    the conversation the first comment started, as the live status named that root."""
    backend = GatedBackend()
    rig = pipeline.build_rig(cast, backend=backend, fetcher=NothingFound(), composer=pipeline.real_composer(cast))
    first = comment(cast, "What about the budget?", MISSING_ROOT)
    await rig.dispatcher.handle(first)
    await asyncio.wait_for(backend.asked.wait(), 5)

    stop = cast.factory.event(cast.user, "", kind=KIND_STOP, tags=[["e", MISSING_ROOT]])
    result = await rig.dispatcher.handle(stop)
    await rig.settle()

    assert (result.outcome, result.conversation_id, result.agents) == (Outcome.STORED, first.id, ("alice",))
    assert backend.cancelled
    assert [e.content for e in rig.publisher.published] == ["Stopped: Alice."]


async def test_a_whitelisted_task_author_may_stop_the_tasks_later_session(cast: Cast) -> None:
    """Who may stop a task's later session is decided by the task's thread, as who may write into it: the
    whitelisted person who wrote the task stops the run of a session the owner's comment started."""
    backend = GatedBackend()
    rig = pipeline.build_rig(
        cast, backend=backend, whitelist=[cast.other_user.pubkey], task_session_ttl_h=1, clock=FakeClock()
    )
    task = cast.factory.event(cast.other_user, "Fix the login bug", kind=KIND_TASK, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(task)
    await asyncio.wait_for(backend.asked.wait(), 5)
    backend.release.set()
    await rig.quiet()
    rig.clock.advance(2 * 3600 * 1000)
    backend.asked.clear()
    backend.release.clear()
    backend.requests.clear()  # the next call is the first again: it waits to be released
    comment = [["E", task.id, "", task.pubkey], ["K", str(KIND_TASK)], ["e", task.id], ["p", cast.alice.pubkey]]
    later = await rig.dispatcher.handle(cast.user_says("is it fixed?", tags=comment))
    await asyncio.wait_for(backend.asked.wait(), 5)

    stop = cast.factory.event(cast.other_user, "", kind=KIND_STOP, tags=[["e", task.id]])
    result = await rig.dispatcher.handle(stop)
    await rig.settle()

    assert later.conversation_id != task.id  # a later session
    assert (result.outcome, result.conversation_id, result.agents) == (
        Outcome.STORED, later.conversation_id, ("alice",)
    )


async def test_a_late_reply_in_a_deleted_thread_whose_root_was_missing_does_not_bring_it_back(cast: Cast) -> None:
    """Once the conversation a thread's first comment started is deleted (retention, an operator), a later
    reply naming the same missing root is ignored as ``conversation_deleted``, as for any deleted thread."""
    rig = pipeline.build_rig(cast, fetcher=NothingFound(), composer=pipeline.real_composer(cast))
    first = comment(cast, "What about the budget?", MISSING_ROOT)
    await rig.dispatcher.handle(first)
    await rig.quiet()
    assert await rig.manager.delete_conversation(first.id)

    late = await rig.dispatcher.handle(comment(cast, "Still there?", first.id))
    await rig.settle()

    assert (late.outcome, late.reason) == (Outcome.IGNORED, "conversation_deleted")
    assert await rig.manager.get_conversation(first.id) is None


class Holding:
    """Relays that hold one event."""

    def __init__(self, event: NostrEvent) -> None:
        self.event = event

    async def fetch_event(self, event_id: str) -> NostrEvent | None:
        """The event held, when asked for."""
        return self.event if event_id == self.event.id else None


async def test_a_task_first_seen_through_a_comment_is_worked_on_in_sessions(cast: Cast) -> None:
    """A comment on a task (K 1934) the daemon never saw makes the task's first session, whether the relays
    hold the task (fetched) or not (the comment starts it): the conversation is the task's, and a comment
    after the session expired starts the next session, linked to the first."""
    task = cast.factory.event(cast.user, "Fix the login bug", kind=KIND_TASK, tags=[["p", cast.alice.pubkey]])
    for fetcher in (Holding(task), NothingFound()):
        rig = pipeline.build_rig(cast, fetcher=fetcher, task_session_ttl_h=1, clock=FakeClock())
        thread = [["E", task.id, "", task.pubkey], ["K", str(KIND_TASK)], ["e", task.id], ["p", cast.alice.pubkey]]
        first = await rig.dispatcher.handle(cast.user_says("any news?", tags=thread))
        await rig.quiet()
        session = await rig.manager.get_conversation(first.conversation_id or "")
        assert session is not None
        assert (session.task_id, session.thread_id) == (task.id, task.id)

        rig.clock.advance(2 * 3600 * 1000)
        later = await rig.dispatcher.handle(cast.user_says("and now?", tags=thread))
        await rig.settle()
        assert later.conversation_id not in (None, session.id)
        following = await rig.manager.get_conversation(later.conversation_id or "")
        assert following is not None
        assert (following.task_id, following.previous_session) == (task.id, session.id)
        assert conversation_json(following)["is_task"]  # the API says so of every session of a task


async def test_a_fetched_root_that_is_itself_a_reply_keeps_its_own_thread(cast: Cast) -> None:
    """A kind-1 note naming as its root a note the relays give (found, not missing), which itself replies
    in another thread: the conversation is that note's, the agent's replies name it as their root, and the
    next reply naming it joins the conversation (only a root no relay gave is replaced by the one its
    first event names)."""
    elsewhere = "ef" * 32
    fetched = cast.factory.event(
        cast.user, "An older note", kind=KIND_NOTE, tags=[["e", elsewhere, "", "root"], ["p", cast.alice.pubkey]]
    )
    rig = pipeline.build_rig(cast, fetcher=Holding(fetched), composer=pipeline.real_composer(cast))
    first = cast.factory.event(
        cast.user, "About that note", kind=KIND_NOTE, tags=[["e", fetched.id, "", "reply"], ["p", cast.alice.pubkey]]
    )
    started = await rig.dispatcher.handle(first)
    await rig.quiet()
    follow = note_reply_in(cast, fetched.id, "And more", started.conversation_id or "")
    joined = await rig.dispatcher.handle(follow)
    await rig.settle()

    assert started.conversation_id == joined.conversation_id == fetched.id
    conversation = await rig.manager.get_conversation(fetched.id)
    assert conversation is not None
    assert conversation.thread_id == fetched.id
    replies = [e for e in rig.publisher.published if e.pubkey == cast.alice.pubkey]
    assert replies
    assert all(["e", fetched.id, "", "root"] in reply.tags for reply in replies)


def note_reply_in(cast: Cast, root_id: str, text: str, parent_id: str) -> NostrEvent:
    """The person's kind-1 reply in the thread rooted at ``root_id``, replying to ``parent_id``."""
    tags = [["e", root_id, "", "root"], ["e", parent_id, "", "reply"], ["p", cast.alice.pubkey]]
    return cast.factory.event(cast.user, text, kind=KIND_NOTE, tags=tags)


async def test_a_root_that_comes_after_its_reply_joins_the_conversation_the_reply_started(cast: Cast) -> None:
    """A person's kind-11 root, not found on the relays when its comment came, arrives later: it joins the
    conversation the comment started (written when it was), no second conversation is made for the thread
    (both would describe it to clients), and no agent runs again for it, nor when its dispatch is redone
    after a crash."""
    rig = pipeline.build_rig(cast, fetcher=NothingFound())
    root = cast.user_says("Plan the launch", kind=11, tags=[["p", cast.alice.pubkey]])
    tags = [["E", root.id, "", cast.user.pubkey], ["K", "11"], ["P", cast.user.pubkey],
            ["e", root.id, "", cast.user.pubkey], ["k", "11"], ["p", cast.alice.pubkey]]
    reply = cast.factory.event(cast.user, "What about the budget?", kind=KIND_COMMENT, tags=tags)
    started = await rig.dispatcher.handle(reply)
    await rig.settle()

    late = await rig.dispatcher.handle(root)
    await rig.settle()

    assert started.outcome is Outcome.SCHEDULED
    assert (late.outcome, late.reason, late.conversation_id) == (Outcome.STORED, "late_root", reply.id)
    assert await rig.manager.get_conversation(root.id) is None
    conversation = await rig.manager.get_conversation(reply.id)
    assert conversation is not None
    assert root.id in [event.id for event in conversation.history]
    assert len([e for e in rig.publisher.published if e.pubkey == cast.alice.pubkey]) == 1
    redone = await rig.dispatcher.redispatch(root.id)  # a crash before its dispatch was journaled as done
    await rig.settle()
    assert (redone.outcome, redone.reason) == (Outcome.STORED, "late_root")
    assert len([e for e in rig.publisher.published if e.pubkey == cast.alice.pubkey]) == 1
