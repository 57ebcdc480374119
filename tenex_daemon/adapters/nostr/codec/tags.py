"""Nostr tag shapes: every tag list tenexd writes, and the threading tags it reads (the reader itself is
the core's, :mod:`tenex_daemon.core.thread_tags`).

Kind numbers and most tag names come from :mod:`tenex_daemon.core.vocabulary`; the shapes
(which tags, in which order, with which positional fields) are those of docs/PROTOCOL.md, NIP-10,
NIP-22 and NIP-42. Nothing here does I/O or signs: callers sign the tags they get.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.ports import ReplySpec
from tenex_daemon.core.thread_tags import MARKER_REPLY, MARKER_ROOT, read_threading
from tenex_daemon.core.vocabulary import (
    ERROR_SYSTEM,
    KIND_COMMENT,
    KIND_CONVERSATION_ROOT,
    KIND_NOTE,
    KIND_PROJECT,
    KIND_RELAY_AUTH,
    KIND_TASK,
    TAG_ADDRESS,
    TAG_BOT,
    TAG_CHALLENGE,
    TAG_DELEGATION,
    TAG_ERROR,
    TAG_EVENT,
    TAG_LLM_COMPLETION_TOKENS,
    TAG_LLM_COST_USD,
    TAG_LLM_MODEL,
    TAG_LLM_PROMPT_TOKENS,
    TAG_MODEL,
    TAG_NET_TIME,
    TAG_PARENT_KIND,
    TAG_PHASE,
    TAG_PUBKEY,
    TAG_RELAY,
    TAG_ROOT_AUTHOR,
    TAG_ROOT_EVENT,
    TAG_ROOT_KIND,
    TAG_SESSION,
    TAG_STATUS,
    TAG_SUBJECT,
    TAG_SUMMARY,
    TAG_TITLE,
    TAG_TOOL,
    TOOL_COMPLETE,
)

TAG_AGENT: Final = "agent"
"""``["agent", <pubkey>, <slug>]`` on the project's kind-24010 heartbeat, one per agent."""
TAG_STREAMING: Final = "streaming"
"""``["streaming", <sequence>]`` on a kind-21111 partial reply."""
Tags = list[list[str]]


def project_address(owner: str, identifier: str) -> str:
    """The ``a`` tag value of the project ``identifier`` owned by ``owner``: ``31933:<owner>:<d>``."""
    return f"{KIND_PROJECT}:{owner}:{identifier}"


def _pubkey_tags(destinations: Iterable[str]) -> Tags:
    """One ``p`` tag per distinct pubkey, in the order given."""
    return [[TAG_PUBKEY, pubkey] for pubkey in dict.fromkeys(destinations)]


def _parent_tags(parent: NostrEvent, relay_hint: str = "") -> Tags:
    """NIP-22 parent tags: ``["e", id, hint, author]`` and ``["k", kind]``."""
    return [[TAG_EVENT, parent.id, relay_hint, parent.pubkey], [TAG_PARENT_KIND, str(parent.kind)]]


# --- reading threading: the reader is the core's (tenex_daemon.core.thread_tags) ----------------


def conversation_id(event: NostrEvent) -> str:
    """Return the id of the conversation ``event`` belongs to: its root, or itself when it is one."""
    return read_threading(event).root_id or event.id


def refers_to_root(event: NostrEvent, root_id: str) -> bool:
    """Whether ``event`` names ``root_id`` as its root: a NIP-22 ``E``, or any NIP-10 ``e`` tag."""
    if event.tag_value(TAG_ROOT_EVENT) == root_id:
        return True
    return any(len(tag) > 1 and tag[0] == TAG_EVENT and tag[1] == root_id for tag in event.tags)


@dataclass(frozen=True, slots=True)
class ThreadRoot:
    """The conversation root a reply points at: id, kind and author."""

    id: str
    kind: int
    pubkey: str

    @classmethod
    def of(cls, event: NostrEvent) -> ThreadRoot:
        """The root fields of an event that is itself the root."""
        return cls(event.id, event.kind, event.pubkey)


