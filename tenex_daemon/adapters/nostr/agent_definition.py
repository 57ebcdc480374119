"""Kind-4199 agent definitions (NIP-AE draft): the reference to one, and the checks a fetched one passes.

A definition names an agent (``title``, or ``name``), its ``role``, a one-line ``description`` and
its instructions (the ``instructions`` tag, else the content); an addressable copy has a ``d`` tag.
``tenexd agents add --from <nevent|naddr>`` installs one (docs/PROTOCOL.md). Nothing here does I/O:
the caller fetches events with the filters a :class:`DefinitionReference` gives and hands them to
:func:`choose_definition`.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any, Final

from tenex_daemon.core import nip19
from tenex_daemon.core.errors import InvalidEventError, TenexError
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.vocabulary import (
    KIND_AGENT_DEFINITION,
    TAG_DESCRIPTION,
    TAG_IDENTIFIER,
    TAG_INSTRUCTIONS,
    TAG_NAME,
    TAG_ROLE,
    TAG_TITLE,
)

from .codec import verify_event

SLUG_MAX: Final = 64
"""The longest slug the settings accept (``[a-z0-9][a-z0-9_-]{0,63}``)."""
DEFAULT_SLUG: Final = "agent"
"""The slug of a definition whose name has no usable letter or digit."""


class DefinitionReferenceError(TenexError):
    """The text is not a reference to an agent definition (a usage error: nothing was fetched)."""


class DefinitionError(TenexError):
    """No valid agent definition was found for a reference: not on the relays, forged, or another event."""


@dataclass(frozen=True, slots=True)
class DefinitionReference:
    """Where a kind-4199 definition is: an event id (``nevent``/``note``) or coordinates (``naddr``)."""

    text: str
    """The reference as given, without a ``nostr:`` prefix (recorded as the agent's ``source``)."""
    event_id: str | None = None
    author: str | None = None
    identifier: str | None = None
    """The ``d`` tag an ``naddr`` names."""
    relays: tuple[str, ...] = ()
    """Relay hints carried by the reference."""

    def filters(self) -> list[dict[str, Any]]:
        """The REQ filters that fetch the definition (by id, or by kind, author and ``d``)."""
        if self.event_id is not None:
            return [{"ids": [self.event_id]}]
        assert self.author is not None
        assert self.identifier is not None
        return [{"kinds": [KIND_AGENT_DEFINITION], "authors": [self.author], "#d": [self.identifier]}]


def parse_reference(text: str) -> DefinitionReference:
    """Decode an ``nevent``, ``note`` or ``naddr`` (``nostr:`` prefix allowed) naming a kind-4199 event."""
    bare = text.strip().removeprefix("nostr:")
    try:
        entity = nip19.decode(bare)
    except nip19.Nip19Error as exc:
        raise DefinitionReferenceError(f"{text!r} is not a NIP-19 reference: {exc}") from None
    if entity.kind_name not in ("nevent", "note", "naddr"):
        raise DefinitionReferenceError(
            f"{text!r} is an {entity.kind_name}; give the nevent or naddr of a kind-{KIND_AGENT_DEFINITION} "
            "event"
        )
    if entity.kind is not None and entity.kind != KIND_AGENT_DEFINITION:
        raise DefinitionReferenceError(
            f"{text!r} names a kind-{entity.kind} event, not an agent definition "
            f"(kind {KIND_AGENT_DEFINITION})"
        )
    if entity.kind_name == "naddr":
        return DefinitionReference(bare, author=entity.author, identifier=entity.value, relays=entity.relays)
    return DefinitionReference(bare, event_id=entity.value, author=entity.author, relays=entity.relays)


@dataclass(frozen=True, slots=True)
class AgentDefinition:
    """What a verified kind-4199 event defines."""

    event_id: str
    author: str
    name: str | None
    role: str | None
    description: str | None
    instructions: str
    identifier: str | None

    @property
    def persona(self) -> str:
        """The installed agent's instructions: the role first (when there is one), then the instructions."""
        return "\n\n".join(part for part in (self.role, self.instructions) if part)

    def to_dict(self) -> dict[str, str | None]:
        """The definition as JSON (what ``agents add --from --json`` prints)."""
        return {
            "event_id": self.event_id,
            "author": self.author,
            "name": self.name,
            "role": self.role,
            "description": self.description,
            "identifier": self.identifier,
        }


def _text(event: NostrEvent, *names: str) -> str | None:
    """The first non-blank value among the tags ``names``, stripped; None when none has one."""
    for name in names:
        value = event.tag_value(name)
        if value is not None and value.strip():
            return value.strip()
    return None


def _refusal(event: NostrEvent, reference: DefinitionReference) -> str | None:
    """Why ``event`` is not the definition ``reference`` names (forged, another kind or address), or None."""
    try:
        event.require_valid_id()
    except InvalidEventError:
        return f"event {event.id}: its id is not the hash of its content (forged or corrupted)"
    if not verify_event(event):
        return f"event {event.id}: its signature does not verify (forged)"
    if reference.event_id is not None and event.id != reference.event_id:
        return f"event {event.id} is not the event {reference.event_id} asked for"
    if event.kind != KIND_AGENT_DEFINITION:
        return (
            f"event {event.id} is a kind-{event.kind} event, not an agent definition"
            f" (kind {KIND_AGENT_DEFINITION})"
        )
    if reference.author is not None and event.pubkey != reference.author:
        return f"event {event.id} is signed by {event.pubkey}, not the reference's author {reference.author}"
    if reference.identifier is not None and event.tag_value(TAG_IDENTIFIER) != reference.identifier:
        return f"event {event.id} has d tag {event.tag_value(TAG_IDENTIFIER)!r}, not {reference.identifier!r}"
    return None


def check_definition(event: NostrEvent, reference: DefinitionReference) -> AgentDefinition:
    """Verify ``event`` (id hash, signature, kind 4199, and the id, author and ``d`` the reference
    names) and return what it defines; raise :class:`DefinitionError` saying why not."""
    problem = _refusal(event, reference)
    if problem is not None:
        raise DefinitionError(problem)
    instructions = _text(event, TAG_INSTRUCTIONS) or event.content.strip()
    role = _text(event, TAG_ROLE)
    if not instructions and not role:
        raise DefinitionError(f"event {event.id} defines neither a role nor instructions")
    return AgentDefinition(
        event_id=event.id,
        author=event.pubkey,
        name=_text(event, TAG_TITLE, TAG_NAME),
        role=role,
        description=_text(event, TAG_DESCRIPTION),
        instructions=instructions,
        identifier=event.tag_value(TAG_IDENTIFIER),
    )


def choose_definition(events: Iterable[NostrEvent], reference: DefinitionReference) -> AgentDefinition:
    """The newest of ``events`` that passes :func:`check_definition` (an ``naddr`` may have several
    versions); raise :class:`DefinitionError` with the first refusal when none does, or when none came."""
    refusals: list[str] = []
    for event in sorted(events, key=lambda e: (-e.created_at, e.id)):
        try:
            return check_definition(event, reference)
        except DefinitionError as exc:
            refusals.append(str(exc))
    if refusals:
        more = f" (and {len(refusals) - 1} more refused)" if len(refusals) > 1 else ""
        raise DefinitionError(f"no valid agent definition for {reference.text}: {refusals[0]}{more}")
    raise DefinitionError(f"agent definition {reference.text} not found on the relays")


_NOT_SLUG = re.compile(r"[^a-z0-9_-]+")
_UNDERSCORES = re.compile(r"__+")


def slug_base(text: str | None) -> str:
    """A slug made of ``text``: accents dropped, lower case, every other run of characters one ``-``, a
    run of ``_`` one ``_`` (``__`` separates names in thread keys), starting with a letter or digit, at most
    64 characters; ``agent`` when nothing usable is left."""
    if not text:
        return DEFAULT_SLUG
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    slug = _UNDERSCORES.sub("_", _NOT_SLUG.sub("-", ascii_text.lower())).strip("-_")
    slug = slug[:SLUG_MAX].rstrip("-_")
    return slug or DEFAULT_SLUG


def derive_slug(text: str | None, taken: Collection[str]) -> str:
    """:func:`slug_base` of ``text``, made unique against ``taken`` with ``-2``, ``-3``... when needed."""
    base = slug_base(text)
    if base not in taken:
        return base
    number = 2
    while True:
        suffix = f"-{number}"
        candidate = base[: SLUG_MAX - len(suffix)].rstrip("-_") + suffix
        if candidate not in taken:
            return candidate
        number += 1
