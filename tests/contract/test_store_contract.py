"""The store contract, port by port, for every store (memory, filesystem both fsync policies, PostgreSQL).

The ports (``tenex_daemon.core.ports``): ``ConversationStore`` (conversations: the tests from the
first to the search), ``ProcessedEvents`` (the processed-ids tests), ``SmallValues`` (meta values and
leases); ``Store`` is all three, what every adapter implements.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import asyncpg
import pytest

from tenex_daemon.adapters.storage.postgres import MIGRATIONS, PostgresStore
from tenex_daemon.core.conversation import AgentState, Conversation, TitleSource
from tenex_daemon.core.errors import (
    ConversationArchivedError,
    ConversationExistsError,
    ConversationNotFoundError,
)
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.phases import Phase, PhaseTransition
from tenex_daemon.core.ports import ConversationStore, ProcessedEvents, SmallValues, Store
from tenex_daemon.core.search import SearchQuery
from tenex_daemon.core.turns import OrchestratorTurn
from tests.conftest import Cast
from tests.contract.conftest import StoreHarness

pytestmark = pytest.mark.integration

T0 = 1_700_000_000_000


def new_conversation(cast: Cast, title: str, *, created_at: int = T0, phase: Phase = Phase.CHAT) -> Conversation:
    """A conversation rooted at a fresh user event."""
    root = cast.user_says(f"start: {title}", kind=11, tags=[["title", title]])
    conversation = Conversation(
        id=root.id, title=title, phase=phase, created_at=created_at, updated_at=created_at,
        phase_started_at=created_at,
    )
    conversation.append(root)
    return conversation


async def stored(
    store: Store, cast: Cast, title: str = "Build a relay", *, created_at: int = T0
) -> Conversation:
    """Create and return a conversation in ``store``."""
    conversation = new_conversation(cast, title, created_at=created_at)
    await store.create(conversation)
    return conversation


def ids(conversation: Conversation | None) -> list[str]:
    """The event ids of a conversation's history, in order."""
    assert conversation is not None
    return [event.id for event in conversation.history]


@pytest.mark.parametrize("port", [ConversationStore, ProcessedEvents, SmallValues, Store])
def test_every_store_implements_each_port(store: Store, port: type) -> None:
    """Each store has every method of each port (a caller may be given it as any one of them)."""
    assert isinstance(store, port)


# --- ConversationStore ----------------------------------------------------------------------


async def test_create_then_load_returns_history_and_state(store: Store, cast: Cast) -> None:
    """A created conversation loads with the same history and state."""
    conversation = await stored(store, cast)
    loaded = await store.load(conversation.id)
    assert loaded is not None
    assert ids(loaded) == ids(conversation)
    assert loaded.state_dict() == conversation.state_dict()


async def test_create_twice_raises_exists(store: Store, cast: Cast) -> None:
    """Creating a conversation whose id is taken raises ConversationExistsError."""
    conversation = await stored(store, cast)
    with pytest.raises(ConversationExistsError):
        await store.create(conversation.model_copy(deep=True))


async def test_load_unknown_returns_none(store: Store) -> None:
    """Loading an id that was never stored returns None."""
    assert await store.load("f" * 64) is None


async def test_append_keeps_order_across_reopen(harness: StoreHarness, cast: Cast) -> None:
    """Appended events come back in append order, also from a reopened durable store."""
    store = await harness.open()
    conversation = await stored(store, cast)
    events = [cast.alice_says(f"reply {i}") for i in range(25)]
    for event in events:
        await store.append_event(conversation.id, event)
    expected = [conversation.id, *(e.id for e in events)]
    assert ids(await store.load(conversation.id)) == expected
    reopened = await harness.reopen(store)
    assert ids(await reopened.load(conversation.id)) == expected
    rows = await reopened.search(SearchQuery())
    assert [(r.id, r.event_count) for r in rows] == [(conversation.id, 26)]


async def test_append_same_event_twice_stores_it_once(store: Store, cast: Cast) -> None:
    """Appending an already accepted event id changes nothing."""
    conversation = await stored(store, cast)
    event = cast.bob_says("only once")
    await store.append_event(conversation.id, event)
    await store.append_event(conversation.id, event)
    assert ids(await store.load(conversation.id)).count(event.id) == 1


