"""ConversationManager's operator methods: delete, reset agent states, preview a context, find an event."""

from __future__ import annotations

import pytest

from tenex_daemon import ConversationArchivedError, ConversationManager
from tests.conftest import Cast


async def test_delete_conversation_reports_whether_it_existed(cast: Cast, manager: ConversationManager) -> None:
    """delete_conversation removes a stored conversation (True) and answers False for an unknown id."""
    root = cast.user_says("hello", kind=11)
    await manager.create_conversation(root)
    assert await manager.delete_conversation(root.id)
    assert await manager.get_conversation(root.id) is None
    assert not await manager.delete_conversation(root.id)


async def test_reset_agent_states_keeps_history_and_forgets_sessions(
    cast: Cast, manager: ConversationManager
) -> None:
    """reset_agent_states sets each agent back to index 0 (1 keeping the root) without a session, history intact."""
    root = cast.user_says("hello", kind=11)
    await manager.create_conversation(root)
    reply = cast.alice_says("hi", tags=[["E", root.id]])
    await manager.add_event(root.id, reply)
    await manager.update_agent_state(root.id, "alice", last_processed_index=2, session_id="abc")
    assert await manager.reset_agent_states(root.id) == ["alice"]
    conversation = await manager.get_conversation(root.id)
    assert conversation is not None
    assert conversation.agent_states["alice"].last_processed_index == 0
    assert conversation.agent_states["alice"].session_id is None
    assert [e.id for e in conversation.history] == [root.id, reply.id]
    await manager.reset_agent_states(root.id, keep_system_message=True)
    conversation = await manager.get_conversation(root.id)
    assert conversation is not None
    assert conversation.agent_states["alice"].last_processed_index == 1
    await manager.archive_conversation(root.id)
    with pytest.raises(ConversationArchivedError):
        await manager.reset_agent_states(root.id)


async def test_preview_matches_the_build_and_persists_nothing(cast: Cast, manager: ConversationManager) -> None:
    """preview_agent_messages returns the same messages as build_agent_messages without touching state."""
    root = cast.user_says("hello", kind=11)
    await manager.create_conversation(root)
    second = cast.user_says("Bob, your turn", tags=[["E", root.id]])
    await manager.add_event(root.id, second)
    preview = await manager.preview_agent_messages(root.id, "bob")
    conversation = await manager.get_conversation(root.id)
    assert conversation is not None
    assert "bob" not in conversation.agent_states
    built = await manager.build_agent_messages(root.id, "bob", second)
    assert preview.messages == built.messages
    assert preview.last_processed_index == built.last_processed_index


async def test_a_preview_for_an_earlier_trigger_is_built_as_its_run_would_be(
    cast: Cast, manager: ConversationManager
) -> None:
    """Previewed for an earlier message, the context is what a run for it is sent: a person's message saved
    after it is not shown (it gets a run of its own: docs/CONTEXT.md, "Bursts"), and the trigger comes last
    (a run's trigger is always last)."""
    root = cast.user_says("hello", kind=11)
    await manager.create_conversation(root)
    earlier = cast.user_says("Bob, first this", tags=[["E", root.id]])
    later = cast.user_says("and then that", tags=[["E", root.id]])
    for event in (earlier, later):
        await manager.add_event(root.id, event)

    preview = await manager.preview_agent_messages(root.id, "bob", earlier)
    run = await manager.build_agent_messages(root.id, "bob", earlier, persist=False, burst=True)

    assert preview.messages == run.messages
    assert preview.messages[-1].content == "Bob, first this"
    assert not any("and then that" in m.content for m in preview.messages)


async def test_find_conversation_of_event_by_root_or_member(cast: Cast, manager: ConversationManager) -> None:
    """find_conversation_of_event returns the conversation id for its root or any event in it, else None."""
    root = cast.user_says("task", kind=1934)
    await manager.create_conversation(root)
    reply = cast.bob_says("done", tags=[["E", root.id]])
    await manager.add_event(root.id, reply)
    assert await manager.find_conversation_of_event(root.id) == root.id
    assert await manager.find_conversation_of_event(reply.id) == root.id
    assert await manager.find_conversation_of_event("0" * 64) is None
