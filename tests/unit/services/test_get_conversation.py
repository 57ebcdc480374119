"""The ``get_conversation`` tool: one conversation in full (paged to the agent's budget), the recently ended
ones, and only ever the conversations of the person the agent works for."""

from __future__ import annotations

import json
from typing import Any

from tenex_daemon import ConversationManager, NostrEvent
from tenex_daemon.core.budget import TokenBudget
from tenex_daemon.core.conversation import TitleSource
from tenex_daemon.core.llm import ToolCall, ToolResult
from tenex_daemon.services.answering import AgentProfile
from tenex_daemon.services.runs import RunRequest
from tenex_daemon.services.tools import PAGE_SHARE, RunEffects, ToolContext, ToolRegistry
from tenex_daemon.testing import FakeClock, KeyPair
from tenex_daemon.testing.fakes import ScriptedBackend
from tests import pipeline
from tests.conftest import Cast
from tests.unit.services.test_tool_loop import calls, text

MINUTE_MS = 60_000
UNKNOWN = "ab" * 32


async def conversation(
    manager: ConversationManager,
    cast: Cast,
    person: KeyPair,
    *contents: str,
    title: str | None = None,
    summary: str | None = None,
    end: bool = True,
) -> NostrEvent:
    """A conversation ``person`` starts with Alice: the root, then Alice and the person take turns with
    ``contents``; ended (and described with ``title`` and ``summary``) unless ``end`` is False."""
    root = cast.factory.event(person, f"Root of {title or 'a talk'}", kind=11, tags=[["p", cast.alice.pubkey]])
    await manager.create_conversation(root)
    for index, content in enumerate(contents):
        keys = cast.alice_keys if index % 2 == 0 else person
        await manager.add_event(root.id, cast.factory.event(keys, content, tags=[["E", root.id]]))
    if end:
        assert await manager.end_conversation(root.id, by="idle")
    if summary is not None:
        stored = await manager.get_conversation(root.id)
        assert stored is not None
        await manager.describe(
            root.id, title=title, summary=summary, source=TitleSource.MODEL, for_activity=stored.last_activity
        )
    return root


async def ask(
    manager: ConversationManager,
    cast: Cast,
    current: str,
    trigger: NostrEvent | None,
    arguments: dict[str, Any],
    *,
    budget: TokenBudget | None = None,
    list_recent: int = 10,
) -> ToolResult:
    """Alice calls get_conversation with ``arguments`` in a run answering ``trigger`` in ``current``."""
    context = ToolContext(
        manager, current, cast.alice, RunEffects(), trigger=trigger, budget=budget, list_recent=list_recent
    )
    return await ToolRegistry.default().execute(ToolCall("c", "get_conversation", arguments), context)


def body(result: ToolResult) -> Any:
    """The JSON of a successful result."""
    assert not result.is_error, result.content
    return json.loads(result.content)


# --- one conversation by id ------------------------------------------------------------------


async def test_by_id_a_run_gets_the_whole_history_in_order_with_roles_and_tools_used(cast: Cast) -> None:
    """Read by id in a run, an ended conversation comes whole (no cut at 20 messages or 500 characters): each
    message's role from Alice's side, its content and the tools Alice called for it; plus its title, summary,
    status and times."""
    backend = ScriptedBackend([calls(("c0", "switch_phase", {"phase": "plan", "reason": "a plan"})), text("Use X.")])
    profiles = {a.slug: AgentProfile(a, "", backend) for a in cast.agents}
    rig = pipeline.build_rig(cast, profiles=profiles)
    manager = rig.manager
    earlier = cast.user_says("Earlier topic: the database", kind=11, tags=[["p", cast.alice.pubkey]])
    await manager.create_conversation(earlier)
    answer = await rig.runner.run(RunRequest(earlier.id, earlier.id, "alice"))
    assert answer is not None
    await manager.add_event(earlier.id, cast.bob_says("I agree.", tags=[["E", earlier.id]]))
    long_text = "x" * 2000
    follow_ups = [long_text, *(f"follow-up {i}" for i in range(24))]
    for content in follow_ups:
        await manager.add_event(earlier.id, cast.user_says(content, tags=[["E", earlier.id]]))
    assert await manager.end_conversation(earlier.id, by="alice", reason="done")
    await manager.describe(
        earlier.id, title="Database choice", summary="They chose X.", source=TitleSource.MODEL, for_activity=0
    )
    now = cast.user_says("What did we decide?", kind=11, tags=[["p", cast.alice.pubkey]])
    await manager.create_conversation(now)
    backend.script = [calls(("c1", "get_conversation", {"conversation_id": earlier.id})), text("X.")]
    backend.requests.clear()

    assert await rig.runner.run(RunRequest(now.id, now.id, "alice")) is not None
    await rig.runner.flush(5.0)

    [result] = backend.tool_results()
    read = body(result)
    stored = await manager.get_conversation(earlier.id)
    assert stored is not None
    assert stored.ended_at is not None
    assert {k: read[k] for k in ("id", "title", "summary", "status", "message_count", "messages_left_out")} == {
        "id": earlier.id,
        "title": "Database choice",
        "summary": "They chose X.",
        "status": "ended",
        "message_count": 28,
        "messages_left_out": 0,
    }
    assert read["next_before"] is None
    assert read["started_at"].endswith("Z")
    assert read["ended_at"].endswith("Z")
    assert [(m["index"], m["role"], m["content"]) for m in read["messages"]] == [
        (0, "user", "Earlier topic: the database"),
        (1, "assistant", "Use X."),
        (2, "Bob", "I agree."),
        *((3 + i, "user", content) for i, content in enumerate(follow_ups)),
    ]
    assert read["messages"][1]["tools_used"] == ["switch_phase"]
    assert stored.tools_used[answer.id] == ["switch_phase"]
    assert all("tools_used" not in m for i, m in enumerate(read["messages"]) if i != 1)
    assert read["messages"][0]["timestamp"].endswith("Z")


