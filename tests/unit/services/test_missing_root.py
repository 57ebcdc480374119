"""A reply whose root cannot be found (docs/PROTOCOL.md, "Tags tenexd reads"): it starts the conversation,
the agents' replies keep the thread's root as NIP-22 clients show it, and the thread's later replies join
that conversation rather than each starting one."""

from __future__ import annotations

import asyncio

from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.vocabulary import KIND_COMMENT, KIND_STOP
from tenex_daemon.services.dispatcher import Outcome
from tests import pipeline
from tests.conftest import Cast
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


async def test_a_thread_whose_root_is_missing_stays_one_conversation_in_its_own_thread(cast: Cast) -> None:
    """The first comment starts the conversation; Alice's reply names the missing root as its root (E, K 11,
    P), the comment as its parent, and its typing names the thread; a second comment, replying to the first,
    joins the same conversation, and Alice's second run is shown both messages."""
    rig = pipeline.build_rig(cast, fetcher=NothingFound(), composer=pipeline.real_composer(cast))
    first = comment(cast, "What about the budget?", MISSING_ROOT)

    started = await rig.dispatcher.handle(first)
    await rig.quiet()
    second = comment(cast, "And the dates?", first.id)
    joined = await rig.dispatcher.handle(second)
    await rig.settle()

    assert started.outcome is Outcome.SCHEDULED
    assert (joined.outcome, joined.conversation_id) == (Outcome.SCHEDULED, first.id)
    conversation = await rig.manager.get_conversation(first.id)
    assert conversation is not None
    assert conversation.thread_id == MISSING_ROOT
    replies = [e for e in rig.publisher.published if e.pubkey == cast.alice.pubkey]
    assert len(replies) == 2
    for reply, trigger in zip(replies, (first, second), strict=True):
        assert reply.kind == KIND_COMMENT
        assert reply.tags[:5] == [
            ["E", MISSING_ROOT, "", cast.user.pubkey], ["K", "11"], ["P", cast.user.pubkey],
            ["e", trigger.id, "", cast.user.pubkey], ["k", "1111"],
        ]
    assert set(rig.publisher.typing_threads) == {MISSING_ROOT}
    assert [e.id for e in conversation.history] == [first.id, replies[0].id, second.id, replies[1].id]
    assert await rig.manager.get_conversation(second.id) is None


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
