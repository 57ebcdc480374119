"""Benchmark: build_agent_messages next to a bare copy of the same events (issue 2).

For conversations of 100, 1,000 and 10,000 events (a user and three agents taking
turns), it times, in the same run:
- bare copy: the events copied into (role, content) pairs, nothing else;
- core build: the pure ``core.context.build_agent_messages``;
- manager build: ``ConversationManager.build_agent_messages`` over a MemoryStore
  (lock, load, build, persist the agent state), for an agent that has seen
  everything but the trigger ("steady") and for one seeing the conversation for the
  first time ("first look": the while-away block holds the whole history).
The ratio is manager build / bare copy. Target: <= 3 at 10,000 events (steady).
"""

from __future__ import annotations

import argparse
import asyncio

from benchmarks.common import fmt_ms, median_seconds, median_seconds_async, print_table
from tenex_daemon import Agent, ConversationManager, MemoryStore, NostrEvent
from tenex_daemon.core.agents import AgentDirectory
from tenex_daemon.core.context import build_agent_messages
from tenex_daemon.core.events import compute_event_id

SIZES = (100, 1_000, 10_000)
USER_KEY = "01" * 32
AGENTS = [
    Agent(slug=s, name=s.title(), pubkey=f"{i + 2:02x}" * 32) for i, s in enumerate(("alice", "bob", "carol"))
]


def make_history(size: int) -> list[NostrEvent]:
    """Return ``size`` events: the user, then each agent in turn, with realistic lengths."""
    authors = [USER_KEY] + [a.pubkey for a in AGENTS]
    events = []
    for n in range(size):
        pubkey = authors[n % len(authors)]
        content = f"message {n}: " + "lorem ipsum dolor sit amet " * (2 + n % 7)
        tags = [["E", "ab" * 32, "", "ab" * 32], ["p", USER_KEY]]
        event_id = compute_event_id(pubkey, 1_700_000_000 + n, 1111, tags, content)
        events.append(
            NostrEvent.model_construct(
                id=event_id,
                pubkey=pubkey,
                created_at=1_700_000_000 + n,
                kind=1111,
                tags=tags,
                content=content,
                sig="0" * 128,
            )
        )
    return events


def bare_copy(history: list[NostrEvent], own: str) -> list[tuple[str, str]]:
    """The floor: copy events into (role, content) pairs."""
    return [("assistant" if e.pubkey == own else "user", e.content) for e in history]


async def measure(size: int, rounds: int) -> list[object]:
    """Return one table row for a conversation of ``size`` events."""
    history = make_history(size)
    manager = ConversationManager(MemoryStore(), AGENTS)
    conversation = await manager.create_conversation(history[0])
    for event in history[1:]:
        await manager.store.append_event(conversation.id, event)
    trigger = history[-1]
    agent = AGENTS[0]
    directory = AgentDirectory(AGENTS)
    live = await manager.get_conversation(conversation.id)
    assert live is not None

    bare = median_seconds(lambda: bare_copy(live.history, agent.pubkey), rounds)
    await manager.update_agent_state(conversation.id, agent.slug, last_processed_index=size - 1)
    core = median_seconds(lambda: build_agent_messages(live, agent, trigger, directory), rounds)

    async def steady_reset() -> None:
        await manager.update_agent_state(conversation.id, agent.slug, last_processed_index=size - 1)

    async def first_look_reset() -> None:
        await manager.update_agent_state(conversation.id, agent.slug, last_processed_index=0)

    async def build() -> None:
        await manager.build_agent_messages(conversation.id, agent.slug, trigger)

    steady = await median_seconds_async(build, rounds, steady_reset)
    first_look = await median_seconds_async(build, rounds, first_look_reset)
    return [
        f"{size:,}",
        fmt_ms(bare),
        fmt_ms(core),
        fmt_ms(steady),
        fmt_ms(first_look),
        f"{steady / bare:.2f}",
        f"{first_look / bare:.2f}",
    ]


async def main(rounds: int) -> None:
    """Measure every size and print the table."""
    rows = [await measure(size, rounds if size < 10_000 else max(5, rounds // 2)) for size in SIZES]
    print_table(
        f"build_agent_messages vs bare copy (median of {rounds} rounds; ratio = manager / bare copy)",
        [
            "events",
            "bare copy",
            "core build",
            "manager steady",
            "manager first look",
            "ratio steady",
            "ratio first look",
        ],
        rows,
    )
    print("target: ratio <= 3 at 10,000 events")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=41)
    asyncio.run(main(parser.parse_args().rounds))
