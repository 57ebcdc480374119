"""What an agent sees: the context-building contract of docs/CONTEXT.md, as pure functions.

The exact strings here are part of the contract; clients and prompts depend on them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, NamedTuple

from tenex_daemon.core.agents import Agent, AgentDirectory, AuthorRole, claims_agent
from tenex_daemon.core.conversation import AgentState, Conversation
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.nip19 import encode_npub
from tenex_daemon.core.references import find_event_references, inline_entities
from tenex_daemon.core.thread_tags import read_threading
from tenex_daemon.core.vocabulary import TAG_SESSION, is_session_id

WHILE_AWAY_HEADER: Final = "=== MESSAGES WHILE YOU WERE AWAY ===\n\n"
WHILE_AWAY_FOOTER: Final = (
    "=== END OF HISTORY ===\nRespond to the most recent user message above, considering the context.\n\n"
)
NEW_INTERACTION: Final = "=== NEW INTERACTION ==="
USER_LABEL: Final = "🟢 USER"
AGENT_LABEL_PREFIX: Final = "💬 "
UNKNOWN_AGENT_NAME: Final = "Another agent"
PROJECT_NAME: Final = "Project"
SHORT_NPUB_CHARS: Final = 13
"""A person's label is the first this many characters of their npub (``npub1`` and 8 more), then ``…``."""

Role = Literal["system", "user", "assistant"]


class ChatMessage(NamedTuple):
    """One chat message for an LLM: ``role`` and ``content``."""

    role: Role
    content: str


_NEVER_BUILT_FOR = AgentState()
"""The state of an agent never built for in a conversation (read, never changed)."""


@dataclass(frozen=True, slots=True)
class AgentContext:
    """What :func:`build_agent_messages` returns: the messages and the state to persist."""

    messages: list[ChatMessage]
    session_id: str | None
    last_processed_index: int
    """The agent's LPI after this build: the end of the history the run answers (the history's length at
    the start of the call, unless a person's message saved after the trigger ends it sooner)."""
    transitions_seen: int = 0
    """Phase transitions the agent has now been told about."""
    protected: tuple[int, ...] = ()
    """Indexes in ``messages`` that a token budget never drops: the while-away block, the marker
    and the trigger (always the last one to three messages; everything before them is history)."""
    summary: str | None = None
    """The stored summary of this agent's older history messages (``summarize`` budgets), if any."""
    summary_covers: int = 0
    """How many of the leading history messages ``summary`` stands for."""
    in_order: int | None = None
    """How many leading ``messages`` stand for history in its own order, when a burst put messages saved
    after the trigger behind them (None: all of the history messages)."""
    resets: int = 0
    """The conversation's :attr:`~tenex_daemon.core.conversation.Conversation.agent_resets` when it was
    built."""

    @property
    def history_end(self) -> int:
        """How many leading ``messages`` are history (step 1); the protected tail follows them."""
        return min(self.protected, default=len(self.messages))

    @property
    def summarizable_end(self) -> int:
        """How many leading ``messages`` a summary may stand for: history in its own order, where the next
        run's messages stand at the same places (a burst's later messages do not)."""
        end = self.history_end
        return end if self.in_order is None else min(end, self.in_order)


@dataclass
class HistoryView:
    """A memo of the history messages already built for one agent in one conversation.

    History is append-only and events are immutable, so the messages for
    ``history[:upto]`` stay valid while the inputs that shape them (resolved
    references, who claims to be an agent, the directory) are unchanged; the
    ``fingerprint`` records those inputs and a mismatch rebuilds the memo.
    """

    messages: list[ChatMessage] = field(default_factory=list)
    upto: int = 0
    fingerprint: tuple[object, ...] = ()
    authors: set[str] = field(default_factory=set)
    """Every author of ``history[:authors_upto]`` (to tell whether more than one person wrote)."""
    authors_upto: int = 0


PERSON_NAME_MAX_CHARS = 40
"""A profile name longer than this is cut (with an ellipsis) where it labels a person."""


def person_label(pubkey: str, name: str | None = None) -> str:
    """Return the label a person's messages carry when several people write (docs/CONTEXT.md step 1):
    their profile name (kind 0; ``name``, on one line, at most :data:`PERSON_NAME_MAX_CHARS` characters),
    else the short npub."""
    shown = " ".join(name.split()) if name else ""
    if not shown:
        return encode_npub(pubkey)[:SHORT_NPUB_CHARS] + "…"
    return shown if len(shown) <= PERSON_NAME_MAX_CHARS else shown[: PERSON_NAME_MAX_CHARS - 1] + "…"


