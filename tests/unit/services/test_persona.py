"""The persona prompt, exactly (docs/CONTEXT.md, "The persona prompt"): the agent's name, its instructions,
the referenced article and the person's recent conversations with the agent."""

from __future__ import annotations

from dataclasses import dataclass

from tenex_daemon import ConversationManager, NostrEvent
from tenex_daemon.core.agents import Agent
from tenex_daemon.core.budget import TokenBudget, estimate_tokens, total_tokens
from tenex_daemon.core.conversation import ReferencedArticle, TitleSource
from tenex_daemon.core.ports import Store
from tenex_daemon.core.search import ConversationSummary, SearchQuery
from tenex_daemon.services.answering import AgentProfile
from tenex_daemon.services.persona import (
    PersonaSpec,
    build_persona,
    ended_date,
    persona_text,
    recent_conversations,
)
from tenex_daemon.services.runs import RunRequest
from tenex_daemon.testing import FakeClock, KeyPair
from tenex_daemon.testing.fakes import ScriptedBackend
from tests import pipeline
from tests.conftest import Cast
from tests.unit.services.test_tool_loop import text

DAY_MS = 86_400_000


def cast_store(store: object) -> Store:
    """A stand-in that has only ``search``, typed as the store the recall takes."""
    return store  # type: ignore[return-value]
ALICE_PERSONA = "You are Alice.\nYou answer briefly.\n"


@dataclass
class Rig:
    """The daemon's pipeline with one scripted backend for every agent, and its clock."""

    base: pipeline.Rig
    backend: ScriptedBackend

    @property
    def manager(self) -> ConversationManager:
        """The pipeline's conversation manager."""
        return self.base.manager

    @property
    def clock(self) -> FakeClock:
        """The pipeline's clock (ends are stamped with it)."""
        return self.base.clock


def make_rig(cast: Cast, recent: int = 2, budget: TokenBudget | None = None) -> Rig:
    """Agents with instructions "You answer briefly." that recall ``recent`` conversations."""
    backend = ScriptedBackend([text("Hello again.")])
    profiles = {
        a.slug: AgentProfile(a, "You answer briefly.", backend, budget=budget, recent_in_persona=recent)
        for a in cast.agents
    }
    return Rig(pipeline.build_rig(cast, profiles=profiles), backend)


async def ended_conversation(
    rig: Rig,
    cast: Cast,
    person: KeyPair,
    agent_keys: KeyPair,
    agent: Agent,
    title: str,
    summary: str | None,
) -> str:
    """A conversation of ``person`` with ``agent`` (both wrote in it), ended now and described, then a day
    passes; return its id."""
    root = cast.factory.event(person, f"About {title}", kind=11, tags=[["p", agent.pubkey]])
    await rig.manager.create_conversation(root)
    await rig.manager.add_event(root.id, cast.factory.event(agent_keys, "Noted.", tags=[["E", root.id]]))
    assert await rig.manager.end_conversation(root.id, by="idle")
    if summary is not None:
        conversation = await rig.manager.get_conversation(root.id)
        assert conversation is not None
        await rig.manager.describe(
            root.id, title=title, summary=summary, source=TitleSource.MODEL, for_activity=conversation.last_activity
        )
    rig.clock.advance(DAY_MS)
    return root.id