async def test_an_id_taken_in_elsewhere_meanwhile_changes_nothing_state_included(
    harness: StoreHarness, cast: Cast
) -> None:
    """An event another conversation took in after the caller looked (another daemon sharing the store):
    append_event returns False and stores neither the event nor the state it carried; the first append
    returned True."""
    store = await harness.open()
    there, here = await stored(store, cast, "there"), await stored(store, cast, "here")
    event = cast.user_says("a reply both daemons took")
    assert await store.append_event(there.id, event) is True
    loaded = await store.load(here.id)
    assert loaded is not None
    live = loaded.model_copy(deep=True)
    before = live.state_dict()
    live.metadata.last_user_message = event.content
    live.activity_at = T0 + 50
    assert await store.append_event(here.id, event, state=live) is False
    reopened = await harness.reopen(store)
    kept = await reopened.load(here.id)
    assert kept is not None
    assert ids(kept) == [here.id]
    assert kept.state_dict() == before


async def test_append_to_unknown_conversation_raises(store: Store, cast: Cast) -> None:
    """Appending to a conversation that is not stored raises ConversationNotFoundError."""
    with pytest.raises(ConversationNotFoundError):
        await store.append_event("e" * 64, cast.user_says("lost?"))


async def test_save_state_round_trips_after_reopen(harness: StoreHarness, cast: Cast) -> None:
    """Agent states, phase, transitions, turns, metadata and execution time survive a reopen."""
    store = await harness.open()
    conversation = await stored(store, cast)
    live = await store.load(conversation.id)
    assert live is not None
    live.agent_states["alice"] = AgentState(last_processed_index=1, session_id="sess-1")
    live.phase = Phase.PLAN
    live.phase_transitions.append(PhaseTransition(
        from_phase=Phase.CHAT, to_phase=Phase.PLAN, message="plan it", timestamp=T0 + 5,
        agent_slug="alice", agent_pubkey=cast.alice.pubkey, agent_name="Alice", history_index=1,
    ))
    live.orchestrator_turns.append(
        OrchestratorTurn(turn_id="t1", timestamp=T0 + 6, phase=Phase.PLAN, agents=["alice"])
    )
    live.metadata.read_files.append("src/main.py")
    live.metadata.extra["cursor"] = 7
    live.execution_time.start(T0 + 7)
    live.updated_at = T0 + 8
    await store.save_state(live)
    expected = live.state_dict()
    reopened = await harness.reopen(store)
    loaded = await reopened.load(conversation.id)
    assert loaded is not None
    assert loaded.state_dict() == expected
    [row] = await reopened.search(SearchQuery(phase=Phase.PLAN))
    assert (row.agent_count, row.updated_at) == (1, T0 + 8)


async def test_a_phase_the_project_added_is_kept_by_name(harness: StoreHarness, cast: Cast) -> None:
    """A conversation in a phase the project added (not one of the seven) is stored, loaded back after a
    reopen in that phase, and found and counted by it."""
    store = await harness.open()
    conversation = await stored(store, cast)
    live = await store.load(conversation.id)
    assert live is not None
    review = Phase("review")
    live.phase = review
    live.phase_transitions.append(PhaseTransition(
        from_phase=Phase.CHAT, to_phase=review, message="review it", timestamp=T0 + 5,
        agent_slug="alice", agent_pubkey=cast.alice.pubkey, agent_name="Alice", history_index=1,
    ))
    await store.save_state(live)
    reopened = await harness.reopen(store)
    loaded = await reopened.load(conversation.id)
    assert loaded is not None
    assert (loaded.phase, loaded.phase_transitions[-1].to_phase) == (review, review)
    assert [row.id for row in await reopened.search(SearchQuery(phase=review))] == [conversation.id]
    assert await reopened.phase_counts() == {("review", False): 1}


