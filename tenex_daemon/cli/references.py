"""What a conversation argument of the CLI names, and the operations the CLI asks of wherever the
conversations are: the daemon's control API (:mod:`~tenex_daemon.cli.client`) or the store itself
(:mod:`~tenex_daemon.cli.access`). Light on imports: every command loads it, ``tenexd --help`` too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Protocol

from tenex_daemon.core import nip19
from tenex_daemon.core.errors import TenexError
from tenex_daemon.core.ids import is_hex


class AccessError(TenexError):
    """A request failed; ``status`` as in HTTP (400 bad input, 404 unknown, 409 archived, 503 no answer)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def normalize_event_id(value: str, what: str = "conversation id") -> str:
    """Return the hex id of 64 hex characters, a ``note1`` or an ``nevent1`` (``nostr:`` prefix allowed)."""
    text = value.strip().removeprefix("nostr:")
    if text.startswith(("note1", "nevent1")):
        try:
            return nip19.decode(text).value
        except nip19.Nip19Error as exc:
            raise AccessError(f"{what}: {exc}") from None
    lowered = text.lower()
    if not is_hex(lowered, 64):
        raise AccessError(f"{what} must be 64 lowercase hex characters, got {lowered[:80]!r}")
    return lowered


MIN_ID_PREFIX = 4
"""The fewest hex digits of a conversation id taken as a short id (``tenexd conversations show 3fa9``)."""
SHORT_ID_SHOWN = 5
"""How many of the conversations an ambiguous short id starts are named in the error."""
_SHORT_ID = re.compile(rf"[0-9a-f]{{{MIN_ID_PREFIX},63}}")


def conversation_reference(value: str, what: str = "conversation id") -> str:
    """Return the hex id of a whole id (hex, ``note1``, ``nevent1``), or the lowercased hex digits a short
    id gives (at least :data:`MIN_ID_PREFIX`, resolved by :func:`resolve_conversation`); raise
    :class:`AccessError` 400 when it is neither."""
    text = value.strip().removeprefix("nostr:").lower()
    if _SHORT_ID.fullmatch(text):
        return text
    try:
        return normalize_event_id(value, what)
    except AccessError:
        if text.startswith(("note1", "nevent1")):
            raise  # its NIP-19 error says what is wrong with it
        raise AccessError(
            f"{what} must be 64 hex characters, the first {MIN_ID_PREFIX} or more of a conversation's id, "
            f"a note1 or an nevent1; got {value.strip()[:80]!r}"
        ) from None


async def resolve_conversation(access: ConversationAccess, reference: str) -> str:
    """Return the conversation id a :func:`conversation_reference` names: itself when whole, else the one
    conversation, archived or not, whose id starts with it; raise :class:`AccessError` 404 when none does
    and 400 when several do (naming them)."""
    if len(reference) == 64:
        return reference
    rows = await access.search({"id_prefix": reference, "limit": str(SHORT_ID_SHOWN + 1)})
    ids = [str(row.get("id")) for row in rows]
    if not ids:
        raise AccessError(f"no conversation id starts with {reference}", 404)
    if len(ids) > 1:
        shown = ", ".join(ids[:SHORT_ID_SHOWN]) + (", ..." if len(ids) > SHORT_ID_SHOWN else "")
        raise AccessError(f"{reference} starts more than one conversation id ({shown}): give more of it", 400)
    return ids[0]


class ConversationAccess(Protocol):
    """Conversation operations the CLI needs; each returns the control API's JSON shapes."""

    via: str
    """``control API`` or ``store``: where the answers come from."""

    async def search(self, query: Mapping[str, str]) -> list[dict[str, Any]]:
        """Return summary rows matching the query parameters of ``GET /api/v1/conversations``."""

    async def get(self, conversation_id: str) -> dict[str, Any]:
        """Return a conversation in full (raises AccessError 404 when unknown)."""

    async def archive(self, conversation_id: str) -> None:
        """Archive a conversation (raises AccessError 409 when it is archived already)."""

    async def restore(self, conversation_id: str) -> None:
        """Restore an archived conversation (raises AccessError 409 when it is not archived)."""

    async def end(self, conversation_id: str, reason: str | None) -> None:
        """End a conversation (by the owner): recorded with it (when, who, why); it stays writable."""

    async def stop(self, conversation_id: str, agent: str | None) -> dict[str, Any]:
        """Stop the agents working on a conversation (``agent`` only, when given), as the owner; return
        ``{"id", "stopped": [slugs], "notice": id | None}``."""

    async def context(self, conversation_id: str, agent: str, trigger: str | None) -> dict[str, Any]:
        """Return what the agent would be sent now, without changing its state."""

    async def conversation_of_event(self, event_id: str) -> dict[str, Any]:
        """Return the conversation rooted at or holding this event (raises AccessError 404)."""
