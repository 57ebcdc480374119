"""The kind-21111 partial-text event the pool publisher signs while an agent's backend streams."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from tenex_daemon.adapters.nostr.codec import verify_event
from tenex_daemon.adapters.nostr.publisher import PoolPublisher
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.vocabulary import KIND_STREAMING
from tests.conftest import Cast


@dataclass
class RecordingPool:
    """Stands in for the relay pool: records what is published and how."""

    published: list[tuple[NostrEvent, dict[str, Any]]] = field(default_factory=list)

    async def publish(self, event: NostrEvent, **options: Any) -> None:
        """Record the event and the publish options."""
        self.published.append((event, options))


async def test_partial_is_a_signed_ephemeral_event_tagged_with_conversation_and_trigger(cast: Cast) -> None:
    """A partial is kind 21111, signed by the agent, tagged with the conversation, trigger and sequence."""
    signer = Signer(os.urandom(32), label="alice")
    pool = RecordingPool()
    publisher = PoolPublisher(pool, {"alice": signer}, {"alice": cast.alice})
    await publisher.partial("alice", "c" * 64, "t" * 64, "Once upon", 3)

    [(event, options)] = pool.published
    assert event.kind == KIND_STREAMING
    assert event.pubkey == signer.pubkey
    assert verify_event(event)
    assert event.content == "Once upon"
    assert event.tags == [["e", "c" * 64], ["e", "t" * 64, "", "reply"], ["streaming", "3"]]
    assert options["raise_on_failure"] is False