def distinct_names(people: Collection[str], names: Mapping[str, str]) -> dict[str, str]:
    """The label of each of ``people`` when several write (:func:`person_label`: the profile name ``names``
    gives, else the short npub), with each label two or more of them would show alike (any case) followed by
    each one's short npub, ``Sam (npub10xlxvlhe…)``, the name cut to leave room: the model still tells them
    apart, and nobody passes for another by taking their name, or the label it is shown with (docs/CONTEXT.md
    step 1). Labels are compared as shown, after the cut."""
    plain = {pubkey: person_label(pubkey, names.get(pubkey)) for pubkey in people}
    marked: set[str] = set()
    while True:
        labels = {pubkey: _marked(pubkey, names.get(pubkey)) if pubkey in marked else plain[pubkey]
                  for pubkey in people}
        counts = Counter(label.casefold() for label in labels.values())
        alike = {pubkey for pubkey, label in labels.items() if counts[label.casefold()] > 1} - marked
        if not alike:
            return labels
        marked |= alike


def _marked(pubkey: str, name: str | None) -> str:
    """``name`` followed by the person's short npub, cut to a label's length (:func:`distinct_names`)."""
    short = encode_npub(pubkey)[:SHORT_NPUB_CHARS] + "…"
    shown = " ".join(name.split()) if name else ""
    if not shown:
        return short
    room = PERSON_NAME_MAX_CHARS - len(short) - 3
    return f"{shown if len(shown) <= room else shown[: room - 1] + '…'} ({short})"


def people_who_wrote(
    conversation: Conversation, trigger: NostrEvent, directory: AgentDirectory, view: HistoryView | None
) -> set[str]:
    """The people (neither an agent nor the project) with a non-empty event in the conversation or as the
    trigger: labelled by name or short npub once there are several (step 1). With ``view`` the authors are
    collected incrementally (:func:`_authors`)."""
    authors = _authors(conversation, view)
    return {
        pubkey for pubkey in (*authors, *((trigger.pubkey,) if trigger.content else ()))
        if directory.role_of(pubkey, conversation.claims_agent(pubkey)) is AuthorRole.USER
    }


def previous_context_line(summary: str) -> str:
    """Return the handoff-summary line of the while-away block."""
    return f"**Previous context**: {summary}\n\n"


def conversation_event_references(conversation: Conversation, trigger: NostrEvent) -> list[str]:
    """Return every event reference in the contents an agent would be shown."""
    found = dict.fromkeys(conversation.event_references())
    for uri in find_event_references(trigger.content):
        found[uri] = None
    return list(found)


# --- the algorithm -------------------------------------------------------------------------


class _Sender(NamedTuple):
    role: Role
    prefix: str | None
    """``"[Name]: "`` for attribution (agents; people when several wrote); None for the agent itself
    and for the only person."""
    label: str
    """The sender label of the while-away block."""


def _sender_for(
    pubkey: str,
    conversation: Conversation,
    agent: Agent,
    directory: AgentDirectory,
    people: bool = False,
    names: Mapping[str, str] | None = None,
) -> _Sender:
    """How ``pubkey``'s events are shown to ``agent``; ``people``: more than one person wrote (``names``:
    their profile names, by pubkey, where known)."""
    if pubkey == agent.pubkey:
        return _Sender("assistant", None, AGENT_LABEL_PREFIX + agent.name)
    role = directory.role_of(pubkey, conversation.claims_agent(pubkey))
    if role is AuthorRole.USER:
        if not people:
            return _Sender("user", None, USER_LABEL)
        return _Sender("user", f"[{person_label(pubkey, (names or {}).get(pubkey))}]: ", USER_LABEL)
    if role is AuthorRole.AGENT:
        other = directory.by_pubkey(pubkey)
        name = other.name if other is not None else UNKNOWN_AGENT_NAME
    elif role is AuthorRole.PROJECT:
        name = PROJECT_NAME
    else:
        name = UNKNOWN_AGENT_NAME
    return _Sender("system", f"[{name}]: ", AGENT_LABEL_PREFIX + name)


