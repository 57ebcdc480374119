"""Routing: which agents work next. By rules, or by the orchestrator agent's language model.

Both implement :class:`Orchestrator`, so the dispatcher does not care which one it has.
A decision is internal: it starts an orchestrator turn and schedules runs, it is never
published as a chat reply.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final, Protocol

import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tenex_daemon.core.agents import Agent, AgentDirectory
from tenex_daemon.core.budget import TokenBudget
from tenex_daemon.core.context import ChatMessage, is_person_message
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.errors import UnknownAgentError
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.llm import BackendError, CompletionRequest, LLMBackend, LLMMessage
from tenex_daemon.core.phases import BUILT_IN_PHASES, Phase, PhaseRules
from tenex_daemon.core.routing_budget import fit_routing_context
from tenex_daemon.core.targeting import mentioned_agent
from tenex_daemon.services.answering import redacted
from tenex_daemon.services.conversation_manager import ConversationManager

log = structlog.get_logger(__name__)

END: Final = "END"
"""The agent name of the decision that finishes a conversation's routing (``{"agents": ["END"]}``)."""


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    """Which agents work next, in which phase, and why; ``agents == ("END",)`` finishes routing."""

    agents: tuple[str, ...]
    reason: str
    phase: str | None = None

    @property
    def is_end(self) -> bool:
        """Whether this decision finishes the conversation's routing."""
        return self.agents == (END,)

    @classmethod
    def end(cls, reason: str) -> RoutingDecision:
        """The decision that finishes routing."""
        return cls((END,), reason)


INVALID_ANSWER = "invalid_answer"
"""A routing the model answered invalidly twice (:attr:`LLMOrchestrator.fallbacks`)."""
BACKEND_FAILED = "backend_failed"
"""A routing whose model call failed: the rules routed it (:attr:`LLMOrchestrator.fallbacks`)."""


class RoutingStop(StrEnum):
    """Why routing did not start a turn (the ``reason`` of the dispatcher's result)."""

    END = "routing_end"
    """The orchestrator decided the work is done."""
    ENDED = "routing_ended"
    """Routing already ended; only a new user message starts it again."""
    TURN_WAITING = "turn_waiting"
    """The open turn still waits for other agents' completions."""
    TURN_LIMIT = "turn_limit"
    """Too many orchestrator turns without a new user message."""
    REPEATED_DECISION = "repeated_decision"
    """The same decision (agents and phase) as the one before it since the last user message: a loop."""
    NOT_ROUTED = "not_routed"
    """A completion by an agent no turn routed to (the person addressed it): it goes back to them."""
    STOPPED = "turn_stopped"
    """A stop came while the orchestrator decided (nobody is run), or the turn this completion closed had an
    agent stopped: a stop hands the conversation back to the person, whose next message routes again
    (whichever came first, the stop or the others' completions)."""


class Orchestrator(Protocol):
    """Decides which agents answer a message addressed to the orchestrator (or to nobody)."""

    async def route(self, conversation: Conversation, trigger: NostrEvent) -> RoutingDecision | None:
        """Return the decision, or None when there is no agent to route to."""


class RuleBasedOrchestrator:
    """Routes by rules: ``@slug`` or ``@Name`` in a user's message picks that agent, else the default agent.

    An agent's completion ends routing: the work goes back to the user.
    """

    def __init__(self, directory: AgentDirectory, default_agent: str | None) -> None:
        if default_agent is not None and directory.find(default_agent) is None:
            raise UnknownAgentError(default_agent, tuple(a.slug for a in directory))
        self._directory = directory
        self._default = default_agent

    async def route(self, conversation: Conversation, trigger: NostrEvent) -> RoutingDecision | None:
        """Return the decision, or None when there is no agent to route to."""
        if self._directory.by_pubkey(trigger.pubkey) is not None:
            return RoutingDecision.end("an agent completed: back to the user")
        agent: Agent | None = mentioned_agent(trigger.content, self._directory)
        if agent is not None:
            return RoutingDecision((agent.slug,), f"mentioned @{agent.slug}")
        if self._default is not None:
            return RoutingDecision((self._default,), "default agent")
        return None


