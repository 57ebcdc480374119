"""The ports the services depend on. Adapters implement them; the wiring picks which."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.nip19 import Entity
from tenex_daemon.core.search import ConversationSummary, SearchQuery


@runtime_checkable
class ConversationStore(Protocol):
    """Durable conversations (docs/ARCHITECTURE.md, "Durability contract").

    The manager serializes writers per conversation; a store may assume that no two
    calls change the same conversation at once. Every method that changes data has
    made the change durable (as its fsync policy says) when it returns.
    """

    async def open(self) -> None:
        """Prepare the store (create folders or tables, recover from a crash)."""

    async def close(self) -> None:
        """Flush pending writes and release resources. Safe to call twice."""

    async def create(self, conversation: Conversation) -> None:
        """Store a new conversation with its history and state.

        Raises :class:`~tenex_daemon.core.errors.ConversationExistsError` if the id is taken.
        """

    async def load(self, conversation_id: str) -> Conversation | None:
        """Return the conversation, or None when it is not stored (or unreadable)."""

    async def append_event(
        self, conversation_id: str, event: NostrEvent, *, state: Conversation | None = None
    ) -> bool:
        """Append one event to a stored conversation's history; O(size of the event).

        The event is accepted (and counted as processed) once this returns True. With ``state`` (the
        conversation, its history not yet holding ``event``), everything but history is replaced
        in the same durable write, as :meth:`save_state` would (an agent's reply and what its run
        changed: one commit). An id already processed (here, or by another daemon sharing the
        store since the caller looked) changes nothing, ``state`` included: False.
        """

    async def save_state(self, conversation: Conversation) -> None:
        """Replace everything but history (agent states, phase, turns, metadata, timing)."""

    async def set_archived(self, conversation_id: str, archived: bool) -> None:
        """Archive or restore a conversation."""

    async def delete(self, conversation_id: str) -> bool:
        """Remove a conversation; return whether it existed. Its event ids stay processed."""

    async def search(self, query: SearchQuery) -> list[ConversationSummary]:
        """Return index rows matching ``query``, newest update first."""

    async def phase_counts(self) -> dict[tuple[str, bool], int]:
        """Count conversations by (phase, archived), from the index (no rows built)."""

    async def find_event(self, event_id: str) -> tuple[str, NostrEvent] | None:
        """Return (conversation id, event) for a stored event id, if any."""


@runtime_checkable
class ProcessedEvents(Protocol):
    """The ledger of event ids tenexd has handled (accepted into a conversation, or not)."""

    async def is_processed(self, event_id: str) -> bool:
        """Return whether this event id was ever accepted or marked processed."""

    async def mark_processed(self, event_id: str) -> None:
        """Remember an event id that was handled without joining a conversation."""


@runtime_checkable
class SmallValues(Protocol):
    """Small values kept beside the conversations (relay cursors, the run journal, delegation threads)
    and the per-conversation lease; writes are durable when they return, like the conversations'."""

    async def get_meta(self, key: str) -> str | None:
        """Return the value stored under ``key``, if any."""

    async def set_meta(self, key: str, value: str) -> None:
        """Durably store a small value under ``key``."""

    def lease(self, conversation_id: str) -> AbstractAsyncContextManager[None]:
        """Hold the right to work on a conversation (exclusive across processes sharing the store)."""

    @property
    def commits_in_order(self) -> bool:
        """Whether writes become durable in the order they are issued: a write whose call has
        started (run up to its first wait) is durable no later than any write started after it."""


@runtime_checkable
class Store(ConversationStore, ProcessedEvents, SmallValues, Protocol):
    """Every port a storage adapter implements (memory, files, PostgreSQL); callers name the one they need."""


@runtime_checkable
class Peers(Protocol):
    """Daemons sharing one store (PostgreSQL): each holds a lock on its own name while it lives, so the
    others can tell a dead one and take over what it left (its run journal and outbox)."""

    def alive(self, name: str) -> AbstractAsyncContextManager[None]:
        """Hold ``name``'s lock for as long as the block runs (a dead holder's lock is released)."""

    def try_take(
        self, name: str, on_lost: Callable[[], None] | None = None
    ) -> AbstractAsyncContextManager[bool]:
        """Take ``name``'s lock if nobody holds it (its daemon is gone): True inside the block then. With
        ``on_lost``, the lock is kept through a database restart (taken again), and ``on_lost`` is called
        if another took it meanwhile."""

    names_lost: int
    """How many times a name this store keeps (:meth:`alive`) was lost and had to be taken again: a
    database restart frees every name at once, so a peer's name seen free meanwhile proves nothing."""

    async def keys_with_prefix(self, prefix: str) -> list[str]:
        """The small values' keys that start with ``prefix``."""

    async def forget(self, key: str) -> None:
        """Remove a small value (a dead daemon's journal once it is taken over)."""