async def test_append_with_state_stores_both_in_one_write(harness: StoreHarness, cast: Cast) -> None:
    """append_event(state=...) stores the event and the new state together: both come back after a
    reopen (an agent's reply with what its run changed)."""
    store = await harness.open()
    conversation = await stored(store, cast)
    live = await store.load(conversation.id)
    assert live is not None
    live.agent_states["alice"] = AgentState(last_processed_index=1, session_id="sess-9", prompt_tokens=12)
    live.execution_time.total_seconds = 3
    live.updated_at = T0 + 9
    reply = cast.alice_says("the reply", tags=[["e", conversation.id]])
    await store.append_event(conversation.id, reply, state=live)
    expected = live.state_dict()
    reopened = await harness.reopen(store)
    loaded = await reopened.load(conversation.id)
    assert loaded is not None
    assert ids(loaded) == [conversation.id, reply.id]
    assert loaded.state_dict() == expected
    assert await reopened.is_processed(reply.id)
    [row] = await reopened.search(SearchQuery())
    assert (row.event_count, row.updated_at) == (2, T0 + 9)


async def test_nul_characters_round_trip_exactly(harness: StoreHarness, cast: Cast) -> None:
    """Content, tags, title, summary and last user message holding U+0000 are stored and read back exactly."""
    store = await harness.open()
    root = cast.user_says("root\u0000 with a NUL", kind=11, tags=[["title", "nul\u0000title"], ["t", "x\u0000y"]])
    conversation = Conversation(id=root.id, title="nul\u0000title", created_at=T0, updated_at=T0)
    conversation.append(root)
    await store.create(conversation)
    reply = cast.user_says("\u0000reply\u0000", tags=[["e", root.id], ["nul\u0000", "\u0000"]])
    live = await store.load(conversation.id)
    assert live is not None
    live.metadata.last_user_message = reply.content
    live.summary = "a summary\u0000with a NUL"
    live.metadata.summary = "\u0000"
    await store.append_event(conversation.id, reply, state=live)
    expected = live.state_dict()
    reopened = await harness.reopen(store)
    loaded = await reopened.load(conversation.id)
    assert loaded is not None
    assert [e.model_dump_json() for e in loaded.history] == [root.model_dump_json(), reply.model_dump_json()]
    assert loaded.history[1].content == "\u0000reply\u0000"
    assert loaded.history[1].tags == [["e", root.id], ["nul\u0000", "\u0000"]]
    assert loaded.history[1].has_valid_id()
    assert loaded.state_dict() == expected
    assert loaded.metadata.last_user_message == "\u0000reply\u0000"
    found = await reopened.find_event(reply.id)
    assert found is not None
    assert found[1].content == reply.content
    [row] = await reopened.search(SearchQuery())
    assert (row.title, row.summary) == ("nul\u0000title", "a summary\u0000with a NUL")


async def test_save_state_of_unknown_conversation_raises(store: Store, cast: Cast) -> None:
    """Saving the state of a conversation that was never created raises ConversationNotFoundError."""
    with pytest.raises(ConversationNotFoundError):
        await store.save_state(new_conversation(cast, "ghost"))


async def test_archive_is_read_only_until_restored(harness: StoreHarness, cast: Cast) -> None:
    """An archived conversation loads, shows as archived, refuses appends, and accepts them once restored."""
    store = await harness.open()
    conversation = await stored(store, cast)
    await store.set_archived(conversation.id, True)
    store = await harness.reopen(store)
    loaded = await store.load(conversation.id)
    assert loaded is not None
    assert loaded.archived
    assert [r.id for r in await store.search(SearchQuery(archived=True))] == [conversation.id]
    assert await store.search(SearchQuery(archived=False)) == []
    with pytest.raises(ConversationArchivedError):
        await store.append_event(conversation.id, cast.user_says("too late"))
    await store.set_archived(conversation.id, False)
    event = cast.user_says("back again")
    await store.append_event(conversation.id, event)
    store = await harness.reopen(store)
    restored = await store.load(conversation.id)
    assert restored is not None
    assert not restored.archived
    assert ids(restored)[-1] == event.id


