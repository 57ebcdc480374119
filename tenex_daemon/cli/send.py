"""``tenexd send``: publish a message as the owner and print the agents' replies as they come.

A convenience for trying a home: any Nostr client does the same. A new message is a kind-11
conversation root; ``--reply-to`` makes a kind-1111 reply with NIP-22 tags (root ``E``/``K``/``P``
copied from the conversation root, parent ``e``/``k``/``p``), or a kind-1 reply with NIP-10 marked
``e`` tags when the parent is a kind 1 (NIP-22 forbids a comment on a note). ``--kind 1`` sends
what an ordinary kind-1 client sends: a top-level note (it joins the person's open channel
conversation with the agent, or starts one), or a NIP-10 reply; the agents answer with kind 1.
The addressed agent is p-tagged first, so it is the one targeted (docs/PROTOCOL.md). ``--private``
sends a NIP-17 private message instead (:func:`send_private_message`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from tenex_daemon.adapters.nostr.codec import (
    conversation_id,
    conversation_root_tags,
    note_tags,
    person_note_reply_tags,
    person_reply_tags,
    refers_to_root,
)
from tenex_daemon.adapters.nostr.private import GiftWraps, OpenedWrap, make_rumor, wrap_recipients
from tenex_daemon.adapters.nostr.relay_pool import (
    Filter,
    PoolSettings,
    PublishError,
    ReceivedEvent,
    RelayPool,
)
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.app.embedded_relay import relay_url
from tenex_daemon.app.settings import Settings
from tenex_daemon.app.status import read_status
from tenex_daemon.core.agents import Agent
from tenex_daemon.core.errors import TenexError
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.thread_tags import read_threading
from tenex_daemon.core.vocabulary import (
    ERROR_SYSTEM,
    KIND_COMMENT,
    KIND_CONVERSATION_ROOT,
    KIND_GIFT_WRAP,
    KIND_NOTE,
    KIND_PRIVATE_MESSAGE,
    TAG_ERROR,
    TAG_PUBKEY,
)

PRIVATE_LOOKBACK_S = 2 * 86_400 + 60
"""How far back the answers' gift wraps may be dated (NIP-59 backdates them up to two days)."""
SEND_KINDS = (KIND_NOTE, KIND_CONVERSATION_ROOT, KIND_COMMENT)
"""What ``--kind`` may name: a kind-1 note or NIP-10 reply, a kind-11 root, a kind-1111 reply."""
STOP_NOTICE_PREFIX = "Stopped: "
"""How the daemon's stop notice begins: "Stopped: Planner, Executor." (tenex_daemon/services/stopping.py)."""


class SendError(TenexError):
    """The message could not be sent; the message says why and what to do."""


class PrivateConversationError(SendError):
    """``--reply-to`` names a message of a private (NIP-17) conversation: a public reply would publish the
    text in the clear, and the daemon takes no public event into a private conversation."""


@dataclass
class SendResult:
    """What happened: the event sent, the replies seen, and whether the addressed agent answered."""

    event: NostrEvent
    conversation_id: str
    addressed: Agent
    relays: list[str]
    replies: list[tuple[Agent, NostrEvent]] = field(default_factory=list)
    answered: bool = False
    stopped: NostrEvent | None = None
    """The daemon's stop notice that ended the wait before the awaited answer (:func:`is_stop_notice`)."""


def send_relays(settings: Settings, explicit: Sequence[str]) -> list[str]:
    """Relays to publish to: ``--relay`` URLs, else the configured ones plus the embedded relay.

    The embedded relay counts when the config enables it or a fresh status file names it.
    """
    if explicit:
        return list(dict.fromkeys(explicit))
    urls = list(settings.relays.urls)
    if settings.relays.embedded:
        urls.append(relay_url(settings.relays.embedded_host, settings.relays.embedded_port))
    report = read_status(settings.status_path, settings.daemon.stale_after_s)
    if report.data is not None and report.state.value == "running":
        embedded = report.data.get("embedded_relay")
        if isinstance(embedded, str) and embedded:
            urls.insert(0, embedded)
    return list(dict.fromkeys(urls))