async def test_over_budget_the_newest_page_comes_with_a_cursor_to_the_older_ones(
    cast: Cast, manager: ConversationManager
) -> None:
    """Over half the agent's budget the newest messages that fit come first, with how many older ones were left
    out and the ``before`` value for the page before; walking the cursor yields every message exactly once."""
    contents = [f"message {i} ".ljust(100, ".") for i in range(30)]
    earlier = await conversation(manager, cast, cast.user, *contents, title="Long", summary="Long talk.")
    current = await conversation(manager, cast, cast.user, end=False)
    budget = TokenBudget(400)
    whole = body(await ask(manager, cast, current.id, current, {"conversation_id": earlier.id}))["messages"]
    assert len(whole) == 31

    pages: list[list[dict[str, Any]]] = []
    before: int | None = None
    while True:
        arguments: dict[str, Any] = {"conversation_id": earlier.id}
        if before is not None:
            arguments["before"] = before
        result = await ask(manager, cast, current.id, current, arguments, budget=budget)
        assert budget.count(result.content) <= budget.limit * PAGE_SHARE
        page = body(result)
        pages.append(page["messages"])
        assert page["messages_left_out"] == page["messages"][0]["index"]
        if not page["messages_left_out"]:
            assert page["next_before"] is None
            break
        assert page["next_before"] == page["messages_left_out"]
        assert f"before={page['next_before']}" in page["note"]
        before = page["next_before"]

    assert len(pages) > 2
    assert pages[0][-1]["index"] == 30  # the first page is the newest
    assert [m for page in reversed(pages) for m in page] == whole


async def test_a_newest_message_bigger_than_a_page_is_cut_and_marked(cast: Cast, manager: ConversationManager) -> None:
    """A message that alone exceeds the page is still shown, its content cut to fit and marked truncated."""
    earlier = await conversation(manager, cast, cast.user, "y" * 4000, title="Huge", summary="One huge answer.")
    current = await conversation(manager, cast, cast.user, end=False)
    budget = TokenBudget(400)

    result = await ask(manager, cast, current.id, current, {"conversation_id": earlier.id}, budget=budget)

    page = body(result)
    [message] = page["messages"]
    assert message["index"] == 1
    assert message["truncated"] is True
    assert 0 < len(message["content"]) < 4000
    assert set(message["content"]) == {"y"}
    assert page["messages_left_out"] == 1
    assert budget.count(result.content) <= budget.limit * PAGE_SHARE


