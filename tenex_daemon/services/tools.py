"""The tools an agent may call during its run, and the registry that runs them.

A tool gets validated arguments and a :class:`ToolContext` (the conversation, the agent,
the manager) and returns the text the model reads next. Anything that goes wrong (an
unknown tool, arguments that do not validate, a rule that forbids the action) becomes a
:class:`~tenex_daemon.core.llm.ToolResult` marked ``is_error`` that says what was wrong,
so the model can try again: a tool call never crashes a run.

Tools that end something (``complete``, ``end_conversation``) only record the wish in
:class:`RunEffects`; the runner acts on it when it saves the reply, so the reply still
goes out and is tagged accordingly.

``send_message`` reaches another agent through the run's :class:`Delegator` (see
:mod:`tenex_daemon.services.delegation`); a run without one is refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tenex_daemon.core.agents import Agent, AuthorRole
from tenex_daemon.core.budget import TokenBudget
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.errors import ConversationArchivedError, PhaseTransitionError
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.llm import ToolCall, ToolResult, ToolSpec
from tenex_daemon.core.phases import BUILT_IN_PHASES, Phase
from tenex_daemon.core.search import ConversationSummary, SearchQuery
from tenex_daemon.core.vocabulary import KIND_PRIVATE_MESSAGE
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.services.persona import asking_person
from tenex_daemon.services.token_budget import cut_to_tokens

log = structlog.get_logger(__name__)

DEFAULT_RECENT_CONVERSATIONS = 10
"""How many conversations ``get_conversation``'s ``list_recent`` lists by default
(``conversations.list_recent``)."""
MAX_RECENT_CONVERSATIONS = 50
"""The most conversations one ``list_recent`` call lists."""
MAX_MESSAGES_SENT = 16
"""The most ``send_message`` calls one run may make (each runs the asked agent): the run's model-call
limit bounds its rounds, not the calls one round asks for."""
PAGE_SHARE = 0.5
"""The share of the asking agent's token budget one page of ``get_conversation`` may take, so the
persona and the conversation the agent is in still fit beside it."""


class ToolRefusedError(Exception):
    """A tool could not do what was asked; the message is returned to the model as an error result."""


class NotAskedError(ToolRefusedError):
    """``send_message`` was refused before the other agent was asked (an unknown or forbidden agent, one a
    person stopped, a thread that cannot be read): the call does not count toward
    :data:`MAX_MESSAGES_SENT`."""


@dataclass(slots=True)
class RunEffects:
    """What the tools of one run asked the runner to do when it saves the reply."""

    complete: bool = False
    completion_summary: str | None = None
    end_conversation: bool = False
    end_reason: str | None = None
    tools_used: list[str] = field(default_factory=list)
    messages_sent: int = 0
    """How many ``send_message`` calls of the run asked another agent (at most :data:`MAX_MESSAGES_SENT`);
    a call refused before anyone was asked (:class:`NotAskedError`) does not count."""


@dataclass(frozen=True, slots=True)
class ToolContext:
    """What a tool works on: one agent's run in one conversation."""

    manager: ConversationManager
    conversation_id: str
    agent: Agent
    effects: RunEffects
    delegator: Delegator | None = None
    """How ``send_message`` reaches another agent; None in runs that may not delegate."""
    trigger: NostrEvent | None = None
    """The event the run answers: its author, or the person who started the conversation, is the
    person whose conversations ``get_conversation`` may read (:func:`asking_person`)."""
    budget: TokenBudget | None = None
    """The running agent's token budget: one ``get_conversation`` page fits in a share of it."""
    list_recent: int = DEFAULT_RECENT_CONVERSATIONS
    """How many conversations ``list_recent: true`` lists."""


class Delegator(Protocol):
    """Asks another agent of the project on behalf of the running agent (``send_message``)."""

    async def send(self, to: str, message: str) -> str:
        """Return the answer of the agent ``to`` (a slug); raise :class:`ToolRefusedError` when it cannot,
        :class:`NotAskedError` when it refuses before asking anyone."""


