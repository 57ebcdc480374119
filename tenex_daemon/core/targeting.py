"""Who answers an incoming event (docs/PROTOCOL.md): allow-listing, targeting and the hop limit.

Pure functions over an event, the agent directory and the conversation's history.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from tenex_daemon.core.agents import Agent, AgentDirectory, AuthorRole
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.vocabulary import (
    KIND_PRIVATE_MESSAGE,
    TAG_DELEGATION,
    TAG_PUBKEY,
    TAG_TOOL,
    TOOL_COMPLETE,
)


class SkipReason(StrEnum):
    """Why an accepted or incoming event makes no agent run."""

    AUTHOR_NOT_ALLOWED = "author_not_allowed"
    ADDRESSED_ELSEWHERE = "addressed_elsewhere"
    OWN_EVENT = "own_event"
    HOP_LIMIT = "hop_limit"
    NO_AGENT = "no_agent"
    NOT_ADDRESSED = "not_addressed"
    NOT_A_PARTICIPANT = "not_a_participant"
    """A whitelisted person's event into a conversation they did not start and were not invited to."""
    DELEGATION = "delegation"
    """One side of a ``send_message`` exchange: the tool already carried it out."""


@dataclass(frozen=True, slots=True)
class Target:
    """The outcome of targeting: the agent to run, or why none runs."""

    agent: Agent | None
    skip: SkipReason | None = None
    via_orchestrator: bool = False
    """True when nobody (or only the project) was p-tagged, so the orchestrator routes."""


def is_allowed_author(
    pubkey: str, directory: AgentDirectory, owner: str | None, whitelist: Collection[str]
) -> bool:
    """Return whether ``pubkey`` may trigger agents: the owner, a whitelisted key or one of our agents."""
    return pubkey == owner or pubkey in whitelist or directory.by_pubkey(pubkey) is not None


def may_join(person: str, history: Sequence[NostrEvent], owner: str | None) -> bool:
    """Whether a whitelisted ``person`` may write into the conversation with ``history``: the owner may
    write anywhere; anyone else only where they wrote the root or the owner p-tagged them (an invitation)."""
    if person == owner or not history or history[0].pubkey == person:
        return True
    return owner is not None and any(
        event.pubkey == owner and event.has_tag(TAG_PUBKEY, person) for event in history
    )


def choose_target(event: NostrEvent, directory: AgentDirectory) -> Target:
    """Return the agent addressed by ``event``.

    The first p-tagged agent other than the author; else, if the project or nobody is
    p-tagged, the orchestrator (the default agent when there is none: the caller
    decides). A p-tag naming neither an agent nor the project: nobody. An agent's event
    tagged ``["delegation", <thread id>]`` (a ``send_message`` exchange, see
    :func:`is_delegation`) runs nobody: the tool already had the addressed agent answer.
    The tag on anyone else's event means nothing (a person cannot silence the agents). An agent's
    private completion (a kind-14 rumor tagged ``["tool", "complete"]``) goes to the orchestrator: its
    ``p`` names the person only, so that NIP-17 clients show it in the person's chat with the agent.
    """
    author_is_agent = directory.by_pubkey(event.pubkey) is not None
    if author_is_agent and is_delegation(event):
        return Target(None, SkipReason.DELEGATION)
    orchestrator = directory.orchestrator
    if (
        author_is_agent
        and event.kind == KIND_PRIVATE_MESSAGE
        and orchestrator is not None
        and orchestrator.pubkey != event.pubkey
        and event.has_tag(TAG_TOOL, TOOL_COMPLETE)
    ):
        return Target(orchestrator)
    tagged = [tag[1] for tag in event.tags if len(tag) > 1 and tag[0] == TAG_PUBKEY]
    for pubkey in tagged:
        agent = directory.by_pubkey(pubkey)
        if agent is not None and pubkey != event.pubkey:
            return Target(agent)
    others = [p for p in tagged if p != event.pubkey and p != directory.project_pubkey]
    if others:
        return Target(None, SkipReason.ADDRESSED_ELSEWHERE)
    if orchestrator is not None and orchestrator.pubkey == event.pubkey:
        return Target(None, SkipReason.OWN_EVENT)
    return Target(orchestrator, None if orchestrator else SkipReason.NO_AGENT, via_orchestrator=True)


