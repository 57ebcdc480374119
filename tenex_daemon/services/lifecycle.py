"""Which conversation an incoming event joins when its threading alone does not say: kind-1 channels
and task sessions (docs/ARCHITECTURE.md, "Conversation lifecycle").

- **Kind-1 channels.** A person's top-level kind-1 note (no ``e`` tags) to an agent continues that
  person's open conversation with that agent (the channel ``<agent slug>:<person pubkey>``, or
  ``*:<person pubkey>`` for notes the orchestrator routes) while its last activity is younger than
  the idle timeout; otherwise the open one is ended (``by="idle"``) and the note starts a new one.
  The channel's current conversation is kept in the store's small values (``channel.<key>``).
- **Task sessions.** A task (kind 1934) is worked on in sessions: its first session is the
  conversation rooted at the task. A session expires ``tasks.session_ttl_h`` after its last
  activity (``ConversationManager.expires_at``); the next event for the task ends and archives it
  and starts a new session rooted at that event, linked to the old one (``previous_session``; the
  current one is kept under ``task.<task id>``). The new session starts fresh, as an expired session
  is gone.

Both decisions are made under a lock per channel or task, and (with daemons sharing a database) the
store's lease on the same key, so two notes that arrive together never start two conversations.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import structlog

from tenex_daemon.core.agents import AgentDirectory
from tenex_daemon.core.conversation import TASK_SESSION_EXPIRED, Conversation, TitleSource
from tenex_daemon.core.errors import ConversationExistsError
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.targeting import choose_target
from tenex_daemon.core.vocabulary import KIND_NOTE
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.services.locks import KeyedLock

log = structlog.get_logger(__name__)

PRIVATE_CHANNEL_PREFIX = "dm:"
"""How a private (NIP-17) conversation's channel key starts: ``dm:<agent slug>:<person's key>``."""


def loggable_channel(channel: str) -> str:
    """A channel key as the logs show it: a private one without its person's key (who talks privately to
    which agent, and when, stays out of the logs: NIP-17 hides exactly that)."""
    if channel.startswith(PRIVATE_CHANNEL_PREFIX):
        return channel.rpartition(":")[0] + ":…"
    return channel

MS_PER_MINUTE = 60_000
DEFAULT_IDLE_TIMEOUT_MIN = 30.0
IDLE = "idle"
"""``ended_by`` of a conversation ended because it was idle."""
IDLE_TIMEOUT = "idle_timeout"


def channel_meta_key(channel: str) -> str:
    """The small value holding a channel's current conversation id."""
    return f"channel.{channel}"


def task_meta_key(task_id: str) -> str:
    """The small value holding a task's current session (a conversation id)."""
    return f"task.{task_id}"


def adopted_root_key(root_id: str) -> str:
    """The small value holding the conversation a reply started when its root, ``root_id``, could not be
    found: the thread's later replies, and stops naming that root, find it there."""
    return f"adopted_root.{root_id}"


@dataclass(frozen=True, slots=True)
class Joined:
    """Where an event went: the conversation, whether the event started it, and whether it was new."""

    conversation: Conversation
    created: bool
    added: bool = True
    """False when the event was there already (a duplicate delivery)."""


def note_channel(event: NostrEvent, directory: AgentDirectory) -> str | None:
    """The channel of a person's top-level kind-1 note to an agent: ``<agent slug>:<person>``, ``*`` for the
    orchestrator (None for anything else; the caller knows the note is top-level)."""
    if event.kind != KIND_NOTE or directory.by_pubkey(event.pubkey) is not None:
        return None
    target = choose_target(event, directory)
    if target.agent is None:
        return None
    slug = "*" if target.via_orchestrator or target.agent.orchestrator else target.agent.slug
    return f"{slug}:{event.pubkey}"