def addressed_agent(agents: Sequence[Agent], to: str | None, default_agent: str | None) -> Agent:
    """Return the agent to p-tag: ``to``, else the orchestrator, else the default agent."""
    by_slug = {a.slug: a for a in agents}
    if to is not None:
        if to not in by_slug:
            raise SendError(f"unknown agent {to!r} (agents: {', '.join(by_slug) or 'none'})")
        return by_slug[to]
    orchestrator = next((a for a in agents if a.orchestrator), None)
    if orchestrator is not None:
        return orchestrator
    if default_agent is not None and default_agent in by_slug:
        return by_slug[default_agent]
    if agents:
        return agents[0]
    raise SendError("the home has no agents (see `tenexd agents add`)")


def check_kind(kind: int | None, replying: bool) -> None:
    """Refuse a ``--kind`` that is not one of :data:`SEND_KINDS` or does not fit ``--reply-to``."""
    if kind is None:
        return
    if kind not in SEND_KINDS:
        raise SendError(f"--kind must be one of {', '.join(map(str, SEND_KINDS))}, not {kind}")
    if kind == KIND_COMMENT and not replying:
        raise SendError("--kind 1111 is a reply: name its parent with --reply-to")
    if kind == KIND_CONVERSATION_ROOT and replying:
        raise SendError("--kind 11 starts a conversation: it cannot reply (leave out --reply-to)")


def check_title(title: str | None, kind: int | None, replying: bool) -> None:
    """Refuse ``--title`` unless the message is a new kind-11 conversation, the only one that carries a title
    (a kind-1 note and a reply have none); a blank one is refused too (leave it out: the daemon titles)."""
    if title is not None and not title.strip():
        raise SendError("--title is empty: give a title, or leave it out (the daemon titles conversations)")
    if title is not None and (replying or kind == KIND_NOTE):
        raise SendError(
            "--title is only for a new kind-11 conversation: leave it out with "
            + ("--reply-to" if replying else "--kind 1")
        )


def is_stop_notice(event: NostrEvent) -> bool:
    """Whether an agent's event is the daemon's notice that runs were stopped (``tenexd conversations stop``,
    a kind-24134 request): "Stopped: <names>.", tagged ``["error", "system"]`` (docs/PROTOCOL.md)."""
    return event.tag_value(TAG_ERROR) == ERROR_SYSTEM and event.content.startswith(STOP_NOTICE_PREFIX)


def stopped_names(notice: NostrEvent) -> list[str]:
    """The names of the agents a stop notice says were stopped ("Stopped: Planner, Executor.")."""
    listed = notice.content.removeprefix(STOP_NOTICE_PREFIX).strip().removesuffix(".")
    return [name.strip() for name in listed.split(",") if name.strip()]


def check_public_parent(parent: NostrEvent) -> None:
    """Refuse to reply in public to a message of a private conversation (a rumor: kind 14, unsigned)."""
    if parent.kind == KIND_PRIVATE_MESSAGE or not parent.is_signed:
        raise PrivateConversationError(
            f"event {parent.id} is a message of a private conversation: a reply with --reply-to would "
            'publish your text in the clear; `tenexd send --private --to AGENT "..."` continues your open '
            "private conversation with that agent"
        )


def message_kind(kind: int | None, parent: NostrEvent | None) -> int:
    """The kind to send: ``kind`` when given (:func:`check_kind`), else kind 11 for a new message,
    kind 1 for a reply to a kind 1 (NIP-22 forbids a comment on a note), else kind 1111."""
    check_kind(kind, parent is not None)
    if kind is not None:
        return kind
    if parent is None:
        return KIND_CONVERSATION_ROOT
    return KIND_NOTE if parent.kind == KIND_NOTE else KIND_COMMENT


