"""Conversation search: the query, the summary row every store returns, and matching rules."""

from __future__ import annotations

import difflib
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tenex_daemon.core.conversation import Conversation, TitleSource
from tenex_daemon.core.phases import Phase

FUZZY_THRESHOLD = 0.6
"""Similarity (difflib ratio, 0..1) above which a title matches a query it does not contain."""


class SearchQuery(BaseModel):
    """Filters for :meth:`ConversationStore.search`. Unset filters match everything."""

    model_config = ConfigDict(frozen=True)

    id_prefix: str | None = None
    """Only the conversations whose id starts with these hex digits (lowercased): a person types a few."""
    title: str | None = None
    phase: Phase | None = None
    date_from: datetime | None = None
    date_to: datetime | None = None
    archived: bool | None = None
    participant: str | None = None
    """A hex public key that authored at least one event."""
    participants: tuple[str, ...] = ()
    """Hex public keys that all authored at least one event (a person and an agent, say)."""
    ended: bool | None = None
    """True: only ended conversations; False: only active ones."""
    inactive_before: int | None = None
    """Only conversations whose last activity (ms since the epoch) is older than this."""
    summarized: bool | None = None
    """True: only conversations with a summary (not blank); False: only those without one."""
    order: Literal["updated", "ended"] = "updated"
    """Rows newest update first, or (``ended``) newest end first, conversations not ended after them;
    ties by id, highest first. With ``limit``, the first rows in this order."""
    limit: int | None = None

    @field_validator("id_prefix")
    @classmethod
    def _lowercase(cls, value: str | None) -> str | None:
        return None if value is None else value.lower()


class ConversationSummary(BaseModel):
    """An index row: what listing and search return without loading history."""

    id: str
    title: str
    phase: Phase
    created_at: int
    """Milliseconds since the epoch."""
    updated_at: int
    event_count: int
    agent_count: int
    archived: bool = False
    participants: list[str] = Field(default_factory=list)
    activity_at: int = 0
    """When it last accepted an event (ms; ``updated_at`` for rows stored before that was kept)."""
    ended_at: int | None = None
    summary: str | None = None
    title_source: TitleSource | None = None
    described_at: int | None = None
    description_published: bool = True
    task_id: str | None = None

    @property
    def last_activity(self) -> int:
        """When it last accepted an event (ms)."""
        return self.activity_at or self.updated_at

    @classmethod
    def of(cls, conversation: Conversation) -> ConversationSummary:
        """Return the summary row of a loaded conversation."""
        return cls(
            id=conversation.id,
            title=conversation.title,
            phase=conversation.phase,
            created_at=conversation.created_at,
            updated_at=conversation.updated_at,
            event_count=len(conversation.history),
            agent_count=len(conversation.agent_states),
            archived=conversation.archived,
            participants=sorted(conversation.participants()),
            **lifecycle_fields(conversation.model_dump(mode="json", include=set(LIFECYCLE_FIELDS))),
        )


LIFECYCLE_FIELDS = (
    "activity_at", "ended_at", "summary", "title_source", "described_at", "description_published", "task_id"
)
"""The lifecycle fields an index row copies from a conversation's state (docs/ARCHITECTURE.md)."""


def lifecycle_fields(state: dict[str, Any]) -> dict[str, Any]:
    """The lifecycle fields of a conversation's state snapshot (JSON), defaults for absent ones."""
    return {
        "activity_at": int(state.get("activity_at") or 0),
        "ended_at": state.get("ended_at"),
        "summary": state.get("summary"),
        "title_source": state.get("title_source"),
        "described_at": state.get("described_at"),
        "description_published": bool(state.get("description_published", True)),
        "task_id": state.get("task_id"),
    }


def title_matches(title: str, query: str) -> bool:
    """Case-insensitive substring match, else a fuzzy match against the title or any word run."""
    t = title.casefold()
    q = query.casefold().strip()
    if not q or q in t:
        return True
    if difflib.SequenceMatcher(None, q, t).ratio() >= FUZZY_THRESHOLD:
        return True
    words = t.split()
    width = max(1, len(q.split()))
    for i in range(len(words)):
        window = " ".join(words[i : i + width])
        if difflib.SequenceMatcher(None, q, window).ratio() >= FUZZY_THRESHOLD:
            return True
    return False


def _ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def summary_matches(summary: ConversationSummary, query: SearchQuery) -> bool:
    """Return whether an index row passes every filter of ``query``."""
    if query.id_prefix is not None and not summary.id.startswith(query.id_prefix):
        return False
    if query.archived is not None and summary.archived != query.archived:
        return False
    if query.phase is not None and summary.phase != query.phase:
        return False
    if query.date_from is not None and summary.created_at < _ms(query.date_from):
        return False
    if query.date_to is not None and summary.created_at > _ms(query.date_to):
        return False
    if query.participant is not None and query.participant not in summary.participants:
        return False
    if query.participants and not set(query.participants) <= set(summary.participants):
        return False
    if query.ended is not None and (summary.ended_at is not None) != query.ended:
        return False
    if query.inactive_before is not None and summary.last_activity >= query.inactive_before:
        return False
    if query.summarized is not None and is_summarized(summary.summary) != query.summarized:
        return False
    return query.title is None or title_matches(summary.title, query.title)


def apply_query(rows: list[ConversationSummary], query: SearchQuery) -> list[ConversationSummary]:
    """Filter rows by ``query``, sort them in its order, cut at ``query.limit``."""
    found = [row for row in rows if summary_matches(row, query)]
    if query.order == "ended":
        found.sort(key=lambda row: (row.ended_at is not None, row.ended_at or 0, row.id), reverse=True)
    else:
        found.sort(key=lambda row: (row.updated_at, row.id), reverse=True)
    return found if query.limit is None else found[: query.limit]


def is_summarized(summary: str | None) -> bool:
    """Whether a conversation's summary says something (not missing, not blank)."""
    return bool((summary or "").strip())