class ConversationLifecycle:
    """Kind-1 channels and task sessions for the dispatcher; times come from the manager's clock."""

    def __init__(
        self,
        manager: ConversationManager,
        *,
        idle_timeout_min: float = DEFAULT_IDLE_TIMEOUT_MIN,
    ) -> None:
        if idle_timeout_min <= 0:
            raise ValueError("the idle timeout must be positive")
        self._manager = manager
        self.idle_timeout_ms = int(idle_timeout_min * MS_PER_MINUTE)
        self._locks = KeyedLock()

    @asynccontextmanager
    async def _holding(self, key: str) -> AsyncIterator[None]:
        async with self._locks.hold(key), self._manager.store.lease(key):
            yield

    async def repoint(self, conversation: Conversation) -> None:
        """After a crash: a channel's conversation, or a task's later session, whose starting event is being
        dispatched again may have been created without its pointer (``channel.<key>``, ``task.<id>``) being
        written; it becomes the current one then, unless a newer one took over since."""
        if conversation.channel is not None:
            key = channel_meta_key(conversation.channel)
        elif conversation.task_id is not None and conversation.id != conversation.task_id:
            key = task_meta_key(conversation.task_id)
        else:
            return
        async with self._holding(key):
            store = self._manager.store
            current_id = await store.get_meta(key)
            if current_id == conversation.id:
                return
            current = None if current_id is None else await self._manager.get_conversation(current_id)
            if current is not None and current.created_at > conversation.created_at:
                return
            await store.set_meta(key, conversation.id)
        channel = conversation.channel
        shown = key if channel is None else channel_meta_key(loggable_channel(channel))  # no person's key
        log.warning("conversation_pointer_repaired", key=shown, conversation_id=conversation.id,
                    was=current_id)

    async def adopt_channel(self, conversation: Conversation) -> bool:
        """A conversation a rebuild brought back becomes its channel's current one when the channel has none,
        or its current one is gone (a home restored from the relays): the person's next message continues
        it while it is open. A channel that has a current conversation keeps it. True when adopted."""
        if conversation.channel is None:
            return False
        key = channel_meta_key(conversation.channel)
        async with self._holding(key):
            store = self._manager.store
            current_id = await store.get_meta(key)
            if current_id == conversation.id:
                return False
            if current_id is not None and await self._manager.get_conversation(current_id) is not None:
                return False
            await store.set_meta(key, conversation.id)
        channel = loggable_channel(conversation.channel)
        log.info("channel_conversation_adopted", channel=channel, conversation_id=conversation.id)
        return True

    # --- kind-1 channels ------------------------------------------------------------------

    def channel_of(self, event: NostrEvent) -> str | None:
        """The channel of a person's top-level kind-1 note to an agent (None for anything else)."""
        return note_channel(event, self._manager.agents)

    async def join_channel(
        self, channel: str, event: NostrEvent, *, busy: Callable[[str], bool] | None = None
    ) -> Joined:
        """Add the note to the channel's open conversation, or start a new one (ending the old, unless
        ``busy`` says a run in it is scheduled or under way: its answer is still to come there)."""
        key = channel_meta_key(channel)
        async with self._holding(key):
            store = self._manager.store
            current_id = await store.get_meta(key)
            current = None if current_id is None else await self._manager.get_conversation(current_id)
            now = self._manager.now_ms()
            idle_before = now - self.idle_timeout_ms
            if current is not None and not current.archived and not current.is_ended:
                if current.last_activity <= idle_before and not (busy is not None and busy(current.id)):
                    ended = await self._manager.end_conversation(
                        current.id, by=IDLE, reason=IDLE_TIMEOUT, idle_before=idle_before
                    )  # if not: a reply in its thread came meanwhile (the note joins), or it ended otherwise
                    current = None if ended else await self._manager.get_conversation(current.id)
                if current is not None and not current.archived and not current.is_ended:
                    added = await self._manager.add_event(current.id, event)
                    return Joined(current, created=False, added=added)
            conversation = await self._manager.create_conversation(event, exclusive=True, channel=channel)
            await store.set_meta(key, conversation.id)
            log.info(
                "channel_conversation_started",
                channel=loggable_channel(channel),
                conversation_id=conversation.id,
                previous=current_id,
            )
            return Joined(conversation, created=True)

    async def point_channel(self, channel: str, conversation_id: str) -> bool:
        """Make ``conversation_id`` the channel's current conversation, unless the channel has an open one of
        its own (not ended, archived or idle); return whether it was made so. (An agent the orchestrator
        routed a person's private message to answers from another channel: the person's next message in
        that agent's chat continues the conversation.)"""
        key = channel_meta_key(channel)
        async with self._holding(key):
            current_id = await self._manager.store.get_meta(key)
            if current_id == conversation_id:
                return False
            current = None if current_id is None else await self._manager.get_conversation(current_id)
            idle_before = self._manager.now_ms() - self.idle_timeout_ms
            closed = current is None or current.archived or current.is_ended
            if not closed and current is not None and current.last_activity > idle_before:
                return False  # the channel's own conversation is open
            await self._manager.store.set_meta(key, conversation_id)
            return True

    # --- task sessions --------------------------------------------------------------------

    async def task_session(
        self, task_id: str, event: NostrEvent, *, busy: Callable[[str], bool] | None = None
    ) -> Joined | None:
        """Add an event for task ``task_id`` to its current session, or start a new session when that
        one expired or was deleted; None when the task has no session here (its root is unknown, or its
        only session was deleted: a late reply does not bring it back). A session ``busy`` says a run is
        scheduled or under way in has not expired: its answer is still to be saved there."""
        key = task_meta_key(task_id)
        async with self._holding(key):
            store = self._manager.store
            current_id = await store.get_meta(key) or task_id
            current = await self._manager.get_conversation(current_id)
            if current is None and current_id != task_id:  # the current session was deleted (retention,
                first = await self._manager.get_conversation(task_id)  # an operator): the next starts anew,
                return await self._new_session(task_id, event, None, first)  # named as the task's first
            if current is None:
                return None
            now = self._manager.now_ms()
            expires = self._manager.expires_at(current)
            if expires is None or now < expires or (busy is not None and busy(current.id)):
                if current.archived:
                    await self._manager.restore_conversation(current.id)
                added = await self._manager.add_event(current.id, event)
                return Joined(current, created=False, added=added)
            if await self._manager.store.is_processed(event.id):
                return Joined(current, created=False, added=False)
            if not current.is_ended:
                await self._manager.end_conversation(current.id, by=IDLE, reason=TASK_SESSION_EXPIRED)
            if not current.archived:
                await self._manager.archive_conversation(current.id)
            return await self._new_session(task_id, event, current)

    async def _new_session(
        self,
        task_id: str,
        event: NostrEvent,
        previous: Conversation | None,
        first: Conversation | None = None,
    ) -> Joined | None:
        """Start the task's next session at ``event``, after ``previous`` (None: the current one is gone; then
        ``first``, the task's first session if it is still stored, gives the title and the link back); the
        caller holds the task's key."""
        before = previous if previous is not None else first
        # the person's title of the task (its tag) stays the title of its every session
        title = before.title if before is not None and before.title_source is TitleSource.TAG else None
        try:
            session = await self._manager.create_conversation(
                event, exclusive=True, task_id=task_id, previous_session=before.id if before else None,
                title=title,
            )
        except ConversationExistsError:
            return None if previous is None else Joined(previous, created=False, added=False)
        await self._manager.store.set_meta(task_meta_key(task_id), session.id)
        log.info(
            "task_session_started", task_id=task_id, conversation_id=session.id,
            previous=previous.id if previous else None,
        )
        return Joined(session, created=True)
