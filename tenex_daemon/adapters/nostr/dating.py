"""Dates for a conversation's events that clients keep only the newest of (kind 24133's live status, kind
513's title, summary and status): each one dated at least a second after the one before it of the same
conversation, so two signed in the same second are never a tie a client breaks at random."""

from __future__ import annotations

from collections import OrderedDict

REMEMBERED_ROOTS = 1024
"""Conversations whose last date is remembered (the least recently dated are forgotten first)."""


class NewestLast:
    """The last date given per conversation, the :data:`REMEMBERED_ROOTS` most recent ones."""

    def __init__(self, remembered: int = REMEMBERED_ROOTS) -> None:
        self._last: OrderedDict[str, int] = OrderedDict()
        self._remembered = remembered

    def date(self, root_id: str, now: int) -> int:
        """The date of the conversation's next event: ``now``, or a second after its last one if that is
        not earlier."""
        last = self._last.pop(root_id, None)
        created_at = now if last is None else max(now, last + 1)
        self._last[root_id] = created_at
        while len(self._last) > self._remembered:
            self._last.popitem(last=False)
        return created_at
