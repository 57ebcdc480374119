"""Publishing an agent's events through the relay pool: replies, typing indicators, partial text."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Protocol

from tenex_daemon.core.agents import Agent
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.vocabulary import KIND_STREAMING, KIND_TYPING_START, KIND_TYPING_STOP

from .codec import streaming_tags, typing_tags
from .signer import Signer


class EventPublishing(Protocol):
    """What the publisher needs from the relay pool (:meth:`RelayPool.publish`)."""

    async def publish(
        self,
        event: NostrEvent,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - RelayPool.publish's own per-relay deadline
        raise_on_failure: bool = True,
    ) -> object:
        """Send ``event`` to the relays; raise when none accepted it (unless told not to)."""


class PoolPublisher:
    """Publishes through the relay pool; typing indicators are rate-limited per agent and conversation."""

    def __init__(
        self,
        pool: EventPublishing,
        signers: Mapping[str, Signer],
        agents: Mapping[str, Agent],
        *,
        typing_min_interval_s: float = 5.0,
        publish_timeout_s: float = 10.0,
    ) -> None:
        """Publish through ``pool``, signing with ``signers`` by agent slug."""
        self._pool = pool
        self._signers = signers
        self._agents = agents
        self._typing_interval = typing_min_interval_s
        self._publish_timeout = publish_timeout_s
        self._typing_started: dict[tuple[str, str], float] = {}

    async def publish(self, event: NostrEvent) -> None:
        """Publish to every writable relay; raise when none accepted it."""
        await self._pool.publish(event, timeout=self._publish_timeout)

    async def typing(self, agent_slug: str, conversation_id: str, active: bool) -> None:
        """Publish typing start (at most one per interval) or stop, tagged with the conversation."""
        key = (agent_slug, conversation_id)
        now = time.monotonic()
        if active:
            last = self._typing_started.get(key)
            if last is not None and now - last < self._typing_interval:
                return
            self._typing_started[key] = now
        else:
            self._typing_started.pop(key, None)
        name = self._agents[agent_slug].name
        kind = KIND_TYPING_START if active else KIND_TYPING_STOP
        content = f"{name} is typing" if active else ""
        event = self._signers[agent_slug].sign(kind, content, typing_tags(conversation_id))
        await self._pool.publish(event, timeout=self._publish_timeout, raise_on_failure=False)

    async def partial(
        self, agent_slug: str, conversation_id: str, trigger_id: str, text: str, sequence: int
    ) -> None:
        """Publish an agent's streamed text so far as an ephemeral kind-21111 event.

        Tagged by :func:`~tenex_daemon.adapters.nostr.codec.streaming_tags`; the final
        reply (kind 1111, or kind 1 in a kind-1 conversation) replaces it in clients.
        """
        tags = streaming_tags(conversation_id, trigger_id, sequence)
        event = self._signers[agent_slug].sign(KIND_STREAMING, text, tags)
        await self._pool.publish(event, timeout=self._publish_timeout, raise_on_failure=False)
