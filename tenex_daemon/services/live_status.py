"""Who works on which conversation now: told by the run scheduler when each run starts and ends, it
publishes the conversation's live status (kind 24133, docs/PROTOCOL.md) through a :class:`RunStatus`.

Best effort, like the typing indicators: the scheduler's calls return at once, the publication runs as
a tracked background task, and a failure is logged and forgotten. Publications of one conversation go
out one at a time and in order; changes made while one is in flight are sent together by the next, so
the last status published is always the current one.
"""

from __future__ import annotations

from collections import Counter

import structlog

from tenex_daemon.core.agents import AuthorRole
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.ports import RunStatus
from tenex_daemon.runtime.background import BackgroundTasks
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.services.runs import RunRequest

log = structlog.get_logger(__name__)


class LiveStatus:
    """The agents working in each conversation (a :class:`~tenex_daemon.services.runs.RunListener`)."""

    def __init__(self, manager: ConversationManager, sink: RunStatus) -> None:
        self._manager = manager
        self._sink = sink
        self._working: dict[str, Counter[str]] = {}
        """Conversation id -> how many runs of each agent slug run in it now."""
        self._changed: set[str] = set()
        self._publishing: set[str] = set()
        self._parties: dict[str, tuple[str, str | None] | None] = {}
        """Conversation id -> (root id, person), None for a private one; kept while agents work in it."""
        self._tasks = BackgroundTasks("live status")
        self.published = 0
        """How many status events were handed to the sink without error."""

    def working(self, conversation_id: str) -> tuple[str, ...]:
        """The slugs of the agents working in the conversation now, in the order they started."""
        return tuple(slug for slug, runs in self._working.get(conversation_id, Counter()).items() if runs > 0)

    def run_started(self, request: RunRequest) -> None:
        """An agent starts working in a conversation."""
        self._working.setdefault(request.conversation_id, Counter())[request.agent_slug] += 1
        self._change(request.conversation_id)

    def run_ended(self, request: RunRequest) -> None:
        """An agent's run in a conversation is over."""
        cid = request.conversation_id
        runs = self._working.get(cid)
        if runs is None or runs[request.agent_slug] <= 0:
            return
        runs[request.agent_slug] -= 1
        if runs[request.agent_slug] == 0:
            del runs[request.agent_slug]
        if not runs:
            del self._working[cid]
        self._change(cid)

    def _change(self, conversation_id: str) -> None:
        self._changed.add(conversation_id)
        if conversation_id not in self._publishing:
            self._publishing.add(conversation_id)
            self._tasks.spawn(self._publish(conversation_id), f"status {conversation_id[:8]}")

    async def _publish(self, conversation_id: str) -> None:
        """Publish the conversation's status until no change is left unpublished."""
        try:
            while conversation_id in self._changed:
                self._changed.discard(conversation_id)
                slugs = self.working(conversation_id)
                try:
                    if await self._send(conversation_id, slugs):
                        self.published += 1
                except Exception as exc:
                    log.info("status_not_published", conversation_id=conversation_id, error=str(exc))
                if not slugs and conversation_id not in self._working:
                    self._parties.pop(conversation_id, None)
        finally:
            self._publishing.discard(conversation_id)

    async def _send(self, conversation_id: str, slugs: tuple[str, ...]) -> bool:
        """Publish the status; False for a private conversation (nothing of it goes out in the clear)."""
        if conversation_id not in self._parties:
            # from the store, without the manager's lock: a run holds that lock while its reply is
            # saved, and the status saying it works must not wait for that. What is read here (the
            # root, the people, privacy) is not what a change being saved changes.
            conversation = await self._manager.store.load(conversation_id)
            if conversation is None:  # gone (deleted): nothing is known of it, a private one included
                return False
            known = self._parties_of(conversation)
            self._parties[conversation_id] = known
        parties = self._parties[conversation_id]
        if parties is None:
            return False
        agents = (self._manager.agents.find(slug) for slug in slugs)
        pubkeys = tuple(agent.pubkey for agent in agents if agent is not None)
        root_id, person = parties
        await self._sink.working(conversation_id, root_id, person, pubkeys)
        return True

    def _parties_of(self, conversation: Conversation) -> tuple[str, str | None] | None:
        """(root id, person) of a conversation: the person is the root's author when a person, else the
        newest person in its history (None when nobody is); None for a private conversation."""
        if conversation.private:
            return None
        directory = self._manager.agents
        root = conversation.root
        root_id = conversation.thread_id  # a task's later session: the task, the thread clients show
        for event in (root, *reversed(conversation.history)):
            if event is None:
                continue
            if directory.role_of(event.pubkey, conversation.claims_agent(event.pubkey)) is AuthorRole.USER:
                return root_id, event.pubkey
        return root_id, None

    async def flush(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for the publications under way; return how many are left."""
        return await self._tasks.wait(timeout_s)

    async def close(self, timeout_s: float) -> None:
        """On stop: wait up to ``timeout_s`` for the publications under way, then cancel the rest."""
        if await self.flush(timeout_s):
            await self._tasks.cancel_all()