async def test_delete_forgets_conversation_but_keeps_ids_processed(
    harness: StoreHarness, cast: Cast
) -> None:
    """Deleting removes the conversation (True once, then False) while its event ids stay processed."""
    store = await harness.open()
    conversation = await stored(store, cast)
    event = cast.alice_says("answer")
    await store.append_event(conversation.id, event)
    assert await store.delete(conversation.id) is True
    assert await store.delete(conversation.id) is False
    assert await store.load(conversation.id) is None
    assert await store.find_event(event.id) is None
    store = await harness.reopen(store)
    assert await store.load(conversation.id) is None
    assert await store.is_processed(event.id)
    assert await store.is_processed(conversation.id)
    assert await store.search(SearchQuery()) == []


async def test_search_filters(store: Store, cast: Cast) -> None:
    """Search filters by title (substring and fuzzy), phase, dates, archived and participant, newest
    first; phase_counts counts the same rows by phase and archived."""
    relay = await stored(store, cast, "Build a Nostr relay", created_at=T0)
    plan = await stored(store, cast, "Plan the database migration", created_at=T0 + 86_400_000)
    chat = await stored(store, cast, "Weekly chat", created_at=T0 + 2 * 86_400_000)
    live = await store.load(plan.id)
    assert live is not None
    live.phase = Phase.PLAN
    live.updated_at = T0 + 3 * 86_400_000
    await store.save_state(live)
    await store.append_event(relay.id, cast.bob_says("on it"))
    await store.set_archived(chat.id, True)

    async def found(**filters: object) -> list[str]:
        return [row.id for row in await store.search(SearchQuery.model_validate(filters))]

    assert await found() == [plan.id, chat.id, relay.id]
    assert await found(title="nostr RELAY") == [relay.id]
    assert await found(title="databse migraton") == [plan.id]
    assert await found(title="zzzz qqqq") == []
    assert await found(phase=Phase.PLAN) == [plan.id]
    assert await found(archived=True) == [chat.id]
    assert await found(archived=False) == [plan.id, relay.id]
    assert await found(participant=cast.bob.pubkey) == [relay.id]
    assert await found(participant=cast.user.pubkey) == [plan.id, chat.id, relay.id]
    day1 = datetime.fromtimestamp((T0 + 86_400_000) / 1000, tz=UTC)
    assert await found(date_from=day1) == [plan.id, chat.id]
    assert await found(date_to=day1) == [plan.id, relay.id]
    assert await found(limit=1) == [plan.id]
    [row] = await store.search(SearchQuery(participant=cast.bob.pubkey))
    assert row.event_count == 2
    assert row.title == "Build a Nostr relay"
    assert await store.phase_counts() == {("chat", False): 1, ("plan", False): 1, ("chat", True): 1}


async def test_search_by_id_prefix_finds_the_conversations_whose_id_starts_with_it(store: Store, cast: Cast) -> None:
    """An id prefix (any case) finds every conversation, archived or not, whose id starts with it, and no
    other; the whole id finds its conversation."""
    rows = [await stored(store, cast, f"Chat {n}", created_at=T0 + n) for n in range(12)]
    await store.set_archived(rows[0].id, True)

    async def found(prefix: str) -> set[str]:
        return {row.id for row in await store.search(SearchQuery(id_prefix=prefix))}

    for conversation in rows:
        for width in (1, 4, 64):
            prefix = conversation.id[:width]
            assert await found(prefix) == {c.id for c in rows if c.id.startswith(prefix)}
    assert rows[0].id in await found(rows[0].id[:4])
    assert await found(rows[1].id[:6].upper()) == {c.id for c in rows if c.id.startswith(rows[1].id[:6])}
    assert await found("f" * 64) == set()


