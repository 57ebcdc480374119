"""The kind-21111 partial-text event the pool publisher signs while an agent's backend streams, and its
typing indicators' rate."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Any

from tenex_daemon.adapters.nostr.codec import verify_event
from tenex_daemon.adapters.nostr.publisher import PoolPublisher
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.vocabulary import KIND_STREAMING, KIND_TYPING_START, KIND_TYPING_STOP
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


async def test_typing_starts_are_an_interval_apart_even_across_runs(cast: Cast) -> None:
    """A typing start within the interval of the last one (the next run, after a stop) waits out the rest
    of it and is sent then, unless a stop comes first; stops go out at once, and another conversation
    has its own interval."""
    pool = RecordingPool()
    interval = 1.0  # the stopped run's start must not come due before the stop, on a loaded machine too
    publisher = PoolPublisher(
        pool, {"alice": Signer(os.urandom(32))}, {"alice": cast.alice}, typing_min_interval_s=interval
    )
    one, other = "c" * 64, "d" * 64
    first_start = time.monotonic()
    await publisher.typing("alice", one, True)
    await publisher.typing("alice", one, False)

    stopped_run = asyncio.create_task(publisher.typing("alice", one, True))  # the next run, too soon
    await asyncio.sleep(0)
    await publisher.typing("alice", other, True)
    await publisher.typing("alice", one, False)  # that run ends before its start was due
    await asyncio.wait_for(stopped_run, interval / 2)
    await publisher.typing("alice", one, True)  # a third run: sent once the interval has passed
    sent_at = time.monotonic()

    sent = [(event.kind, event.tags[0][1]) for event, _ in pool.published]
    assert sent == [
        (KIND_TYPING_START, one), (KIND_TYPING_STOP, one), (KIND_TYPING_START, other),
        (KIND_TYPING_STOP, one), (KIND_TYPING_START, one),
    ]
    assert sent_at - first_start >= interval