class Tool(Protocol):
    """One tool: its spec (offered to the model), its argument model and what it does."""

    @property
    def spec(self) -> ToolSpec:
        """What the model is told about the tool."""

    @property
    def arguments(self) -> type[BaseModel]:
        """The pydantic model the call's arguments are validated with."""

    async def run(self, arguments: Any, context: ToolContext) -> str:
        """Do it; return the text the model reads next, or raise :class:`ToolRefusedError`."""


class _Arguments(BaseModel):
    """Tool arguments: unknown keys are ignored (models add them), known ones are checked."""

    model_config = ConfigDict(extra="ignore", frozen=True)


def _text_property(description: str) -> dict[str, Any]:
    return {"type": "string", "description": description}


# --- complete -------------------------------------------------------------------------------


class CompleteArguments(_Arguments):
    """``complete``'s arguments."""

    summary: str | None = None


class CompleteTool:
    """Ends the agent's part of the turn: the reply is a completion addressed to the orchestrator too."""

    spec = ToolSpec(
        name="complete",
        description=(
            "Call this when your part of the task is done. Your reply is then sent to the orchestrator "
            "as your completion (and to the user). Put what you did in `summary`."
        ),
        parameters={
            "type": "object",
            "properties": {"summary": _text_property("What you did and what the result is.")},
            "required": [],
        },
    )
    arguments = CompleteArguments

    async def run(self, arguments: CompleteArguments, context: ToolContext) -> str:
        """Record the completion (once per run)."""
        effects = context.effects
        if effects.complete:
            return "Your completion was already recorded; it is sent once."
        effects.complete = True
        summary = (arguments.summary or "").strip()
        effects.completion_summary = summary or None
        return "Completion recorded: your reply goes to the orchestrator and the user."


# --- switch_phase ---------------------------------------------------------------------------


class SwitchPhaseArguments(_Arguments):
    """``switch_phase``'s arguments."""

    phase: str
    reason: str = Field(min_length=1)
    summary: str | None = None

    @field_validator("phase")
    @classmethod
    def _phase_name(cls, value: str) -> str:
        """A phase's name (whether the project has it, and may move to it, the phase rules say)."""
        return Phase(value.strip().lower()).value


class SwitchPhaseTool:
    """Moves the conversation to another phase, subject to the phase rules; offered with the project's
    phases (``phases``: the phase rules' own, the built-in seven by default)."""

    arguments = SwitchPhaseArguments

    def __init__(self, phases: Sequence[Phase] = BUILT_IN_PHASES) -> None:
        names = [phase.value for phase in phases]
        self.spec = ToolSpec(
            name="switch_phase",
            description=(
                f"Move the conversation to another phase ({', '.join(names)}). Only allowed transitions "
                "succeed. Give the reason and a handoff summary of where things stand for whoever works in "
                "the next phase."
            ),
            parameters={
                "type": "object",
                "properties": {
                    "phase": {"type": "string", "enum": names, "description": "The phase to move to."},
                    "reason": _text_property("Why the conversation moves to this phase."),
                    "summary": _text_property("Handoff summary: what is known and decided so far."),
                },
                "required": ["phase", "reason"],
            },
        )

    async def run(self, arguments: SwitchPhaseArguments, context: ToolContext) -> str:
        """Change the phase; a phase the project has not, or a forbidden transition, fails saying which
        may be named (the phase rules' error)."""
        summary = arguments.summary.strip() if arguments.summary else None
        try:
            transition = await context.manager.update_phase(
                context.conversation_id,
                arguments.phase,
                summary or arguments.reason,
                context.agent.slug,
                reason=arguments.reason,
                summary=summary,
            )
        except PhaseTransitionError as exc:
            raise ToolRefusedError(str(exc)) from None
        except ConversationArchivedError:
            raise ToolRefusedError("the conversation is archived; its phase cannot change") from None
        if transition.is_handoff:
            return f"Handoff recorded; the conversation stays in {transition.to_phase.value}."
        return f"Phase changed from {transition.from_phase.value} to {transition.to_phase.value}."


# --- end_conversation -----------------------------------------------------------------------


class EndConversationArguments(_Arguments):
    """``end_conversation``'s arguments."""

    reason: str | None = None


