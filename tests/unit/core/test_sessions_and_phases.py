"""Session ids per agent and phase transitions through the ConversationManager."""

from __future__ import annotations

import pytest

from tenex_daemon import ConversationManager, Phase, PhaseTransitionError
from tenex_daemon.core.phases import BUILT_IN_PHASES, PhaseRules
from tenex_daemon.testing import FakeClock
from tests.conftest import Cast


async def test_session_id_is_captured_from_the_trigger(manager: ConversationManager, cast: Cast) -> None:
    """The owner's trigger's claude-session tag becomes the agent's session id."""
    root = cast.user_says("hi", kind=11, tags=[["claude-session", "sess-1"]])
    cid = (await manager.create_conversation(root)).id

    context = await manager.build_agent_messages(cid, "alice", root)

    assert context.session_id == "sess-1"
    conversation = await manager.get_conversation(cid)
    assert conversation is not None
    assert conversation.agent_states["alice"].session_id == "sess-1"


async def test_a_session_id_from_another_persons_event_is_never_taken(
    manager: ConversationManager, cast: Cast
) -> None:
    """A person who is not the owner cannot point an agent at a session: their claude-session tag is ignored
    and the stored session stays."""
    root = cast.user_says("hi", kind=11, tags=[["claude-session", "sess-1"]])
    cid = (await manager.create_conversation(root)).id
    await manager.build_agent_messages(cid, "alice", root)
    stranger = cast.factory.event(cast.other_user, "resume mine", kind=1111, tags=[["claude-session", "sess-2"]])
    await manager.add_event(cid, stranger)

    context = await manager.build_agent_messages(cid, "alice", stranger)

    assert context.session_id == "sess-1"
    conversation = await manager.get_conversation(cid)
    assert conversation is not None
    assert conversation.agent_states["alice"].session_id == "sess-1"


@pytest.mark.parametrize(
    "value", ["--dangerously-skip-permissions", "-p", "a b", "x" * 65, "sess;rm", "-leading-dash", "sess\n2"]
)
async def test_a_malformed_session_id_is_never_taken(manager: ConversationManager, cast: Cast, value: str) -> None:
    """Even the owner's claude-session tag is ignored unless it is UUID-like (letters, digits, '-', <= 64)."""
    root = cast.user_says("hi", kind=11, tags=[["claude-session", value]])
    cid = (await manager.create_conversation(root)).id

    context = await manager.build_agent_messages(cid, "alice", root)

    assert context.session_id is None


async def test_an_agents_session_tag_is_taken(manager: ConversationManager, cast: Cast) -> None:
    """A trigger written by one of the project's agents may name the session (delegation hands one on)."""
    root = cast.user_says("hi", kind=11)
    cid = (await manager.create_conversation(root)).id
    handoff = cast.alice_says("over to you", tags=[["claude-session", "0b0c7a3e-9f1d-4c1e"]])
    await manager.add_event(cid, handoff)

    context = await manager.build_agent_messages(cid, "bob", handoff)

    assert context.session_id == "0b0c7a3e-9f1d-4c1e"


async def test_session_id_is_kept_when_a_later_trigger_has_none(
    manager: ConversationManager, cast: Cast
) -> None:
    """A trigger without the tag never erases the stored session id."""
    root = cast.user_says("hi", kind=11, tags=[["claude-session", "sess-1"]])
    cid = (await manager.create_conversation(root)).id
    await manager.build_agent_messages(cid, "alice", root)
    follow = cast.user_says("again")
    await manager.add_event(cid, follow)

    context = await manager.build_agent_messages(cid, "alice", follow)

    assert context.session_id == "sess-1"


async def test_session_id_is_replaced_by_a_new_one(manager: ConversationManager, cast: Cast) -> None:
    """A trigger with a different session id replaces the stored one."""
    root = cast.user_says("hi", kind=11, tags=[["claude-session", "sess-1"]])
    cid = (await manager.create_conversation(root)).id
    await manager.build_agent_messages(cid, "alice", root)
    follow = cast.user_says("again", tags=[["claude-session", "sess-2"]])
    await manager.add_event(cid, follow)

    context = await manager.build_agent_messages(cid, "alice", follow)

    assert context.session_id == "sess-2"


async def test_session_ids_are_per_agent_and_none_when_never_set(
    manager: ConversationManager, cast: Cast
) -> None:
    """Each agent keeps its own session id; an agent never given one has None."""
    root = cast.user_says("hi", kind=11, tags=[["claude-session", "alice-sess"]])
    cid = (await manager.create_conversation(root)).id
    await manager.build_agent_messages(cid, "alice", root)
    follow = cast.user_says("bob?")
    await manager.add_event(cid, follow)

    bob = await manager.build_agent_messages(cid, "bob", follow)

    assert bob.session_id is None
    conversation = await manager.get_conversation(cid)
    assert conversation is not None
    assert conversation.agent_states["alice"].session_id == "alice-sess"
    assert conversation.agent_states["bob"].session_id is None