async def test_lifecycle_fields_are_kept_in_state_and_index_rows_and_filtered(
    harness: StoreHarness, cast: Cast
) -> None:
    """The lifecycle state (last activity, end, title source, summary, description state, task) survives a
    reopen, shows in the index rows, and search filters by ended, by every participant, and by inactivity."""
    store = await harness.open()
    old = await stored(store, cast, "Old chat", created_at=T0)
    fresh = await stored(store, cast, "Fresh chat", created_at=T0)
    live = await store.load(old.id)
    assert live is not None
    live.activity_at = T0 + 1_000
    live.ended_at = T0 + 5_000
    live.ended_by = "idle"
    live.end_reason = "idle_timeout"
    live.summary = "They talked about a vet visit. \u00e9t\u00e9 \U0001f408"
    live.title = "A vet visit for Miso"
    live.title_source = TitleSource.MODEL
    live.described_at = T0 + 1_000
    live.description_published = False
    live.task_id = old.id
    await store.save_state(live)
    await store.append_event(fresh.id, cast.alice_says("hi"), state=_touched(await store.load(fresh.id), T0 + 9_000))
    store = await harness.reopen(store)

    reloaded = await store.load(old.id)
    assert reloaded is not None
    assert (reloaded.ended_at, reloaded.ended_by, reloaded.end_reason) == (T0 + 5_000, "idle", "idle_timeout")
    assert reloaded.summary == live.summary
    assert reloaded.title_source is TitleSource.MODEL
    assert reloaded.description_published is False
    rows = {row.id: row for row in await store.search(SearchQuery())}
    assert rows[old.id].ended_at == T0 + 5_000
    assert rows[old.id].summary == live.summary
    assert rows[old.id].title_source is TitleSource.MODEL
    assert rows[old.id].described_at == T0 + 1_000
    assert rows[old.id].description_published is False
    assert rows[old.id].task_id == old.id
    assert rows[fresh.id].activity_at == T0 + 9_000
    assert rows[fresh.id].ended_at is None

    async def found(**filters: object) -> list[str]:
        return sorted(row.id for row in await store.search(SearchQuery.model_validate(filters)))

    assert await found(ended=True) == [old.id]
    assert await found(ended=False) == [fresh.id]
    assert await found(participants=(cast.user.pubkey, cast.alice.pubkey)) == [fresh.id]
    assert await found(inactive_before=T0 + 5_000) == [old.id]
    assert await found(inactive_before=T0 + 10_000) == sorted([old.id, fresh.id])


async def test_search_by_participants_follows_each_way_a_participant_joins_and_a_conversation_goes(
    harness: StoreHarness, cast: Cast
) -> None:
    """A search by participants finds a conversation as soon as a participant joined it, no longer once it
    is deleted, the conversation created in its place once it is, and the same after a reopen."""
    store = await harness.open()
    first = await stored(store, cast, "First", created_at=T0)
    second = await stored(store, cast, "Second", created_at=T0)
    user, alice, bob = cast.user.pubkey, cast.alice.pubkey, cast.bob.pubkey

    async def found(*pubkeys: str) -> list[str]:
        return sorted(row.id for row in await store.search(SearchQuery(participants=pubkeys)))

    assert await found(user) == sorted([first.id, second.id])
    assert await found(user, alice) == []
    await store.append_event(first.id, cast.alice_says("joined"))
    assert await found(user, alice) == [first.id]
    assert await found(alice) == [first.id]
    await store.append_event(second.id, cast.bob_says("one"))
    await store.append_event(second.id, cast.alice_says("two"))
    assert await found(user, alice) == sorted([first.id, second.id])
    assert await found(bob, alice) == [second.id]
    assert [row.id for row in await store.search(SearchQuery(participant=bob))] == [second.id]
    assert await store.delete(second.id)
    assert await found(bob) == []
    assert await found(user, alice) == [first.id]
    again = new_conversation(cast, "Second again", created_at=T0)
    again.append(cast.bob_says("back"))
    await store.create(again)
    assert await found(bob) == [again.id]
    store = await harness.reopen(store)
    assert await found(user, alice) == [first.id]
    assert await found(user, bob) == [again.id]
    assert await found(cast.other_user.pubkey) == []


