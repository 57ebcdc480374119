"""What docs/CONTEXT.md says the tests pin down, with exact expected messages."""

from __future__ import annotations

from tenex_daemon import ConversationManager, NostrEvent
from tenex_daemon.core.context import NEW_INTERACTION, ChatMessage
from tests.conftest import Cast

BLOCK_HEAD = "=== MESSAGES WHILE YOU WERE AWAY ===\n\n"
BLOCK_TAIL = (
    "=== END OF HISTORY ===\nRespond to the most recent user message above, considering the context.\n\n"
)


def msgs(*pairs: tuple[str, str]) -> list[ChatMessage]:
    """Build the expected message list from (role, content) pairs."""
    return [ChatMessage(role, content) for role, content in pairs]  # type: ignore[arg-type]


async def start(manager: ConversationManager, root: NostrEvent) -> str:
    """Create a conversation from ``root`` and return its id."""
    conversation = await manager.create_conversation(root)
    return conversation.id


async def test_first_message_p_tagging_an_agent_is_exactly_that_message(
    manager: ConversationManager, cast: Cast
) -> None:
    """A user's first message p-tagging an agent gives exactly [user message], no block, no marker, LPI 1."""
    root = cast.user_says("Hello @alice, plan my trip", kind=11, tags=[["p", cast.alice.pubkey]])
    cid = await start(manager, root)

    context = await manager.build_agent_messages(cid, "alice", root)

    assert context.messages == msgs(("user", "Hello @alice, plan my trip"))
    conversation = await manager.get_conversation(cid)
    assert conversation is not None
    assert conversation.agent_states["alice"].last_processed_index == 1


async def test_single_agent_conversation_with_several_exchanges(
    manager: ConversationManager, cast: Cast
) -> None:
    """An agent continuing with the user sees its replies as assistant, with no block and no marker."""
    u1 = cast.user_says("First question", kind=11)
    cid = await start(manager, u1)
    await manager.build_agent_messages(cid, "alice", u1)
    a1 = cast.alice_says("First answer")
    await manager.add_event(cid, a1)
    u2 = cast.user_says("Second question")
    await manager.add_event(cid, u2)
    second = await manager.build_agent_messages(cid, "alice", u2)
    a2 = cast.alice_says("Second answer")
    await manager.add_event(cid, a2)
    u3 = cast.user_says("Third question")
    await manager.add_event(cid, u3)

    third = await manager.build_agent_messages(cid, "alice", u3)

    assert second.messages == msgs(
        ("user", "First question"), ("assistant", "First answer"), ("user", "Second question")
    )
    assert third.messages == msgs(
        ("user", "First question"),
        ("assistant", "First answer"),
        ("user", "Second question"),
        ("assistant", "Second answer"),
        ("user", "Third question"),
    )
    conversation = await manager.get_conversation(cid)
    assert conversation is not None
    assert conversation.agent_states["alice"].last_processed_index == 5


async def test_agent_p_tagged_mid_conversation_gets_history_block_marker_and_trigger(
    manager: ConversationManager, cast: Cast
) -> None:
    """A newly p-tagged agent gets full history in roles, a block of all it has not seen, the marker, then the trigger."""
    u1 = cast.user_says("We need a logo", kind=11)
    cid = await start(manager, u1)
    await manager.build_agent_messages(cid, "alice", u1)
    a1 = cast.alice_says("I suggest a blue fox.")
    await manager.add_event(cid, a1)
    u2 = cast.user_says("@bob what do you think?", tags=[["p", cast.bob.pubkey]])
    await manager.add_event(cid, u2)

    context = await manager.build_agent_messages(cid, "bob", u2)

    block = BLOCK_HEAD + "🟢 USER:\nWe need a logo\n\n" + "💬 Alice:\nI suggest a blue fox.\n\n" + BLOCK_TAIL
    assert context.messages == msgs(
        ("user", "We need a logo"),
        ("system", "[Alice]: I suggest a blue fox."),
        ("system", block),
        ("system", NEW_INTERACTION),
        ("user", "@bob what do you think?"),
    )
    conversation = await manager.get_conversation(cid)
    assert conversation is not None
    assert conversation.agent_states["bob"].last_processed_index == 3


