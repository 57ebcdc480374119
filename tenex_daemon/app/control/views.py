"""Conversations, token counts and agent contexts as JSON-ready data (the API's and the CLI's shapes)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from tenex_daemon.app.control.errors import ApiError
from tenex_daemon.core.budget import BudgetStrategy, TokenBudget
from tenex_daemon.core.context import AgentContext
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.errors import ConversationNotFoundError
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.llm import LLMMessage
from tenex_daemon.core.routing_budget import fit_routing_context
from tenex_daemon.core.search import ConversationSummary
from tenex_daemon.core.vocabulary import KIND_TASK
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.services.orchestrator import with_current_phase
from tenex_daemon.services.persona import PersonaSpec, build_persona
from tenex_daemon.services.token_budget import preview_fit


def summary_json(summary: ConversationSummary) -> dict[str, Any]:
    """Return a conversation's summary row as JSON-ready data."""
    return summary.model_dump(mode="json")


def conversation_json(
    conversation: Conversation, now_ms: int | None = None, *, expires_at: int | None = None
) -> dict[str, Any]:
    """Return a conversation in full: summary, metadata, history, agent states, phase, transitions, turns;
    ``expires_at``: when a task session expires (:meth:`ConversationManager.expires_at`)."""
    now = int(datetime.now(UTC).timestamp() * 1000) if now_ms is None else now_ms
    state = conversation.state_dict()
    return {
        "id": conversation.id,
        "title": conversation.title,
        "phase": conversation.phase.value,
        "archived": conversation.archived,
        "root_kind": conversation.root_kind,
        "is_task": conversation.task_id is not None or conversation.root_kind == KIND_TASK,
        "private": conversation.private,
        "created_at": conversation.created_at,
        "updated_at": conversation.updated_at,
        "phase_started_at": conversation.phase_started_at,
        "status": "ended" if conversation.is_ended else "active",
        "activity_at": conversation.last_activity,
        "ended_at": conversation.ended_at,
        "ended_by": conversation.ended_by,
        "end_reason": conversation.end_reason,
        "description": conversation.summary,
        "title_source": conversation.title_source,
        "channel": conversation.channel,
        "task_id": conversation.task_id,
        "previous_session": conversation.previous_session,
        "expires_at": expires_at,
        "token_count": conversation.token_count(),
        "summary": summary_json(ConversationSummary.of(conversation)),
        "metadata": state["metadata"],
        "agent_states": state["agent_states"],
        "transitions": state["phase_transitions"],
        "turns": state["orchestrator_turns"],
        "execution_time": state["execution_time"],
        "execution_seconds": conversation.execution_time.total(now),
        "tokens": tokens_json(conversation),
        "history": [event.to_dict() for event in conversation.history],
    }


def tokens_json(conversation: Conversation) -> dict[str, Any]:
    """Tokens the agents' backends reported for the conversation: totals and per agent."""
    by_agent = {
        slug: {"prompt": state.prompt_tokens, "completion": state.completion_tokens}
        for slug, state in sorted(conversation.agent_states.items())
        if state.prompt_tokens or state.completion_tokens
    }
    return {
        "prompt": sum(t["prompt"] for t in by_agent.values()),
        "completion": sum(t["completion"] for t in by_agent.values()),
        "by_agent": by_agent,
    }


def context_json(
    conversation_id: str,
    agent_slug: str,
    trigger_id: str,
    context: AgentContext,
    stored_index: int,
    persona: str,
    budget: TokenBudget | None = None,
) -> dict[str, Any]:
    """Return a context preview: the persona (the ``system`` message sent first) and the messages, in
    order, exactly as the agent would be sent them: cut to ``budget`` as a run's first call is
    (:func:`~tenex_daemon.services.token_budget.preview_fit`), with what the budget did."""
    messages: Sequence[LLMMessage] = context.messages
    cut: dict[str, Any] | None = None
    if budget is not None:
        fitted = preview_fit(context, persona, budget)
        messages = fitted.messages
        cut = {
            "limit": budget.limit,
            "strategy": budget.strategy.value,
            "tokens": fitted.tokens,
            "dropped": fitted.dropped,
            "to_summarize": fitted.to_summarize,
        }
    return {
        "conversation_id": conversation_id,
        "agent": agent_slug,
        "trigger": trigger_id,
        "persona": persona,
        "messages": [{"role": m.role, "content": m.content} for m in messages],
        "session_id": context.session_id,
        "last_processed_index": stored_index,
        "next_last_processed_index": context.last_processed_index,
        "budget": cut,
    }