def reply_tags(
    parent: NostrEvent, target: Agent, agent_keys: set[str], owner: str, kind: int = KIND_COMMENT
) -> tuple[str, list[list[str]]]:
    """Return (conversation root id, tags) for a reply of ``kind`` to ``parent`` addressed to ``target``.

    Kind 1111: NIP-22 tags, the root the parent's ``E`` when it has one (a reply), else the parent
    itself (:func:`~tenex_daemon.adapters.nostr.codec.person_reply_tags`). Kind 1: NIP-10 marked ``e``
    tags, the root the one the parent's tags name, else the parent
    (:func:`~tenex_daemon.adapters.nostr.codec.person_note_reply_tags`). The target is p-tagged
    first; the parent's author is p-tagged too when it is a person other than the owner (an
    agent author would otherwise be targeted instead).
    """
    destinations = [target.pubkey]
    if parent.pubkey not in agent_keys and parent.pubkey not in (owner, target.pubkey):
        destinations.append(parent.pubkey)
    if kind == KIND_NOTE:
        return person_note_reply_tags(parent, destinations)
    return person_reply_tags(parent, destinations)


def root_tags(target: Agent, owner: str, project_d: str, title: str | None) -> list[list[str]]:
    """Return the tags of a new conversation root: the ``--title`` given (none otherwise: the daemon
    titles the conversation, docs/ARCHITECTURE.md, "Conversation lifecycle"), the target's ``p``, the
    project's ``a``."""
    return conversation_root_tags(title, [target.pubkey], (owner, project_d))


def compose_message(
    settings: Settings,
    owner: Signer,
    text: str,
    target: Agent,
    agent_keys: set[str],
    *,
    parent: NostrEvent | None,
    kind: int | None,
    title: str | None,
) -> tuple[NostrEvent, str]:
    """Sign what ``send`` publishes; return (event, the root id of its thread as far as it knows).

    A top-level kind-1 note names no root: the daemon may join it to the person's open channel
    conversation, whose root only the agent's answer tells (its ``root`` ``e`` tag). A ``parent`` of a
    private conversation is refused (:func:`check_public_parent`): nothing is signed.
    """
    chosen = message_kind(kind, parent)
    if parent is not None:
        check_public_parent(parent)
        root_id, tags = reply_tags(parent, target, agent_keys, owner.pubkey, chosen)
        return owner.sign(chosen, text, tags), root_id
    if chosen == KIND_NOTE:
        event = owner.sign(KIND_NOTE, text, note_tags([target.pubkey]))
    else:
        event = owner.sign(
            KIND_CONVERSATION_ROOT, text, root_tags(target, owner.pubkey, settings.project.d_tag, title)
        )
    return event, event.id


