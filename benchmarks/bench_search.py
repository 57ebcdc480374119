"""Benchmark: the persona's search in a large home.

docs/BENCHMARKS.md, "search: the persona's search in a large home", shows a run.

Every run looks up the person's recent ended conversations with the agent (``SearchQuery`` with
``ended`` and both pubkeys as ``participants``). In a ``FileSystemStore`` holding 1,000 and 10,000
conversations, each started by a person and answered by one agent, one in ten of them ended, it
times in the same run, in two homes: 50 people (the conversations shared out among them) and one
person (a home with one owner: every conversation has the person and the agent):
- persona query: the persona's own lookup (``services.persona.recent_conversations``, the default
  count): the newest ended conversations with a summary in which both the person and the agent
  wrote;
- every entry: ``archived=True`` (no conversation is archived): no map narrows it, so it reads every
  index entry, the floor of any search that does.
Medians of ``--rounds`` calls (default 200).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile

from benchmarks.common import emit_figures, fmt_ms, median_seconds_async, print_table
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.adapters.storage.filesystem import FileSystemStore
from tenex_daemon.core.agents import Agent
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.search import SearchQuery
from tenex_daemon.services.persona import DEFAULT_RECENT_IN_PERSONA, recent_conversations

SIZES = (1_000, 10_000)
HOMES = (50, 1)
"""People in each home: conversations are shared out among them."""
ENDED_EVERY = 10
"""One conversation in this many is ended."""


async def filled_store(path: str, size: int, people: list[Signer], agent: Signer) -> FileSystemStore:
    """A store of ``size`` conversations: a person's root and the agent's answer each; one in
    ``ENDED_EVERY`` of each person's ended, with a summary."""
    store = FileSystemStore(path, fsync="batch")
    await store.open()

    async def create(n: int) -> None:
        root = people[n % len(people)].sign(11, f"hello {n}", [["p", agent.pubkey]])
        conversation = Conversation(id=root.id, title=f"c{n}", created_at=n, updated_at=n, phase_started_at=n)
        conversation.append(root)
        conversation.append(agent.sign(1111, "answer", [["e", root.id]]))
        if (n // len(people)) % ENDED_EVERY == 0:  # one in ten of each person's
            conversation.ended_at = n + 1
            conversation.summary = f"conversation {n}"
        await store.create(conversation)

    for start in range(0, size, 200):
        await asyncio.gather(*(create(n) for n in range(start, min(size, start + 200))))
    return store


async def measure(size: int, people_count: int, rounds: int) -> tuple[float, float]:
    """(persona query, every entry) median seconds in a home of ``size`` conversations."""
    people = [Signer.generate() for _ in range(people_count)]
    agent = Signer.generate()
    with tempfile.TemporaryDirectory() as tmp:
        store = await filled_store(tmp, size, people, agent)
        try:
            person, agent_row = people[0].pubkey, Agent(slug="agent", name="Agent", pubkey=agent.pubkey)
            every = SearchQuery(archived=True)
            recall = DEFAULT_RECENT_IN_PERSONA

            async def persona() -> object:
                found = await recent_conversations(store, person, agent_row, recall, exclude=None)
                assert len(found) == min(recall, size // people_count // ENDED_EVERY)
                return found

            mapped = await median_seconds_async(persona, rounds)
            scanned = await median_seconds_async(lambda: store.search(every), rounds)
        finally:
            await store.close()
    return mapped, scanned


async def main(rounds: int) -> None:
    rows = []
    for people in HOMES:
        for size in SIZES:
            mapped, scanned = await measure(size, people, rounds)
            ratio = f"{scanned / mapped:.0f}x"
            mine = size // people
            rows.append([
                f"{size:,}", f"{people}", f"{mine:,}", f"{mine // ENDED_EVERY:,}", fmt_ms(mapped),
                fmt_ms(scanned), ratio,
            ])
            suffix = f"{size}" if people > 1 else f"{size}_one_person"
            figures = {f"persona_query_ms_{suffix}": mapped * 1e3, f"every_entry_ms_{suffix}": scanned * 1e3}
            emit_figures("search", figures)
    print_table(
        f"The persona's search in a FileSystemStore, median of {rounds} calls",
        ["conversations", "people", "the person's", "ended", "persona query", "every entry", "ratio"],
        rows,
    )


if __name__ == "__main__":
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--rounds", type=int, default=200, help="calls per measurement")
    asyncio.run(main(parser.parse_args().rounds))
