"""The conversations a :class:`~tenex_daemon.adapters.storage.postgres.PostgresStore` loaded or saved, kept
with the state text stored with each, so that a load reads the state row and only the events past those
it holds (docs/ARCHITECTURE.md, "Durability contract": appending costs O(the event), not O(the
conversation)). Every load still reads the database: what another daemon sharing it wrote since is seen
(a state replaced, events appended, the conversation deleted or made anew)."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.events import NostrEvent

LOAD_SQL = """SELECT -1 AS seq, state AS json, archived, NULL AS event_id FROM conversations WHERE id = $1
               UNION ALL
              SELECT seq, body, NULL, event_id FROM events WHERE conversation_id = $1 AND seq >= $2
               ORDER BY seq"""
"""A conversation's state row (``seq`` -1), then its events from ``seq`` $2 on, in order, read together (one
snapshot): 0 for the whole conversation, else the last one held, whose id says the history held is still
the stored one."""


@dataclass(slots=True)
class _Held:
    conversation: Conversation
    state_text: str
    """The state JSON stored with it (the column is text: read back as written)."""


class ConversationCache:
    """At most ``size`` conversations, the least recently used dropped first (the caller's live objects,
    as the filesystem store's cache holds them)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._held: OrderedDict[str, _Held] = OrderedDict()

    def first_seq(self, conversation_id: str) -> int:
        """The ``seq`` a load reads from (:data:`LOAD_SQL`'s $2): the last event held, else 0."""
        held = self._held.get(conversation_id)
        return 0 if held is None else max(len(held.conversation.history) - 1, 0)

    def loaded(self, conversation_id: str, first_seq: int, rows: Sequence[Any]) -> Conversation | None:
        """The conversation :data:`LOAD_SQL` read from ``first_seq`` (rows of seq, json, archived, event_id),
        from the copy held when it still agrees with them, else whole from the rows; None when it is not
        stored, or when the rows do not continue the history held (read it again from 0)."""
        if not rows or rows[0]["seq"] != -1:
            self.drop(conversation_id)
            return None
        state_text, events = rows[0]["json"], rows[1:]
        held = self._held.get(conversation_id) if first_seq else None
        if first_seq and held is None:
            return None  # dropped meanwhile (a failed write): read it whole
        if held is None:
            history = [NostrEvent.model_validate_json(r["json"]) for r in events]
            conversation = Conversation.from_state(json.loads(state_text), history)
        else:
            kept = held.conversation.history
            # the rows continue the history held (same event at first_seq) and reach at least its end: a read
            # older than what another load of this daemon took in since is not mixed with it (its state and
            # that newer history), nor is a conversation deleted and made anew, or cut: read whole
            same = first_seq < len(kept) <= first_seq + len(events) and events[0]["seq"] == first_seq
            if not same or events[0]["event_id"] != kept[first_seq].id:
                self.drop(conversation_id)
                return None
            conversation = held.conversation
            if state_text != held.state_text:  # another daemon saved its state
                conversation = Conversation.from_state_continuing(json.loads(state_text), conversation)
            for row in events[len(kept) - first_seq:]:  # those past the history held
                conversation.append(NostrEvent.model_validate_json(row["json"]))
        conversation.archived = rows[0]["archived"]
        self.keep(conversation, state_text)
        return conversation

    def keep(self, conversation: Conversation, state_text: str) -> None:
        """Hold ``conversation`` as stored with ``state_text`` (after a load, or a write committed)."""
        self._held[conversation.id] = _Held(conversation, state_text)
        self._held.move_to_end(conversation.id)
        while len(self._held) > self._size:
            self._held.popitem(last=False)

    def archived(self, conversation_id: str, archived: bool) -> None:
        """The conversation's archived flag was set."""
        held = self._held.get(conversation_id)
        if held is not None:
            held.conversation.archived = archived

    def drop(self, conversation_id: str) -> None:
        """Forget the conversation (deleted, or a write of it failed: what it holds is not known)."""
        self._held.pop(conversation_id, None)