class EndConversationTool:
    """Ends the conversation with the reply, in one write (docs/ARCHITECTURE.md, "Conversation lifecycle")."""

    spec = ToolSpec(
        name="end_conversation",
        description=(
            "End the current conversation. Use this when the topic is concluded, the user says they are "
            "done, or the user moves to an unrelated topic. Your reply is still sent."
        ),
        parameters={
            "type": "object",
            "properties": {
                "reason": _text_property("Optional reason, e.g. 'task completed', 'user requested'.")
            },
            "required": [],
        },
    )
    arguments = EndConversationArguments

    async def run(self, arguments: EndConversationArguments, context: ToolContext) -> str:
        """Record the wish to end; the runner ends the conversation after saving the reply."""
        effects = context.effects
        effects.end_conversation = True
        reason = (arguments.reason or "").strip()
        effects.end_reason = reason or effects.end_reason
        return (
            "The conversation will be ended after your reply is sent. "
            "A new message in it reopens it."
        )


# --- get_conversation -----------------------------------------------------------------------


class GetConversationArguments(_Arguments):
    """``get_conversation``'s arguments: ``conversation_id`` (or its alias ``id``) with an optional
    ``before`` cursor, or ``list_recent``."""

    conversation_id: str | None = None
    id: str | None = None
    before: int | None = Field(default=None, ge=0)
    list_recent: bool | int | None = None

    @field_validator("list_recent")
    @classmethod
    def _positive(cls, value: bool | int | None) -> bool | int | None:
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ValueError("list_recent must be true or a number of conversations >= 1")
        return value


def _iso(ms: int) -> str:
    """An ISO-8601 UTC time; a moment no calendar holds (an absurd stored date) as its number."""
    try:
        return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
    except (ValueError, OverflowError, OSError):
        return f"{ms} ms (out of range)"


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


async def _newest_ended_readable(context: ToolContext, person: str, count: int) -> list[ConversationSummary]:
    """The ``count`` newest ended conversations of ``person`` readable here (not the current one, not a
    private one asked for from a public one), newest end first: read a page at a time in end order,
    doubling, so a large home costs about ``count`` checks (each may load a conversation), not one per
    ended conversation."""
    hidden: dict[str, bool] = {}
    want = count + 1
    while True:
        query = SearchQuery(ended=True, participants=(person,), order="ended", limit=want)
        rows = await context.manager.store.search(query)
        kept = []
        for row in rows:
            if row.id == context.conversation_id or row.ended_at is None:
                continue
            if row.id not in hidden:
                hidden[row.id] = await _hidden_here(context, row.id)
            if not hidden[row.id]:
                kept.append(row)
        if len(kept) >= count or len(rows) < want:
            kept.sort(key=lambda row: (row.ended_at or 0, row.id), reverse=True)
            return kept[:count]
        want *= 2


async def _hidden_here(context: ToolContext, conversation_id: str) -> bool:
    """Whether a private conversation (NIP-17) is asked for from a public one: it is not readable there
    (what the agent reads could be published in the clear), with the words of an unknown id."""
    found = await context.manager.store.find_event(conversation_id)
    if found is None or found[1].kind != KIND_PRIVATE_MESSAGE:
        return False
    here = await context.manager.get_conversation(context.conversation_id)
    return here is None or not here.private


def _not_found(conversation_id: str) -> str:
    """The refusal for an unknown id and for a conversation the person took no part in: the same
    words, so the tool never tells that another person's conversation exists."""
    return f"no conversation with id {conversation_id!r} that you can read; list_recent shows the ids"


def _status(conversation: Conversation) -> str:
    if conversation.archived:
        return "archived"
    return "ended" if conversation.is_ended else "active"


def _role(event: NostrEvent, conversation: Conversation, context: ToolContext) -> str:
    """``assistant`` for the asking agent's own messages, ``user`` for a person's, else the author's label."""
    directory = context.manager.agents
    agent = directory.by_pubkey(event.pubkey)
    if agent is not None:
        return "assistant" if agent.slug == context.agent.slug else agent.name
    role = directory.role_of(event.pubkey, conversation.claims_agent(event.pubkey))
    if role is AuthorRole.USER:
        return "user"
    return "Project" if role is AuthorRole.PROJECT else "Another agent"


