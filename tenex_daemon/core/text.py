"""Text shortened for a log line or a table cell."""

from __future__ import annotations


def shortened(text: str, chars: int) -> str:
    """``text`` cut to ``chars`` characters, the cut marked with an ellipsis."""
    return text if len(text) <= chars else text[: chars - 1] + "…"