def build_agent_messages(
    conversation: Conversation,
    agent: Agent,
    trigger: NostrEvent,
    directory: AgentDirectory,
    resolved_entities: Mapping[str, str] | None = None,
    view: HistoryView | None = None,
    *,
    burst: bool = False,
    names: Mapping[str, str] | None = None,
) -> AgentContext:
    """Build the chat messages ``agent`` is sent to respond to ``trigger`` (docs/CONTEXT.md).

    ``burst``: the trigger is answered by a run that may have waited (docs/CONTEXT.md, "Bursts"): step 1
    then shows, after the history before the trigger, what was saved after it that the agent said (its
    answers to an earlier message of its burst, or to the message its previous run answered) or was
    already shown (by a run for a later message that went first: before its last processed index), and
    the trigger comes last. Other events saved after the trigger stay out of step 1 (they came after it;
    the while-away block shows them, as it does without ``burst``, up to a person's later message, which
    ends the history the run answers: :func:`_seen_until`).

    ``names``: people's profile names by pubkey, labelling them when several people write (else the
    short npub). Pure with respect to the conversation: it is not changed. The caller persists the
    returned ``last_processed_index``, ``session_id`` and ``transitions_seen`` before
    using the messages. Senders are classified once per author. A ``view`` (kept by the
    caller per conversation and agent) lets history already built be reused, so a
    build costs O(new events) plus a list copy instead of O(history) string work.
    """
    resolved = resolved_entities or {}
    history = conversation.history
    history_length = len(history)
    state = conversation.agent_states.get(agent.slug, _NEVER_BUILT_FOR)
    last_processed = state.last_processed_index
    own_key = agent.pubkey
    trigger_id = trigger.id
    trigger_index = conversation.index_of(trigger_id)
    senders: dict[str, _Sender] = {}
    people = _several_people(conversation, agent, trigger, directory, view)

    def sender(pubkey: str) -> _Sender:
        found = senders.get(pubkey)
        if found is None:
            found = senders[pubkey] = _sender_for(pubkey, conversation, agent, directory, people, names)
        return found

    def text(content: str) -> str:
        return inline_entities(content, resolved) if resolved else content

    # 1. History up to (not including) the trigger; all of it when the trigger is not stored.
    stop = history_length if trigger_index is None else trigger_index
    fingerprint = _fingerprint(conversation, agent, directory, people, names, resolved)
    messages = _history_prefix(history, stop, view, fingerprint, sender, text if resolved else None)
    in_order: int | None = None
    # where the history this run answers ends: a person's later message is the next run's (step 2)
    end = _seen_until(history, trigger_index, last_processed, sender)
    if burst and trigger_index is not None:  # the trigger goes last: what the agent saw or said since first
        later = [  # past the end, only its words answering what is before it (the rest are the next run's)
            event
            for index, event in enumerate(history[trigger_index + 1 :], trigger_index + 1)
            if index < last_processed
            or (event.pubkey == own_key and (index < end or _answers_before(conversation, event, end)))
        ]
        if later:
            in_order = len(messages)
        messages.extend(_history_messages(later, sender, text if resolved else None))
    append = messages.append

    # 2. The while-away block: what others said since the agent was last built for, up to a person's
    # message that came after the trigger (it gets a run of its own, after this one's reply).
    labels: dict[str, str] = {}
    away_parts: list[str] = []
    extend = away_parts.extend
    for event in history[last_processed:end]:
        content = event.content
        if not content:
            continue
        pubkey = event.pubkey
        if pubkey == own_key or event.id == trigger_id:
            continue
        label = labels.get(pubkey)
        if label is None:
            label = labels[pubkey] = sender(pubkey).label + ":\n"
        extend((label, text(content) if resolved else content, "\n\n"))
    if away_parts:
        seen = state.transitions_seen
        summary = _handoff_summary_since(conversation, seen)
        head = WHILE_AWAY_HEADER + previous_context_line(summary) if summary else WHILE_AWAY_HEADER
        append(ChatMessage("system", head + "".join(away_parts) + WHILE_AWAY_FOOTER))
        # 3. The marker, if and only if there is a block.
        append(ChatMessage("system", NEW_INTERACTION))

    # 4. The trigger, exactly once.
    append(_trigger_message(trigger, agent, sender(trigger.pubkey), text(trigger.content)))

    # 5. The state to persist.
    session_id = _session_for(trigger, state.session_id, directory)
    tail = 3 if away_parts else 1  # block, marker and trigger; or the trigger alone
    return AgentContext(
        messages,
        session_id,
        max(end, last_processed),
        len(conversation.phase_transitions),
        protected=tuple(range(len(messages) - tail, len(messages))),
        summary=state.summary,
        summary_covers=state.summary_covers,
        in_order=in_order,
        resets=conversation.agent_resets,
    )


