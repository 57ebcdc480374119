"""Partial text while a backend streams: published as it grows, never after the final reply."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from itertools import pairwise

from tenex_daemon import NostrEvent
from tenex_daemon.core.budget import SUMMARIZER_PROMPT, BudgetStrategy, TokenBudget
from tenex_daemon.core.llm import CompletionRequest, CompletionResult
from tenex_daemon.services.agent_runner import AgentProfile
from tenex_daemon.services.runs import RunRequest
from tenex_daemon.testing.fakes import FakePublisher
from tests import pipeline
from tests.conftest import Cast

INTERVAL = 0.02


@dataclass
class ChunkingBackend:
    """Streams ``pieces`` one by one with a pause between them (a streaming provider)."""

    pieces: list[str]
    pause_s: float = INTERVAL * 1.5
    name: str = "chunking"

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Hand each piece to ``on_chunk``, then return the whole text."""
        for piece in self.pieces:
            if request.on_chunk is not None:
                await request.on_chunk(piece)
            await asyncio.sleep(self.pause_s)
        return CompletionResult(text="".join(self.pieces), model="chunking")


@dataclass
class WholeTextBackend:
    """Cannot stream: thinks a while, then hands over the whole text once, at the end."""

    text: str = "All at once."
    name: str = "whole"

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Wait, call ``on_chunk`` once with everything, return."""
        await asyncio.sleep(INTERVAL * 4)
        if request.on_chunk is not None:
            await request.on_chunk(self.text)
        return CompletionResult(text=self.text, model="whole")


@dataclass
class RecordingPartials:
    """Records partials in the order they were published, next to the publisher's replies."""

    publisher: FakePublisher
    partials: list[tuple[str, str, str, int]] = field(default_factory=list)
    order: list[str] = field(default_factory=list)
    fail: bool = False

    async def partial(
        self, agent_slug: str, conversation_id: str, trigger_id: str, text: str, sequence: int
    ) -> None:
        """Record the partial (or fail like a relay that refuses)."""
        if self.fail:
            raise RuntimeError("relay refused")
        self.partials.append((agent_slug, trigger_id, text, sequence))
        self.order.append(f"partial:{sequence}")


async def run_once(cast: Cast, backend: object, partials: RecordingPartials) -> tuple[NostrEvent, NostrEvent]:
    """Run Alice once on a fresh conversation; return (trigger, reply)."""
    profiles = {a.slug: AgentProfile(a, "", backend) for a in cast.agents}  # type: ignore[arg-type]
    rig = pipeline.build_rig(
        cast,
        profiles=profiles,
        composer=pipeline.real_composer(cast),
        publisher=partials.publisher,
        partials=partials,
        partial_interval_s=INTERVAL,
    )
    manager, runner = rig.manager, rig.runner
    root = cast.user_says("Tell me a story", kind=11, tags=[["p", cast.alice.pubkey]])
    await manager.create_conversation(root)
    reply = await runner.run(RunRequest(root.id, root.id, "alice"))
    assert reply is not None
    partials.order.append("reply-saved")
    await runner.flush(5.0)
    return root, reply


async def test_streamed_text_is_published_as_it_grows(cast: Cast) -> None:
    """A streaming backend's text goes out as several growing partials, numbered, before the final reply."""
    partials = RecordingPartials(FakePublisher())
    pieces = ["Once ", "upon ", "a ", "time ", "there ", "was ", "a ", "relay."]
    root, reply = await run_once(cast, ChunkingBackend(pieces), partials)

    assert len(partials.partials) >= 3
    texts = [text for _, _, text, _ in partials.partials]
    assert all(later.startswith(earlier) for earlier, later in pairwise(texts))
    assert all("".join(pieces).startswith(text) for text in texts)
    assert [seq for *_, seq in partials.partials] == list(range(1, len(partials.partials) + 1))
    assert {(agent, trigger) for agent, trigger, _, _ in partials.partials} == {("alice", root.id)}
    assert partials.order[-1] == "reply-saved"
    assert reply.content == "".join(pieces)


async def test_a_backend_that_cannot_stream_publishes_no_partial(cast: Cast) -> None:
    """Text handed over once at the end of the call is not published as a partial: the reply carries it."""
    partials = RecordingPartials(FakePublisher())
    _, reply = await run_once(cast, WholeTextBackend(), partials)
    assert partials.partials == []
    assert reply.content == "All at once."


async def test_a_failed_partial_does_not_stop_the_run(cast: Cast) -> None:
    """Partials are best effort: when relays refuse them the reply is still saved and published."""
    publisher = FakePublisher()
    partials = RecordingPartials(publisher, fail=True)
    _, reply = await run_once(cast, ChunkingBackend(["a ", "b ", "c ", "d"]), partials)
    assert reply.content == "a b c d"
    assert [event.id for event in publisher.published] == [reply.id]


@dataclass
class SummaryAwareBackend:
    """Streams every answer; a summary request (the summarizer's prompt) is answered with SUMMARY."""

    name: str = "summary-aware"
    summary_calls: int = 0

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Stream ``SUMMARY ...`` for summary requests and the reply otherwise."""
        summary = request.system_prompt == SUMMARIZER_PROMPT
        self.summary_calls += summary
        pieces = ["SUMMARY ", "of ", "older ", "talk."] if summary else ["The ", "answer ", "is ", "here."]
        for piece in pieces:
            if request.on_chunk is not None:
                await request.on_chunk(piece)
            await asyncio.sleep(INTERVAL * 1.5)
        return CompletionResult(text="".join(pieces), model="summary-aware")


async def test_summary_calls_publish_no_partials(cast: Cast) -> None:
    """When a run summarizes history to fit its budget, only the reply's text is published as partials."""
    backend = SummaryAwareBackend()
    publisher = FakePublisher()
    partials = RecordingPartials(publisher)
    budget = TokenBudget(600, BudgetStrategy.SUMMARIZE)  # a cut within it: one summary call
    profiles = {a.slug: AgentProfile(a, "", backend, budget=budget) for a in cast.agents}
    rig = pipeline.build_rig(
        cast,
        profiles=profiles,
        composer=pipeline.real_composer(cast),
        publisher=publisher,
        partials=partials,
        partial_interval_s=INTERVAL,
    )
    manager, runner = rig.manager, rig.runner
    root = cast.user_says("Let us talk at length. " * 10, kind=11, tags=[["p", cast.alice.pubkey]])
    await manager.create_conversation(root)
    thread = [["E", root.id, "", root.pubkey], ["p", cast.alice.pubkey]]
    last = root
    for n in range(12):
        last = cast.user_says(f"Point {n}: " + "more words here. " * 12, tags=thread)
        await manager.add_event(root.id, last)

    reply = await runner.run(RunRequest(root.id, last.id, "alice"))

    assert reply is not None
    assert backend.summary_calls == 1
    assert partials.partials, "the reply itself was streamed"
    assert not any("SUMMARY" in text for _, _, text, _ in partials.partials)
    await runner.flush(5.0)
