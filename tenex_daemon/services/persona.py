"""The persona prompt: the first ``system`` message of every request to an agent's model
(docs/CONTEXT.md, "The persona prompt").

One builder serves the agent's runs (:class:`~tenex_daemon.services.answering.AnswerLoop`) and the
context preview (``tenexd context``, ``GET /api/v1/conversations/{id}/context``), so what the
preview shows is what the model is sent::

    You are <display name>.\\n
    <instructions>\\n                                      (when configured)
    \\n## Referenced article: <title>\\n<article content>\\n   (when the root references an article)
    \\n## Recent conversations\\n                           (only when there is at least one)
    - <ended at, YYYY-MM-DD> · <title>: <summary>\\n

The recent conversations are the person's latest ended conversations with the agent that have a
summary, newest ended first, read from the store's index rows (one search, no conversation loaded).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from tenex_daemon.core.agents import Agent, AgentDirectory, AuthorRole
from tenex_daemon.core.budget import TokenBudget
from tenex_daemon.core.conversation import Conversation, ReferencedArticle
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.ports import Store
from tenex_daemon.core.search import ConversationSummary, SearchQuery, is_summarized
from tenex_daemon.services.token_budget import article_tokens, cut_to_tokens

DEFAULT_RECENT_IN_PERSONA = 2
"""How many recent conversations the persona recalls by default (``conversations.recent_in_persona``)."""


@dataclass(frozen=True, slots=True)
class PersonaSpec:
    """What an agent's persona is made of, besides the conversation it answers in."""

    agent: Agent
    instructions: str = ""
    budget: TokenBudget | None = None
    """The agent's token budget: a referenced article is cut to 25% of it."""
    recent_in_persona: int = DEFAULT_RECENT_IN_PERSONA
    """How many of the person's recent conversations with the agent it recalls (0: none)."""


def persona_text(
    spec: PersonaSpec,
    article: ReferencedArticle | None = None,
    recent: Sequence[ConversationSummary] = (),
) -> str:
    """The persona prompt, exactly (see the module docstring); instructions are stripped of
    surrounding blank space, and only ``recent`` rows with an end time are listed."""
    parts = [f"You are {spec.agent.name}.\n"]
    instructions = spec.instructions.strip()
    if instructions:
        parts.append(f"{instructions}\n")
    if article is not None:
        content = article.content
        if spec.budget is not None:
            content = cut_to_tokens(content, article_tokens(spec.budget), spec.budget.count)
        parts.append(f"\n## Referenced article: {article.title}\n{content}\n")
    lines = [
        f"- {ended_date(row.ended_at)} · {row.title.strip()}: {(row.summary or '').strip()}\n"
        for row in recent
        if row.ended_at is not None
    ]
    if lines:
        parts.append("\n## Recent conversations\n")
        parts.extend(lines)
    return "".join(parts)


def ended_date(ended_at_ms: int) -> str:
    """The UTC date (YYYY-MM-DD) of a moment in milliseconds since the epoch."""
    return datetime.fromtimestamp(ended_at_ms / 1000, UTC).strftime("%Y-%m-%d")


def asking_person(
    conversation: Conversation | None, trigger: NostrEvent | None, directory: AgentDirectory
) -> str | None:
    """The person a run works for: the trigger's author when a person wrote it; else (an agent's trigger)
    the conversation's one person: its newest person, who the reply goes to
    (:func:`~tenex_daemon.core.targeting.reply_person`), when that is also the root's author or the root
    is no person's; None when neither is a person (an agent, the project key or a foreign agent), or when
    the newest person is not the root's author (several people: whose conversations the run may recall
    cannot be told, so none). The owner is a person like any other."""

    def is_person(event: NostrEvent) -> bool:
        claims = conversation.claims_agent(event.pubkey) if conversation is not None else False
        return directory.role_of(event.pubkey, claims) is AuthorRole.USER

    if trigger is not None and is_person(trigger):
        return trigger.pubkey
    if conversation is None:
        return None
    root = conversation.root
    root_person = root.pubkey if root is not None and is_person(root) else None
    newest = next((e.pubkey for e in reversed(conversation.history) if is_person(e)), None)
    if newest is None or root_person in (None, newest):
        return newest or root_person
    return None


async def recent_conversations(
    store: Store, person: str | None, agent: Agent, count: int, exclude: str | None = None
) -> list[ConversationSummary]:
    """The ``count`` latest ended conversations in which both ``person`` and ``agent`` wrote, that have
    a summary, newest ended first, without ``exclude`` (the current one); one index search, cut at
    ``count`` by the store (its cost does not grow with the person's ended conversations)."""
    if person is None or count < 1:
        return []
    query = SearchQuery(
        ended=True,
        participants=(person, agent.pubkey),
        summarized=True,
        order="ended",
        limit=count + (exclude is not None),
    )
    rows = await store.search(query)
    # a few rows at most: what a store answers is checked, not trusted
    kept = [
        row
        for row in rows
        if row.id != exclude and row.ended_at is not None and is_summarized(row.summary)
    ]
    kept.sort(key=lambda row: (row.ended_at or 0, row.id), reverse=True)
    return kept[:count]


async def build_persona(
    store: Store,
    directory: AgentDirectory,
    spec: PersonaSpec,
    conversation: Conversation | None,
    trigger: NostrEvent | None,
) -> str:
    """The persona of ``spec``'s agent answering ``trigger`` in ``conversation``: its article (found
    when the conversation was created) and the person's recent conversations with the agent."""
    article = conversation.metadata.referenced_article if conversation is not None else None
    person = asking_person(conversation, trigger, directory)
    exclude = conversation.id if conversation is not None else None
    recent = await recent_conversations(store, person, spec.agent, spec.recent_in_persona, exclude)
    return persona_text(spec, article, recent)