def _seen_until(
    history: Sequence[NostrEvent],
    trigger_index: int | None,
    last_processed: int,
    sender: Callable[[str], _Sender],
) -> int:
    """Where the history a run answers ends: before the first person's message saved after the trigger
    that the agent was not shown yet (docs/CONTEXT.md, "Bursts": a message that arrives while the run is
    working gets the next run). Such a message came while the run was taking its turn; in the block it
    would stand before the trigger as "the most recent user message" and be answered twice. The whole
    history when the trigger is not stored."""
    if trigger_index is None:
        return len(history)
    for index in range(max(trigger_index + 1, last_processed), len(history)):
        event = history[index]
        if event.content and sender(event.pubkey).role == "user":
            return index
    return len(history)


def _answers_before(conversation: Conversation, event: NostrEvent, end: int) -> bool:
    """Whether ``event`` replies to an event of history before ``end`` (its threading tags' parent)."""
    parent = read_threading(event).parent_id
    index = None if parent is None else conversation.index_of(parent)
    return index is not None and index < end


def _fingerprint(
    conversation: Conversation,
    agent: Agent,
    directory: AgentDirectory,
    people: bool,
    names: Mapping[str, str] | None,
    resolved: Mapping[str, str],
) -> tuple[object, ...]:
    """What shapes the history messages of a :class:`HistoryView` besides the events themselves."""
    return (
        id(directory),
        agent.pubkey,
        conversation.claimant_count(),
        people,
        tuple(sorted(names.items())) if people and names else (),
        tuple(sorted(resolved.items())),
    )


def _authors(conversation: Conversation, view: HistoryView | None) -> set[str]:
    """The authors of the conversation's non-empty events; with ``view``, kept there and brought up to
    date with the events added since (O(new events))."""
    history = conversation.history
    if view is None:
        return {event.pubkey for event in history if event.content}
    if view.authors_upto > len(history):  # not the history the memo was made from
        view.authors, view.authors_upto = set(), 0
    view.authors.update(event.pubkey for event in history[view.authors_upto :] if event.content)
    view.authors_upto = len(history)
    return view.authors


def _several_people(
    conversation: Conversation,
    agent: Agent,
    trigger: NostrEvent,
    directory: AgentDirectory,
    view: HistoryView | None,
) -> bool:
    """Whether more than one person wrote in the conversation (its history and the trigger; an empty event
    writes nothing, as step 1 skips it): then each person's messages carry their label. With ``view`` the
    authors are collected incrementally."""
    authors = _authors(conversation, view)
    found: set[str] = set()
    for pubkey in (*authors, *((trigger.pubkey,) if trigger.content else ())):
        if pubkey in found or pubkey == agent.pubkey:
            continue
        if directory.role_of(pubkey, conversation.claims_agent(pubkey)) is AuthorRole.USER:
            found.add(pubkey)
            if len(found) > 1:
                return True
    return False


def _session_for(trigger: NostrEvent, stored: str | None, directory: AgentDirectory) -> str | None:
    """Step 5's session id: the trigger's well-formed ``claude-session`` tag when the owner or one of
    the project's agents wrote it, else the stored one."""
    tagged = trigger.tag_value(TAG_SESSION)
    if tagged and is_session_id(tagged) and directory.may_set_session(trigger.pubkey):
        return tagged
    return stored


def _history_prefix(
    history: list[NostrEvent],
    stop: int,
    view: HistoryView | None,
    fingerprint: tuple[object, ...],
    sender: Callable[[str], _Sender],
    text: Callable[[str], str] | None,
) -> list[ChatMessage]:
    """Step 1's messages for ``history[:stop]``, from the memo ``view`` when it holds them."""
    if view is None or stop < view.upto:
        return _history_messages(history[:stop], sender, text)
    if view.fingerprint != fingerprint:
        view.messages, view.upto, view.fingerprint = [], 0, fingerprint
    view.messages.extend(_history_messages(history[view.upto : stop], sender, text))
    view.upto = stop
    return view.messages.copy()


