"""Fakes for the pipeline's ports, for unit tests that build the pipeline the daemon builds.

Service tests call :func:`tenex_daemon.app.wiring.build_pipeline` with these in place of the Nostr
edge (composer, publisher, partial publisher) and of language models; everything between them is
the production code.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.core.errors import EventRefusedError
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.llm import BackendError, CompletionRequest, CompletionResult, ToolResult
from tenex_daemon.core.ports import ReplySpec
from tenex_daemon.services.conversation_changes import clear_end
from tenex_daemon.testing import KeyPair, sign_event


def signers_for(keys: Mapping[str, KeyPair]) -> dict[str, Signer]:
    """Real signers (the daemon's) over test key pairs, by agent slug."""
    return {slug: Signer.from_text(pair.secret, label=slug) for slug, pair in keys.items()}


@dataclass
class PlainComposer:
    """Signs replies with the few tags that matter to targeting: ``E`` root, ``e`` trigger, ``p`` each
    destination, and ``["error", "system"]`` on errors. Use the real composer where tags matter."""

    keys: dict[str, KeyPair]

    def compose(self, spec: ReplySpec) -> NostrEvent:
        """Return a signed kind-1111 reply to the trigger."""
        tags = [["e", spec.trigger.id], *(["p", p] for p in spec.destinations)]
        if spec.task_id is not None and (spec.root is None or spec.root.id != spec.task_id):
            tags.insert(0, ["E", spec.task_id])  # a task's later session replies in the task's thread
        elif spec.root is not None:
            tags.insert(0, ["E", spec.root.id, "", spec.root.pubkey])
        if spec.error:
            tags.append(["error", "system"])
        return sign_event(self.keys[spec.agent_slug], spec.content, tags=tags)


@dataclass
class FakePublisher:
    """Records what would go to the relays (or fails like a relay that refuses, with ``fail``)."""

    published: list[NostrEvent] = field(default_factory=list)
    typing_events: list[tuple[str, bool]] = field(default_factory=list)
    typing_threads: list[str] = field(default_factory=list)
    fail: bool = False
    refuse_over: int | None = None
    """Events whose content is longer than this are refused for good, as a relay refuses an event over its
    size limit (``blocked:``)."""

    refuse_kinds: frozenset[int] = frozenset()
    """Events of these kinds are refused for good (``blocked:``)."""

    async def publish(self, event: NostrEvent) -> None:
        """Record the event (or fail like a relay that refuses, for now or for good)."""
        if event.kind in self.refuse_kinds:
            reason = f"blocked: kind {event.kind} is not accepted here"
            raise EventRefusedError(f"no relay accepted event {event.id}", (reason,))
        if self.refuse_over is not None and len(event.content) > self.refuse_over:
            reason = f"blocked: event size ({len(event.content)} chars) exceeds {self.refuse_over}"
            raise EventRefusedError(f"no relay accepted event {event.id}", (reason,))
        if self.fail:
            raise RuntimeError("no relay accepted the event")
        self.published.append(event)

    async def typing(self, agent_slug: str, conversation_id: str, active: bool) -> None:
        """Record a typing indicator (and, in ``typing_threads``, the thread it names)."""
        self.typing_events.append((agent_slug, active))
        self.typing_threads.append(conversation_id)


@dataclass
class ScriptedBackend:
    """Returns the scripted answers in order (the last one again when the script runs out); records
    requests."""

    script: list[CompletionResult]
    name: str = "scripted"
    requests: list[CompletionRequest] = field(default_factory=list)

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Return the next scripted answer."""
        self.requests.append(request)
        return self.script[min(len(self.requests), len(self.script)) - 1]

    def tool_results(self) -> list[ToolResult]:
        """Every tool result the backend was sent in its last request."""
        return [m for m in self.requests[-1].messages if isinstance(m, ToolResult)]


class PeerBus:
    """Messages between daemons sharing a store, in memory (a :class:`~tenex_daemon.core.ports.PeerMessages`
    for every pipeline of a test): a message told reaches everyone hearing its channel, the teller
    included, on the next turn of the loop, as PostgreSQL's NOTIFY does after its commit."""

    def __init__(self) -> None:
        self.told: list[tuple[str, str]] = []
        self._hearing: list[tuple[str, Callable[[str], None]]] = []

    async def tell(self, channel: str, message: str) -> None:
        """Record the message and hand it to everyone hearing ``channel`` now."""
        self.told.append((channel, message))
        loop = asyncio.get_running_loop()
        for heard_on, on_message in list(self._hearing):
            if heard_on == channel:
                loop.call_soon(on_message, message)

    async def hearers(self, channel: str) -> int:
        """How many hear ``channel`` now."""
        return sum(1 for heard_on, _ in self._hearing if heard_on == channel)

    @asynccontextmanager
    async def hear(self, channel: str, on_message: Callable[[str], None]) -> AsyncIterator[None]:
        """Hear ``channel`` while the block runs."""
        entry = (channel, on_message)
        self._hearing.append(entry)
        try:
            yield
        finally:
            self._hearing.remove(entry)


class StuckBackend:
    """A model that never answers (the process dies while it thinks): ``asked`` is set on the first call."""

    name = "stuck"

    def __init__(self) -> None:
        self.asked = asyncio.Event()

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Signal the request, then wait until cancelled."""
        self.asked.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


class FailingBackend:
    """A backend that always fails the way a provider does (HTTP 429)."""

    name = "failing"

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Raise a rate-limit error."""
        raise BackendError("rate_limit", "429 Too Many Requests")


@dataclass
class RecordingRouting:
    """Stands in for the dispatcher when a test runs the runner alone: records the replies it is told of."""

    before_save: list[NostrEvent] = field(default_factory=list)
    saved: list[NostrEvent] = field(default_factory=list)

    async def before_reply_saved(self, conversation_id: str, reply: NostrEvent) -> None:
        """Record a reply about to be saved."""
        self.before_save.append(reply)

    async def after_reply(self, conversation_id: str, reply: NostrEvent) -> None:
        """Record a saved reply."""
        self.saved.append(reply)

    async def saved_reply_found(self, conversation_id: str, reply: NostrEvent) -> None:
        """A run redone found its reply saved: nothing to record (it was recorded when saved)."""


@dataclass
class TargetingLog:
    """Records how each saved agent reply was targeted (a dispatcher's ``ReplyObserver``)."""

    results: list[Any] = field(default_factory=list)
    """The dispatcher's ``HandleResult`` per reply, in order."""

    def reply_targeted(self, conversation_id: str, reply: NostrEvent, result: Any) -> None:
        """Record the result."""
        self.results.append(result)


@dataclass
class RunLog:
    """Records every finished agent run (a runner's ``RunObserver``)."""

    runs: list[Any] = field(default_factory=list)
    """The ``RunRequest`` of each finished run, in the order they finished."""
    published: list[tuple[str, str]] = field(default_factory=list)
    """(agent slug, trigger id) of each reply a relay accepted."""

    def run_finished(self, request: Any, seconds: float, error: str | None) -> None:
        """Record the run."""
        self.runs.append(request)

    def reply_published(self, agent_slug: str, trigger_id: str, sent_at: float) -> None:
        """Record the publication."""
        self.published.append((agent_slug, trigger_id))


class WriteBeforeLease(MemoryStore):
    """A memory store in which one event is saved into a conversation just before a step of the manager
    takes that conversation's lease (what another task, or another daemon, wrote between a check made
    outside the lock and the step): ``write_before(conversation_id, event, now, reopens=...)`` arms it."""

    def __init__(self) -> None:
        super().__init__()
        self._armed: tuple[str, NostrEvent, int, bool] | None = None

    def write_before(self, cid: str, event: NostrEvent, now: int, *, reopens: bool = False) -> None:
        """The next lease on conversation ``cid`` first saves ``event`` there, its last activity ``now``
        (``reopens``: an ended conversation is reopened by it, as a person's message does)."""
        self._armed = (cid, event, now, reopens)

    @asynccontextmanager
    async def lease(self, conversation_id: str) -> AsyncIterator[None]:
        if self._armed is not None and self._armed[0] == conversation_id:
            _, event, now, reopens = self._armed
            self._armed = None
            stored = await self.load(conversation_id)
            assert stored is not None
            state = stored.model_copy(deep=True)
            if reopens:
                clear_end(state)
            state.activity_at = now
            await self.append_event(conversation_id, event, state=state)
        yield
