"""Reading a provider's answer without trusting it: its size, its token counts, its text's shape.

A server that says HTTP 200 may still send anything: a 200 MB answer, a usage block whose counts are
words, content that is a list of parts. What can be kept is kept (a bad token count never throws away a
good answer); an answer over :data:`MAX_ANSWER_BYTES` is cut there and reported as cut at the length
limit (the reply then says it is not whole).
"""

from __future__ import annotations

from typing import Any

from tenex_daemon.adapters.nostr.codec import DEFAULT_MAX_CONTENT_BYTES

MAX_ANSWER_BYTES = DEFAULT_MAX_CONTENT_BYTES - 1024
"""The most an answer's text may hold (UTF-8 bytes): an event's content over the 256 KiB a daemon accepts
(``daemon.max_content_bytes``' default, the codec's) is refused by daemons and most relays that read it, so a
longer answer could not be published whole anyway; 1 KiB is left for the note saying it was cut. Text past
it is neither kept in memory nor streamed."""


def token_count(value: Any) -> int | None:
    """A usage count as an int when it is one (a whole float too), else None: never an exception."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    return None


def text_of(content: Any) -> str:
    """A message's content as text: a string as it is, a list of parts as their text joined (some servers
    send ``[{"type": "text", "text": ...}]``), anything else as no text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = (p.get("text") if isinstance(p, dict) else getattr(p, "text", None) for p in content)
        return "".join(text for text in texts if isinstance(text, str))
    return ""


def capped(text: str, limit: int = MAX_ANSWER_BYTES) -> tuple[str, bool]:
    """``text`` within ``limit`` UTF-8 bytes (cut at a character's boundary), and whether it was cut."""
    if len(text) <= limit // 4:  # a character is at most 4 bytes
        return text, False
    raw = text.encode("utf-8", errors="replace")
    if len(raw) <= limit:
        return text, False
    return raw[:limit].decode("utf-8", errors="ignore"), True


class AnswerSize:
    """Counts the bytes of a streamed answer; says what of each piece fits under :data:`MAX_ANSWER_BYTES`."""

    def __init__(self, limit: int = MAX_ANSWER_BYTES) -> None:
        self.limit = limit
        self.used = 0
        self.full = False
        """Whether the answer reached the limit (what came after was left out)."""

    def take(self, piece: str) -> str:
        """What of ``piece`` fits (all of it, a head of it, or nothing once full)."""
        if self.full:
            return ""
        kept, cut = capped(piece, self.limit - self.used)
        self.used += len(kept.encode("utf-8", errors="replace"))
        self.full = cut
        return kept
