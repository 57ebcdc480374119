"""An agent answering in a conversation whose root references a kind-30023 article is sent the article in its
persona (docs/CONTEXT.md, "The persona prompt")."""

from __future__ import annotations

from tenex_daemon.core.budget import TokenBudget
from tenex_daemon.core.vocabulary import KIND_ARTICLE
from tenex_daemon.services.answering import AgentProfile
from tenex_daemon.testing import FakeResolver
from tenex_daemon.testing.fakes import ScriptedBackend
from tests import pipeline
from tests.conftest import Cast
from tests.unit.services.test_tool_loop import text

ARTICLE_D = "release-notes"


async def ask_alice_about_an_article(
    cast: Cast, content: str, budget: TokenBudget | None = None
) -> ScriptedBackend:
    """Run Alice on a root that references an article with ``content``; return her backend (its requests)."""
    article = cast.bob_says(content, kind=KIND_ARTICLE, tags=[["d", ARTICLE_D], ["title", "Release notes"]])
    resolver = FakeResolver()
    resolver.add(article, key=f"{KIND_ARTICLE}:{cast.bob.pubkey}:{ARTICLE_D}")
    backend = ScriptedBackend([text("Read it.")])
    profiles = {a.slug: AgentProfile(a, f"You are {a.name}.", backend, budget=budget) for a in cast.agents}
    rig = pipeline.build_rig(cast, profiles=profiles, resolver=resolver)
    root = cast.user_says(
        "What do you think of it?",
        kind=11,
        tags=[["a", f"{KIND_ARTICLE}:{cast.bob.pubkey}:{ARTICLE_D}"], ["p", cast.alice.pubkey]],
    )
    await rig.dispatcher.handle(root)
    await rig.settle()
    return backend


async def test_the_referenced_article_follows_the_persona(cast: Cast) -> None:
    """The system prompt is the persona, a blank line, then the article's title heading and its content."""
    backend = await ask_alice_about_an_article(cast, "We shipped the bridge.")

    [request] = backend.requests
    assert request.system_prompt == (
        "You are Alice.\nYou are Alice.\n"
        "\n## Referenced article: Release notes\nWe shipped the bridge.\n"
    )


async def test_the_article_is_cut_to_a_quarter_of_the_budget(cast: Cast) -> None:
    """With a budget of 400 tokens (characters/4), the article keeps its first 100 tokens: 400 characters."""
    backend = await ask_alice_about_an_article(cast, "a" * 1000 + "TAIL", TokenBudget(400))

    [request] = backend.requests
    assert request.system_prompt.endswith("## Referenced article: Release notes\n" + "a" * 400 + "\n")