async def alice_answers(rig: Rig, cast: Cast, content: str = "Hi Alice") -> str:
    """The user starts a new conversation with Alice and she answers; return the persona she was sent."""
    root = cast.user_says(content, kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.manager.create_conversation(root)
    reply = await rig.base.runner.run(RunRequest(root.id, root.id, "alice"))
    assert reply is not None
    await rig.base.runner.flush(5.0)
    return rig.backend.requests[-1].system_prompt


def test_without_instructions_the_persona_is_one_line(cast: Cast) -> None:
    """An agent without instructions (or with blank ones) is introduced by its display name only."""
    assert persona_text(PersonaSpec(cast.alice)) == "You are Alice.\n"
    assert persona_text(PersonaSpec(cast.alice, "  \n")) == "You are Alice.\n"


def test_instructions_follow_on_the_next_line(cast: Cast) -> None:
    """Instructions come on the line after the name, stripped of surrounding blank space, with one line break."""
    assert persona_text(PersonaSpec(cast.alice, "You answer briefly.\n")) == ALICE_PERSONA


def test_the_article_follows_after_a_blank_line(cast: Cast) -> None:
    """A referenced article is a heading with its title, its content, and a line break, after a blank line."""
    article = ReferencedArticle(title="Release notes", content="We shipped.", identifier="notes", author="ab")

    assert persona_text(PersonaSpec(cast.alice, "You answer briefly."), article) == (
        ALICE_PERSONA + "\n## Referenced article: Release notes\nWe shipped.\n"
    )


def test_the_ended_date_is_the_utc_day() -> None:
    """The date of a recent conversation is the UTC calendar day of its end, as YYYY-MM-DD."""
    midnight = 1_700_006_400_000  # 2023-11-15T00:00:00Z
    assert ended_date(midnight) == "2023-11-15"
    assert ended_date(midnight - 1) == "2023-11-14"


async def test_recent_conversations_are_the_persons_two_newest_with_this_agent_that_have_a_summary(
    cast: Cast,
) -> None:
    """Of three summarized conversations of the user with Alice the two newest come, newest first; one
    without a summary, one with Bob, one of another person and an active one are not recalled."""
    rig = make_rig(cast)
    await ended_conversation(rig, cast, cast.user, cast.alice_keys, cast.alice, "Old topic", "The oldest one.")
    await ended_conversation(rig, cast, cast.user, cast.alice_keys, cast.alice, "Database", "They chose PostgreSQL.")
    await ended_conversation(rig, cast, cast.user, cast.alice_keys, cast.alice, "Logo", "A blue logo was picked.")
    await ended_conversation(rig, cast, cast.user, cast.alice_keys, cast.alice, "Unsummarized", None)
    await ended_conversation(rig, cast, cast.user, cast.bob_keys, cast.bob, "With Bob", "Bob's topic.")
    await ended_conversation(rig, cast, cast.other_user, cast.alice_keys, cast.alice, "Private", "Not yours.")
    active = cast.user_says("Still open", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.manager.create_conversation(active)
    await rig.manager.add_event(active.id, cast.alice_says("Open reply.", tags=[["E", active.id]]))

    persona = await alice_answers(rig, cast)

    assert persona == (
        ALICE_PERSONA
        + "\n## Recent conversations\n"
        + "- 2023-11-16 · Logo: A blue logo was picked.\n"
        + "- 2023-11-15 · Database: They chose PostgreSQL.\n"
    )


async def test_the_recall_checks_the_rows_a_store_answers(cast: Cast) -> None:
    """A store that answers the recall's search ignoring its order, ``summarized`` and limit (every ended
    conversation of the two, oldest update first) gives the persona the same two conversations."""
    rig = make_rig(cast)
    for title, summary in (("Old topic", "The oldest."), ("Database", "PostgreSQL."), ("Logo", "Blue."),
                           ("Unsummarized", None), ("Blank", " \n")):
        await ended_conversation(rig, cast, cast.user, cast.alice_keys, cast.alice, title, summary)
    store = rig.manager.store

    class Careless:
        async def search(self, query: SearchQuery) -> list[ConversationSummary]:
            loose = query.model_copy(update={"order": "updated", "summarized": None, "limit": None})
            return list(reversed(await store.search(loose)))

    careless = await recent_conversations(cast_store(Careless()), cast.user.pubkey, cast.alice, 2)
    careful = await recent_conversations(store, cast.user.pubkey, cast.alice, 2)

    assert [row.title for row in careless] == [row.title for row in careful] == ["Logo", "Database"]


async def test_recent_in_persona_0_recalls_nothing(cast: Cast) -> None:
    """With ``recent_in_persona = 0`` the persona has no recent conversations section."""
    rig = make_rig(cast, recent=0)
    await ended_conversation(rig, cast, cast.user, cast.alice_keys, cast.alice, "Database", "They chose PostgreSQL.")

    assert await alice_answers(rig, cast) == ALICE_PERSONA


async def test_no_recent_conversation_means_no_section(cast: Cast) -> None:
    """A person's first conversation with the agent gets no "Recent conversations" heading."""
    rig = make_rig(cast)

    assert await alice_answers(rig, cast) == ALICE_PERSONA


async def test_the_current_conversation_is_not_recalled(cast: Cast) -> None:
    """Built for a run in an ended, summarized conversation, the persona recalls the others only."""
    rig = make_rig(cast)
    await ended_conversation(rig, cast, cast.user, cast.alice_keys, cast.alice, "First", "The first.")
    second = await ended_conversation(rig, cast, cast.user, cast.alice_keys, cast.alice, "Second", "The second.")
    conversation = await rig.manager.get_conversation(second)
    assert conversation is not None
    assert conversation.root is not None

    persona = await build_persona(
        rig.manager.store, rig.manager.agents, PersonaSpec(cast.alice), conversation, conversation.root
    )

    assert persona == "You are Alice.\n\n## Recent conversations\n- 2023-11-14 · First: The first.\n"


async def test_an_agents_trigger_recalls_the_conversations_of_the_person_who_started_it(cast: Cast) -> None:
    """When Bob's message triggers Alice, the conversations recalled are those of the person whose root it is."""
    rig = make_rig(cast)
    await ended_conversation(rig, cast, cast.user, cast.alice_keys, cast.alice, "Database", "They chose PostgreSQL.")
    root = cast.user_says("Hi both", kind=11, tags=[["p", cast.bob.pubkey]])
    await rig.manager.create_conversation(root)
    bob: NostrEvent = cast.bob_says("Alice, your view?", tags=[["E", root.id], ["p", cast.alice.pubkey]])
    await rig.manager.add_event(root.id, bob)
    conversation = await rig.manager.get_conversation(root.id)
    assert conversation is not None

    persona = await build_persona(rig.manager.store, rig.manager.agents, PersonaSpec(cast.alice), conversation, bob)

    assert persona.endswith("\n## Recent conversations\n- 2023-11-14 · Database: They chose PostgreSQL.\n")


async def test_the_budget_counts_the_recent_conversations(cast: Cast) -> None:
    """Under a budget, a persona that recalls conversations leaves less room: fewer history messages are sent,
    and the persona plus what is sent stays within the budget."""
    sent: dict[int, int] = {}
    for recent in (0, 2):
        rig = make_rig(cast, recent=recent, budget=TokenBudget(120))
        long_summary = "They talked about many things in great detail. " * 3
        await ended_conversation(rig, cast, cast.user, cast.alice_keys, cast.alice, "Long", long_summary)
        root = cast.user_says("Hi Alice", kind=11, tags=[["p", cast.alice.pubkey]])
        await rig.manager.create_conversation(root)
        for i in range(8):
            await rig.manager.add_event(root.id, cast.alice_says(f"answer {i}".ljust(40, "."), tags=[["E", root.id]]))
            await rig.manager.add_event(root.id, cast.user_says(f"question {i}".ljust(40, "."), tags=[["E", root.id]]))
        conversation = await rig.manager.get_conversation(root.id)
        assert conversation is not None
        trigger = conversation.history[-1]
        # all before the trigger seen: no while-away block (it is never cut)
        await rig.manager.update_agent_state(root.id, "alice", last_processed_index=len(conversation.history) - 1)
        assert await rig.base.runner.run(RunRequest(root.id, trigger.id, "alice")) is not None
        await rig.base.runner.flush(5.0)
        [request] = rig.backend.requests
        assert ("## Recent conversations" in request.system_prompt) is (recent == 2)
        assert total_tokens(request.system_prompt, request.messages, estimate_tokens) <= 120
        sent[recent] = len(request.messages)

    assert sent[2] < sent[0]