class RoutingAnswer(BaseModel):
    """The JSON object the orchestrator's model must answer with."""

    model_config = ConfigDict(extra="ignore")

    agents: list[str] = Field(min_length=1)
    phase: Phase | None = None
    reason: str = ""

    @field_validator("phase", mode="before")
    @classmethod
    def _no_phase(cls, value: object) -> object:
        if isinstance(value, str) and value.strip().lower() in ("", "null", "none"):
            return None
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("agents")
    @classmethod
    def _end_alone(cls, agents: list[str]) -> list[str]:
        cleaned = [a.strip() for a in agents]
        if any(a.upper() == END for a in cleaned):
            if len(cleaned) > 1:
                raise ValueError('"END" finishes routing: it cannot be combined with agents')
            return [END]
        if any(not a for a in cleaned):
            raise ValueError("an agent slug cannot be empty")
        return cleaned


class AnswerError(ValueError):
    """The model's answer is not a valid routing decision; the message is fed back to it. ``kind`` names
    what is wrong without quoting the answer (what a private conversation's logs may show)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_json_object(text: str) -> dict[str, Any]:
    """Return the first JSON object in ``text``: fenced first, else the first ``{...}`` that parses."""
    candidates = [m.group(1) for m in _FENCE.finditer(text)] + [text]
    decoder = json.JSONDecoder()
    for candidate in candidates:
        start = candidate.find("{")
        while start >= 0:
            try:
                value, _ = decoder.raw_decode(candidate, start)
            except json.JSONDecodeError:
                pass
            else:
                if isinstance(value, dict):
                    return value
            start = candidate.find("{", start + 1)
    raise AnswerError("the answer holds no JSON object", "no_json")


def parse_routing_answer(
    text: str, known_agents: Sequence[str], phases: Sequence[Phase] = BUILT_IN_PHASES
) -> RoutingDecision:
    """Parse and validate the model's answer (its agents among ``known_agents``, its phase among ``phases``,
    the project's); raise :class:`AnswerError` saying what is wrong."""
    raw = extract_json_object(text)
    try:
        answer = RoutingAnswer.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'answer'}: {e['msg']}" for e in exc.errors()
        )
        raise AnswerError(f"the JSON is not a routing decision ({problems})", "not_a_decision") from None
    if answer.agents == [END]:
        return RoutingDecision.end(answer.reason or "done")
    unknown = [a for a in answer.agents if a not in known_agents]
    if unknown:
        raise AnswerError(
            f"unknown agent {', '.join(repr(a) for a in unknown)}; the agents are {', '.join(known_agents)}",
            "unknown_agent",
        )
    if answer.phase is not None and answer.phase not in phases:
        raise AnswerError(
            f"unknown phase {answer.phase.value!r}; the phases are {', '.join(phases)}", "unknown_phase"
        )
    phase = answer.phase.value if answer.phase is not None else None
    return RoutingDecision(tuple(dict.fromkeys(answer.agents)), answer.reason, phase)


def orchestrator_system_prompt(
    roles: Mapping[str, str], phase_rules: PhaseRules, instructions: str = ""
) -> str:
    """The orchestrator's system prompt: the agents and their roles, the phases, the exact answer format."""
    agent_lines = "\n".join(f"- {slug}: {role or 'no role given'}" for slug, role in roles.items())
    phases = phase_rules.phases
    moves = {phase: sorted(p.value for p in phase_rules.allowed_from(phase)) for phase in phases}
    phase_lines = "\n".join(f"- {phase.value} -> {', '.join(moves[phase]) or '(none)'}" for phase in phases)
    prompt = (
        "You are the orchestrator of a TENEX project: an invisible router. You never answer the user; "
        "you decide which agents work next.\n\n"
        f"The agents (slug: role):\n{agent_lines}\n\n"
        "The phases and the moves allowed from each (staying in the same phase is always allowed):\n"
        f"{phase_lines}\n\n"
        "You are sent the routing context as JSON: user_request (the conversation's first message), "
        "latest_user_message (the newest message the user wrote, up to the event being routed), "
        "routing_history (the finished turns: phase, agents, their completions, reason) and "
        "current_routing (the open turn, or null). The phase the conversation is in now is said last (an "
        "agent may have moved it since the newest turn began).\n\n"
        "Answer with exactly one JSON object and nothing else:\n"
        '{"agents": ["<slug>", ...], "phase": "<phase or null>", "reason": "<why>"}\n'
        "agents: one or more slugs from the list above; phase: the phase the agents work in (null keeps "
        "the current one).\n"
        "When the work is done, or only the user can say what comes next, answer:\n"
        '{"agents": ["END"], "reason": "<why>"}'
    )
    return f"{prompt}\n\n{instructions}" if instructions else prompt