async def test_search_for_ended_conversations_follows_each_end_reopening_and_deletion(
    harness: StoreHarness, cast: Cast
) -> None:
    """A search for the ended conversations of some participants (the persona's) finds a conversation
    as soon as it ends, no longer once a message reopens it or once it is deleted, and the same after
    a reopen of the store."""
    store = await harness.open()
    first = await stored(store, cast, "First", created_at=T0)
    second = await stored(store, cast, "Second", created_at=T0)
    await stored(store, cast, "Never ended", created_at=T0)
    user, alice = cast.user.pubkey, cast.alice.pubkey
    for conversation in (first, second):
        await store.append_event(conversation.id, cast.alice_says(f"in {conversation.title}"))

    async def found(*pubkeys: str) -> list[str]:
        query = SearchQuery(ended=True, participants=pubkeys)
        return sorted(row.id for row in await store.search(query))

    async def set_ended(conversation_id: str, ended_at: int | None) -> None:
        live = await store.load(conversation_id)
        assert live is not None
        live.ended_at = ended_at
        await store.save_state(live)

    assert await found(user, alice) == []
    await set_ended(first.id, T0 + 1_000)
    assert await found(user, alice) == [first.id]
    assert await found(user) == [first.id]
    await set_ended(second.id, T0 + 2_000)
    assert await found(user, alice) == sorted([first.id, second.id])
    assert await found(cast.bob.pubkey) == []
    await set_ended(first.id, None)  # a new message reopened it
    assert await found(user, alice) == [second.id]
    await set_ended(first.id, T0 + 3_000)
    assert await store.delete(second.id)
    assert await found(user, alice) == [first.id]
    store = await harness.reopen(store)
    assert await found(user, alice) == [first.id]
    assert sorted(row.id for row in await store.search(SearchQuery(ended=True))) == [first.id]


async def test_the_newest_ended_conversations_with_a_summary_come_newest_end_first_cut_at_the_limit(
    harness: StoreHarness, cast: Cast
) -> None:
    """A search ordered by end time returns the ended conversations newest end first (ties: highest id
    first), only those with a summary that says something when asked, cut at the limit, whether the
    ended conversations or the participants' conversations are the fewer, and the same after a reopen;
    conversations not ended come after the ended ones when ``ended`` is not asked."""
    store = await harness.open()
    user, alice, bob = cast.user.pubkey, cast.alice.pubkey, cast.bob.pubkey
    made = [await stored(store, cast, f"Chat {n}", created_at=T0) for n in range(7)]
    ends = {0: T0 + 300, 1: T0 + 100, 2: T0 + 300, 3: T0 + 200, 4: T0 + 400, 5: None, 6: T0 + 500}
    summaries = {0: "Zero", 1: "One", 2: "Two", 3: "  \n ", 4: None, 5: "Five", 6: "Six"}
    for n, conversation in enumerate(made):
        await store.append_event(conversation.id, cast.alice_says(f"in {n}"))
        live = await store.load(conversation.id)
        assert live is not None
        live.ended_at, live.summary = ends[n], summaries[n]
        await store.save_state(live)
    await store.append_event(made[1].id, cast.bob_says("only here"))
    tie = sorted((made[0].id, made[2].id), reverse=True)

    async def found(*pubkeys: str, limit: int | None, summarized: bool | None = True) -> list[str]:
        query = SearchQuery(
            ended=True, participants=pubkeys, summarized=summarized, order="ended", limit=limit
        )
        return [row.id for row in await store.search(query)]

    for _ in range(2):
        assert await found(user, alice, limit=3) == [made[6].id, *tie]
        assert await found(user, limit=None) == [made[6].id, *tie, made[1].id]
        assert await found(user, limit=2, summarized=None) == [made[6].id, made[4].id]
        assert await found(user, limit=10, summarized=False) == [made[4].id, made[3].id]
        assert await found(user, bob, limit=5) == [made[1].id]
        assert await found(user, limit=0) == []
        everyone = await store.search(SearchQuery(order="ended"))
        assert [row.id for row in everyone] == [made[6].id, made[4].id, *tie, made[3].id, made[1].id, made[5].id]
        store = await harness.reopen(store)


def _touched(conversation: Conversation | None, at: int) -> Conversation:
    assert conversation is not None
    conversation.activity_at = at
    return conversation


# --- ProcessedEvents ------------------------------------------------------------------------


async def test_processed_ids_survive_reopen(harness: StoreHarness, cast: Cast) -> None:
    """Marked and accepted event ids are still processed after a reopen; others are not."""
    store = await harness.open()
    conversation = await stored(store, cast)
    accepted = cast.alice_says("accepted")
    await store.append_event(conversation.id, accepted)
    ignored = cast.bob_says("ignored").id
    await store.mark_processed(ignored)
    await store.mark_processed(ignored)
    store = await harness.reopen(store)
    assert await store.is_processed(accepted.id)
    assert await store.is_processed(ignored)
    assert await store.is_processed(conversation.id)
    assert not await store.is_processed("0" * 64)


