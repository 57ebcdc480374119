"""The NIP-01 event: shape validation and canonical id computation."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from tenex_daemon.core.errors import InvalidEventError

Hex64 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
Hex128 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{128}$")]
Signature = Annotated[str, StringConstraints(pattern=r"^(?:[0-9a-f]{128})?$")]
"""A Schnorr signature, or empty for a NIP-17 rumor (an unsigned kind-14 message unwrapped from its
gift wrap, whose seal's signature was checked): never published, never taken from a relay as is."""


def serialize_for_id(pubkey: str, created_at: int, kind: int, tags: list[list[str]], content: str) -> bytes:
    """Return the NIP-01 serialization whose sha256 is the event id.

    ``json.dumps`` with ``ensure_ascii=False`` and no spaces escapes exactly what
    NIP-01 asks for (quote, backslash, control characters) and leaves every other
    character, U+2028 included, as UTF-8.
    """
    return json.dumps(
        [0, pubkey, created_at, kind, tags, content], separators=(",", ":"), ensure_ascii=False
    ).encode("utf-8")


def compute_event_id(pubkey: str, created_at: int, kind: int, tags: list[list[str]], content: str) -> str:
    """Return the NIP-01 id (sha256 hex) of an event with these fields."""
    return hashlib.sha256(serialize_for_id(pubkey, created_at, kind, tags, content)).hexdigest()


class NostrEvent(BaseModel):
    """A Nostr event with the NIP-01 fields.

    Validation checks the shape only (hex lengths, integer ranges, tags as lists of
    strings). Whether ``id`` matches the content is :meth:`has_valid_id`; whether the
    signature verifies is the Nostr codec's job (it needs a crypto library).
    """

    model_config = ConfigDict(frozen=True, strict=True, extra="ignore")

    id: Hex64
    pubkey: Hex64
    created_at: Annotated[int, Field(ge=0)]
    kind: Annotated[int, Field(ge=0, le=65535)]
    tags: list[list[str]]
    content: str
    sig: Signature

    @property
    def is_signed(self) -> bool:
        """Whether the event carries a signature (False: a rumor, see :data:`Signature`)."""
        return bool(self.sig)

    def compute_id(self) -> str:
        """Return the id these fields hash to."""
        return compute_event_id(self.pubkey, self.created_at, self.kind, self.tags, self.content)

    def has_valid_id(self) -> bool:
        """Return whether ``id`` is the NIP-01 hash of the event's fields."""
        return self.compute_id() == self.id

    def require_valid_id(self) -> None:
        """Raise :class:`InvalidEventError` when ``id`` does not match the fields."""
        if not self.has_valid_id():
            raise InvalidEventError(f"event id {self.id} does not match its content")

    def tags_named(self, name: str) -> Iterator[list[str]]:
        """Yield every tag whose first element is ``name``."""
        for tag in self.tags:
            if tag and tag[0] == name:
                yield tag

    def tag_value(self, name: str) -> str | None:
        """Return the second element of the first tag named ``name``, if any."""
        for tag in self.tags:
            if len(tag) > 1 and tag[0] == name:
                return tag[1]
        return None

    def tag_values(self, name: str) -> list[str]:
        """Return the second element of every tag named ``name``."""
        return [tag[1] for tag in self.tags if len(tag) > 1 and tag[0] == name]

    def has_tag(self, *values: str) -> bool:
        """Return whether some tag starts with exactly these values."""
        n = len(values)
        return any(len(tag) >= n and tuple(tag[:n]) == values for tag in self.tags)

    def to_dict(self) -> dict[str, Any]:
        """Return the event as the plain NIP-01 JSON object."""
        return {
            "id": self.id,
            "pubkey": self.pubkey,
            "created_at": self.created_at,
            "kind": self.kind,
            "tags": [list(tag) for tag in self.tags],
            "content": self.content,
            "sig": self.sig,
        }
