"""Where an event sits in a thread, read from its NIP-22 or NIP-10 tags (docs/PROTOCOL.md).

Pure: the codec (:mod:`tenex_daemon.adapters.nostr.codec`) re-exports this reader beside the tag shapes
tenexd writes, and the core asks it which event a reply answers (an orchestrator turn's completion).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.ids import is_hex
from tenex_daemon.core.vocabulary import (
    TAG_EVENT,
    TAG_PARENT_KIND,
    TAG_PUBKEY,
    TAG_ROOT_AUTHOR,
    TAG_ROOT_EVENT,
    TAG_ROOT_KIND,
)

MARKER_ROOT: Final = "root"
MARKER_REPLY: Final = "reply"
MARKER_MENTION: Final = "mention"
"""NIP-10 markers, the fourth field of an ``e`` tag."""


class ThreadStyle(StrEnum):
    """Which convention an event's threading tags follow."""

    NONE = "none"
    NIP22 = "nip22"
    NIP10_MARKED = "nip10-marked"
    NIP10_POSITIONAL = "nip10-positional"


@dataclass(frozen=True, slots=True)
class Threading:
    """Where an event sits in a thread.

    ``root_id`` is None for an event that is itself a root (then the conversation id
    is the event's own id: :func:`conversation_id`). ``root_kind`` is known for
    NIP-22 (``K``) only. ``parent_id`` is the event replied to.
    """

    style: ThreadStyle
    root_id: str | None = None
    root_kind: int | None = None
    root_author: str | None = None
    parent_id: str | None = None
    parent_kind: int | None = None
    parent_author: str | None = None

    @property
    def is_root(self) -> bool:
        """Whether the event starts a thread (no root reference)."""
        return self.root_id is None


def _int_or_none(value: str | None) -> int | None:
    # isdecimal, not isdigit: a superscript ("²") is a digit that int() cannot read (it raised)
    if value is None or not value.isdecimal() or len(value) > 10:
        return None
    return int(value)


def _first(tags: list[list[str]], name: str) -> list[str] | None:
    for tag in tags:
        if len(tag) > 1 and tag[0] == name:
            return tag
    return None


def _kind_of(tag: list[str] | None) -> int | None:
    """The kind a ``K``/``k`` tag names, when it is a plain number."""
    return _int_or_none(tag[1]) if tag is not None else None


def _hex_value(tag: list[str] | None) -> str | None:
    """The tag's value when it is a 64-hex id or key."""
    return tag[1] if tag is not None and is_hex(tag[1], 64) else None


def _author_hint(tag: list[str] | None) -> str | None:
    """The author's pubkey in the fourth field of an ``E``/``e`` tag, when there is one."""
    if tag is not None and len(tag) > 3 and is_hex(tag[3], 64):
        return tag[3]
    return None


def _nip10_author(tag: list[str]) -> str | None:
    # NIP-10 marked tags: ["e", id, relay, marker, pubkey]
    if len(tag) > 4 and is_hex(tag[4], 64):
        return tag[4]
    return None


def _marker(tag: list[str]) -> str | None:
    return tag[3] if len(tag) > 3 else None


def read_threading(event: NostrEvent) -> Threading:
    """Read the thread position of ``event`` from NIP-22 tags, else NIP-10 ``e`` tags.

    NIP-22: ``E``/``K``/``P`` name the root, ``e``/``k``/``p`` the parent (a reply
    straight to the root may omit ``e``). NIP-10 marked: ``e`` with ``root`` /
    ``reply`` markers (a lone ``root`` is also the parent; of several ``reply`` markers the last
    one, as NDK writes a reply to a reply: the parent's marked tags copied, then its own; a marker
    missing beside unmarked tags is filled positionally: the first unmarked is the root, the last the
    parent). NIP-10
    positional: the first ``e`` is the root and the last the parent; ``mention`` tags are
    skipped. Ids that are not 64 hex characters are ignored.
    """
    root_tag = _first(event.tags, TAG_ROOT_EVENT)
    if root_tag is not None and is_hex(root_tag[1], 64):
        return _nip22_threading(event.tags, root_tag)
    return _nip10_threading(event.tags)


def _nip22_threading(tags: list[list[str]], root_tag: list[str]) -> Threading:
    """NIP-22: the root from ``E``/``K``/``P``, the parent from ``e``/``k``/``p`` (else the root)."""
    root_id = root_tag[1]
    root_kind = _kind_of(_first(tags, TAG_ROOT_KIND))
    root_author = _hex_value(_first(tags, TAG_ROOT_AUTHOR)) or _author_hint(root_tag)
    parent_tag = _first(tags, TAG_EVENT)
    if parent_tag is None or not is_hex(parent_tag[1], 64):
        return Threading(ThreadStyle.NIP22, root_id, root_kind, root_author, root_id, root_kind, root_author)
    parent_author = _author_hint(parent_tag) or _hex_value(_first(tags, TAG_PUBKEY))
    return Threading(
        ThreadStyle.NIP22, root_id, root_kind, root_author,
        parent_tag[1], _kind_of(_first(tags, TAG_PARENT_KIND)), parent_author,
    )


def _nip10_threading(tags: list[list[str]]) -> Threading:
    """NIP-10: marked ``root``/``reply`` ``e`` tags, else positional ones (first root, last parent)."""
    e_tags = [t for t in tags if len(t) > 1 and t[0] == TAG_EVENT and is_hex(t[1], 64)]
    marked_root = next((t for t in e_tags if _marker(t) == MARKER_ROOT), None)
    marked_reply = next((t for t in reversed(e_tags) if _marker(t) == MARKER_REPLY), None)
    unmarked = [t for t in e_tags if _marker(t) not in (MARKER_ROOT, MARKER_REPLY, MARKER_MENTION)]
    # a marker missing beside the other is filled positionally (as nostr-tools reads it): an unmarked root
    # beside a marked reply, a marked root beside an unmarked parent
    marked = marked_root or marked_reply
    if marked is not None:
        root = marked_root or (unmarked[0] if unmarked else marked)
        parent = marked_reply or (unmarked[-1] if unmarked else marked)
        return Threading(
            ThreadStyle.NIP10_MARKED, root[1], None, _nip10_author(root),
            parent[1], None, _nip10_author(parent),
        )
    if not unmarked:  # no marker at all: the tags but mentions, by position
        return Threading(ThreadStyle.NONE)
    return Threading(ThreadStyle.NIP10_POSITIONAL, unmarked[0][1], None, None, unmarked[-1][1], None, None)
