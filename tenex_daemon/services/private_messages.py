"""Private conversations (NIP-17; docs/ARCHITECTURE.md, "Private conversations"): which gift-wrapped
messages are taken in, and which conversation a person's private message to an agent joins.

- **Intake** (:class:`Intake`). What the daemon's subscriptions deliver passes here before the
  dispatcher: a gift wrap (kind 1059) is opened with the key of the agent it is addressed to (an
  adapter, :class:`WrapOpener`) and its kind-14 rumor goes on in its place; a wrap that does not open is
  refused with the reason (counted, logged), never raised. A rumor is taken in only when it is
  one-to-one (it ``p``-tags the agent it was wrapped for and nobody else) and written by a person: a
  rumor by an agent is the copy of its own message (or of a ``send_message`` exchange) that the daemon
  wrapped for it, stored already. The allow-list then applies to the rumor's author, as to anyone's
  event (the dispatcher's first rule). The answer setting (``daemon.answer``) refuses what it excludes:
  private messages (``private_messages_off``) or public mentions (``public_mentions_off``).
- **Joining** (:class:`PrivateConversations`). A private conversation is one person with one agent:
  the channel ``dm:<agent slug>:<person>``, continued like a kind-1 channel (the same idle timeout,
  :meth:`ConversationLifecycle.join_channel`). A rumor whose ``e`` tag names an event of an earlier
  private conversation of the same person continues that one (reopened, restored from the archive if need
  be), of the same channel or another: an agent the orchestrator routed the person's message to answers
  in a chat of its own, where the person replies.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Protocol

import structlog

from tenex_daemon.core.agents import AgentDirectory
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.vocabulary import (
    ERROR_SYSTEM,
    KIND_COMMENT,
    KIND_CONVERSATION_ROOT,
    KIND_GIFT_WRAP,
    KIND_NOTE,
    KIND_PRIVATE_MESSAGE,
    KIND_TASK,
    TAG_ERROR,
    TAG_EVENT,
    TAG_PUBKEY,
)
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.services.lifecycle import (
    PRIVATE_CHANNEL_PREFIX,
    ConversationLifecycle,
    Joined,
    loggable_channel,
)

log = structlog.get_logger(__name__)

PRIVATE_MESSAGES_OFF = "private_messages_off"
"""A gift wrap, while ``daemon.answer = "public"``."""
PUBLIC_MENTIONS_OFF = "public_mentions_off"
"""A public mention (kinds 1, 11, 1111, 1934), while ``daemon.answer = "private"``."""
AGENT_PRIVATE_COPY = "agent_private_copy"
"""A rumor written by one of the agents: the copy the daemon wrapped for it (stored already)."""
PRIVATE_NOT_ONE_TO_ONE = "private_not_one_to_one"
"""A rumor that p-tags someone besides the agent it was wrapped for (a group message), or nobody."""
PUBLIC_KINDS = frozenset({KIND_NOTE, KIND_CONVERSATION_ROOT, KIND_COMMENT, KIND_TASK})
"""The kinds of public conversations (what ``daemon.answer = "private"`` refuses)."""
CHANNEL_PREFIX = PRIVATE_CHANNEL_PREFIX


class Opened(Protocol):
    """An opened gift wrap: its rumor and the agent it was addressed to."""

    @property
    def rumor(self) -> NostrEvent:
        """The kind-14 rumor (``sig`` empty), its id checked and its author the seal's."""

    @property
    def recipient(self) -> str:
        """The public key of the agent the wrap was addressed to."""


class WrapOpener(Protocol):
    """Opens gift wraps with the agents' keys (:class:`~tenex_daemon.adapters.nostr.private.GiftWraps`)."""

    def open(self, wrap: NostrEvent) -> Opened | str:
        """Return the opened wrap, or why it gives no private message."""


def refuse_private(rumor: NostrEvent, recipient: str, directory: AgentDirectory) -> str | None:
    """Why an opened rumor is not taken in (None: it is): by an agent, or not one-to-one."""
    if directory.by_pubkey(rumor.pubkey) is not None:
        return AGENT_PRIVATE_COPY
    addressed = {p for p in rumor.tag_values(TAG_PUBKEY) if p != rumor.pubkey}
    if addressed != {recipient}:
        return PRIVATE_NOT_ONE_TO_ONE
    return None


