"""Properties of build_agent_messages over random conversations of users and several agents."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenex_daemon.core.agents import Agent, AgentDirectory
from tenex_daemon.core.context import (
    NEW_INTERACTION,
    WHILE_AWAY_HEADER,
    HistoryView,
    build_agent_messages,
)
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.events import NostrEvent, compute_event_id

AUTHORS = ["user", "alice", "bob", "carol"]
KEYS = {name: f"{i + 1:064x}" for i, name in enumerate(AUTHORS)}
AGENTS = [Agent(slug=n, name=n.title(), pubkey=KEYS[n]) for n in AUTHORS[1:]]
DIRECTORY = AgentDirectory(AGENTS)


def make_event(author: str, content: str, n: int) -> NostrEvent:
    """A well-formed (unsigned) event; signatures do not matter to context building."""
    pubkey = KEYS[author]
    event_id = compute_event_id(pubkey, n, 1111, [], content)
    return NostrEvent(
        id=event_id, pubkey=pubkey, created_at=n, kind=1111, tags=[], content=content, sig="0" * 128
    )


@dataclass
class Step:
    """One step of a random conversation: someone speaks, then maybe an agent is built for it."""

    author: str
    content: str
    build_for: str | None


steps = st.lists(
    st.builds(
        Step,
        author=st.sampled_from(AUTHORS),
        content=st.one_of(st.just(""), st.text(min_size=1, max_size=20)),
        build_for=st.one_of(st.none(), st.sampled_from(AUTHORS[1:])),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps)
def test_context_invariants(script: list[Step]) -> None:
    """Trigger once, history order kept, no own events in the block, marker iff block, LPI never decreases."""
    conversation = Conversation(id="c" * 64)
    for n, step in enumerate(script):
        # Make contents unique so occurrences can be counted.
        content = f"{step.content}#{n}" if step.content else ""
        event = make_event(step.author, content, n)
        conversation.append(event)
        if step.build_for is None:
            continue
        agent = DIRECTORY.get(step.build_for)
        before = conversation.agent_state(agent.slug).last_processed_index
        context = build_agent_messages(conversation, agent, event, DIRECTORY)
        contents = [m.content for m in context.messages]

        # The trigger appears exactly once, as the last message.
        if content:
            assert sum(c.endswith(content) for c in contents) == 1
            assert contents[-1].endswith(content)
            block_text = next((c for c in contents if c.startswith(WHILE_AWAY_HEADER)), "")
            assert content not in block_text

        # History order is kept: non-empty earlier events appear in order before the trigger.
        earlier = [e.content for e in conversation.history[:-1] if e.content]
        history_part = [c for c in contents if not c.startswith(WHILE_AWAY_HEADER) and c != NEW_INTERACTION][
            :-1
        ]
        assert [c.rsplit("]: ", 1)[-1] if c.startswith("[") else c for c in history_part] == earlier

        # Own events never appear in the block.
        block = next((c for c in contents if c.startswith(WHILE_AWAY_HEADER)), None)
        if block is not None:
            for own in (e for e in conversation.history if e.pubkey == agent.pubkey and e.content):
                assert f":\n{own.content}\n\n" not in block

        # The marker appears if and only if the block does.
        assert (block is not None) == (NEW_INTERACTION in contents)
        assert contents.count(NEW_INTERACTION) <= 1

        # The LPI never decreases, and becomes the history length.
        assert context.last_processed_index >= before
        assert context.last_processed_index == len(conversation.history)
        state = conversation.agent_state(agent.slug)
        state.last_processed_index = context.last_processed_index
        state.session_id = context.session_id


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps, st.lists(st.integers(0, 30), max_size=5))
def test_memoized_view_builds_exactly_what_a_fresh_build_does(script: list[Step], early: list[int]) -> None:
    """Reusing a HistoryView gives the same messages as building from scratch, for any trigger order."""
    conversation = Conversation(id="c" * 64)
    views = {agent.slug: HistoryView() for agent in AGENTS}
    for n, step in enumerate(script):
        author = "dave" if step.author == "user" and n % 5 == 4 else step.author
        pubkey = KEYS.get(author, "f" * 64)
        tags = [["llm-model", "m"]] if author == "dave" and n % 2 else []
        content = f"{step.content}#{n}" if step.content else ""
        event_id = compute_event_id(pubkey, n, 1111, tags, content)
        event = NostrEvent(
            id=event_id, pubkey=pubkey, created_at=n, kind=1111, tags=tags, content=content, sig="0" * 128
        )
        conversation.append(event)
        if step.build_for is None:
            continue
        agent = DIRECTORY.get(step.build_for)
        triggers = [event] + [conversation.history[i] for i in early if i < len(conversation.history)]
        for trigger in triggers:
            memo = build_agent_messages(conversation, agent, trigger, DIRECTORY, view=views[agent.slug])
            fresh = build_agent_messages(conversation, agent, trigger, DIRECTORY)
            assert memo == fresh