def _messages(conversation: Conversation, context: ToolContext) -> list[dict[str, Any]]:
    """Every event with content, in history order, numbered from 0 (the numbers ``before`` takes)."""
    messages: list[dict[str, Any]] = []
    for event in conversation.history:
        if not event.content:
            continue
        message: dict[str, Any] = {
            "index": len(messages),
            "timestamp": _iso(event.created_at * 1000),
            "role": _role(event, conversation, context),
            "content": event.content,
        }
        tools_used = conversation.tools_used.get(event.id)
        if tools_used:
            message["tools_used"] = list(tools_used)
        messages.append(message)
    return messages


def _left_out_note(left_out: int) -> str:
    return (
        f"{left_out} older messages were left out to fit your token budget; call get_conversation with "
        f"this conversation_id and before={left_out} for the previous page."
    )


def _page(
    messages: list[dict[str, Any]], before: int | None, budget: TokenBudget | None, header: dict[str, Any]
) -> tuple[int, list[dict[str, Any]]]:
    """(index of the page's first message, the page): the newest messages before ``before`` (default:
    all) that fit in :data:`PAGE_SHARE` of ``budget`` with ``header``; all of them without a budget. A
    newest message that does not fit alone is shown with its content cut, marked ``truncated``."""
    end = len(messages) if before is None else min(before, len(messages))
    if budget is None:
        return 0, messages[:end]
    count = budget.count
    limit = max(int(budget.limit * PAGE_SHARE), 1)
    # the header as it is at most: the page's fields with the biggest values they can take
    worst = {**header, "messages": [], "messages_left_out": end, "next_before": end}
    worst["note"] = _left_out_note(end)
    used = count(json.dumps(worst, ensure_ascii=False))
    start = end
    while start > 0:
        cost = count(json.dumps(messages[start - 1], ensure_ascii=False)) + 1
        if used + cost > limit:
            break
        used += cost
        start -= 1
    if start == end and end > 0:
        start = end - 1
        newest = {**messages[start], "truncated": True}
        room = limit - used - count(json.dumps({**newest, "content": ""}, ensure_ascii=False))

        def escaped(content: str) -> int:
            return count(json.dumps(content, ensure_ascii=False))

        newest["content"] = cut_to_tokens(newest["content"], max(room, 0), escaped)
        return start, [newest]
    return start, messages[start:end]


class GetConversationTool:
    """Reads the conversations the person the agent works for took part in: one in full (paged to the
    agent's token budget), or the recently ended ones with their titles and summaries.

    The person is the trigger's author when a person wrote it, else the person who started the current
    conversation (:func:`~tenex_daemon.services.persona.asking_person`); the owner is a person like any
    other. A conversation that person did not write in is never listed, and asking for it by id is
    refused with the words used for an unknown id, so a person cannot read, or learn of, another
    person's conversation through an agent. A run with no person (its trigger and root by agents)
    reads nothing.
    """

    spec = ToolSpec(
        name="get_conversation",
        description=(
            "Read past conversations that the person you are working for took part in. With "
            "`conversation_id`: its title, summary, status, start and end, and its full history in order: "
            "each message's index, timestamp, role (`assistant`: you, `user`: a person, else the author's "
            "name), content and `tools_used` (the tools an agent called for it). A history too long for "
            "your context comes in pages, newest first: the result says how many older messages were left "
            "out and the `before` value that fetches the previous page. With `list_recent` (true, or how "
            "many): the most recently ended conversations, newest first, with their titles and summaries."
        ),
        parameters={
            "type": "object",
            "properties": {
                "conversation_id": _text_property(
                    "The id of the conversation to read (also accepted as `id`)."
                ),
                "before": {
                    "type": "integer",
                    "minimum": 0,
                    "description": "With conversation_id: show only messages with an index below this "
                    "(the previous page's `next_before`).",
                },
                "list_recent": {
                    "type": ["boolean", "integer"],
                    "description": (
                        f"true (or a number up to {MAX_RECENT_CONVERSATIONS}) to list recently ended "
                        "conversations."
                    ),
                },
            },
            "required": [],
        },
    )
    arguments = GetConversationArguments

    async def run(self, arguments: GetConversationArguments, context: ToolContext) -> str:
        """Return the conversation (by id) or the recent list, as JSON."""
        current = await context.manager.get_conversation(context.conversation_id)
        person = asking_person(current, context.trigger, context.manager.agents)
        wanted = (arguments.conversation_id or arguments.id or "").strip()
        if wanted:
            return await self._one(wanted, arguments.before, person, context)
        count = context.list_recent
        if isinstance(arguments.list_recent, int) and not isinstance(arguments.list_recent, bool):
            count = arguments.list_recent
        return await self._recent(min(count, MAX_RECENT_CONVERSATIONS), person, context)

    async def _one(
        self, conversation_id: str, before: int | None, person: str | None, context: ToolContext
    ) -> str:
        conversation = await context.manager.get_conversation(conversation_id)
        if conversation is None or person is None or person not in conversation.participants():
            raise ToolRefusedError(_not_found(conversation_id))
        if conversation.private and await _hidden_here(context, conversation.id):
            raise ToolRefusedError(_not_found(conversation_id))
        messages = _messages(conversation, context)
        header: dict[str, Any] = {
            "id": conversation.id,
            "title": conversation.title,
            "summary": conversation.summary,
            "status": _status(conversation),
            "started_at": _iso(conversation.created_at),
            "ended_at": None if conversation.ended_at is None else _iso(conversation.ended_at),
            "message_count": len(messages),
        }
        start, page = _page(messages, before, context.budget, header)
        body = {**header, "messages": page, "messages_left_out": start, "next_before": start or None}
        if start:
            body["note"] = _left_out_note(start)
        return json.dumps(body, ensure_ascii=False)

    async def _recent(self, count: int, person: str | None, context: ToolContext) -> str:
        ended = [] if person is None else await _newest_ended_readable(context, person, count)
        listed = [
            {
                "id": row.id,
                "title": row.title,
                "summary": row.summary,
                "started_at": _iso(row.created_at),
                "ended_at": _iso(row.ended_at or 0),
                "message_count": row.event_count,
            }
            for row in ended[:count]
        ]
        return json.dumps({"conversations": listed}, ensure_ascii=False)


