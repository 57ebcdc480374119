"""ConversationManager: creation, idempotent events, archive/restore, search, concurrency."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

from tenex_daemon import (
    ConversationArchivedError,
    ConversationManager,
    ConversationNotFoundError,
    InvalidEventError,
    NostrEvent,
    Phase,
    UnknownAgentError,
)
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.core.conversation import Conversation, TitleSource
from tenex_daemon.testing import FakeClock, FakeResolver, sign_event
from tests.conftest import Cast


async def test_title_comes_from_the_title_tag(manager: ConversationManager, cast: Cast) -> None:
    """A root's title tag names the conversation (the person's title: source "tag"); no summary yet; chat."""
    root = cast.user_says("Let's design the API", kind=11, tags=[["title", "API design"]])

    conversation = await manager.create_conversation(root)

    assert conversation.id == root.id
    assert conversation.title == "API design"
    assert conversation.title_source is TitleSource.TAG
    assert conversation.summary is None
    assert conversation.phase is Phase.CHAT
    assert conversation.history == [root]


async def test_untitled_conversation(manager: ConversationManager, cast: Cast) -> None:
    """A root without a title tag gives "Untitled Conversation"."""
    conversation = await manager.create_conversation(cast.user_says("no title", kind=11))
    assert conversation.title == "Untitled Conversation"


async def test_create_is_idempotent(manager: ConversationManager, cast: Cast) -> None:
    """Creating from the same root twice returns the stored conversation with one event."""
    root = cast.user_says("once", kind=11)
    await manager.create_conversation(root)
    again = await manager.create_conversation(root)
    assert len(again.history) == 1


async def test_article_reference_is_fetched(
    manager: ConversationManager, cast: Cast, resolver: FakeResolver
) -> None:
    """An a tag 30023:<pubkey>:<d> makes the resolved article the referenced article."""
    article = cast.factory.event(
        cast.other_user, "# Spec\nDetails", kind=30023, tags=[["d", "spec-v1"], ["title", "The Spec"]]
    )
    resolver.add(article, f"30023:{cast.other_user.pubkey}:spec-v1")
    root = cast.user_says("Implement this", kind=11, tags=[["a", f"30023:{cast.other_user.pubkey}:spec-v1"]])

    conversation = await manager.create_conversation(root)

    referenced = conversation.metadata.referenced_article
    assert referenced is not None
    assert (referenced.title, referenced.content, referenced.identifier) == (
        "The Spec",
        "# Spec\nDetails",
        "spec-v1",
    )


async def test_article_title_falls_back_to_context_d(
    manager: ConversationManager, cast: Cast, resolver: FakeResolver
) -> None:
    """An article without a title tag is titled "Context: <d>"."""
    article = cast.factory.event(cast.other_user, "body", kind=30023, tags=[["d", "notes"]])
    resolver.add(article, f"30023:{cast.other_user.pubkey}:notes")
    root = cast.user_says("see", kind=11, tags=[["a", f"30023:{cast.other_user.pubkey}:notes"]])

    conversation = await manager.create_conversation(root)

    assert conversation.metadata.referenced_article is not None
    assert conversation.metadata.referenced_article.title == "Context: notes"


async def test_missing_article_leaves_no_reference(manager: ConversationManager, cast: Cast) -> None:
    """An article the resolver cannot find leaves referenced_article unset and creation succeeds."""
    root = cast.user_says("see", kind=11, tags=[["a", f"30023:{cast.other_user.pubkey}:gone"]])
    conversation = await manager.create_conversation(root)
    assert conversation.metadata.referenced_article is None


async def test_add_event_is_idempotent_by_id(manager: ConversationManager, cast: Cast) -> None:
    """The same event added twice is stored once; the second add returns False."""
    cid = (await manager.create_conversation(cast.user_says("root", kind=11))).id
    reply = cast.alice_says("reply")

    assert await manager.add_event(cid, reply) is True
    assert await manager.add_event(cid, reply) is False
    conversation = await manager.get_conversation(cid)
    assert conversation is not None
    assert [e.id for e in conversation.history].count(reply.id) == 1


async def test_late_event_is_appended_not_reordered(manager: ConversationManager, cast: Cast) -> None:
    """An event with an older created_at is appended at the end of history."""
    cid = (await manager.create_conversation(cast.user_says("root", kind=11))).id
    newer = cast.user_says("newer")
    from tenex_daemon.testing import sign_event

    older = sign_event(cast.user, "older", created_at=1)
    await manager.add_event(cid, newer)
    await manager.add_event(cid, older)

    conversation = await manager.get_conversation(cid)
    assert conversation is not None
    assert [e.content for e in conversation.history] == ["root", "newer", "older"]


async def test_forged_id_is_refused(manager: ConversationManager, cast: Cast) -> None:
    """An event whose id does not hash its content is refused with InvalidEventError."""
    cid = (await manager.create_conversation(cast.user_says("root", kind=11))).id
    good = cast.user_says("real")
    forged = NostrEvent.model_validate({**good.to_dict(), "content": "tampered"})

    with pytest.raises(InvalidEventError, match="does not match"):
        await manager.add_event(cid, forged)


async def test_unknown_conversation_and_agent_raise(manager: ConversationManager, cast: Cast) -> None:
    """Events for an unknown conversation and builds for an unknown agent raise clear errors."""
    root = cast.user_says("root", kind=11)
    with pytest.raises(ConversationNotFoundError, match="not found"):
        await manager.add_event("ff" * 32, root)
    cid = (await manager.create_conversation(root)).id
    with pytest.raises(UnknownAgentError, match="'nobody'"):
        await manager.build_agent_messages(cid, "nobody", root)


async def test_archived_conversation_is_read_only_until_restored(
    manager: ConversationManager, cast: Cast
) -> None:
    """An archived conversation loads but refuses events and phase changes until restored."""
    cid = (await manager.create_conversation(cast.user_says("root", kind=11))).id
    await manager.archive_conversation(cid)

    conversation = await manager.get_conversation(cid)
    assert conversation is not None
    assert conversation.archived
    with pytest.raises(ConversationArchivedError, match="restore it first"):
        await manager.add_event(cid, cast.user_says("late"))
    with pytest.raises(ConversationArchivedError):
        await manager.update_phase(cid, "plan", "x", "alice")

    await manager.restore_conversation(cid)
    assert await manager.add_event(cid, cast.user_says("after restore"))


async def test_search_by_title_phase_archived_date_and_participant(
    manager: ConversationManager, cast: Cast, clock: FakeClock
) -> None:
    """search_conversations filters by title (substring, fuzzy), phase, archived, date range and participant."""
    start = datetime.fromtimestamp(clock.now / 1000, tz=UTC)
    api = (
        await manager.create_conversation(cast.user_says("a", kind=11, tags=[["title", "REST API design"]]))
    ).id
    clock.advance(86_400_000)
    logo = (
        await manager.create_conversation(cast.user_says("b", kind=11, tags=[["title", "Logo ideas"]]))
    ).id
    await manager.add_event(logo, cast.alice_says("blue fox"))
    await manager.update_phase(logo, "brainstorm", "ideas", "alice")
    clock.advance(86_400_000)
    old = (await manager.create_conversation(cast.user_says("c", kind=11, tags=[["title", "Old stuff"]]))).id
    await manager.archive_conversation(old)

    by_title = await manager.search_conversations(title="api")
    fuzzy = await manager.search_conversations(title="logo idea")
    typo = await manager.search_conversations(title="desgin")
    by_phase = await manager.search_conversations(phase="brainstorm")
    archived = await manager.search_conversations(archived=True)
    active = await manager.search_conversations(archived=False)
    first_day = await manager.search_conversations(date_from=start, date_to=start + timedelta(hours=1))
    with_alice = await manager.search_conversations(participant=cast.alice.pubkey)

    assert [r.id for r in by_title] == [api]
    assert [r.id for r in fuzzy] == [logo]
    assert [r.id for r in typo] == [api]
    assert [r.id for r in by_phase] == [logo]
    assert [r.id for r in archived] == [old]
    assert {r.id for r in active} == {api, logo}
    assert [r.id for r in first_day] == [api]
    assert [r.id for r in with_alice] == [logo]


async def test_last_user_message_is_tracked(manager: ConversationManager, cast: Cast) -> None:
    """The newest user message is kept in metadata; agent messages do not change it."""
    cid = (await manager.create_conversation(cast.user_says("first", kind=11))).id
    await manager.add_event(cid, cast.user_says("second"))
    await manager.add_event(cid, cast.alice_says("agent talk"))

    conversation = await manager.get_conversation(cid)
    assert conversation is not None
    assert conversation.metadata.last_user_message == "second"


async def test_a_message_whose_write_fails_leaves_the_latest_message_as_it_was(cast: Cast) -> None:
    """When the store refuses a person's message, the conversation keeps its previous latest person
    message (the write changed nothing, in memory either)."""

    class RefusingStore(MemoryStore):
        refuse = False

        async def append_event(
            self, conversation_id: str, event: NostrEvent, *, state: Conversation | None = None
        ) -> bool:
            if self.refuse:
                raise OSError("disk full")
            return await super().append_event(conversation_id, event, state=state)

    store = RefusingStore()
    manager = ConversationManager(store, cast.agents, cast.project.pubkey, owner_pubkey=cast.user.pubkey)
    cid = (await manager.create_conversation(cast.user_says("first", kind=11))).id
    store.refuse = True

    with pytest.raises(OSError, match="disk full"):
        await manager.add_event(cid, cast.user_says("second"))

    conversation = await manager.get_conversation(cid)
    assert conversation is not None
    assert conversation.metadata.last_user_message == "first"
    assert len(conversation.history) == 1


async def test_a_message_another_daemon_took_in_meanwhile_is_a_duplicate_and_changes_nothing(cast: Cast) -> None:
    """The person's message looked new, but another daemon sharing the store took it into another
    conversation before the write: add_event returns False (not dispatched) and the conversation keeps
    its latest message and activity, in memory too."""

    class SharedStore(MemoryStore):
        """Answers ``is_processed`` as it was when this daemon looked, before the other daemon's write."""

        async def is_processed(self, event_id: str) -> bool:
            return False

    store = SharedStore()
    manager = ConversationManager(store, cast.agents, cast.project.pubkey, owner_pubkey=cast.user.pubkey)
    here = await manager.create_conversation(cast.user_says("first", kind=11))
    there = await manager.create_conversation(cast.user_says("elsewhere", kind=11))
    before = here.state_dict()
    taken = cast.user_says("second")
    assert await store.append_event(there.id, taken)  # the other daemon's write

    assert await manager.add_event(here.id, taken) is False

    conversation = await manager.get_conversation(here.id)
    assert conversation is not None
    assert [event.id for event in conversation.history] == [here.id]
    assert conversation.state_dict() == before


