"""MemoryStore: conversations held in process memory (tests, demos, ephemeral runs)."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.erasure import owned_value_prefixes
from tenex_daemon.core.errors import (
    ConversationArchivedError,
    ConversationExistsError,
    ConversationNotFoundError,
)
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.search import ConversationSummary, SearchQuery, apply_query


class MemoryStore:
    """A :class:`~tenex_daemon.core.ports.ConversationStore` that keeps everything in memory.

    It holds the conversation objects themselves: ``load`` returns the live object,
    so a change is visible before ``save_state`` (which is then only bookkeeping).
    Nothing survives the process.
    """

    def __init__(self) -> None:
        self._conversations: dict[str, Conversation] = {}
        self._event_index: dict[str, str] = {}
        self._processed: set[str] = set()
        self._meta: dict[str, str] = {}

    async def open(self) -> None:
        """Nothing to prepare."""

    async def close(self) -> None:
        """Nothing to flush."""

    async def create(self, conversation: Conversation) -> None:
        """Store a new conversation."""
        if conversation.id in self._conversations:
            raise ConversationExistsError(conversation.id)
        self._conversations[conversation.id] = conversation
        for event in conversation.history:
            self._event_index[event.id] = conversation.id
            self._processed.add(event.id)

    async def load(self, conversation_id: str) -> Conversation | None:
        """Return the live conversation object, or None."""
        return self._conversations.get(conversation_id)

    async def append_event(
        self, conversation_id: str, event: NostrEvent, *, state: Conversation | None = None
    ) -> bool:
        """Append an event to history (and adopt ``state``); an archived conversation is read-only; a
        processed id changes nothing (False)."""
        conversation = self._conversations.get(conversation_id)
        if conversation is None:
            raise ConversationNotFoundError(conversation_id)
        if conversation.archived:
            raise ConversationArchivedError(conversation_id)
        if event.id in self._processed:
            return False
        conversation.append(event)
        self._event_index[event.id] = conversation_id
        self._processed.add(event.id)
        if state is not None:
            state.append(event)
            self._conversations[conversation_id] = state  # adopted, as save_state does
        return True

    async def save_state(self, conversation: Conversation) -> None:
        """Adopt ``conversation`` as the stored object (it usually already is)."""
        if conversation.id not in self._conversations:
            raise ConversationNotFoundError(conversation.id)
        self._conversations[conversation.id] = conversation

    async def set_archived(self, conversation_id: str, archived: bool) -> None:
        """Archive or restore."""
        conversation = self._conversations.get(conversation_id)
        if conversation is None:
            raise ConversationNotFoundError(conversation_id)
        conversation.archived = archived

    async def delete(self, conversation_id: str) -> bool:
        """Forget a conversation and the small values that belong to it (its delegation threads,
        :mod:`~tenex_daemon.core.erasure`); its event ids stay processed."""
        conversation = self._conversations.pop(conversation_id, None)
        if conversation is None:
            return False
        for event in conversation.history:
            self._event_index.pop(event.id, None)
        prefixes = owned_value_prefixes(conversation_id)
        for key in [key for key in self._meta if key.startswith(prefixes)]:
            del self._meta[key]
        return True

    async def search(self, query: SearchQuery) -> list[ConversationSummary]:
        """Filter every conversation's summary row (the cheap filters first, before a row is built)."""
        rows = [
            ConversationSummary.of(c)
            for c in self._conversations.values()
            if (query.ended is None or c.is_ended == query.ended)
            and (query.archived is None or c.archived == query.archived)
        ]
        return apply_query(rows, query)

    async def phase_counts(self) -> dict[tuple[str, bool], int]:
        """Count conversations by (phase, archived)."""
        return dict(Counter((c.phase.value, c.archived) for c in self._conversations.values()))

    async def is_processed(self, event_id: str) -> bool:
        """Whether the id was accepted or marked."""
        return event_id in self._processed

    async def mark_processed(self, event_id: str) -> None:
        """Remember the id."""
        self._processed.add(event_id)

    async def find_event(self, event_id: str) -> tuple[str, NostrEvent] | None:
        """Find a stored event by id."""
        conversation_id = self._event_index.get(event_id)
        if conversation_id is None:
            return None
        conversation = self._conversations[conversation_id]
        event = next(e for e in conversation.history if e.id == event_id)
        return conversation_id, event

    async def get_meta(self, key: str) -> str | None:
        """Return a stored small value."""
        return self._meta.get(key)

    async def set_meta(self, key: str, value: str) -> None:
        """Store a small value."""
        self._meta[key] = value

    @asynccontextmanager
    async def lease(self, conversation_id: str) -> AsyncIterator[None]:
        """One process owns a memory store, so the lease is always granted."""
        yield

    @property
    def commits_in_order(self) -> bool:
        """Every write takes effect when its call starts."""
        return True
