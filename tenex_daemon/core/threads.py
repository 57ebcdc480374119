"""Conversation threads per communication pair (docs/ARCHITECTURE.md): the thread model and its keys."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, Field

from tenex_daemon.core.errors import TenexError

USER_PARTICIPANT = "USER"
"""The other side of an agent's thread with the user."""

KEY_SEPARATOR = "__"


class ThreadPersistenceError(TenexError):
    """Loading or saving a thread failed; the thread's items are kept in memory."""

    def __init__(self, thread_id: str, action: str, cause: BaseException) -> None:
        super().__init__(
            f"could not {action} thread {thread_id!r}: {type(cause).__name__}: {cause}; "
            "its items are kept in memory and saved on the next successful save"
        )
        self.thread_id = thread_id
        self.action = action


def thread_key(chat_id: str, agent: str, other: str | None = None) -> str:
    """Return ``<chat_id>__<a>__<b>`` with the two names sorted, or ``<chat_id>__<agent>__USER``."""
    for name, value in (("chat_id", chat_id), ("agent", agent), ("other", other)):
        if value is not None and (not value or KEY_SEPARATOR in value):
            raise ValueError(f"{name} {value!r} must be non-empty and must not contain {KEY_SEPARATOR!r}")
    if other is None:
        return f"{chat_id}{KEY_SEPARATOR}{agent}{KEY_SEPARATOR}{USER_PARTICIPANT}"
    first, second = sorted((agent, other))
    return f"{chat_id}{KEY_SEPARATOR}{first}{KEY_SEPARATOR}{second}"


class ConversationThread(BaseModel):
    """The history of one communication pair within a chat: items in order plus metadata.

    Items are JSON values (messages, tool calls, tool outputs) when the store persists them;
    user callbacks may store anything they can save.
    """

    thread_id: str
    items: list[Any] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)

    def add_item(self, item: Any) -> None:
        """Append one item (persistence is the ThreadManager's job)."""
        self.items.append(item)

    def add_items(self, items: Sequence[Any]) -> None:
        """Append several items in order."""
        self.items.extend(items)

    def get_full_log(self) -> list[Any]:
        """Return a copy of every item."""
        return list(self.items)

    def to_json(self) -> str:
        """Serialize the thread (items must be JSON values)."""
        return json.dumps(
            {"thread_id": self.thread_id, "items": self.items, "metadata": self.metadata},
            ensure_ascii=False, separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, data: str) -> ConversationThread:
        """Rebuild a thread from :meth:`to_json` output."""
        return cls.model_validate(json.loads(data))