@dataclass
class ReplyWatch:
    """Which agent events answer the message sent: one naming it (an ``e``/``E`` tag), or one in its
    thread (naming the root) that is not older than it, is not the parent replied to (a relay returns the
    thread's earlier answers too: the subscription reaches back a few seconds), and replies to the message
    sent, to another answer (a routed agent's to a completion) or to a root an agent wrote. One replying to
    another message, a person's earlier one or their root, answers that one, not this: asked twice in a
    row, the first answer was taken for the second's."""

    sent: NostrEvent | None = None
    root_id: str = ""
    parent_id: str | None = None
    root_by_agent: bool = False
    """Whether an agent wrote the thread's root: a reply to it may answer the message sent then; to a
    person's root (their first message) it answers that one."""
    taken: set[str] = field(default_factory=set)
    """The answers taken so far (ids)."""
    held: list[NostrEvent] = field(default_factory=list)
    """Events replying to a message not known yet: an answer that comes later may be it (events come in
    any order)."""

    def ids(self) -> list[str]:
        """The ids an answer may name in an ``e`` tag: the root, and the message sent."""
        return list(dict.fromkeys([self.root_id, *([self.sent.id] if self.sent is not None else [])]))

    def take(self, event: NostrEvent) -> list[NostrEvent]:
        """The answers ``event`` (by an agent) brings: itself when it answers the message sent, and the
        events held back that reply to it (or to one of them)."""
        if event.id in self.taken:
            return []
        verdict = self._answers(event)
        if verdict is None:
            self.held.append(event)
        if not verdict:
            return []
        taken = [event]
        self.taken.add(event.id)
        while found := [e for e in self.held if read_threading(e).parent_id in self.taken]:
            for answer in found:
                self.held.remove(answer)
                self.taken.add(answer.id)
            taken += found
        return taken

    def _answers(self, event: NostrEvent) -> bool | None:
        """Whether ``event`` answers the message sent; None while the message it replies to is unknown."""
        sent = self.sent
        if sent is None or event.id == self.parent_id:
            return False
        if refers_to_root(event, sent.id):
            return True
        if not refers_to_root(event, self.root_id) or event.created_at < sent.created_at:
            return False
        parent = read_threading(event).parent_id
        if parent is None or parent == sent.id or parent in self.taken:
            return True
        if parent == self.root_id:
            return self.root_by_agent or None  # a person's root: the answer to it, unless an answer of ours
        return None


def _relays_to_use(settings: Settings, agents: Sequence[Agent], explicit: Sequence[str]) -> list[str]:
    """The relays to send through (:func:`send_relays`); a :class:`SendError` when there are none, or
    when the home has no agent to address."""
    urls = send_relays(settings, explicit)
    if not urls:
        raise SendError(
            "no relay to publish to: pass --relay URL, set relays.urls in config.toml, "
            "or run the daemon with --embedded-relay"
        )
    if not agents:
        raise SendError("the home has no agents (see `tenexd agents add`)")
    return urls


