"""What deleting a conversation erases besides its own records: the small values that belong to it.

A conversation's delegation threads (docs/ARCHITECTURE.md) are kept in the store's small values
under ``thread:<conversation id>__<a>__<b>``. Every store's ``delete`` erases the values whose key
starts with one of :func:`owned_value_prefixes`, so deleting a conversation (the retention sweeper,
the CLI, the API) leaves none of its content behind. Other small values that name a conversation
(a kind-1 channel's or a task's current conversation, the run journal, the outbox) hold ids only.
"""

from __future__ import annotations

from tenex_daemon.core.threads import KEY_SEPARATOR

THREAD_VALUE_PREFIX = "thread:"
"""The prefix of a delegation thread's small value (``thread:<thread id>``)."""


def owned_value_prefixes(conversation_id: str) -> tuple[str, ...]:
    """The key prefixes of the small values that belong to the conversation (erased with it)."""
    return (f"{THREAD_VALUE_PREFIX}{conversation_id}{KEY_SEPARATOR}",)


def value_owner(key: str) -> str | None:
    """The conversation a small value belongs to (a delegation thread's), or None."""
    if not key.startswith(THREAD_VALUE_PREFIX):
        return None
    conversation_id, separator, _ = key[len(THREAD_VALUE_PREFIX):].partition(KEY_SEPARATOR)
    return conversation_id if separator and conversation_id else None