def root_of(event: NostrEvent) -> ThreadRoot:
    """Return the conversation root of ``event`` as far as its tags tell.

    A root event is its own root; a NIP-22 reply names root id, kind and author;
    for NIP-10 replies the kind is unknown and taken as the reply's own kind.
    """
    threading = read_threading(event)
    if threading.root_id is None:
        return ThreadRoot.of(event)
    return ThreadRoot(
        threading.root_id,
        threading.root_kind if threading.root_kind is not None else event.kind,
        threading.root_author or "",
    )


# --- tags tenexd writes ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReplyDetails:
    """What an agent's reply carries besides its threading: docs/PROTOCOL.md's optional reply tags.

    ``project`` is ``(owner pubkey, project d-tag)`` for the ``a`` tag; ``cost_usd`` is what the
    reply's tokens cost (written with at most 6 decimals, never an exponent); ``delegation`` is a
    ``send_message`` exchange's thread id. A None (or False) field writes no tag.
    """

    project: tuple[str, str] | None = None
    phase: str | None = None
    net_time_seconds: int | None = None
    session_id: str | None = None
    complete: bool = False
    llm_model: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cost_usd: float | None = None
    error: bool = False
    delegation: str | None = None

    def tags(self) -> Tags:
        """The optional tags, in the order docs/PROTOCOL.md lists them (``delegation`` last)."""
        values: list[tuple[str, str | None]] = [
            (TAG_ADDRESS, project_address(*self.project) if self.project is not None else None),
            (TAG_PHASE, self.phase),
            (TAG_NET_TIME, _text(self.net_time_seconds)),
            (TAG_SESSION, self.session_id),
            (TAG_TOOL, TOOL_COMPLETE if self.complete else None),
            (TAG_LLM_MODEL, self.llm_model),
            (TAG_LLM_PROMPT_TOKENS, _text(self.prompt_tokens)),
            (TAG_LLM_COMPLETION_TOKENS, _text(self.completion_tokens)),
            (TAG_LLM_COST_USD, usd_text(self.cost_usd)),
            (TAG_ERROR, ERROR_SYSTEM if self.error else None),
            (TAG_DELEGATION, self.delegation),
        ]
        return [[name, value] for name, value in values if value is not None]


NO_DETAILS: Final = ReplyDetails()


def _text(number: int | None) -> str | None:
    return str(number) if number is not None else None


def usd_text(amount: float | None) -> str | None:
    """An amount of US dollars as an ``llm-cost-usd`` value: at most 6 decimals, no exponent, no
    trailing zeros (``0.0015``, ``2``, ``0`` for less than half a millionth)."""
    if amount is None:
        return None
    text = f"{amount:.6f}".rstrip("0").rstrip(".")
    return "0" if text in ("", "-0") else text


def _thread_root(trigger: NostrEvent, root: ThreadRoot | NostrEvent | None) -> ThreadRoot:
    """The conversation root given (an event or its fields), else the one the trigger's tags name."""
    if root is None:
        return root_of(trigger)
    return ThreadRoot.of(root) if isinstance(root, NostrEvent) else root


def task_thread_root(task_id: str, session_root: NostrEvent | None) -> ThreadRoot:
    """The root of a reply in a session of task ``task_id``: the task (kind 1934), its author as the
    session's root names it (a later session's root is a comment in the task's thread: NIP-22 has a
    reply to a comment keep the comment's root), else unknown (empty)."""
    if session_root is not None and session_root.id == task_id:
        return ThreadRoot.of(session_root)
    named = read_threading(session_root) if session_root is not None else None
    author = named.root_author if named is not None and named.root_id == task_id else None
    return ThreadRoot(task_id, KIND_TASK, author or "")


def reply_kind(root_kind: int) -> int:
    """The kind of an agent's reply in a conversation whose root has ``root_kind``: kind 1 (NIP-10)
    in a kind-1 conversation, where NIP-22 forbids a comment and kind-1 clients would not show it;
    kind 1111 (NIP-22) in every other one."""
    return KIND_NOTE if root_kind == KIND_NOTE else KIND_COMMENT