@runtime_checkable
class PeerMessages(Protocol):
    """Short messages between the daemons sharing one store (PostgreSQL's NOTIFY): what one daemon
    cannot do alone, such as stopping the runs another holds. Best effort: a daemon that is not
    listening when a message is told (disconnected, restarting) never hears it."""

    async def tell(self, channel: str, message: str) -> None:
        """Send ``message`` to everyone hearing ``channel`` (the teller included)."""

    def hear(self, channel: str, on_message: Callable[[str], None]) -> AbstractAsyncContextManager[None]:
        """Call ``on_message`` with each message told on ``channel`` while the block runs (listening
        again after a broken connection)."""

    async def hearers(self, channel: str) -> int:
        """How many hear ``channel`` now (the asker included when it does): how many answers to expect."""


class EventFetcher(Protocol):
    """Fetches one event by id from the relays (for replies whose root is unknown)."""

    async def fetch_event(self, event_id: str) -> NostrEvent | None:
        """Return the event, or None when no relay has it in time."""


class EventResolver(Protocol):
    """Finds the event a NIP-19 reference points at (store first, then relays)."""

    async def resolve(self, entity: Entity) -> NostrEvent | None:
        """Return the referenced event, or None when it cannot be found."""


class ProfileNames(Protocol):
    """People's profile names (kind 0), for labelling them when several people write (docs/CONTEXT.md)."""

    async def names(self, pubkeys: Collection[str]) -> dict[str, str]:
        """Return the names known or found in time for ``pubkeys`` (a pubkey without one is left out)."""


class Clock(Protocol):
    """Wall-clock time in milliseconds since the epoch, and a clock for durations."""

    def now_ms(self) -> int:
        """Return the current time in milliseconds."""

    def monotonic_ms(self) -> int:
        """Return milliseconds on a clock no step of the wall clock moves (its origin is arbitrary): what a
        duration within one process is measured on."""


class SystemClock:
    """The real clock."""

    def now_ms(self) -> int:
        """Return ``time.time()`` in milliseconds."""
        return time.time_ns() // 1_000_000

    def monotonic_ms(self) -> int:
        """Return ``time.monotonic()`` in milliseconds."""
        return time.monotonic_ns() // 1_000_000


@dataclass(frozen=True, slots=True)
class ReplySpec:
    """What an agent's reply says and where it goes; the composer turns it into a signed event."""

    agent_slug: str
    trigger: NostrEvent
    root: NostrEvent | None
    content: str
    destinations: tuple[str, ...]
    phase: str
    net_time_seconds: int
    session_id: str | None = None
    complete: bool = False
    model: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: bool = False
    delegation: str | None = None
    """The agent-to-agent thread id when the reply is one side of a ``send_message`` exchange;
    the composer then tags it ``["delegation", <thread id>]`` so that nobody is run for it."""
    cost_usd: float | None = None
    """What the reply's tokens cost in US dollars when the agent's prices are configured
    (``llm-cost-usd``)."""
    task_id: str | None = None
    """The kind-1934 task the conversation is a session of: a later session's root is the person's
    comment in the task's thread, and the reply takes the task as its root so it shows there too."""
    subject: str | None = None
    """A private conversation's subject (:meth:`Conversation.subject`), which its rumors carry."""
    missing_root: str | None = None
    """The thread root the conversation's first event (a reply) names when no relay gave it and that
    reply started the conversation (:attr:`Conversation.missing_root`): the reply takes the root that
    first event names, so it shows in that thread."""
    after: int = 0
    """The newest ``created_at`` of the other events the reply answers or follows (a burst's messages, its
    run's ``send_message`` exchange): it is dated after them too, as after its trigger."""


class ReplyComposer(Protocol):
    """Builds and signs an agent's reply (the kind its conversation speaks) with docs/PROTOCOL.md's tags."""

    def compose(self, spec: ReplySpec) -> NostrEvent:
        """Return the signed reply event (the event it answers reads back from its tags:
        :func:`~tenex_daemon.core.thread_tags.read_threading`)."""


class Publisher(Protocol):
    """Sends events to the relays."""

    async def publish(self, event: NostrEvent) -> None:
        """Publish; raise when no relay accepted it."""

    async def typing(self, agent_slug: str, conversation_id: str, active: bool) -> None:
        """Publish a typing start (active) or stop indicator for an agent in a conversation."""


class RunStatus(Protocol):
    """Tells clients which agents work on a conversation now (kind 24133, docs/PROTOCOL.md)."""

    async def working(
        self, conversation_id: str, root_id: str, person: str | None, agents: tuple[str, ...]
    ) -> None:
        """Publish that ``agents`` (public keys; none: idle) work on the conversation rooted at ``root_id``
        for ``person`` (the conversation's person, if known)."""


class PartialTextPublisher(Protocol):
    """Sends an agent's partial reply text while its backend streams (ephemeral kind 21111)."""

    async def partial(
        self, agent_slug: str, conversation_id: str, trigger_id: str, text: str, sequence: int
    ) -> None:
        """Publish the text streamed so far (``sequence`` counts up from 1 within one run)."""
