"""A conversation's title and summary as a signed kind-513 event (docs/PROTOCOL.md).

Tags: ``["e", <root id>]``, ``["title", …]``, ``["summary", …]``, ``["status", "active"|"ended"]`` and,
when the project is known, ``["a", "31933:<owner pubkey>:<project d-tag>"]``; signed by the project key.
The content is empty: everything is in the tags.
"""

from __future__ import annotations

from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.vocabulary import (
    KIND_CONVERSATION_METADATA,
)

from .codec import metadata_tags
from .dating import NewestLast
from .signer import Signer


class ConversationMetadataComposer:
    """Builds and signs the kind-513 event of a conversation's title and summary with the project key."""

    def __init__(self, project_signer: Signer, project: tuple[str, str] | None) -> None:
        """Sign with ``project_signer``; ``project`` is (owner pubkey, d-tag) for the ``a`` tag (None: no
        ``a`` tag, a home without an owner)."""
        self._signer = project_signer
        self._project = project
        self._dates = NewestLast()

    def compose(self, conversation_id: str, title: str, summary: str, *, ended: bool) -> NostrEvent:
        """Return the signed kind-513 event for the conversation rooted at ``conversation_id``, dated at
        least a second after the one before it (an end right after a description: clients keep the newest)."""
        tags = metadata_tags(conversation_id, title, summary, ended=ended, project=self._project)
        created_at = self._dates.date(conversation_id, self._signer.now())
        return self._signer.sign(KIND_CONVERSATION_METADATA, "", tags, created_at=created_at)