def _history_messages(
    events: list[NostrEvent],
    sender: Callable[[str], _Sender],
    text: Callable[[str], str] | None,
) -> list[ChatMessage]:
    """Map history events to messages (step 1 of docs/CONTEXT.md); empty events are skipped."""
    new_message = tuple.__new__  # ChatMessage(role, content) without an extra Python frame
    messages: list[ChatMessage] = []
    append = messages.append
    senders: dict[str, _Sender] = {}
    for event in events:
        content = event.content
        if not content:
            continue
        who = senders.get(event.pubkey)
        if who is None:
            who = senders[event.pubkey] = sender(event.pubkey)
        if text is not None:
            content = text(content)
        if who.prefix is None:
            append(new_message(ChatMessage, (who.role, content)))
        else:
            append(new_message(ChatMessage, (who.role, who.prefix + content)))
    return messages


def _trigger_message(trigger: NostrEvent, agent: Agent, who: _Sender, content: str) -> ChatMessage:
    """Step 4's message: the trigger as its author's, the agent's own (routed to itself after its completion)
    as another author's, so that its request ends on something to answer, not on its own words."""
    if trigger.pubkey == agent.pubkey:
        return ChatMessage("system", f"[{agent.name}]: {content}")
    return ChatMessage(who.role, content if who.prefix is None else who.prefix + content)


def _handoff_summary_since(conversation: Conversation, transitions_seen: int) -> str | None:
    """Return the newest handoff summary among transitions the agent has not been told about."""
    for transition in reversed(conversation.phase_transitions[transitions_seen:]):
        if transition.summary:
            return transition.summary
    return None


# --- the orchestrator's view ----------------------------------------------------------------


def is_person_message(conversation: Conversation, directory: AgentDirectory, event: NostrEvent) -> bool:
    """Whether ``event`` is a message with content written by a person (a user: not one of our agents, the
    project key, or an author that writes agent-only tags, in this event or earlier in the conversation)."""
    claims = conversation.claims_agent(event.pubkey) or claims_agent(event.tags)
    return bool(event.content) and directory.role_of(event.pubkey, claims) is AuthorRole.USER


def latest_user_message(
    conversation: Conversation, directory: AgentDirectory, trigger: NostrEvent | None = None
) -> str:
    """The content of the newest event with content a person wrote, up to the trigger (the trigger itself
    when a person wrote it, even before it is stored); the first message's when there is none."""
    history = conversation.history
    end = len(history)
    if trigger is not None:
        if is_person_message(conversation, directory, trigger):
            return trigger.content
        index = conversation.index_of(trigger.id)
        if index is not None:
            end = index
    for event in reversed(history[:end]):
        if is_person_message(conversation, directory, event):
            return event.content
    root = conversation.root
    return root.content if root is not None else ""


def build_routing_context(
    conversation: Conversation,
    directory: AgentDirectory,
    trigger: NostrEvent | None = None,
    completion_preview: tuple[str, str, int] | None = None,
) -> dict[str, Any]:
    """Return the orchestrator's routing context (docs/CONTEXT.md, "The orchestrator's view").

    ``latest_user_message`` is read up to ``trigger`` (the whole history without one).
    ``completion_preview`` (agent slug, message, timestamp) shows a completion that is
    arriving with the trigger but is not recorded yet; it is shown once, like any other, and only when
    it will count (it answers the open turn's trigger).
    """
    root = conversation.root
    history_entries = [t.routing_entry() for t in conversation.orchestrator_turns if t.is_completed]
    current: dict[str, Any] | None = None
    open_turn = conversation.open_turn()
    if open_turn is not None:
        current = open_turn.routing_entry()
        if completion_preview is not None:
            slug, message, timestamp = completion_preview
            counts = trigger is None or open_turn.answered_by(trigger)  # as its recording will judge it
            if counts and slug in open_turn.agents and not open_turn.has_completed(slug):
                current["completions"].append({"agent": slug, "message": message, "timestamp": timestamp})
    return {
        "user_request": root.content if root is not None else "",
        "latest_user_message": latest_user_message(conversation, directory, trigger),
        "routing_history": history_entries,
        "current_routing": current,
    }