async def test_agent_p_tagged_at_start_vs_mid_conversation(manager: ConversationManager, cast: Cast) -> None:
    """At the start the agent sees only the message; mid-conversation it sees everything before it."""
    root = cast.user_says("Start", kind=11, tags=[["p", cast.alice.pubkey]])
    cid = await start(manager, root)
    at_start = await manager.build_agent_messages(cid, "alice", root)
    reply = cast.alice_says("Started")
    await manager.add_event(cid, reply)
    u2 = cast.user_says("Bob, join", tags=[["p", cast.bob.pubkey]])
    await manager.add_event(cid, u2)

    mid = await manager.build_agent_messages(cid, "bob", u2)

    assert at_start.messages == msgs(("user", "Start"))
    assert [m.role for m in mid.messages] == ["user", "system", "system", "system", "user"]
    assert mid.messages[0].content == "Start"
    assert mid.messages[1].content == "[Alice]: Started"


async def test_multi_agent_attribution_and_independent_states(
    manager: ConversationManager, cast: Cast
) -> None:
    """Two agents each keep their own LPI and see each other as [Name]: system messages."""
    u1 = cast.user_says("Kick off", kind=11)
    cid = await start(manager, u1)
    await manager.build_agent_messages(cid, "alice", u1)
    a1 = cast.alice_says("Alice here")
    await manager.add_event(cid, a1)
    u2 = cast.user_says("Bob?")
    await manager.add_event(cid, u2)
    await manager.build_agent_messages(cid, "bob", u2)
    b1 = cast.bob_says("Bob here")
    await manager.add_event(cid, b1)
    u3 = cast.user_says("Alice again")
    await manager.add_event(cid, u3)

    alice_view = await manager.build_agent_messages(cid, "alice", u3)

    block = BLOCK_HEAD + "🟢 USER:\nBob?\n\n" + "💬 Bob:\nBob here\n\n" + BLOCK_TAIL
    assert alice_view.messages == msgs(
        ("user", "Kick off"),
        ("assistant", "Alice here"),
        ("user", "Bob?"),
        ("system", "[Bob]: Bob here"),
        ("system", block),
        ("system", NEW_INTERACTION),
        ("user", "Alice again"),
    )
    conversation = await manager.get_conversation(cid)
    assert conversation is not None
    assert conversation.agent_states["alice"].last_processed_index == 5
    assert conversation.agent_states["bob"].last_processed_index == 3


async def test_agent_trigger_is_attributed_system_message(manager: ConversationManager, cast: Cast) -> None:
    """A trigger from another agent becomes one system "[Name]: content" message at the end."""
    u1 = cast.user_says("Task", kind=11)
    cid = await start(manager, u1)
    await manager.build_agent_messages(cid, "bob", u1)
    a1 = cast.alice_says("Bob, please review", tags=[["p", cast.bob.pubkey]])
    await manager.add_event(cid, a1)

    context = await manager.build_agent_messages(cid, "bob", a1)

    assert context.messages[-1] == ChatMessage("system", "[Alice]: Bob, please review")
    assert sum("Bob, please review" in m.content for m in context.messages) == 1
    assert context.messages[0] == ChatMessage("user", "Task")


async def test_trigger_not_in_history_walks_all_history_and_appears_once(
    manager: ConversationManager, cast: Cast
) -> None:
    """A trigger that is not in history is added once at the end after the whole history."""
    u1 = cast.user_says("One", kind=11)
    cid = await start(manager, u1)
    await manager.build_agent_messages(cid, "alice", u1)
    a1 = cast.alice_says("Two")
    await manager.add_event(cid, a1)
    outside = cast.user_says("Three (not stored)")

    context = await manager.build_agent_messages(cid, "alice", outside)

    assert context.messages == msgs(("user", "One"), ("assistant", "Two"), ("user", "Three (not stored)"))


