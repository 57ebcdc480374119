"""A conversation's live status as a signed kind-24133 event (ephemeral, docs/PROTOCOL.md).

Tags: ``["e", <conversation root>]`` (the root, never the event that triggered a run), one
``["p", <agent pubkey>]`` per agent working now (none when idle), ``["P", <person>]`` when the
conversation's person is known and, when the project is known, ``["a", "31933:<owner>:<d>"]``; signed by
the project key. The content is empty: everything is in the tags.
"""

from __future__ import annotations

import time

from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.vocabulary import (
    KIND_OPERATIONS_STATUS,
)

from .codec import status_tags
from .dating import NewestLast
from .publisher import EventPublishing
from .signer import Signer


class StatusEventPublisher:
    """Signs each conversation's live status with the project key and publishes it (a :class:`RunStatus`).

    A status published right after another of the same conversation is dated at least one second
    later, so clients that keep the newest status by ``created_at`` keep the right one.
    """

    def __init__(
        self,
        pool: EventPublishing,
        project_signer: Signer,
        project: tuple[str, str] | None,
        *,
        publish_timeout_s: float = 10.0,
    ) -> None:
        """Publish through ``pool``; ``project`` is (owner pubkey, d-tag) for the ``a`` tag (None: none)."""
        self._pool = pool
        self._signer = project_signer
        self._project = project
        self._timeout = publish_timeout_s
        self._dates = NewestLast()

    def compose(self, root_id: str, person: str | None, agents: tuple[str, ...]) -> NostrEvent:
        """Return the signed status event of the conversation rooted at ``root_id``."""
        created_at = self._dates.date(root_id, int(time.time()))
        tags = status_tags(root_id, person, agents, self._project)
        return self._signer.sign(KIND_OPERATIONS_STATUS, "", tags, created_at=created_at)

    async def working(
        self, conversation_id: str, root_id: str, person: str | None, agents: tuple[str, ...]
    ) -> None:
        """Publish the status (best effort: a relay that refuses it is not an error)."""
        event = self.compose(root_id, person, agents)
        await self._pool.publish(event, timeout=self._timeout, raise_on_failure=False)