# --- send_message ---------------------------------------------------------------------------

SEND_MESSAGE = "send_message"


class SendMessageArguments(_Arguments):
    """``send_message``'s arguments."""

    to: str = Field(min_length=1)
    message: str = Field(min_length=1)

    @field_validator("to", "message")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be blank")
        return value


class SendMessageTool:
    """Asks another agent and returns its answer (``send_message``, docs/ARCHITECTURE.md).

    The two agents talk in their own thread, ``<conversation id>__<a>__<b>`` (slugs
    sorted), kept by the ThreadManager and persisted, so the next ``send_message``
    between the same pair continues it (also after a restart). The asked agent sees
    only that thread: its persona, the asker's messages as ``user``, its own answers as
    ``assistant``; it is offered no ``send_message`` (no recursion). Its answer is this
    tool's result.

    On Nostr the exchange is two replies in the conversation (of its kind: 1111, or 1): the request,
    signed by the asker and p-tagging the asked agent, and the answer, signed by the
    asked agent, replying to the request and p-tagging the asker. Both carry
    ``["delegation", "<thread id>"]``: they are added to history before they are
    published, and targeting never runs an agent for an event with that tag
    (``SkipReason.DELEGATION``), so neither they nor their relay echoes (duplicates)
    cause a run. An answer that reports a failure also carries ``["error", "system"]``.

    Refused (error results): an unknown slug (the error lists who can be asked),
    oneself, the orchestrator (it routes the conversation; it does not answer
    questions), a run with no delegation, an asked agent whose backend failed
    (the error says what failed), and a call past the run's :data:`MAX_MESSAGES_SENT`th that asked an
    agent (a call refused before anyone was asked does not count).
    """

    spec = ToolSpec(
        name=SEND_MESSAGE,
        description=(
            "Ask another agent of this project and get its answer. You and that agent talk in your own "
            "private thread, which continues where you left off; the agent sees only that thread, so put "
            "everything it needs in `message`. `to` is the agent's slug."
        ),
        parameters={
            "type": "object",
            "properties": {
                "to": _text_property("The slug of the agent to ask."),
                "message": _text_property("What you ask or tell it, self-contained."),
            },
            "required": ["to", "message"],
        },
    )
    arguments = SendMessageArguments

    async def run(self, arguments: SendMessageArguments, context: ToolContext) -> str:
        """Ask the other agent through the run's delegator; its answer is the result."""
        if context.delegator is None:
            raise ToolRefusedError("send_message is not available in this run: no other agent can be asked")
        if context.effects.messages_sent >= MAX_MESSAGES_SENT:
            raise ToolRefusedError(
                f"send_message was refused: this reply already asked other agents {MAX_MESSAGES_SENT} times, "
                "the most one reply may; answer with what you have"
            )
        asked = True
        try:
            return await context.delegator.send(arguments.to.strip(), arguments.message)
        except NotAskedError:
            asked = False
            raise
        finally:
            if asked:  # the other agent was asked (its answer failed or was stopped, maybe): the call counts
                context.effects.messages_sent += 1