def build_agent_reply(
    trigger: NostrEvent,
    destinations: Iterable[str],
    *,
    root: ThreadRoot | NostrEvent | None = None,
    details: ReplyDetails = NO_DETAILS,
) -> tuple[int, Tags]:
    """Return (kind, tags) of an agent's reply to ``trigger``: the kind its conversation speaks
    (:func:`reply_kind`), with :func:`build_note_reply_tags` or :func:`build_reply_tags`."""
    thread_root = _thread_root(trigger, root)
    kind = reply_kind(thread_root.kind)
    if kind == KIND_NOTE:
        return kind, build_note_reply_tags(trigger, destinations, root=thread_root, details=details)
    return kind, build_reply_tags(trigger, destinations, root=thread_root, details=details)


def note_thread_tags(root_id: str, parent_id: str, relay_hint: str = "") -> Tags:
    """NIP-10 marked ``e`` tags of a kind-1 reply to ``parent_id`` in the thread of ``root_id``:
    ``["e", <root>, hint, "root"]``, then ``["e", <parent>, hint, "reply"]`` unless the parent is
    the root (one ``e`` marked ``root`` then)."""
    tags: Tags = [[TAG_EVENT, root_id, relay_hint, MARKER_ROOT]]
    if parent_id != root_id:
        tags.append([TAG_EVENT, parent_id, relay_hint, MARKER_REPLY])
    return tags


def build_note_reply_tags(
    trigger: NostrEvent,
    destinations: Iterable[str],
    *,
    root: ThreadRoot | NostrEvent | None = None,
    details: ReplyDetails = NO_DETAILS,
    relay_hint: str = "",
) -> Tags:
    """Return the tags of an agent's kind-1 reply to ``trigger`` in a kind-1 conversation (NIP-10).

    The marked ``e`` tags of :func:`note_thread_tags` (the conversation root, else the root the
    trigger's tags name, else the trigger), one ``p`` per destination (the person and every agent
    addressed), then ``details``' tags as on a kind-1111 reply.
    """
    thread_root = _thread_root(trigger, root)
    return (
        note_thread_tags(thread_root.id, trigger.id, relay_hint)
        + _pubkey_tags(destinations)
        + details.tags()
    )


def build_reply_tags(
    trigger: NostrEvent,
    destinations: Iterable[str],
    *,
    root: ThreadRoot | NostrEvent | None = None,
    details: ReplyDetails = NO_DETAILS,
    relay_hint: str = "",
) -> Tags:
    """Return the tags of an agent's kind-1111 reply to ``trigger`` (docs/PROTOCOL.md).

    Root ``E``/``K``/``P`` come from the conversation root (``root``, else read from
    the trigger's tags, else the trigger itself), parent ``e``/``k`` from the
    trigger; every ``p`` is then replaced by one per destination. ``details`` adds
    the optional tags after them (:meth:`ReplyDetails.tags`).
    """
    thread_root = _thread_root(trigger, root)
    tags: Tags = [
        [TAG_ROOT_EVENT, thread_root.id, relay_hint, thread_root.pubkey]
        if thread_root.pubkey else [TAG_ROOT_EVENT, thread_root.id, relay_hint],
        [TAG_ROOT_KIND, str(thread_root.kind)],
    ]
    if thread_root.pubkey:
        tags.append([TAG_ROOT_AUTHOR, thread_root.pubkey])
    return tags + _parent_tags(trigger, relay_hint) + _pubkey_tags(destinations) + details.tags()