class Intake:
    """Turns what the subscriptions deliver into what the dispatcher handles (see the module docstring)."""

    def __init__(
        self,
        opener: WrapOpener | None,
        directory: AgentDirectory,
        *,
        public: bool = True,
        private: bool = True,
    ) -> None:
        """``public`` / ``private``: whether agents answer public mentions / private messages."""
        self._opener = opener
        self._directory = directory
        self._public = public
        self._private = private and opener is not None

    def admit(self, event: NostrEvent) -> NostrEvent | str:
        """The event to dispatch (a wrap's rumor in its place), or the reason it is refused."""
        if event.kind == KIND_GIFT_WRAP:
            if not self._private or self._opener is None:
                return PRIVATE_MESSAGES_OFF
            opened = self._opener.open(event)
            if isinstance(opened, str):
                return opened
            refusal = refuse_private(opened.rumor, opened.recipient, self._directory)
            if refusal is not None:
                # debug: the daemon logs refused wraps once a minute per reason (anyone can send them)
                log.debug("private_message_refused", event_id=event.id, reason=refusal)
                return refusal
            return opened.rumor
        if event.kind == KIND_PRIVATE_MESSAGE:
            return "private_message_in_the_clear"  # a rumor is only ever taken from a wrap
        if event.kind in PUBLIC_KINDS and not self._public:
            return PUBLIC_MENTIONS_OFF
        return event


def agent_channel(agent_slug: str, person: str) -> str:
    """The private channel of one person with one agent: ``dm:<agent slug>:<person>``."""
    return f"{CHANNEL_PREFIX}{agent_slug}:{person}"


def private_channel(rumor: NostrEvent, directory: AgentDirectory) -> str | None:
    """The channel ``dm:<agent slug>:<person>`` of a person's rumor to one agent (None: to no agent)."""
    for pubkey in rumor.tag_values(TAG_PUBKEY):
        agent = directory.by_pubkey(pubkey)
        if agent is not None and pubkey != rumor.pubkey:
            return agent_channel(agent.slug, rumor.pubkey)
    return None


def _persons_channel(channel: str | None, person: str) -> bool:
    """Whether ``channel`` is one of ``person``'s private channels (``dm:<any agent>:<person>``; a kind-1
    channel of an agent whose slug is ``dm``, ``dm:<person>``, is not one)."""
    if channel is None or not channel.startswith(CHANNEL_PREFIX):
        return False
    parts = channel.split(":")
    return len(parts) == 3 and parts[2] == person


class PrivateConversations:
    """Which private conversation a person's rumor joins (see the module docstring)."""

    def __init__(self, manager: ConversationManager, lifecycle: ConversationLifecycle) -> None:
        self._manager = manager
        self._lifecycle = lifecycle

    async def join(self, rumor: NostrEvent, *, busy: Callable[[str], bool] | None = None) -> Joined | None:
        """Add the rumor to its conversation (starting one if need be); None when it names no agent.
        ``busy`` says whether a run in a conversation is scheduled or under way: an idle one with a run
        still to answer is not ended (the rumor joins it), as for a kind-1 channel's note."""
        channel = private_channel(rumor, self._manager.agents)
        if channel is None:
            return None
        continued = await self._continued(rumor, channel)
        if continued is not None:
            return continued
        return await self._lifecycle.join_channel(channel, rumor, busy=busy)

    async def answered(self, conversation: Conversation, reply: NostrEvent) -> None:
        """An agent's private reply from another agent's channel (the orchestrator routed the person's
        message to it) shows in its own chat with the person: their next message there, with no ``e`` tag
        as clients write them, continues this conversation while it is open."""
        agent = self._manager.agents.by_pubkey(reply.pubkey)
        root = conversation.root
        if agent is None or root is None or not _persons_channel(conversation.channel, root.pubkey):
            return
        if reply.has_tag(TAG_ERROR, ERROR_SYSTEM):  # a notice (a failure's): no answer that moves the chat
            return
        channel = agent_channel(agent.slug, root.pubkey)
        if channel != conversation.channel and await self._lifecycle.point_channel(channel, conversation.id):
            shown = loggable_channel(channel)
            log.info("private_channel_pointed", conversation_id=conversation.id, channel=shown)

    async def _continued(self, rumor: NostrEvent, channel: str) -> Joined | None:
        """The earlier private conversation of the rumor's author its ``e`` tags reply into, with the rumor
        added: of ``channel``, or of another of their channels (an agent the orchestrator routed their
        message to answered in its own chat, and they reply there)."""
        for replied in reversed(rumor.tag_values(TAG_EVENT)):  # the message it answers, NIP-17's ``e``
            found = await self._manager.store.find_event(replied)
            conversation = None if found is None else await self._manager.get_conversation(found[0])
            if conversation is None or not conversation.private or not _persons_channel(
                conversation.channel, rumor.pubkey
            ):
                continue  # another person's, a public one, or unknown: the channel decides
            if conversation.archived:
                await self._manager.restore_conversation(conversation.id)
            added = await self._manager.add_event(conversation.id, rumor)
            shown = loggable_channel(channel)
            log.info("private_conversation_continued", conversation_id=conversation.id, channel=shown)
            return Joined(conversation, created=False, added=added)
        return None



# --- rebuilding private conversations from the agents' gift wraps ---------------------------------


