"""``nostr:`` references to events inside message content (NIP-21, NIP-19)."""

from __future__ import annotations

import re
from collections.abc import Mapping

from tenex_daemon.core import nip19

MAX_REFERENCES_PER_MESSAGE = 32
"""The most distinct ``nostr:`` event references of one message that are resolved (docs/CONTEXT.md)."""

MAX_INLINED_CHARS_PER_MESSAGE = 262_144
"""The most referenced content one message is given inline; later occurrences stay as written (a message
repeating one reference thousands of times made a context of hundreds of megabytes)."""


def find_event_references(text: str) -> list[str]:
    """Return the valid ``nostr:note/nevent/naddr`` URIs in ``text``, in order, without repeats, the first
    :data:`MAX_REFERENCES_PER_MESSAGE` of them.

    Each item is the full URI (with the ``nostr:`` prefix). Invalid NIP-19 strings are skipped.
    """
    if "nostr:" not in text:
        return []
    found: list[str] = []
    seen: set[str] = set()
    for match in nip19.NOSTR_URI_PATTERN.finditer(text):
        uri = match.group(0)
        if uri in seen:
            continue
        seen.add(uri)
        try:
            entity = nip19.decode(match.group(1))
        except nip19.Nip19Error:
            continue
        if entity.is_event_reference:
            found.append(uri)
            if len(found) == MAX_REFERENCES_PER_MESSAGE:
                break
    return found


def inline_entity(uri: str, content: str) -> str:
    """Return the element that replaces a resolved ``nostr:`` reference."""
    return f'<nostr-event entity="{uri}">{content}</nostr-event>'


def inline_entities(text: str, resolved: Mapping[str, str]) -> str:
    """Replace each resolved URI in ``text`` while the content given inline stays within
    :data:`MAX_INLINED_CHARS_PER_MESSAGE`; unresolved ones, and those past it, are left as written."""
    if not resolved or "nostr:" not in text:
        return text
    room = MAX_INLINED_CHARS_PER_MESSAGE

    def replace(match: re.Match[str]) -> str:
        nonlocal room
        uri = match.group(0)
        content = resolved.get(uri)
        if content is None or len(content) > room:
            return uri
        room -= len(content)
        return inline_entity(uri, content)

    return nip19.NOSTR_URI_PATTERN.sub(replace, text)
