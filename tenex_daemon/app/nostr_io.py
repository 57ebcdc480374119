"""The daemon's Nostr glue: classifying events with the codec, composing signed replies,
publishing through the relay pool, and the project's own announcements (profiles, heartbeat).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from tenex_daemon.adapters.nostr.codec import ThreadRoot, build_reply_tags, read_threading
from tenex_daemon.adapters.nostr.relay_pool import RelayPool
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.core.agents import Agent
from tenex_daemon.core.classify import Classification, EventClass
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.ports import ReplySpec
from tenex_daemon.core.vocabulary import (
    KIND_COMMENT,
    KIND_CONVERSATION_ROOT,
    KIND_NOTE,
    KIND_PROFILE,
    KIND_PROJECT,
    KIND_PROJECT_STATUS,
    KIND_STREAMING,
    KIND_TASK,
    KIND_TYPING_START,
    KIND_TYPING_STOP,
)


def classify_event(event: NostrEvent) -> Classification:
    """Classify an incoming event once: new conversation, reply, task, or ignored with the reason.

    kind 11 starts a conversation; kind 1934 starts a task (its own conversation); kind
    1111 and NIP-10 replies (kind 1 with ``e`` tags) continue the conversation of their
    root (a root of kind 1934 makes it a task reply); a kind-1 note that replies to
    nothing starts a conversation.
    """
    if event.kind == KIND_CONVERSATION_ROOT:
        return Classification(EventClass.NEW_CONVERSATION, event.id)
    if event.kind == KIND_TASK:
        return Classification(EventClass.TASK, event.id, is_task=True)
    if event.kind not in (KIND_COMMENT, KIND_NOTE):
        return Classification(EventClass.IGNORED, reason=f"unsupported_kind:{event.kind}")
    threading = read_threading(event)
    if threading.root_id is None:
        if event.kind == KIND_NOTE:
            return Classification(EventClass.NEW_CONVERSATION, event.id)
        return Classification(EventClass.IGNORED, reason="reply_without_root")
    return Classification(EventClass.REPLY, threading.root_id, is_task=threading.root_kind == KIND_TASK)


class ClassifyOnce:
    """Classifies each incoming event once, for both the relay pool's lanes and the dispatcher.

    :meth:`lane` (the pool's ``lane_key``) classifies and keeps the result until the
    dispatcher asks for it (``__call__``); events the pool drops as duplicates are
    forgotten oldest first past ``keep``.
    """

    def __init__(self, keep: int = 10_000) -> None:
        self._keep = keep
        self._pending: OrderedDict[str, Classification] = OrderedDict()

    def lane(self, event: NostrEvent) -> str:
        """The key whose events must be delivered in order: the event's conversation."""
        classification = classify_event(event)
        self._pending[event.id] = classification
        if len(self._pending) > self._keep:
            self._pending.popitem(last=False)
        return classification.conversation_id or event.id

    def __call__(self, event: NostrEvent) -> Classification:
        """The event's classification (made by :meth:`lane` when the event came through the pool)."""
        classification = self._pending.pop(event.id, None)
        return classification if classification is not None else classify_event(event)


class SignedReplyComposer:
    """Builds an agent's kind-1111 reply with PROTOCOL.md's tags and signs it with the agent's key."""

    def __init__(self, signers: Mapping[str, Signer], project: tuple[str, str] | None) -> None:
        self._signers = signers
        self._project = project

    def compose(self, spec: ReplySpec) -> NostrEvent:
        """Return the signed reply."""
        root = ThreadRoot.of(spec.root) if spec.root is not None else None
        tags = build_reply_tags(
            spec.trigger,
            spec.destinations,
            root=root,
            project=self._project,
            phase=spec.phase,
            net_time_seconds=spec.net_time_seconds,
            session_id=spec.session_id,
            complete=spec.complete,
            llm_model=spec.model,
            prompt_tokens=spec.prompt_tokens,
            completion_tokens=spec.completion_tokens,
            error=spec.error,
            delegation=spec.delegation,
        )
        return self._signers[spec.agent_slug].sign(KIND_COMMENT, spec.content, tags)


class PoolPublisher:
    """Publishes through the relay pool; typing indicators are rate-limited per agent and conversation."""

    def __init__(
        self,
        pool: RelayPool,
        signers: Mapping[str, Signer],
        agents: Mapping[str, Agent],
        *,
        typing_min_interval_s: float = 5.0,
        publish_timeout_s: float = 10.0,
    ) -> None:
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
        event = self._signers[agent_slug].sign(kind, content, [["e", conversation_id]])
        await self._pool.publish(event, timeout=self._publish_timeout, raise_on_failure=False)

    async def partial(
        self, agent_slug: str, conversation_id: str, trigger_id: str, text: str, sequence: int
    ) -> None:
        """Publish an agent's streamed text so far as an ephemeral kind-21111 event.

        Tags: ``["e", <conversation id>]`` (as typing indicators), ``["e", <trigger id>, "", "reply"]``
        and ``["streaming", <sequence>]``. The final kind-1111 reply replaces it in clients.
        """
        tags = [["e", conversation_id], ["e", trigger_id, "", "reply"], ["streaming", str(sequence)]]
        event = self._signers[agent_slug].sign(KIND_STREAMING, text, tags)
        await self._pool.publish(event, timeout=self._publish_timeout, raise_on_failure=False)


def profile_event(signer: Signer, agent: Agent, about: str) -> NostrEvent:
    """Return an agent's kind-0 profile."""
    content = json.dumps({"name": agent.name, "display_name": agent.name, "about": about}, ensure_ascii=False)
    return signer.sign(KIND_PROFILE, content, [])


def heartbeat_event(
    project_signer: Signer, agents: Sequence[Agent], project: tuple[str, str] | None
) -> NostrEvent:
    """Return the project's kind-24010 status heartbeat: one ``["agent", pubkey, slug]`` tag per agent."""
    tags = [["agent", agent.pubkey, agent.slug] for agent in agents]
    if project is not None:
        tags.append(["a", f"{KIND_PROJECT}:{project[0]}:{project[1]}"])
    return project_signer.sign(KIND_PROJECT_STATUS, "", tags)