class _Answers:
    """The agents' answers as they come, and the wait for the one that ends it: with ``to``, that agent's;
    else, or when ``to`` is the orchestrator, any agent's but the orchestrator's (it routes, and answers
    only when it is the only agent). A stop notice (:func:`is_stop_notice`), whoever signed it, ends the
    wait too, unanswered: with ``to`` (not the orchestrator), one that names that agent; else any."""

    def __init__(
        self,
        agents: Sequence[Agent],
        target: Agent,
        to: str | None,
        on_reply: Callable[[Agent, NostrEvent], None] | None,
    ) -> None:
        self._target = target
        self._to = to
        self._others_exist = any(not a.orchestrator for a in agents)
        self._on_reply = on_reply
        self.replies: list[tuple[Agent, NostrEvent]] = []
        self.answered = False
        self.stopped: NostrEvent | None = None
        self._done = asyncio.Event()

    def add(self, agent: Agent, event: NostrEvent) -> None:
        """One agent's answer: kept, shown, and the end of the wait when it is the awaited one or a stop
        notice."""
        self.replies.append((agent, event))
        if self._on_reply is not None:
            self._on_reply(agent, event)
        if is_stop_notice(event):
            if self._stops_the_wait(event):
                self.stopped = self.stopped or event
                self._done.set()
        elif self._ends_the_wait(agent):
            self.answered = True
            self._done.set()

    def _stops_the_wait(self, notice: NostrEvent) -> bool:
        if self._to is not None and not self._target.orchestrator:
            return self._target.name in stopped_names(notice)
        return True

    def _ends_the_wait(self, agent: Agent) -> bool:
        if self._to is not None and not self._target.orchestrator:
            return agent.slug == self._target.slug
        return not (agent.orchestrator and self._others_exist)

    async def wait(self, timeout: float) -> bool:  # noqa: ASYNC109 - the whole wait for the answer
        """Wait up to ``timeout`` seconds for the awaited answer or a stop notice; return whether the answer
        came (after a stop notice: :attr:`stopped`)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._done.wait()
        return self.answered

    async def settle(self, result: SendResult, timeout: float) -> None:  # noqa: ASYNC109 - as wait's
        """Wait (:meth:`wait`), then record in ``result`` whether the answer came or the runs were stopped."""
        result.answered = await self.wait(timeout)
        result.stopped = None if result.answered else self.stopped


@asynccontextmanager
async def _connected_pool(
    urls: Sequence[str],
    handle: Callable[[ReceivedEvent], Awaitable[None]],
    pool_settings: PoolSettings | None,
    timeout: float,  # noqa: ASYNC109 - how long to wait for a first relay, not one call's timeout
) -> AsyncIterator[RelayPool]:
    """A relay pool over ``urls`` delivering to ``handle``, once one relay is connected; stopped after."""
    settings = pool_settings or PoolSettings(open_timeout=5.0, backoff_base=0.2, backoff_cap=2.0)
    pool = RelayPool(list(urls), on_event=handle, settings=settings)
    await pool.start()
    try:
        if not await pool.wait_connected(1, min(10.0, max(1.0, timeout))):
            raise SendError(f"no relay answered: {', '.join(urls)}")
        yield pool
    finally:
        await pool.stop()


async def send_message(
    settings: Settings,
    owner: Signer,
    agents: Sequence[Agent],
    text: str,
    *,
    to: str | None = None,
    reply_to: str | None = None,
    kind: int | None = None,
    relays: Sequence[str] = (),
    timeout: float = 30.0,  # noqa: ASYNC109 - the whole wait for replies, not one call's timeout
    title: str | None = None,
    find_event: Callable[[str], Awaitable[NostrEvent | None]] | None = None,
    on_reply: Callable[[Agent, NostrEvent], None] | None = None,
    on_sent: Callable[[NostrEvent, Agent, list[str]], None] | None = None,
    pool_settings: PoolSettings | None = None,
) -> SendResult:
    """Publish ``text`` as the owner, then collect agents' replies until the addressed one answers.

    Without ``to``, or with the orchestrator's, the orchestrator is addressed, and the first reply from
    an agent other than the orchestrator (it routes) ends the wait; with another agent's, that agent's
    reply does; a stop notice ends it unanswered (:attr:`SendResult.stopped`). ``on_sent`` is told
    (event, addressed agent, relays that took it) once it is published.
    ``find_event`` looks the parent of ``reply_to`` up locally when no relay has it; a parent in a private
    conversation is refused (:class:`PrivateConversationError`) before anything is signed. ``kind``
    picks what is sent (:func:`message_kind`); replies of kind 1111 and 1 are both collected: those
    naming the thread's root, or the event sent (a kind-1 answer's ``reply`` ``e`` tag).
    """
    urls = _relays_to_use(settings, agents, relays)
    check_kind(kind, reply_to is not None)
    check_title(title, kind, reply_to is not None)
    target = addressed_agent(agents, to, settings.default_agent_slug)
    by_key = {a.pubkey: a for a in agents}
    answers = _Answers(agents, target, to, on_reply)
    watch = ReplyWatch()

    async def handle(received: ReceivedEvent) -> None:
        event = received.event
        agent = by_key.get(event.pubkey)
        if agent is not None:
            for answer in watch.take(event):
                answers.add(by_key[answer.pubkey], answer)

    async with _connected_pool(urls, handle, pool_settings, timeout) as pool:
        since = int(time.time()) - 5
        parent = None
        if reply_to is not None:
            parent = await pool.fetch_event(reply_to, timeout=min(5.0, timeout))
            if parent is None and find_event is not None:
                parent = await find_event(reply_to)
            if parent is None:
                raise SendError(f"event {reply_to} was found neither on the relays nor in the home")
        event, root_id = compose_message(
            settings, owner, text, target, set(by_key), parent=parent, kind=kind, title=title
        )
        watch.sent, watch.root_id, watch.parent_id = event, root_id, reply_to
        if parent is not None:
            root_author = parent.pubkey if parent.id == root_id else read_threading(parent).root_author
            watch.root_by_agent = root_author in by_key
        authors = sorted(by_key)
        await pool.subscribe(
            "tenexd-send",
            [
                {"kinds": [KIND_COMMENT], "#E": [root_id], "authors": authors, "since": since},
                {"kinds": [KIND_COMMENT, KIND_NOTE], "#e": watch.ids(), "authors": authors, "since": since},
            ],
        )
        try:
            published = await pool.publish(event, timeout=min(10.0, max(1.0, timeout)))
        except PublishError as exc:
            raise SendError(str(exc)) from None
        result = SendResult(event, root_id, target, list(published.accepted_by), answers.replies)
        if on_sent is not None:
            on_sent(event, target, result.relays)
        await answers.settle(result, timeout)
        if event.kind == KIND_NOTE and answers.replies:
            # a top-level note may have joined an open channel conversation: its answers name the root
            result.conversation_id = conversation_id(answers.replies[0][1])
        return result


async def send_private_message(
    settings: Settings,
    owner: Signer,
    agents: Sequence[Agent],
    text: str,
    *,
    to: str | None = None,
    relays: Sequence[str] = (),
    timeout: float = 30.0,  # noqa: ASYNC109 - the whole wait for replies, not one call's timeout
    on_reply: Callable[[Agent, NostrEvent], None] | None = None,
    on_sent: Callable[[NostrEvent, Agent, list[str]], None] | None = None,
    pool_settings: PoolSettings | None = None,
) -> SendResult:
    """Send ``text`` as the owner in a NIP-17 private message (docs/PROTOCOL.md, "Private conversations"),
    then collect the agents' gift-wrapped answers to it until the addressed one answers.

    The kind-14 rumor (``p``: the addressed agent) is gift-wrapped for the agent and for the owner (their
    own copy), by nostr-sdk as the daemon does; answers are the wraps p-tagging the owner whose rumor, by
    an agent, replies to the message sent. Gift wraps are dated up to two days back, so the subscription
    reaches back that far and keeps only those answers. The result's ``event`` is the rumor (unsigned).
    """
    urls = _relays_to_use(settings, agents, relays)
    target = addressed_agent(agents, to, settings.default_agent_slug)
    by_key = {a.pubkey: a for a in agents}
    answers = _Answers(agents, target, to, on_reply)
    gift = GiftWraps({"owner": owner})
    rumor = make_rumor(owner.pubkey, text, [[TAG_PUBKEY, target.pubkey]], int(time.time()))
    seen: set[str] = set()

    async def handle(received: ReceivedEvent) -> None:
        opened = gift.open(received.event)
        if not isinstance(opened, OpenedWrap):
            return
        answer = opened.rumor
        agent = by_key.get(answer.pubkey)
        if agent is None or answer.id in seen or not refers_to_root(answer, rumor.id):
            return
        seen.add(answer.id)
        answers.add(agent, answer)

    async with _connected_pool(urls, handle, pool_settings, timeout) as pool:
        since = rumor.created_at - PRIVATE_LOOKBACK_S
        wraps: Filter = {"kinds": [KIND_GIFT_WRAP], "#p": [owner.pubkey], "since": since}
        await pool.subscribe("tenexd-send", [wraps])
        accepted: list[str] = []
        within = min(10.0, max(1.0, timeout))
        for recipient in wrap_recipients(rumor):
            try:
                published = await pool.publish(gift.wrap(rumor, recipient), timeout=within)
            except PublishError as exc:
                raise SendError(str(exc)) from None
            accepted = [url for url in published.accepted_by if url not in accepted] + accepted
        result = SendResult(rumor, rumor.id, target, sorted(accepted), answers.replies)
        if on_sent is not None:
            on_sent(rumor, target, result.relays)
        await answers.settle(result, timeout)
        return result
