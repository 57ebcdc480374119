"""What an agent sees: the context-building contract of CONTEXT.md, as pure functions.

The exact strings here are part of the contract; clients and prompts depend on them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, NamedTuple

from tenex_daemon.core.agents import Agent, AgentDirectory, AuthorRole
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.references import find_event_references, inline_entities
from tenex_daemon.core.vocabulary import TAG_SESSION

WHILE_AWAY_HEADER: Final = "=== MESSAGES WHILE YOU WERE AWAY ===\n\n"
WHILE_AWAY_FOOTER: Final = (
    "=== END OF HISTORY ===\nRespond to the most recent user message above, considering the context.\n\n"
)
NEW_INTERACTION: Final = "=== NEW INTERACTION ==="
USER_LABEL: Final = "🟢 USER"
AGENT_LABEL_PREFIX: Final = "💬 "
UNKNOWN_AGENT_NAME: Final = "Another agent"
PROJECT_NAME: Final = "Project"

Role = Literal["system", "user", "assistant"]


class ChatMessage(NamedTuple):
    """One chat message for an LLM: ``role`` and ``content``."""

    role: Role
    content: str


@dataclass(frozen=True, slots=True)
class AgentContext:
    """What :func:`build_agent_messages` returns: the messages and the state to persist."""

    messages: list[ChatMessage]
    session_id: str | None
    last_processed_index: int
    """The agent's LPI after this build (history length at the start of the call)."""
    transitions_seen: int = 0
    """Phase transitions the agent has now been told about."""


def previous_context_line(summary: str) -> str:
    """Return the handoff-summary line of the while-away block."""
    return f"**Previous context**: {summary}\n\n"


def attributed(name: str, content: str) -> str:
    """Return another agent's content as the system message shows it."""
    return f"[{name}]: {content}"


def conversation_event_references(conversation: Conversation, trigger: NostrEvent) -> list[str]:
    """Return every event reference in the contents an agent would be shown."""
    found = dict.fromkeys(conversation.event_references())
    for uri in find_event_references(trigger.content):
        found[uri] = None
    return list(found)


# --- the algorithm -------------------------------------------------------------------------


class _Sender(NamedTuple):
    role: Role
    name: str | None
    """Display name for system attribution; None for the agent itself and for users."""
    label: str


def _sender_for(pubkey: str, conversation: Conversation, agent: Agent, directory: AgentDirectory) -> _Sender:
    if pubkey == agent.pubkey:
        return _Sender("assistant", None, AGENT_LABEL_PREFIX + agent.name)
    role = directory.role_of(pubkey, conversation.claims_agent(pubkey))
    if role is AuthorRole.USER:
        return _Sender("user", None, USER_LABEL)
    if role is AuthorRole.AGENT:
        other = directory.by_pubkey(pubkey)
        name = other.name if other is not None else UNKNOWN_AGENT_NAME
    elif role is AuthorRole.PROJECT:
        name = PROJECT_NAME
    else:
        name = UNKNOWN_AGENT_NAME
    return _Sender("system", name, AGENT_LABEL_PREFIX + name)


def build_agent_messages(
    conversation: Conversation,
    agent: Agent,
    trigger: NostrEvent,
    directory: AgentDirectory,
    resolved_entities: Mapping[str, str] | None = None,
) -> AgentContext:
    """Build the chat messages ``agent`` is sent to respond to ``trigger`` (CONTEXT.md).

    Pure: the conversation is not changed. The caller persists the returned
    ``last_processed_index`` and ``session_id`` before using the messages.
    """
    resolved = resolved_entities or {}
    history = conversation.history
    history_length = len(history)
    state = conversation.agent_states.get(agent.slug)
    last_processed = state.last_processed_index if state is not None else 0
    own_key = agent.pubkey
    trigger_id = trigger.id

    # Senders are resolved once per author, not once per event.
    senders: dict[str, _Sender] = {}

    def sender(event: NostrEvent) -> _Sender:
        found = senders.get(event.pubkey)
        if found is None:
            found = senders[event.pubkey] = _sender_for(event.pubkey, conversation, agent, directory)
        return found

    def text(content: str) -> str:
        return inline_entities(content, resolved) if resolved else content

    messages: list[ChatMessage] = []
    append = messages.append

    # 1. History up to (not including) the trigger.
    for event in history:
        if event.id == trigger_id:
            break
        content = event.content
        if not content:
            continue
        who = sender(event)
        if who.name is None:
            append(ChatMessage(who.role, text(content)))
        else:
            append(ChatMessage("system", attributed(who.name, text(content))))

    # 2. The while-away block: what others said since the agent was last built for.
    away_parts: list[str] = []
    for event in history[last_processed:]:
        if event.id == trigger_id or event.pubkey == own_key or not event.content:
            continue
        away_parts.append(f"{sender(event).label}:\n{text(event.content)}\n\n")
    if away_parts:
        seen = state.transitions_seen if state is not None else 0
        summary = _handoff_summary_since(conversation, seen)
        block = WHILE_AWAY_HEADER
        if summary:
            block += previous_context_line(summary)
        block += "".join(away_parts) + WHILE_AWAY_FOOTER
        append(ChatMessage("system", block))
        # 3. The marker, if and only if there is a block.
        append(ChatMessage("system", NEW_INTERACTION))

    # 4. The trigger, exactly once.
    who = sender(trigger)
    if who.name is None:
        append(ChatMessage(who.role, text(trigger.content)))
    else:
        append(ChatMessage("system", attributed(who.name, text(trigger.content))))

    # 5. The state to persist.
    session_tag = trigger.tag_value(TAG_SESSION)
    session_id = session_tag if session_tag else (state.session_id if state is not None else None)
    return AgentContext(
        messages, session_id, max(history_length, last_processed), len(conversation.phase_transitions)
    )


def _handoff_summary_since(conversation: Conversation, transitions_seen: int) -> str | None:
    """Return the newest handoff summary among transitions the agent has not been told about."""
    for transition in reversed(conversation.phase_transitions[transitions_seen:]):
        if transition.summary:
            return transition.summary
    return None


# --- the orchestrator's view ----------------------------------------------------------------


def build_routing_context(
    conversation: Conversation, completion_preview: tuple[str, str, int] | None = None
) -> dict[str, Any]:
    """Return the orchestrator's routing context (CONTEXT.md, seed 001).

    ``completion_preview`` (agent slug, message, timestamp) shows a completion that is
    arriving with the trigger but is not recorded yet; it is shown once, like any other.
    """
    root = conversation.root
    history_entries = [t.routing_entry() for t in conversation.orchestrator_turns if t.is_completed]
    current: dict[str, Any] | None = None
    open_turn = conversation.open_turn()
    if open_turn is not None:
        current = open_turn.routing_entry()
        if completion_preview is not None:
            slug, message, timestamp = completion_preview
            if slug in open_turn.agents and not open_turn.has_completed(slug):
                current["completions"].append({"agent": slug, "message": message, "timestamp": timestamp})
    return {
        "user_request": root.content if root is not None else "",
        "routing_history": history_entries,
        "current_routing": current,
    }