async def test_update_agent_state_sets_session_and_index(manager: ConversationManager, cast: Cast) -> None:
    """update_agent_state stores a session id and an index, and rejects an index outside history."""
    root = cast.user_says("hi", kind=11)
    cid = (await manager.create_conversation(root)).id

    await manager.update_agent_state(cid, "bob", last_processed_index=1, session_id="s")

    conversation = await manager.get_conversation(cid)
    assert conversation is not None
    assert conversation.agent_states["bob"].last_processed_index == 1
    assert conversation.agent_states["bob"].session_id == "s"
    with pytest.raises(ValueError, match="outside history"):
        await manager.update_agent_state(cid, "bob", last_processed_index=5)


async def test_phase_transition_is_recorded_with_all_fields(
    manager: ConversationManager, cast: Cast, clock: FakeClock
) -> None:
    """A transition records from, to, message, agent, reason, summary and timestamp."""
    cid = (await manager.create_conversation(cast.user_says("hi", kind=11))).id
    clock.advance(5_000)

    transition = await manager.update_phase(
        cid, Phase.PLAN, "Let's plan", "alice", reason="ready", summary="User wants X"
    )

    conversation = await manager.get_conversation(cid)
    assert conversation is not None
    assert conversation.phase is Phase.PLAN
    assert conversation.phase_started_at == clock.now
    assert conversation.phase_transitions == [transition]
    assert (transition.from_phase, transition.to_phase) == (Phase.CHAT, Phase.PLAN)
    assert transition.message == "Let's plan"
    assert (transition.agent_slug, transition.agent_name, transition.agent_pubkey) == (
        "alice",
        "Alice",
        cast.alice.pubkey,
    )
    assert (transition.reason, transition.summary) == ("ready", "User wants X")
    assert transition.timestamp == clock.now


async def test_three_chained_transitions_give_three_records(manager: ConversationManager, cast: Cast) -> None:
    """chat -> plan -> execute -> verification leaves three records in order."""
    cid = (await manager.create_conversation(cast.user_says("hi", kind=11))).id

    for phase in ("plan", "execute", "verification"):
        await manager.update_phase(cid, phase, f"to {phase}", "alice")

    conversation = await manager.get_conversation(cid)
    assert conversation is not None
    assert [(t.from_phase.value, t.to_phase.value) for t in conversation.phase_transitions] == [
        ("chat", "plan"),
        ("plan", "execute"),
        ("execute", "verification"),
    ]


async def test_forbidden_transition_raises_and_changes_nothing(
    manager: ConversationManager, cast: Cast
) -> None:
    """chat -> verification is refused with an error naming the allowed phases; nothing is recorded."""
    cid = (await manager.create_conversation(cast.user_says("hi", kind=11))).id

    with pytest.raises(
        PhaseTransitionError,
        match=r"chat -> verification is not allowed \(allowed from chat: brainstorm, execute, plan\)",
    ):
        await manager.update_phase(cid, "verification", "skip ahead", "alice")

    conversation = await manager.get_conversation(cid)
    assert conversation is not None
    assert conversation.phase is Phase.CHAT
    assert conversation.phase_transitions == []


async def test_same_phase_handoff_is_allowed_and_recorded(manager: ConversationManager, cast: Cast) -> None:
    """A chat -> chat handoff is recorded as a transition without changing the phase start."""
    cid = (await manager.create_conversation(cast.user_says("hi", kind=11))).id
    before = await manager.get_conversation(cid)
    assert before is not None
    started = before.phase_started_at

    transition = await manager.update_phase(cid, "chat", "handing to bob", "alice", summary="ctx")

    conversation = await manager.get_conversation(cid)
    assert conversation is not None
    assert transition.is_handoff
    assert len(conversation.phase_transitions) == 1
    assert conversation.phase_started_at == started


async def test_reflection_to_chat_clears_read_files(manager: ConversationManager, cast: Cast) -> None:
    """Leaving reflection for chat clears the conversation's read-files set."""
    cid = (await manager.create_conversation(cast.user_says("hi", kind=11))).id
    await manager.update_metadata(cid, read_files=["src/a.py", "README.md"])
    for phase in ("execute", "verification", "chores", "reflection"):
        await manager.update_phase(cid, phase, phase, "alice")
    during = await manager.get_conversation(cid)
    assert during is not None
    assert during.metadata.read_files == ["src/a.py", "README.md"]

    await manager.update_phase(cid, "chat", "back to chat", "alice")

    conversation = await manager.get_conversation(cid)
    assert conversation is not None
    assert conversation.metadata.read_files == []