async def test_a_runs_tool_is_paged_to_the_agents_own_budget(cast: Cast) -> None:
    """In a run, get_conversation pages to the running agent's budget (its profile's): a history too long for
    half of it is left out in part, and the result fits."""
    backend = ScriptedBackend([text("placeholder")])
    budget = TokenBudget(2000)
    profiles = {a.slug: AgentProfile(a, "", backend, budget=budget) for a in cast.agents}
    rig = pipeline.build_rig(cast, profiles=profiles)
    contents = [f"line {i} ".ljust(100, ".") for i in range(60)]
    earlier = await conversation(rig.manager, cast, cast.user, *contents, title="Long", summary="Long.")
    now = cast.user_says("Remind me", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.manager.create_conversation(now)
    backend.script = [calls(("c1", "get_conversation", {"conversation_id": earlier.id})), text("ok")]

    assert await rig.runner.run(RunRequest(now.id, now.id, "alice")) is not None
    await rig.runner.flush(5.0)

    [result] = backend.tool_results()
    page = body(result)
    assert page["messages_left_out"] > 0
    assert page["messages"][-1]["index"] == 60
    assert budget.count(result.content) <= budget.limit * PAGE_SHARE


# --- whose conversations ---------------------------------------------------------------------


async def test_another_persons_conversation_is_refused_like_an_unknown_id_and_never_listed(cast: Cast) -> None:
    """In a run for the user, Alice cannot read the other person's conversation: by id the error is word for word
    the one for an id nobody stored, and list_recent does not list it; the user's own conversation is readable."""
    backend = ScriptedBackend([text("placeholder")])
    profiles = {a.slug: AgentProfile(a, "", backend) for a in cast.agents}
    rig = pipeline.build_rig(cast, profiles=profiles, whitelist=[cast.other_user.pubkey])
    theirs = await conversation(rig.manager, cast, cast.other_user, "Secret plan.", title="Theirs", summary="S.")
    mine = await conversation(rig.manager, cast, cast.user, "My plan.", title="Mine", summary="Mine.")
    now = cast.user_says("What did they say?", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.manager.create_conversation(now)
    backend.script = [
        calls(
            ("c1", "get_conversation", {"conversation_id": theirs.id}),
            ("c2", "get_conversation", {"id": UNKNOWN}),
            ("c3", "get_conversation", {"list_recent": True}),
            ("c4", "get_conversation", {"conversation_id": mine.id}),
        ),
        text("I cannot tell."),
    ]

    assert await rig.runner.run(RunRequest(now.id, now.id, "alice")) is not None
    await rig.runner.flush(5.0)

    refused, unknown, listed, own = backend.tool_results()
    assert refused.is_error
    assert unknown.is_error
    assert refused.content == unknown.content.replace(UNKNOWN, theirs.id)
    assert "Secret" not in refused.content
    assert [row["id"] for row in body(listed)["conversations"]] == [mine.id]
    assert body(own)["messages"][1]["content"] == "My plan."


async def test_the_other_person_reads_only_their_own(cast: Cast, manager: ConversationManager) -> None:
    """The same rule the other way: a run answering the other person lists and reads only their conversations,
    even in a conversation the user started (the trigger's author is the person)."""
    theirs = await conversation(manager, cast, cast.other_user, "Their plan.", title="Theirs", summary="T.")
    mine = await conversation(manager, cast, cast.user, "My plan.", title="Mine", summary="M.")
    shared = await conversation(manager, cast, cast.user, end=False)
    question = cast.factory.event(cast.other_user, "Alice, anything?", tags=[["E", shared.id]])
    await manager.add_event(shared.id, question)

    listed = body(await ask(manager, cast, shared.id, question, {"list_recent": True}))
    refused = await ask(manager, cast, shared.id, question, {"conversation_id": mine.id})
    unknown = await ask(manager, cast, shared.id, question, {"conversation_id": UNKNOWN})

    assert [row["id"] for row in listed["conversations"]] == [theirs.id]
    assert refused.content == unknown.content.replace(UNKNOWN, mine.id)


async def test_an_agents_trigger_reads_as_the_person_who_started_the_conversation(
    cast: Cast, manager: ConversationManager
) -> None:
    """When Bob's message triggers Alice the person is the root's author; with no person at all (an agent's
    root and trigger) nothing is readable and nothing listed."""
    theirs = await conversation(manager, cast, cast.other_user, "Their plan.", title="Theirs", summary="T.")
    mine = await conversation(manager, cast, cast.user, "My plan.", title="Mine", summary="M.")
    current = await conversation(manager, cast, cast.user, end=False)
    bob = cast.bob_says("Alice, what did we do?", tags=[["E", current.id], ["p", cast.alice.pubkey]])
    await manager.add_event(current.id, bob)
    agents_own = cast.bob_says("Bob starts this", kind=11, tags=[["p", cast.alice.pubkey]])
    await manager.create_conversation(agents_own)

    listed = body(await ask(manager, cast, current.id, bob, {"list_recent": True}))
    readable = await ask(manager, cast, current.id, bob, {"conversation_id": mine.id})
    refused = await ask(manager, cast, current.id, bob, {"conversation_id": theirs.id})
    nobody_lists = body(await ask(manager, cast, agents_own.id, agents_own, {"list_recent": True}))
    nobody_reads = await ask(manager, cast, agents_own.id, agents_own, {"conversation_id": mine.id})

    assert [row["id"] for row in listed["conversations"]] == [mine.id]
    assert not readable.is_error
    assert refused.is_error
    assert nobody_lists == {"conversations": []}
    assert nobody_reads.is_error


# --- list_recent -------------------------------------------------------------------------------


async def test_list_recent_lists_ten_ended_conversations_newest_ended_first(
    cast: Cast, manager: ConversationManager, clock: FakeClock
) -> None:
    """``list_recent: true`` lists 10 by default: ended conversations only, newest end first (not newest
    update), without the current one, each with id, title, summary, start, end and message count."""
    ended = []
    for i in range(12):
        ended.append(await conversation(manager, cast, cast.user, f"talk {i}", title=f"Talk {i}", summary=f"S{i}."))
        clock.advance(MINUTE_MS)
    await conversation(manager, cast, cast.user, "still going", end=False)
    oldest = ended[0]
    await manager.describe(  # the oldest is updated last: the order is still by end
        oldest.id, title="Talk 0", summary="S0 again.", source=TitleSource.MODEL, for_activity=1
    )
    current = ended[-1]

    listed = body(await ask(manager, cast, current.id, current, {"list_recent": True}))["conversations"]

    expected = list(reversed(ended[1:11]))  # ended[11] is the current one; ended[0] the eleventh
    assert [row["id"] for row in listed] == [root.id for root in expected]
    assert listed[0] == {
        "id": ended[10].id,
        "title": "Talk 10",
        "summary": "S10.",
        "started_at": listed[0]["started_at"],
        "ended_at": listed[0]["ended_at"],
        "message_count": 2,
    }
    assert listed[0]["ended_at"] > listed[1]["ended_at"]


async def test_list_recent_checks_about_as_many_conversations_as_it_lists(
    cast: Cast, manager: ConversationManager, clock: FakeClock
) -> None:
    """Of 40 ended conversations, listing 3 checks whether each is readable here (a lookup that may load
    it) for at most the first page in end order, not for all 40; the 3 are the newest ended."""
    for i in range(40):
        await conversation(manager, cast, cast.user, f"talk {i}", title=f"Talk {i}", summary=f"S{i}.")
        clock.advance(MINUTE_MS)
    current = await conversation(manager, cast, cast.user, end=False)
    store = manager.store
    looked_up: list[str] = []
    find_event = store.find_event

    async def counted(event_id: str) -> tuple[str, NostrEvent] | None:
        looked_up.append(event_id)
        return await find_event(event_id)

    store.find_event = counted  # type: ignore[method-assign]

    three = body(await ask(manager, cast, current.id, current, {"list_recent": 3}))["conversations"]

    assert [row["title"] for row in three] == ["Talk 39", "Talk 38", "Talk 37"]
    assert 3 <= len(looked_up) <= 4


async def test_list_recent_takes_a_number_and_the_configured_default(
    cast: Cast, manager: ConversationManager, clock: FakeClock
) -> None:
    """A number lists that many; ``true`` and no argument at all list ``conversations.list_recent``."""
    for i in range(6):
        await conversation(manager, cast, cast.user, f"talk {i}", title=f"Talk {i}", summary=f"S{i}.")
        clock.advance(MINUTE_MS)
    current = await conversation(manager, cast, cast.user, end=False)

    three = body(await ask(manager, cast, current.id, current, {"list_recent": 3}))["conversations"]
    configured = body(await ask(manager, cast, current.id, current, {"list_recent": True}, list_recent=4))
    bare = body(await ask(manager, cast, current.id, current, {}, list_recent=5))

    assert [row["title"] for row in three] == ["Talk 5", "Talk 4", "Talk 3"]
    assert len(configured["conversations"]) == 4
    assert len(bare["conversations"]) == 5


async def test_an_agents_run_in_a_conversation_of_two_people_works_for_nobodys_past(
    manager: ConversationManager, cast: Cast
) -> None:
    """An agent's trigger (another agent's completion) in the owner's conversation that a second person
    joined: the run recalls neither person's conversations (its reply goes to the newest person, while the
    root is the owner's: whose past it may show cannot be told); with the owner alone it works for the
    owner, and a person's own trigger works for that person."""
    from tenex_daemon.services.persona import asking_person

    root = cast.user_says("Project kickoff", kind=11, tags=[["p", cast.alice.pubkey]])
    shared = await manager.create_conversation(root)
    tags = [["E", root.id, "", root.pubkey], ["K", "11"], ["e", root.id]]
    answer = cast.alice_says("hi owner", tags=tags)
    await manager.add_event(shared.id, answer)
    directory = manager.agents
    owners = await manager.get_conversation(shared.id)
    assert owners is not None
    assert asking_person(owners, answer, directory) == cast.user.pubkey

    joined = cast.factory.event(cast.other_user, "list the owner's conversations", tags=tags)
    await manager.add_event(shared.id, joined)
    completion = cast.alice_says("did part 1", tags=[*tags, ["tool", "complete"]])
    await manager.add_event(shared.id, completion)
    both = await manager.get_conversation(shared.id)
    assert both is not None
    assert asking_person(both, completion, directory) is None
    assert asking_person(both, joined, directory) == cast.other_user.pubkey
