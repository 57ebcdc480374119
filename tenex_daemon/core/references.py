"""``nostr:`` references to events inside message content (NIP-21, NIP-19)."""

from __future__ import annotations

import re
from collections.abc import Mapping

from tenex_daemon.core import nip19


def find_event_references(text: str) -> list[str]:
    """Return the valid ``nostr:note/nevent/naddr`` URIs in ``text``, in order, without repeats.

    Each item is the full URI (with the ``nostr:`` prefix). Invalid NIP-19 strings are skipped.
    """
    if "nostr:" not in text:
        return []
    found: list[str] = []
    for match in nip19.NOSTR_URI_PATTERN.finditer(text):
        uri = match.group(0)
        if uri in found:
            continue
        try:
            entity = nip19.decode(match.group(1))
        except nip19.Nip19Error:
            continue
        if entity.is_event_reference:
            found.append(uri)
    return found


def inline_entity(uri: str, content: str) -> str:
    """Return the element that replaces a resolved ``nostr:`` reference."""
    return f'<nostr-event entity="{uri}">{content}</nostr-event>'


def inline_entities(text: str, resolved: Mapping[str, str]) -> str:
    """Replace each resolved URI in ``text``; unresolved ones are left as written."""
    if not resolved or "nostr:" not in text:
        return text

    def replace(match: re.Match[str]) -> str:
        uri = match.group(0)
        content = resolved.get(uri)
        return uri if content is None else inline_entity(uri, content)

    return nip19.NOSTR_URI_PATTERN.sub(replace, text)
