"""Finding the event a ``note`` / ``nevent`` / ``naddr`` points at: the store first, then the relays."""

from __future__ import annotations

from typing import Protocol

from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.nip19 import Entity
from tenex_daemon.core.vocabulary import TAG_IDENTIFIER

from .pool import RelayPool


class _EventFinder(Protocol):
    async def find_event(self, event_id: str) -> tuple[str, NostrEvent] | None:
        """Return (conversation id, event) for a stored event id."""


class RelayEventResolver:
    """Finds the event a ``note`` / ``nevent`` / ``naddr`` points at: the store first, then the relays.

    Implements :class:`~tenex_daemon.core.ports.EventResolver`.
    """

    def __init__(
        self, pool: RelayPool, *, store: _EventFinder | None = None, timeout: float = 5.0
    ) -> None:
        """Resolve through ``pool`` (and ``store.find_event`` first, when given)."""
        self.pool = pool
        self.store = store
        self.timeout = timeout

    async def resolve(self, entity: Entity) -> NostrEvent | None:
        """Return the referenced event, or None when it cannot be found in time."""
        if entity.kind_name in ("note", "nevent"):
            if self.store is not None:
                found = await self.store.find_event(entity.value)
                if found is not None:
                    # a private conversation's message (unsigned) is never shown outside it
                    return found[1] if found[1].is_signed else None
            return await self.pool.fetch_event(entity.value, timeout=self.timeout)
        if entity.kind_name == "naddr" and entity.author is not None and entity.kind is not None:
            events = await self.pool.fetch(
                [{"kinds": [entity.kind], "authors": [entity.author], f"#{TAG_IDENTIFIER}": [entity.value]}],
                timeout=self.timeout,
            )
            # a relay may answer with anything: only the address's own author, kind and d-tag count
            # (another key's event with the same d-tag would otherwise stand in for the article)
            matching = [
                e for e in events
                if (e.pubkey, e.kind) == (entity.author, entity.kind)
                and e.tag_value(TAG_IDENTIFIER) == entity.value
            ]
            return matching[0] if matching else None  # fetch gives the newest first
        return None