async def test_find_event_returns_conversation_and_event(harness: StoreHarness, cast: Cast) -> None:
    """find_event returns the owning conversation id and the event itself, also after a reopen."""
    store = await harness.open()
    conversation = await stored(store, cast)
    event = cast.alice_says("find me", tags=[["e", conversation.id]])
    await store.append_event(conversation.id, event)
    store = await harness.reopen(store)
    assert await store.find_event(event.id) == (conversation.id, event)
    assert await store.find_event(conversation.id) == (conversation.id, conversation.history[0])
    assert await store.find_event("1" * 64) is None


# --- SmallValues ----------------------------------------------------------------------------


async def test_meta_values_overwrite_and_survive_reopen(harness: StoreHarness) -> None:
    """set_meta overwrites, get_meta returns the latest value or None, and values survive a reopen."""
    store = await harness.open()
    assert await store.get_meta("relay-cursor") is None
    await store.set_meta("relay-cursor", "100")
    await store.set_meta("relay-cursor", "200")
    await store.set_meta("thread:chat__a__b", '{"items": ["é", "\\n"]}')
    store = await harness.reopen(store)
    assert await store.get_meta("relay-cursor") == "200"
    assert await store.get_meta("thread:chat__a__b") == '{"items": ["é", "\\n"]}'


async def test_lease_is_granted_released_and_independent(store: Store) -> None:
    """A lease is granted, released when its block ends, and leases on other conversations do not wait."""
    steps: list[str] = []
    async with asyncio.timeout(10):
        async with store.lease("c1"):
            steps.append("c1")
            async with store.lease("c2"):
                steps.append("c2")
        async with store.lease("c1"):
            steps.append("c1 again")
    assert steps == ["c1", "c2", "c1 again"]


def test_event_round_trip_is_exact(cast: Cast) -> None:
    """The event model used by every store round-trips through JSON unchanged (unicode included)."""
    event = cast.user_says("emoji 🎉, U+2028 \u2028 and quotes \" \\")
    assert NostrEvent.model_validate_json(event.model_dump_json()) == event


async def test_postgres_migration_keeps_rows_stored_as_jsonb(postgres_dsn: str, cast: Cast) -> None:
    """Rows written under migrations 1-2 (jsonb columns) load, search and take NUL text after migration 3."""
    conversation = new_conversation(cast, "Before the upgrade")
    conn = await asyncpg.connect(postgres_dsn)
    try:
        await conn.execute(
            "CREATE TABLE schema_migrations (version integer PRIMARY KEY, description text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        for version, description, sql in MIGRATIONS[:2]:
            await conn.execute(sql)
            await conn.execute("INSERT INTO schema_migrations VALUES ($1, $2)", version, description)
        await conn.execute(
            """INSERT INTO conversations (id, title, phase, created_at, updated_at, event_count, state, lifecycle)
               VALUES ($1, $2, 'chat', $3, $3, 1, $4::jsonb, '{"summary": "old"}'::jsonb)""",
            conversation.id, conversation.title, T0, conversation.model_dump_json(exclude={"history"}),
        )
        await conn.execute(
            "INSERT INTO events (event_id, conversation_id, seq, body) VALUES ($1, $1, 0, $2::jsonb)",
            conversation.id, conversation.history[0].model_dump_json(),
        )
    finally:
        await conn.close()
    store = PostgresStore(postgres_dsn)
    await store.open()
    try:
        loaded = await store.load(conversation.id)
        assert loaded is not None
        assert ids(loaded) == ids(conversation)
        [row] = await store.search(SearchQuery(title="upgrade"))
        assert (row.title, row.summary) == ("Before the upgrade", "old")
        reply = cast.user_says("after\u0000the upgrade")
        await store.append_event(conversation.id, reply)
        again = await store.load(conversation.id)
        assert again is not None
        assert again.history[-1].content == "after\u0000the upgrade"
    finally:
        await store.close()
