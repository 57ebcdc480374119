"""Publishing an agent's events through the relay pool: replies, typing indicators, partial text."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from typing import Protocol

from tenex_daemon.core.agents import Agent
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.vocabulary import KIND_STREAMING, KIND_TYPING_START, KIND_TYPING_STOP

from .codec import streaming_tags, typing_tags
from .signer import Signer

TYPING_STARTS_KEPT = 1024
"""Typing starts remembered (agent, conversation) before those older than the interval are forgotten."""


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
        self._typing_waits: dict[tuple[str, str], asyncio.Event] = {}
        """Starts waiting out the interval, by (agent, conversation); setting one makes it give up."""

    async def publish(self, event: NostrEvent) -> None:
        """Publish to every writable relay; raise when none accepted it."""
        await self._pool.publish(event, timeout=self._publish_timeout)

    async def typing(self, agent_slug: str, conversation_id: str, active: bool) -> None:
        """Publish typing start or stop, tagged with the conversation. Starts are at least the interval
        apart, a stop in between (the end of a run) included: one that comes sooner waits out the rest
        of it, and gives up when a stop (or a newer start) comes meanwhile."""
        key = (agent_slug, conversation_id)
        if active:
            if not await self._typing_start_due(key):
                return
        else:
            waiting = self._typing_waits.pop(key, None)
            if waiting is not None:
                waiting.set()  # the start still waiting is not sent: the run it was for has ended
        name = self._agents[agent_slug].name
        kind = KIND_TYPING_START if active else KIND_TYPING_STOP
        content = f"{name} is typing" if active else ""
        event = self._signers[agent_slug].sign(kind, content, typing_tags(conversation_id))
        await self._pool.publish(event, timeout=self._publish_timeout, raise_on_failure=False)

    async def _typing_start_due(self, key: tuple[str, str]) -> bool:
        """Wait until a start for ``key`` may go out; record it and return True, or False when a stop or
        a newer start came while it waited."""
        last = self._typing_started.get(key)
        wait = 0.0 if last is None else last + self._typing_interval - time.monotonic()
        if wait > 0:
            older = self._typing_waits.get(key)
            if older is not None:
                older.set()  # the newer start takes its place
            given_up = self._typing_waits[key] = asyncio.Event()
            try:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await given_up.wait()
            finally:
                if self._typing_waits.get(key) is given_up:  # not taken by a stop or a newer start
                    del self._typing_waits[key]
            if given_up.is_set():
                return False
        now = time.monotonic()
        if len(self._typing_started) >= TYPING_STARTS_KEPT:
            interval = self._typing_interval
            self._typing_started = {k: t for k, t in self._typing_started.items() if now - t < interval}
        self._typing_started[key] = now
        return True

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