# --- the registry ---------------------------------------------------------------------------


def _describe(error: ValidationError) -> str:
    parts = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "arguments"
        parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)


class ToolRegistry:
    """The tools by name; runs a model's tool call and always returns a result for it."""

    def __init__(self, tools: Iterable[Tool]) -> None:
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.spec.name in self._tools:
                raise ValueError(f"two tools are named {tool.spec.name!r}")
            self._tools[tool.spec.name] = tool

    @classmethod
    def default(cls, phases: Sequence[Phase] = BUILT_IN_PHASES) -> ToolRegistry:
        """Every tool: complete, switch_phase (offering ``phases``), end_conversation, get_conversation and
        send_message.

        Which of them an agent is offered is its profile's choice (the runner adds
        ``send_message`` when another agent can be asked).
        """
        return cls(
            [
                CompleteTool(),
                SwitchPhaseTool(phases),
                EndConversationTool(),
                GetConversationTool(),
                SendMessageTool(),
            ]
        )

    @property
    def names(self) -> tuple[str, ...]:
        """The registered tool names, in registration order."""
        return tuple(self._tools)

    def specs(self, names: Iterable[str] | None = None) -> tuple[ToolSpec, ...]:
        """The specs of ``names`` (every tool when None); an unknown name raises KeyError."""
        chosen = self._tools if names is None else {name: self._tools[name] for name in names}
        return tuple(tool.spec for tool in chosen.values())

    async def execute(
        self, call: ToolCall, context: ToolContext, offered: Iterable[str] | None = None
    ) -> ToolResult:
        """Run ``call``; an unknown tool, bad arguments or a refused action become an error result."""
        allowed = self._tools if offered is None else {n: self._tools[n] for n in offered if n in self._tools}
        tool = allowed.get(call.name)
        if tool is None:
            names = ", ".join(allowed) or "none"
            return self._error(call, context, f"unknown tool {call.name!r}; the tools are: {names}")
        if call.invalid_arguments is not None:
            return self._error(
                call, context, f"the arguments are not a JSON object: {_cut(call.invalid_arguments, 200)!r}"
            )
        try:
            arguments = tool.arguments.model_validate(dict(call.arguments))
        except ValidationError as exc:
            return self._error(call, context, f"invalid arguments for {call.name}: {_describe(exc)}")
        context.effects.tools_used.append(call.name)
        try:
            content = await tool.run(arguments, context)
        except ToolRefusedError as exc:
            return self._error(call, context, str(exc))
        except Exception as exc:
            log.exception("tool_crashed", tool=call.name, conversation_id=context.conversation_id)
            return self._error(call, context, f"{call.name} failed: internal error ({type(exc).__name__})")
        log.info(
            "tool_called", tool=call.name, agent=context.agent.slug, conversation_id=context.conversation_id
        )
        return ToolResult(tool_call_id=call.id, name=call.name, content=content)

    @staticmethod
    def _error(call: ToolCall, context: ToolContext, message: str) -> ToolResult:
        # the log takes what failed, not what after its colon quotes the model or an answer (a private
        # conversation's words: a model's broken arguments, another agent's reply): the model gets it whole
        log.info(
            "tool_call_refused",
            tool=call.name,
            agent=context.agent.slug,
            conversation_id=context.conversation_id,
            error=message.split(": ", 1)[0],
        )
        return ToolResult(tool_call_id=call.id, name=call.name, content=f"Error: {message}", is_error=True)