async def test_a_persons_message_after_the_trigger_ends_the_history_the_run_answers(
    manager: ConversationManager, cast: Cast
) -> None:
    """What was saved after the trigger before the build: another agent's answer is in the block, a
    person's later message is not (nor what came after it), and the last processed index stops before it,
    so the run for that message shows it as its trigger, once."""
    u1 = cast.user_says("Question one", kind=11)
    cid = await start(manager, u1)
    b1 = cast.bob_says("Bob answers one")
    u2 = cast.user_says("Question two")
    b2 = cast.bob_says("Bob answers two")
    for event in (b1, u2, b2):
        await manager.add_event(cid, event)

    first = await manager.build_agent_messages(cid, "alice", u1)
    await manager.add_event(cid, cast.alice_says("Alice answers one"))
    second = await manager.build_agent_messages(cid, "alice", u2, burst=True)

    assert first.messages == msgs(
        ("system", BLOCK_HEAD + "💬 Bob:\nBob answers one\n\n" + BLOCK_TAIL),
        ("system", NEW_INTERACTION),
        ("user", "Question one"),
    )
    assert first.last_processed_index == 2
    assert second.messages == msgs(
        ("user", "Question one"),
        ("system", "[Bob]: Bob answers one"),
        ("assistant", "Alice answers one"),
        ("system", BLOCK_HEAD + "💬 Bob:\nBob answers two\n\n" + BLOCK_TAIL),
        ("system", NEW_INTERACTION),
        ("user", "Question two"),
    )
    assert second.last_processed_index == 5


async def test_the_agents_own_words_past_the_end_of_the_runs_history_wait_for_the_next_run(
    manager: ConversationManager, cast: Cast
) -> None:
    """A run for an older message, built late: what the agent said after a person's later message (its
    answer to another agent's question that came after it) is not shown without that question; both wait
    for the run that answers the later message."""
    u1 = cast.user_says("Question for Alice", kind=11)
    cid = await start(manager, u1)
    for event in (
        cast.user_says("Question for Bob"),
        cast.bob_says("Alice, what is X?"),
        cast.alice_says("X is 42"),
    ):
        await manager.add_event(cid, event)

    context = await manager.build_agent_messages(cid, "alice", u1, persist=False, burst=True)

    assert context.messages == msgs(("user", "Question for Alice"))
    assert context.last_processed_index == 1


async def test_empty_events_are_skipped_everywhere(manager: ConversationManager, cast: Cast) -> None:
    """Events with empty content appear neither in history nor in the while-away block."""
    u1 = cast.user_says("Hi", kind=11)
    cid = await start(manager, u1)
    await manager.add_event(cid, cast.alice_says(""))
    u2 = cast.user_says("Still there?")
    await manager.add_event(cid, u2)

    context = await manager.build_agent_messages(cid, "bob", u2)

    assert context.messages[0] == ChatMessage("user", "Hi")
    assert all("[Alice]" not in m.content and "💬 Alice" not in m.content for m in context.messages)


async def test_unknown_author_claiming_to_be_an_agent_is_another_agent(
    manager: ConversationManager, cast: Cast
) -> None:
    """An unknown author writing agent-only tags is shown as "[Another agent]: ..." and "💬 Another agent"."""
    u1 = cast.user_says("Hi", kind=11)
    cid = await start(manager, u1)
    stranger = cast.factory.event(cast.other_user, "I am an agent too", tags=[["llm-model", "x"]])
    await manager.add_event(cid, stranger)
    u2 = cast.user_says("Alice?")
    await manager.add_event(cid, u2)

    context = await manager.build_agent_messages(cid, "alice", u2)

    assert ChatMessage("system", "[Another agent]: I am an agent too") in context.messages
    assert "💬 Another agent:\nI am an agent too\n\n" in context.messages[2].content


async def test_messages_are_byte_exact(manager: ConversationManager, cast: Cast) -> None:
    """Unicode, newlines, emoji, U+2028 and very long content reach the agent unchanged."""
    tricky = 'Zürich 🚀\nline two\r\n\ttab \u2028 sep "quotes" \\ back ' + "x" * 100_000
    root = cast.user_says(tricky, kind=11)
    cid = await start(manager, root)

    context = await manager.build_agent_messages(cid, "alice", root)

    assert context.messages == msgs(("user", tricky))
    assert context.messages[0].content.encode() == tricky.encode()