def person_reply_tags(parent: NostrEvent, destinations: Iterable[str]) -> tuple[str, Tags]:
    """Return (conversation root id, tags) of a person's kind-1111 reply to ``parent`` (``tenexd send``).

    The root is copied from the parent's ``E``/``K``/``P`` values as written (``K``
    defaulting to 11) when it has an ``E``, else the root is the parent itself; then the
    parent's ``e``/``k`` and one ``p`` per destination. ``P`` is left out when the root's
    author is unknown (``E`` then carries an empty author field).
    """
    root_id = parent.tag_value(TAG_ROOT_EVENT)
    if root_id is not None:
        root_kind = parent.tag_value(TAG_ROOT_KIND) or str(KIND_CONVERSATION_ROOT)
        root_author = parent.tag_value(TAG_ROOT_AUTHOR) or ""
    else:
        root_id, root_kind, root_author = parent.id, str(parent.kind), parent.pubkey
    tags: Tags = [[TAG_ROOT_EVENT, root_id, "", root_author], [TAG_ROOT_KIND, root_kind]]
    if root_author:
        tags.append([TAG_ROOT_AUTHOR, root_author])
    return root_id, tags + _parent_tags(parent) + _pubkey_tags(destinations)


def person_note_reply_tags(parent: NostrEvent, destinations: Iterable[str]) -> tuple[str, Tags]:
    """Return (thread root id, tags) of a person's kind-1 reply to ``parent`` (``tenexd send --kind 1``).

    NIP-10 marked ``e`` tags (:func:`note_thread_tags`): the root the parent's tags name, else the
    parent itself; then one ``p`` per destination.
    """
    root_id = read_threading(parent).root_id or parent.id
    return root_id, note_thread_tags(root_id, parent.id) + _pubkey_tags(destinations)


def note_tags(destinations: Iterable[str]) -> Tags:
    """Return the tags of a person's top-level kind-1 note: one ``p`` per destination."""
    return _pubkey_tags(destinations)


def conversation_root_tags(
    title: str | None, destinations: Iterable[str], project: tuple[str, str]
) -> Tags:
    """Return the tags of a new kind-11 conversation root: the title (when given), one ``p`` per destination,
    the ``a``."""
    titled = [[TAG_TITLE, title]] if title is not None else []
    return [*titled, *_pubkey_tags(destinations), [TAG_ADDRESS, project_address(*project)]]


def typing_tags(conversation_id: str) -> Tags:
    """Return the tags of a typing indicator (kinds 24111/24112): ``["e", <conversation id>]``."""
    return [[TAG_EVENT, conversation_id]]


def streaming_tags(conversation_id: str, trigger_id: str, sequence: int) -> Tags:
    """Return the tags of a kind-21111 partial reply.

    ``["e", <conversation id>]`` (as typing indicators), ``["e", <trigger id>, "", "reply"]``
    and ``["streaming", <sequence>]``.
    """
    return [
        [TAG_EVENT, conversation_id],
        [TAG_EVENT, trigger_id, "", MARKER_REPLY],
        [TAG_STREAMING, str(sequence)],
    ]


def heartbeat_tags(agents: Iterable[tuple[str, str]], project: tuple[str, str] | None) -> Tags:
    """Return the tags of the project's kind-24010 heartbeat.

    One ``["agent", <pubkey>, <slug>]`` per ``(pubkey, slug)`` pair, then the project's ``a``
    when there is a project.
    """
    tags: Tags = [[TAG_AGENT, pubkey, slug] for pubkey, slug in agents]
    if project is not None:
        tags.append([TAG_ADDRESS, project_address(*project)])
    return tags


def capability_tags(known: Sequence[tuple[str, str | None, Iterable[str]]]) -> Tags:
    """The heartbeat's model and tool tags from each agent's (slug, model, tools), in the agents' order:
    ``["model", <model>, <slug>...]`` per model, then ``["tool", <tool>, <slug>...]`` per tool, each
    naming the agents that use it (an agent without a model gets no model tag)."""
    models = _grouped((model, slug) for slug, model, _ in known if model)
    tools = _grouped((tool, slug) for slug, _, offered in known for tool in offered)
    return [[TAG_MODEL, model, *slugs] for model, slugs in models.items()] + [
        [TAG_TOOL, tool, *slugs] for tool, slugs in tools.items()
    ]