@dataclass(frozen=True, slots=True)
class PrivateThread:
    """One private conversation found in the agents' gift wraps: its channel and its rumors, root first."""

    channel: str
    events: tuple[NostrEvent, ...]


def plan_private_conversations(
    opened: Iterable[Opened],
    directory: AgentDirectory,
    allowed: Collection[str],
    idle_timeout_ms: int,
    skipped: Counter[str],
) -> list[PrivateThread]:
    """Replay what the daemon did with the rumors of the agents' wraps (``tenexd conversations rebuild``):
    a person's message joins the conversation of the message its ``e`` tag answers when that is one of
    theirs (of any of their channels), else its channel's current conversation unless that was idle longer
    than ``idle_timeout_ms`` by the rumors' dates (then it starts one); an agent's own copy joins the
    conversation of the message it answers, and one from another agent's channel makes that conversation
    its own chat's current one unless that chat's is open (:meth:`PrivateConversations.answered`). What
    cannot be placed is counted in ``skipped`` by reason."""
    rumors: dict[str, tuple[NostrEvent, str | None]] = {}
    answering: dict[str, str] = {}
    for item in opened:
        rumor = item.rumor
        agent = directory.by_pubkey(rumor.pubkey)
        if agent is not None:
            if item.recipient == rumor.pubkey:  # an agent's own copy (its copies for others say the same)
                rumors.setdefault(rumor.id, (rumor, None))
                people = [p for p in rumor.tag_values(TAG_PUBKEY) if directory.by_pubkey(p) is None]
                if people and not rumor.has_tag(TAG_ERROR, ERROR_SYSTEM):  # a notice moves no chat (as live)
                    answering[rumor.id] = agent_channel(agent.slug, people[0])
            continue
        refusal = refuse_private(rumor, item.recipient, directory)
        if refusal is None and rumor.pubkey not in allowed:
            refusal = "author_not_allowed"
        if refusal is not None:
            skipped[refusal] += 1
        else:
            rumors.setdefault(rumor.id, (rumor, private_channel(rumor, directory)))
    return _Replay(idle_timeout_ms, skipped, answering).run(rumors)


class _Replay:
    """The conversations of :func:`plan_private_conversations`, built rumor by rumor in date order."""

    def __init__(self, idle_timeout_ms: int, skipped: Counter[str], answering: dict[str, str]) -> None:
        self._idle_ms = idle_timeout_ms
        self._skipped = skipped
        self._answering = answering
        """The chat (channel) each agent's answer shows in, by the answer's id."""
        self._threads: dict[str, list[NostrEvent]] = {}
        self._channel_of: dict[str, str] = {}
        self._root_of: dict[str, str] = {}
        self._current: dict[str, str] = {}

    def run(self, rumors: dict[str, tuple[NostrEvent, str | None]]) -> list[PrivateThread]:
        waiting: dict[str, list[tuple[NostrEvent, str | None]]] = {}
        for rumor, channel in sorted(rumors.values(), key=lambda item: (item[0].created_at, item[0].id)):
            parent = _parent(rumor)
            if parent is not None and parent in rumors and parent not in self._root_of:
                waiting.setdefault(parent, []).append((rumor, channel))  # dated before what it answers
                continue
            ready = [(rumor, channel)]
            while ready:
                placed, where = ready.pop()
                if self._place(placed, where):
                    ready += waiting.pop(placed.id, [])
        threads = self._threads.items()
        return [PrivateThread(self._channel_of[root], tuple(events)) for root, events in threads]

    def _place(self, rumor: NostrEvent, channel: str | None) -> bool:
        root = self._root_of.get(_parent(rumor) or "")
        theirs = root is not None and _persons_channel(self._channel_of[root], rumor.pubkey)
        if root is not None and channel is not None and not theirs:
            root = None  # a person answering into another person's conversation: the channel decides
        if root is None and channel is None:
            self._skipped["private_answer_without_message"] += 1
            return False
        if root is None:
            assert channel is not None
            root = self._current.get(channel)
            if root is None or self._idle(root, rumor):
                root = rumor.id
                self._threads[root] = []
                self._channel_of[root] = channel
            self._current[channel] = root
        self._threads[root].append(rumor)
        self._root_of[rumor.id] = root
        chat = self._answering.get(rumor.id)
        if chat is not None and chat != self._channel_of[root]:  # answered from another agent's channel
            own = self._current.get(chat)
            if own is None or self._idle(own, rumor):
                self._current[chat] = root
        return True

    def _idle(self, root: str, rumor: NostrEvent) -> bool:
        """Whether the conversation ``root`` was idle longer than the timeout when ``rumor`` came."""
        return (rumor.created_at - self._threads[root][-1].created_at) * 1000 > self._idle_ms


def _parent(rumor: NostrEvent) -> str | None:
    """The message a rumor answers (its last ``e`` tag), if any."""
    replied = rumor.tag_values(TAG_EVENT)
    return replied[-1] if replied else None