async def test_handoff_summary_appears_as_previous_context(manager: ConversationManager, cast: Cast) -> None:
    """A phase transition with a summary since the agent's LPI puts "**Previous context**" in the block."""
    u1 = cast.user_says("Build a CLI", kind=11)
    cid = await start(manager, u1)
    await manager.build_agent_messages(cid, "alice", u1)
    a1 = cast.alice_says("Requirements gathered")
    await manager.add_event(cid, a1)
    await manager.update_phase(
        cid, "plan", "Moving to planning", "alice", reason="requirements clear", summary="User wants a CLI."
    )
    u2 = cast.user_says("Bob, plan it")
    await manager.add_event(cid, u2)

    context = await manager.build_agent_messages(cid, "bob", u2)

    block = (
        BLOCK_HEAD
        + "**Previous context**: User wants a CLI.\n\n"
        + "🟢 USER:\nBuild a CLI\n\n"
        + "💬 Alice:\nRequirements gathered\n\n"
        + BLOCK_TAIL
    )
    assert context.messages[2] == ChatMessage("system", block)
    assert context.messages[3] == ChatMessage("system", NEW_INTERACTION)


async def test_old_handoff_summary_is_not_repeated(manager: ConversationManager, cast: Cast) -> None:
    """A summary recorded before the agent last looked is not shown again."""
    u1 = cast.user_says("Start", kind=11)
    cid = await start(manager, u1)
    await manager.update_phase(cid, "plan", "plan now", "alice", summary="Old summary")
    await manager.build_agent_messages(cid, "bob", u1)
    await manager.add_event(cid, cast.alice_says("Plan drafted"))
    u2 = cast.user_says("Bob?")
    await manager.add_event(cid, u2)

    context = await manager.build_agent_messages(cid, "bob", u2)

    assert all("Old summary" not in m.content for m in context.messages)
    assert any("Plan drafted" in m.content for m in context.messages)


async def test_marker_appears_only_with_block(manager: ConversationManager, cast: Cast) -> None:
    """The NEW INTERACTION marker appears exactly when a while-away block does."""
    u1 = cast.user_says("Hi", kind=11)
    cid = await start(manager, u1)
    first = await manager.build_agent_messages(cid, "alice", u1)
    await manager.add_event(cid, cast.bob_says("Bob chimes in"))
    u2 = cast.user_says("Alice?")
    await manager.add_event(cid, u2)
    second = await manager.build_agent_messages(cid, "alice", u2)

    assert all(m.content != NEW_INTERACTION for m in first.messages)
    assert [m.content for m in second.messages].count(NEW_INTERACTION) == 1
    assert second.messages[-3].content.startswith(BLOCK_HEAD)


async def test_complete_history_is_preserved_across_phases(manager: ConversationManager, cast: Cast) -> None:
    """After several phase changes the agent still receives every earlier message in order."""
    u1 = cast.user_says("m1", kind=11)
    cid = await start(manager, u1)
    contents = ["m1"]
    for i, phase in enumerate(["plan", "execute", "verification"]):
        event = cast.alice_says(f"a{i}") if i % 2 else cast.user_says(f"u{i}")
        await manager.add_event(cid, event)
        contents.append(event.content)
        await manager.update_phase(cid, phase, f"to {phase}", "alice")
    trigger = cast.user_says("last")
    await manager.add_event(cid, trigger)

    context = await manager.build_agent_messages(cid, "alice", trigger)

    seen = [m.content for m in context.messages[: len(contents)]]
    assert seen == contents
    assert context.messages[-1] == ChatMessage("user", "last")


async def test_an_agents_own_event_as_its_trigger_is_shown_as_another_authors(
    manager: ConversationManager, cast: Cast
) -> None:
    """Routed to itself after its own completion (the orchestrator keeps Alice on in the next phase), Alice's
    trigger is her own reply: it comes last as system "[Alice]: <content>", so her request ends on something
    to answer, not on her own words as assistant (a model would continue them); her earlier events stay
    assistant."""
    u1 = cast.user_says("Build a bridge", kind=11)
    cid = await start(manager, u1)
    await manager.build_agent_messages(cid, "alice", u1)
    earlier, plan = cast.alice_says("Thinking about it"), cast.alice_says("PLAN: three steps")
    for event in (earlier, plan):
        await manager.add_event(cid, event)

    context = await manager.build_agent_messages(cid, "alice", plan)

    assert context.messages[-1] == ChatMessage("system", "[Alice]: PLAN: three steps")
    assert ChatMessage("assistant", "Thinking about it") in context.messages
    assert [m.content for m in context.messages].count("PLAN: three steps") == 0