async def test_a_merged_event_dated_ahead_of_the_clock_counts_as_written_now(cast: Cast) -> None:
    """A rebuild merges an event whose author's clock ran an hour ahead: the conversation's last activity is
    the daemon's now, not the event's date, so idle ending and retention are not put off by it."""
    clock = FakeClock()
    manager = ConversationManager(MemoryStore(), cast.agents, cast.project.pubkey, clock=clock)
    cid = (await manager.create_conversation(cast.user_says("first", kind=11))).id
    ahead = sign_event(cast.user, "from a clock an hour ahead", created_at=clock.now // 1000 + 3600)

    assert await manager.add_event(cid, ahead, backfill=True)

    conversation = await manager.get_conversation(cid)
    assert conversation is not None
    assert conversation.activity_at == clock.now


async def test_concurrent_adds_keep_every_event(manager: ConversationManager, cast: Cast) -> None:
    """200 concurrent add_event calls over 10 conversations lose nothing and keep per-task order."""
    roots = [cast.user_says(f"root {i}", kind=11) for i in range(10)]
    ids = [(await manager.create_conversation(r)).id for r in roots]
    batches = {cid: [cast.user_says(f"{cid[:6]} #{n}") for n in range(20)] for cid in ids}

    async def feed(cid: str) -> None:
        for event in batches[cid]:
            await manager.add_event(cid, event)

    await asyncio.gather(*(feed(cid) for cid in ids))

    for cid in ids:
        conversation = await manager.get_conversation(cid)
        assert conversation is not None
        assert [e.id for e in conversation.history[1:]] == [e.id for e in batches[cid]]


def test_an_agent_is_made_positionally_as_the_public_api_says() -> None:
    """``Agent(slug, name, pubkey, orchestrator=False)`` takes its fields positionally or by keyword, and
    the two make the same agent."""
    from tenex_daemon import Agent

    pubkey = "ab" * 32
    assert Agent("planner", "Planner", pubkey) == Agent(slug="planner", name="Planner", pubkey=pubkey)
    assert Agent("orchestrator", "Orchestrator", pubkey, True).orchestrator