def _grouped(pairs: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """Value -> the slugs that have it, both in first-seen order, each slug once per value."""
    groups: dict[str, list[str]] = {}
    for value, slug in pairs:
        slugs = groups.setdefault(value, [])
        if slug not in slugs:
            slugs.append(slug)
    return groups


def dm_relay_tags(relays: Iterable[str]) -> Tags:
    """The tags of a kind-10050 relay list (NIP-17): one ``["relay", <url>]`` per relay, each once."""
    return [[TAG_RELAY, url] for url in dict.fromkeys(relays)]


def profile_tags(owner: str | None) -> Tags:
    """The tags of an agent's kind-0 profile (NIP-AE draft): ``["bot"]``, then ``["p", <owner>]`` when
    there is an owner."""
    tags: Tags = [[TAG_BOT]]
    if owner:
        tags.append([TAG_PUBKEY, owner])
    return tags


def status_tags(
    root_id: str, person: str | None, agents: Iterable[str], project: tuple[str, str] | None
) -> Tags:
    """The tags of a kind-24133 live status: ``["e", <conversation root>]`` (never the trigger), one
    ``["p", <agent>]`` per agent working now (none when idle), ``["P", <person>]`` when known, and the
    project's ``a`` when there is a project."""
    tags: Tags = [[TAG_EVENT, root_id]]
    tags.extend([TAG_PUBKEY, pubkey] for pubkey in dict.fromkeys(agents))
    if person is not None:
        tags.append([TAG_ROOT_AUTHOR, person])
    if project is not None:
        tags.append([TAG_ADDRESS, project_address(*project)])
    return tags


STATUS_ACTIVE: Final = "active"
STATUS_ENDED: Final = "ended"
"""The ``status`` tag values of a kind-513 conversation metadata event."""


def metadata_tags(
    conversation_id: str, title: str, summary: str, *, ended: bool, project: tuple[str, str] | None
) -> Tags:
    """The tags of a conversation's kind-513 metadata event: ``["e", <root id>]``, ``["title", …]``,
    ``["summary", …]``, ``["status", "active"|"ended"]``, and the project's ``a`` when there is one."""
    tags: Tags = [
        [TAG_EVENT, conversation_id],
        [TAG_TITLE, title],
        [TAG_SUMMARY, summary],
        [TAG_STATUS, STATUS_ENDED if ended else STATUS_ACTIVE],
    ]
    if project is not None:
        tags.append([TAG_ADDRESS, project_address(*project)])
    return tags


def private_reply_tags(spec: ReplySpec) -> Tags:
    """The tags of an agent's kind-14 rumor (a reply in a private conversation): one ``p`` per
    destination, ``e`` replying to the trigger, the conversation's ``subject`` if it has one (its newest),
    and the tags the daemon reads back (completion, error, delegation). Nothing else: the rumor is private,
    and clients show only these."""
    tags = _pubkey_tags(spec.destinations)
    tags.append([TAG_EVENT, spec.trigger.id, "", MARKER_REPLY])
    subject = spec.subject
    if subject is None:  # a spec not made from a conversation: its trigger's, else its root's
        root = spec.root.tag_value(TAG_SUBJECT) if spec.root else None
        subject = spec.trigger.tag_value(TAG_SUBJECT) or root
    if subject:
        tags.append([TAG_SUBJECT, subject])
    if spec.complete:
        tags.append([TAG_TOOL, TOOL_COMPLETE])
    if spec.error:
        tags.append([TAG_ERROR, ERROR_SYSTEM])
    if spec.delegation is not None:
        tags.append([TAG_DELEGATION, spec.delegation])
    return tags


def auth_event_template(relay_url: str, challenge: str) -> tuple[int, Tags, str]:
    """Return (kind, tags, content) of the NIP-42 event that answers ``challenge``."""
    return KIND_RELAY_AUTH, [[TAG_RELAY, relay_url], [TAG_CHALLENGE, challenge]], ""