def test_every_default_transition_and_only_those_are_allowed() -> None:
    """The default table is exactly docs/ARCHITECTURE.md's, plus same-phase handoffs."""
    rules = PhaseRules()
    expected = {
        "chat": {"execute", "plan", "brainstorm"},
        "brainstorm": {"chat", "plan", "execute"},
        "plan": {"execute", "chat"},
        "execute": {"verification", "chat"},
        "verification": {"chores", "execute", "chat"},
        "chores": {"reflection", "chat"},
        "reflection": {"chat"},
    }
    assert rules.phases == BUILT_IN_PHASES
    for source in BUILT_IN_PHASES:
        for target in BUILT_IN_PHASES:
            allowed = target.value in expected[source.value] or source == target
            assert rules.is_allowed(source, target) is allowed, (source, target)


async def test_phase_rules_are_replaceable_per_project(cast: Cast, clock: FakeClock) -> None:
    """A project's own table replaces the default: here chat may go straight to verification."""
    from tenex_daemon import MemoryStore

    rules = PhaseRules({Phase.CHAT: [Phase.VERIFICATION]})
    manager = ConversationManager(MemoryStore(), cast.agents, phase_rules=rules, clock=clock)
    cid = (await manager.create_conversation(cast.user_says("hi", kind=11))).id

    await manager.update_phase(cid, "verification", "straight to verification", "alice")
    with pytest.raises(PhaseTransitionError):
        await manager.update_phase(cid, "chat", "no way back configured", "alice")


async def test_a_project_adds_phases_of_its_own(cast: Cast, clock: FakeClock) -> None:
    """A phase the project's table adds (docs/ARCHITECTURE.md: phases can be added) is a phase like the built-in
    ones: a conversation moves to it and back as the table allows, and it is stored and loaded by its name."""
    from tenex_daemon import MemoryStore

    store = MemoryStore()
    rules = PhaseRules({"chat": ["review"], "review": ["chat", "execute"], "execute": ["chat"]})
    manager = ConversationManager(store, cast.agents, phase_rules=rules, clock=clock)
    cid = (await manager.create_conversation(cast.user_says("hi", kind=11))).id

    transition = await manager.update_phase(cid, "review", "a review first", "alice")
    with pytest.raises(PhaseTransitionError):
        await manager.update_phase(cid, "plan", "plan is not in this project's table", "alice")
    loaded = await ConversationManager(store, cast.agents, phase_rules=rules, clock=clock).get_conversation(cid)

    assert rules.phases == (Phase.CHAT, Phase.EXECUTE, Phase("review"))
    assert (transition.from_phase, transition.to_phase) == (Phase.CHAT, Phase("review"))
    assert loaded is not None
    assert loaded.phase == "review"
    assert isinstance(loaded.phase, Phase)
    assert loaded.phase_transitions[-1].to_phase == Phase("review")
    assert Phase("chat") is Phase.CHAT  # the built-in ones compare by identity, as enum members did
    with pytest.raises(ValueError, match="not a phase name"):
        Phase("Review!")


async def test_a_conversation_in_a_phase_the_table_no_longer_names_may_move_to_any_of_its_phases(
    cast: Cast, clock: FakeClock
) -> None:
    """A conversation left in a phase the project's table dropped (stored before the table changed) is not
    held there for good: it may move to any phase the table names, back to chat included."""
    from tenex_daemon import MemoryStore

    store = MemoryStore()
    before = ConversationManager(store, cast.agents, phase_rules=PhaseRules(), clock=clock)
    cid = (await before.create_conversation(cast.user_says("hi", kind=11))).id
    await before.update_phase(cid, "plan", "a plan first", "alice")
    rules = PhaseRules({"chat": ["execute"], "execute": ["chat"]})
    after = ConversationManager(store, cast.agents, phase_rules=rules, clock=clock)

    assert rules.allowed_from(Phase.PLAN) == {Phase.CHAT, Phase.EXECUTE}
    transition = await after.update_phase(cid, "execute", "the project has no plan phase now", "alice")
    assert (transition.from_phase, transition.to_phase) == (Phase.PLAN, Phase.EXECUTE)
    with pytest.raises(PhaseTransitionError):
        await after.update_phase(cid, "plan", "gone from the table", "alice")