CURRENT_PHASE: Final = "The conversation is in the {phase} phase now."
"""The last line of the orchestrator's system prompt, per request: the routing context's turns say the phase
each began in, and an agent's ``switch_phase`` moves it within a turn."""


def with_current_phase(system_prompt: str, phase: Phase) -> str:
    """The orchestrator's system prompt for one routing request: the conversation's phase ends it."""
    return f"{system_prompt}\n\n{CURRENT_PHASE.format(phase=phase.value)}"


END_REFUSED: Final = (
    "a person just wrote in this conversation and must get an answer, so END is not possible now"
)
"""Why an END answering a person's message is refused (the model is told their message too)."""
ANSWER_AGAIN: Final = (
    "Your answer was not a valid routing decision: {error}. "
    'Answer again with exactly one JSON object: {{"agents": [...], "phase": ..., "reason": "..."}} '
    'or {{"agents": ["END"], "reason": "..."}}.'
)


QUOTE_CHARS: Final = 1000
"""A person's message quoted back to the orchestrator is cut to this many characters."""


def _quote(text: str) -> str:
    return json.dumps(text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS] + "…", ensure_ascii=False)


class LLMOrchestrator:
    """Routes with the orchestrator agent's language model.

    The model is sent the system prompt (:func:`orchestrator_system_prompt`) and one ``user``
    message holding the routing context JSON (docs/CONTEXT.md). An invalid answer (no JSON object,
    not a decision, an unknown slug) is fed back once with what is wrong; a second invalid
    answer routes to the default agent. END in answer to a person's message is invalid: a
    person who writes gets an answer (the feedback quotes their message). A backend failure
    falls back to ``fallback``. With a ``budget`` (the orchestrator agent's, from its model's context
    window) the routing context is fitted to it first
    (:func:`~tenex_daemon.core.routing_budget.fit_routing_context`).
    """

    def __init__(
        self,
        manager: ConversationManager,
        backend: LLMBackend,
        fallback: Orchestrator,
        *,
        default_agent: str | None,
        roles: Mapping[str, str] | None = None,
        instructions: str = "",
        model: str | None = None,
        temperature: float | None = None,
        max_tokens: int | None = None,
        budget: TokenBudget | None = None,
    ) -> None:
        directory = manager.agents
        orchestrator = directory.orchestrator
        if orchestrator is None:
            raise ValueError("the LLM orchestrator needs an agent with orchestrator = true")
        if default_agent is not None and directory.find(default_agent) is None:
            raise UnknownAgentError(default_agent, tuple(a.slug for a in directory))
        self._manager = manager
        self._backend = backend
        self._fallback = fallback
        self.fallbacks: Counter[str] = Counter()
        """Routings that did without the model's decision, by why (``invalid_answer``: two invalid answers;
        ``backend_failed``): the daemon's status and /metrics show them."""
        self._agent = orchestrator
        self._default = default_agent
        routable = [a for a in directory if not a.orchestrator]
        given = roles or {}
        self._roles = {a.slug: given.get(a.slug) or a.name for a in routable}
        self._known = tuple(self._roles)
        self._system_prompt = orchestrator_system_prompt(self._roles, manager.phase_rules, instructions)
        self._phases = manager.phase_rules.phases
        self._model = model
        self._temperature = temperature
        self._max_tokens = max_tokens
        self._budget = budget

    @property
    def system_prompt(self) -> str:
        """What the model is told before the routing context (each request ends it with the conversation's
        phase: :func:`with_current_phase`)."""
        return self._system_prompt

    @property
    def budget(self) -> TokenBudget | None:
        """The token budget the routing context is fitted to (None: sent whole)."""
        return self._budget

    async def route(self, conversation: Conversation, trigger: NostrEvent) -> RoutingDecision | None:
        """Ask the model; return its decision, the default agent's after two invalid answers,
        or the fallback's when the backend fails."""
        cid = conversation.id
        # a person's message must be answered; an agent's (ours, a foreign one, the project's) may end routing
        from_user = is_person_message(conversation, self._manager.agents, trigger)
        context = await self._manager.build_orchestrator_routing_context(cid, trigger)
        system_prompt = with_current_phase(self._system_prompt, conversation.phase)
        if self._budget is not None:
            fitted = fit_routing_context(context, system_prompt, self._budget)
            if fitted is not context:
                left_out = len(context["routing_history"]) - len(fitted["routing_history"])
                log.info("routing_context_truncated", conversation_id=cid, turns_left_out=left_out)
                context = fitted
        messages: list[LLMMessage] = [ChatMessage("user", json.dumps(context, ensure_ascii=False))]
        error = ""
        for attempt in (1, 2):
            try:
                text = await self._ask(cid, system_prompt, messages)
            except Exception as exc:
                kind = exc.kind.value if isinstance(exc, BackendError) else type(exc).__name__
                log.warning(
                    "orchestrator_backend_failed",
                    conversation_id=cid,
                    backend=self._backend.name,
                    error=kind,
                    detail=redacted(str(exc)),  # as an agent's error reply: no piece of a key in the log
                    action="rule-based routing",
                )
                self.fallbacks[BACKEND_FAILED] += 1
                return await self._fallback.route(conversation, trigger)
            try:
                decision = parse_routing_answer(text, self._known, self._phases)
            except AnswerError as exc:
                # a private conversation's logs name what was wrong, never the answer's words
                error, told = (exc.kind if conversation.private else str(exc)), str(exc)
            else:
                if not (decision.is_end and from_user):
                    return decision
                # the person's words go to the model only: the error is logged, and a private one's are not
                error = END_REFUSED
                told = f"{END_REFUSED}; their message: {_quote(trigger.content)}"
            log.info("orchestrator_answer_invalid", conversation_id=cid, attempt=attempt, error=error)
            messages += [ChatMessage("assistant", text), ChatMessage("user", ANSWER_AGAIN.format(error=told))]
        self.fallbacks[INVALID_ANSWER] += 1
        if from_user:  # as the rules route it: an @mention the person wrote, else the default agent
            ruled = await self._fallback.route(conversation, trigger)
            agents: tuple[str, ...] = () if ruled is None else ruled.agents
        else:
            ruled, agents = None, () if self._default is None else (self._default,)
        log.warning(
            "orchestrator_answer_rejected",
            conversation_id=cid,
            error=error,
            action=f"routed to {', '.join(agents)}" if agents else "no agent",
        )
        if not agents:
            return None
        how = ruled.reason if ruled is not None else "default agent"
        return RoutingDecision(agents, f"{how} (orchestrator answer invalid: {error})")

    async def _ask(self, conversation_id: str, system_prompt: str, messages: Sequence[LLMMessage]) -> str:
        result = await self._backend.complete(
            CompletionRequest(
                agent_slug=self._agent.slug,
                agent_name=self._agent.name,
                system_prompt=system_prompt,
                messages=tuple(messages),
                model=self._model,
                temperature=self._temperature,
                max_tokens=self._max_tokens,
            )
        )
        used = (result.prompt_tokens or 0, result.completion_tokens or 0)
        if any(used):
            try:
                await self._manager.update_agent_state(conversation_id, self._agent.slug, add_tokens=used)
            except Exception as exc:  # the answer stands: a count left out is not worth a decision lost
                log.warning(
                    "orchestrator_tokens_not_counted", conversation_id=conversation_id, tokens=list(used),
                    error=repr(exc),
                )
        return result.text
