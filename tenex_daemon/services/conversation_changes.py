"""What the conversation manager keeps to put a conversation back when a save fails, and what an
agent run records besides its reply."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog

from tenex_daemon.core.agents import AgentDirectory
from tenex_daemon.core.context import AgentContext, is_person_message
from tenex_daemon.core.conversation import TASK_SESSION_EXPIRED, AgentState, Conversation
from tenex_daemon.core.execution_time import ExecutionTime
from tenex_daemon.core.turns import OrchestratorTurn

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class StateBeforeReply:
    """What :meth:`ConversationManager.append_reply` changes, kept to put back when its save fails."""

    execution_time: ExecutionTime
    agent_state: AgentState | None
    open_turn: OrchestratorTurn | None
    """The open turn as it was (a completion may close it)."""
    updated_at: int

    @classmethod
    def of(cls, conversation: Conversation, agent_slug: str) -> StateBeforeReply:
        state = conversation.agent_states.get(agent_slug)
        turn = conversation.open_turn()
        return cls(
            conversation.execution_time,
            None if state is None else state.model_copy(),
            None if turn is None else turn.model_copy(deep=True),
            conversation.updated_at,
        )

    def restore(self, conversation: Conversation, agent_slug: str) -> None:
        conversation.execution_time = self.execution_time
        if self.agent_state is None:
            conversation.agent_states.pop(agent_slug, None)
        else:
            conversation.agent_states[agent_slug] = self.agent_state
        if self.open_turn is not None:
            conversation.orchestrator_turns[-1] = self.open_turn
        conversation.updated_at = self.updated_at


@dataclass(frozen=True, slots=True)
class LifecycleBefore:
    """A conversation's lifecycle fields and clocks, kept to put back when a save fails."""

    values: dict[str, Any]

    @classmethod
    def of(cls, conversation: Conversation) -> LifecycleBefore:
        values = {name: getattr(conversation, name) for name in LIFECYCLE_ATTRS}
        values["metadata"] = conversation.metadata.model_copy()  # changed in place (last_user_message)
        return cls(values)

    def restore(self, conversation: Conversation) -> None:
        for name, value in self.values.items():
            setattr(conversation, name, value)


LIFECYCLE_ATTRS = (
    "activity_at", "updated_at", "ended_at", "ended_by", "end_reason", "title", "title_source",
    "summary", "described_at", "description_published", "metadata",
)


def record_end(
    conversation: Conversation, run: RunRecord, now_ms: int, agents: AgentDirectory
) -> LifecycleBefore | None:
    """A run that ended the conversation: its agent's end (when, who, why) is set, to be saved with the
    reply; returns what to put back when that save fails (None: nothing set, it was ended already, or a
    person wrote in it after what the run answered: the conversation stays open for that message)."""
    if not run.ends or conversation.is_ended:
        return None
    unseen = conversation.history[run.context.last_processed_index :]
    if any(is_person_message(conversation, agents, event) for event in unseen):
        log.info(
            "end_skipped", conversation_id=conversation.id, agent=run.agent_slug,
            reason="a person wrote after the messages the run answered",
        )
        return None
    before = LifecycleBefore.of(conversation)
    mark_ended(conversation, run.agent_slug, run.end_reason, now_ms)
    return before


def mark_ended(conversation: Conversation, by: str, reason: str | None, now_ms: int) -> None:
    """Record the end (when, who, why). A conversation described before has its description marked
    unpublished, so that its kind 513 goes out again saying ``ended`` (at once through the running
    daemon's description jobs, else at the next start), unless it is an expired task session's: the
    task's next session speaks for the task's thread."""
    conversation.ended_at, conversation.ended_by, conversation.end_reason = now_ms, by, reason or None
    if conversation.summary and conversation.end_reason != TASK_SESSION_EXPIRED:
        conversation.description_published = False


def clear_end(conversation: Conversation) -> None:
    """Reopen an ended conversation: its end is cleared, and its description is marked unpublished so that
    its kind 513 goes out again saying ``active`` (clients kept the one that said ``ended``), unless it is
    an expired task session's: the task's next session speaks for the task's thread."""
    if conversation.summary and conversation.end_reason != TASK_SESSION_EXPIRED:
        conversation.description_published = False
    conversation.ended_at = None
    conversation.ended_by = None
    conversation.end_reason = None


@dataclass(frozen=True, slots=True)
class RunRecord:
    """What an agent run changes besides its reply (:meth:`ConversationManager.append_reply`)."""

    agent_slug: str
    context: AgentContext
    """The context the agent answered from (its last processed index, session, transitions seen)."""
    started_ms: int
    """When the run started, on :meth:`ConversationManager.run_clock_ms` (its working time counts until the
    reply is saved)."""
    session_id: str | None = None
    """The backend's new session, if it reported one (None keeps the context's)."""
    add_tokens: tuple[int, int] | None = None
    """The run's (prompt, completion) token usage."""
    tools_used: tuple[str, ...] = ()
    """The tools the agent called in the run, in call order (kept with its reply)."""
    ends: bool = False
    """The agent ended the conversation (``end_conversation``): the end is recorded with its reply."""
    end_reason: str | None = None



def record_context(state: AgentState, context: AgentContext, resets: int | None = None) -> bool:
    """What the agent has now been shown: its last processed index, session and phase transitions; nothing
    when the agents were reset since the context was built (``resets``: the conversation's count now; the
    reset stands, the agent starts fresh). Returns whether it was recorded."""
    if resets is not None and resets != context.resets:
        return False
    state.last_processed_index = context.last_processed_index
    state.session_id = context.session_id
    state.transitions_seen = context.transitions_seen
    return True


def record_run(state: AgentState, session_id: str | None, add_tokens: tuple[int, int] | None) -> None:
    """Set the agent's new session id (None leaves it) and add a run's token usage (prompt, completion)."""
    if session_id is not None:
        state.session_id = session_id
    if add_tokens is not None:
        prompt, completion = add_tokens
        if prompt < 0 or completion < 0:
            raise ValueError(f"token counts cannot be negative: {add_tokens}")
        state.prompt_tokens += prompt
        state.completion_tokens += completion