async def preview_context(
    manager: ConversationManager,
    conversation_id: str,
    agent_slug: str,
    trigger_id: str | None = None,
    personas: Mapping[str, PersonaSpec] | None = None,
    routing_prompt: str | None = None,
) -> dict[str, Any]:
    """Build an agent's context without changing its state (the trigger defaults to the newest event the
    agent did not write, else the newest: its own does not trigger it).

    Its persona is built as a run builds it (:func:`~tenex_daemon.services.persona.build_persona`)
    from ``personas[agent_slug]``; an agent not in ``personas`` gets a persona without instructions.
    The orchestrator's is its routing request (docs/CONTEXT.md, "The orchestrator's view"): the system
    prompt its model routes with (``routing_prompt``) and one ``user`` message holding the routing
    context (routing never runs on its own either); 409
    when it routes by rules (no model is sent anything).
    Raises :class:`ConversationNotFoundError`, :class:`UnknownAgentError`, or :class:`ApiError`
    (404) for a trigger that is not in the conversation.
    """
    agent = manager.agents.get(agent_slug)
    conversation = await manager.get_conversation(conversation_id)
    if conversation is None:
        raise ConversationNotFoundError(conversation_id)
    if not conversation.history:
        raise ApiError(409, f"conversation {conversation_id} has no events")
    routes = manager.agents.orchestrator is agent
    if trigger_id is None:  # the newest event the agent did not write (else the newest)
        trigger = next(
            (e for e in reversed(conversation.history) if e.pubkey != agent.pubkey), conversation.history[-1]
        )
    else:
        index = conversation.index_of(trigger_id)
        if index is None:
            raise ApiError(404, f"event {trigger_id} is not in conversation {conversation_id}")
        trigger = conversation.history[index]
    spec = (personas or {}).get(agent_slug) or PersonaSpec(agent)
    if routes:
        return await _routing_preview(manager, conversation, agent_slug, trigger, routing_prompt, spec.budget)
    context = await manager.preview_agent_messages(conversation_id, agent_slug, trigger)
    state = conversation.agent_states.get(agent_slug)
    stored_index = state.last_processed_index if state is not None else 0
    persona = await build_persona(manager.store, manager.agents, spec, conversation, trigger)
    return context_json(conversation_id, agent_slug, trigger.id, context, stored_index, persona, spec.budget)


async def _routing_preview(
    manager: ConversationManager,
    conversation: Conversation,
    agent_slug: str,
    trigger: NostrEvent,
    routing_prompt: str | None,
    budget: TokenBudget | None,
) -> dict[str, Any]:
    """The orchestrator's routing request for ``trigger``, shaped as :func:`context_json`: fitted to the
    orchestrator's ``budget`` as its model is sent it (``budget.tokens``: before cuts; ``budget.dropped``: the
    turns left out)."""
    if routing_prompt is None:
        raise ApiError(409, f"{agent_slug} routes by rules here (no model): it is sent nothing")
    routing_prompt = with_current_phase(routing_prompt, conversation.phase)
    whole = await manager.build_orchestrator_routing_context(conversation.id, trigger)
    routing = whole if budget is None else fit_routing_context(whole, routing_prompt, budget)
    content = json.dumps(routing, ensure_ascii=False)
    cut: dict[str, Any] | None = None
    if budget is not None:
        cut = {
            "limit": budget.limit,
            "strategy": BudgetStrategy.SLIDING_WINDOW.value,  # routing always leaves the oldest turns out
            "tokens": budget.count(routing_prompt) + budget.count(json.dumps(whole, ensure_ascii=False)),
            "dropped": len(whole["routing_history"]) - len(routing["routing_history"]),
            "to_summarize": 0,
        }
    state = conversation.agent_states.get(agent_slug)
    index = state.last_processed_index if state is not None else 0
    return {
        "conversation_id": conversation.id,
        "agent": agent_slug,
        "trigger": trigger.id,
        "persona": routing_prompt,
        "messages": [{"role": "user", "content": content}],
        "session_id": None,
        "last_processed_index": index,
        "next_last_processed_index": index,
        "budget": cut,
    }