def is_delegation(event: NostrEvent) -> bool:
    """Return whether ``event`` is one side of a ``send_message`` exchange (tagged ``delegation``)."""
    return any(len(tag) > 1 and tag[0] == TAG_DELEGATION for tag in event.tags)


def agent_chain_length(history: Sequence[NostrEvent], directory: AgentDirectory) -> int:
    """Return how many events at the end of history were written by agents in a row.

    ``send_message`` exchanges are not hops (they happen inside one agent's run and run
    nobody), so they are passed over without counting.
    """
    count = 0
    for event in reversed(history):
        if directory.by_pubkey(event.pubkey) is None:
            break
        if not is_delegation(event):
            count += 1
    return count


def _handle_at(text: str, handle: str) -> int:
    """The first position of ``@handle`` in ``text`` as a whole word: not inside a longer handle
    (``@devops`` does not name ``dev``) nor an address (``me@alice.org``); -1 when there is none."""
    wanted = "@" + handle
    position = text.find(wanted)
    while position >= 0:
        end = position + len(wanted)
        before_ok = position == 0 or not _in_handle(text[position - 1])
        if before_ok and (end == len(text) or not _in_handle(text[end])):
            return position
        position = text.find(wanted, position + 1)
    return -1


def _in_handle(character: str) -> bool:
    """Whether ``character`` may go on a handle: ASCII letters, digits, ``_`` and ``-`` (text written without
    spaces, Chinese say, may follow a mention at once: "@alice你好")."""
    return character.isascii() and (character.isalnum() or character in "_-")


def mentioned_agent(text: str, directory: AgentDirectory, exclude: Collection[str] = ()) -> Agent | None:
    """Return the first agent named in ``text`` as ``@slug`` or ``@Name`` (case-insensitive, a whole word;
    of two handles at one position, the longer)."""
    lowered = text.casefold()
    best: tuple[int, int, Agent] | None = None
    for agent in directory:
        if agent.slug in exclude or agent.orchestrator:
            continue
        for handle in {agent.slug, agent.name}:
            position = _handle_at(lowered, handle.casefold())
            if position >= 0 and (best is None or (position, -len(handle)) < (best[0], -best[1])):
                best = (position, len(handle), agent)
    return best[2] if best else None


def reply_person(conversation: Conversation, trigger: NostrEvent, directory: AgentDirectory) -> str:
    """The person an agent's reply to ``trigger`` goes to: the trigger's author if a person, else the newest
    person in history (else the root's author)."""
    if directory.role_of(trigger.pubkey, conversation.claims_agent(trigger.pubkey)) is AuthorRole.USER:
        return trigger.pubkey
    for event in reversed(conversation.history):
        if directory.role_of(event.pubkey, conversation.claims_agent(event.pubkey)) is AuthorRole.USER:
            return event.pubkey
    root = conversation.root
    return root.pubkey if root is not None else trigger.pubkey


def burst_people(
    conversation: Conversation, trigger: NostrEvent, burst: Iterable[str], directory: AgentDirectory
) -> list[str]:
    """The people an agent's reply answering a burst goes to (docs/CONTEXT.md, "Bursts"): the
    :func:`reply_person` of ``trigger``, then each other person who wrote one of its ``burst`` messages
    (ids), once each, in history order: every message of it counts as answered, so each author is told."""
    people = [reply_person(conversation, trigger, directory)]
    indexes = sorted(index for index in map(conversation.index_of, burst) if index is not None)
    for index in indexes:
        author = conversation.history[index].pubkey
        is_person = directory.role_of(author, conversation.claims_agent(author)) is AuthorRole.USER
        if is_person and author not in people:
            people.append(author)
    return people
