"""People told apart (docs/CONTEXT.md step 1): once more than one person has written in a conversation,
each person's message carries their label; with one person the messages stay byte-exact as before."""

from __future__ import annotations

from collections.abc import Collection

from tenex_daemon import ConversationManager
from tenex_daemon.core.agents import AgentDirectory
from tenex_daemon.core.context import (
    NEW_INTERACTION,
    USER_LABEL,
    ChatMessage,
    build_agent_messages,
    distinct_names,
    person_label,
)
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.nip19 import encode_npub
from tenex_daemon.core.ports import ProfileNames
from tenex_daemon.testing.fakes import ScriptedBackend
from tests import pipeline
from tests.conftest import Cast
from tests.unit.services.test_tool_loop import text


def test_person_label_is_the_short_npub() -> None:
    """A person's label is the first 13 characters of their npub followed by an ellipsis."""
    pubkey = "ab" * 32
    assert person_label(pubkey) == encode_npub(pubkey)[:13] + "…"
    assert person_label(pubkey).startswith("npub1")


async def test_two_people_are_labelled_in_history_and_trigger(manager: ConversationManager, cast: Cast) -> None:
    """With two people in the conversation, both people's messages (history and trigger) read
    ``[<label>]: <content>`` as ``user``; the agent's own stays ``assistant``; the block keeps ``🟢 USER``."""
    root = cast.user_says("Plan my trip", kind=11, tags=[["p", cast.alice.pubkey]])
    conversation = await manager.create_conversation(root)
    await manager.build_agent_messages(conversation.id, "alice", root)
    answer = cast.alice_says("Where to?")
    await manager.add_event(conversation.id, answer)
    hello = cast.factory.event(cast.other_user, "Hi all", tags=[["E", root.id]])
    await manager.add_event(conversation.id, hello)
    other = cast.factory.event(cast.other_user, "Tell me everything", tags=[["E", root.id]])
    await manager.add_event(conversation.id, other)

    context = await manager.build_agent_messages(conversation.id, "alice", other)

    me, them = person_label(cast.user.pubkey), person_label(cast.other_user.pubkey)
    assert context.messages[:3] == [
        ChatMessage("user", f"[{me}]: Plan my trip"),
        ChatMessage("assistant", "Where to?"),
        ChatMessage("user", f"[{them}]: Hi all"),
    ]
    assert context.messages[-2:] == [
        ChatMessage("system", NEW_INTERACTION),
        ChatMessage("user", f"[{them}]: Tell me everything"),
    ]
    assert f"{USER_LABEL}:\nHi all\n\n" in context.messages[-3].content


async def test_one_person_stays_unlabelled(manager: ConversationManager, cast: Cast) -> None:
    """With one person and several agents, a person's messages stay plain ``user`` content, byte for byte."""
    root = cast.user_says("Hello ✨", kind=11, tags=[["p", cast.alice.pubkey]])
    conversation = await manager.create_conversation(root)
    await manager.add_event(conversation.id, cast.bob_says("Bob here"))
    follow = cast.user_says("Again", tags=[["E", root.id]])
    await manager.add_event(conversation.id, follow)

    context = await manager.build_agent_messages(conversation.id, "alice", follow)

    assert context.messages[0] == ChatMessage("user", "Hello ✨")
    assert context.messages[1] == ChatMessage("system", "[Bob]: Bob here")
    assert context.messages[-1] == ChatMessage("user", "Again")


async def test_memoized_history_is_relabelled_when_a_second_person_writes(
    manager: ConversationManager, cast: Cast
) -> None:
    """History built (and memoized) while one person wrote is shown labelled once a second person writes."""
    root = cast.user_says("First", kind=11, tags=[["p", cast.alice.pubkey]])
    conversation = await manager.create_conversation(root)
    second = cast.user_says("Second", tags=[["E", root.id]])
    await manager.add_event(conversation.id, second)
    before = await manager.build_agent_messages(conversation.id, "alice", second)
    other = cast.factory.event(cast.other_user, "Third", tags=[["E", root.id]])
    await manager.add_event(conversation.id, other)

    after = await manager.build_agent_messages(conversation.id, "alice", other)

    assert before.messages[0] == ChatMessage("user", "First")
    assert after.messages[:2] == [
        ChatMessage("user", f"[{person_label(cast.user.pubkey)}]: First"),
        ChatMessage("user", f"[{person_label(cast.user.pubkey)}]: Second"),
    ]


def test_a_trigger_from_a_second_person_not_yet_in_history_labels_everyone(cast: Cast) -> None:
    """The trigger's author counts as a person who has written even before the trigger is stored."""
    root = cast.user_says("Mine", kind=11)
    conversation = Conversation(id=root.id, history=[root])
    trigger = cast.factory.event(cast.other_user, "Theirs", tags=[["E", root.id]])
    directory = AgentDirectory(cast.agents)

    context = build_agent_messages(conversation, cast.alice, trigger, directory)

    assert context.messages[0] == ChatMessage("user", f"[{person_label(cast.user.pubkey)}]: Mine")
    assert context.messages[-1] == ChatMessage("user", f"[{person_label(cast.other_user.pubkey)}]: Theirs")


async def test_a_second_person_s_empty_event_labels_nobody(manager: ConversationManager, cast: Cast) -> None:
    """An empty event writes nothing (step 1 skips it): a second person's empty event, in history or as the
    trigger, does not make the conversation one of several people, so the person's messages stay plain."""
    root = cast.user_says("Plan my trip", kind=11, tags=[["p", cast.alice.pubkey]])
    conversation = await manager.create_conversation(root)
    empty = cast.factory.event(cast.other_user, "", tags=[["E", root.id]])
    await manager.add_event(conversation.id, empty)
    follow = cast.user_says("To Lisbon", tags=[["E", root.id]])
    await manager.add_event(conversation.id, follow)

    context = await manager.build_agent_messages(conversation.id, "alice", follow)
    assert context.messages[0] == ChatMessage("user", "Plan my trip")
    assert context.messages[-1] == ChatMessage("user", "To Lisbon")

    trailing = cast.factory.event(cast.other_user, "", tags=[["E", root.id]])
    await manager.add_event(conversation.id, trailing)
    again = await manager.build_agent_messages(conversation.id, "alice", trailing)
    assert ChatMessage("user", "Plan my trip") in again.messages
    assert ChatMessage("user", "To Lisbon") in again.messages


def test_a_person_is_labelled_by_profile_name_on_one_line_and_cut() -> None:
    """With a profile name the label is that name (its whitespace runs made one space, at most 40
    characters with an ellipsis); a blank name falls back to the short npub."""
    pubkey = "ab" * 32
    assert person_label(pubkey, "Carol") == "Carol"
    assert person_label(pubkey, "  Carol\n the\tGreat ") == "Carol the Great"
    long = "x" * 60
    assert person_label(pubkey, long) == "x" * 39 + "…"
    assert person_label(pubkey, " \n ") == person_label(pubkey)


async def shown_once_a_guest_writes(cast: Cast, names: ProfileNames) -> list[str]:
    """Through the production pipeline (profile names from ``names``): the person writes to Alice, who
    answers; a whitelisted guest writes in the thread; return what Alice's backend was sent for the guest."""
    backend = ScriptedBackend([text("Hi both."), text("Noted.")])
    rig = pipeline.build_rig(
        cast, backend=backend, names=names, whitelist=[cast.other_user.pubkey], whitelist_may_join=True
    )
    root = cast.user_says("Plan my trip", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await rig.quiet()
    guest = cast.factory.event(
        cast.other_user, "Lisbon, please", tags=[["E", root.id, "", root.pubkey], ["p", cast.alice.pubkey]]
    )
    await rig.dispatcher.handle(guest)
    await rig.settle()
    return [m.content for m in backend.requests[-1].messages]


async def test_the_run_labels_people_by_their_profile_names(cast: Cast) -> None:
    """Through the production pipeline, with two people in the conversation, the agent is shown each
    person's profile name where one is known ("[Carol]: ...") and the short npub for the other."""
    asked: list[set[str]] = []

    class Names:
        async def names(self, pubkeys: Collection[str]) -> dict[str, str]:
            asked.append(set(pubkeys))
            return {pubkey: "Carol" for pubkey in pubkeys if pubkey == cast.other_user.pubkey}

    shown = await shown_once_a_guest_writes(cast, Names())
    assert shown[0] == f"[{person_label(cast.user.pubkey)}]: Plan my trip"
    assert shown[-1] == "[Carol]: Lisbon, please"
    assert asked == [{cast.user.pubkey, cast.other_user.pubkey}]  # asked only once two people wrote


def test_a_label_two_people_would_share_is_followed_by_each_ones_short_npub() -> None:
    """Two people whose profiles give the same name (any case, any spacing) are labelled ``<name> (<short
    npub>…)``, each their own, cut to the label's 40 characters; so are two whose long names are alike only
    up to the cut, and one who takes another's label as their name; a name nobody shares, and a person
    without one (the short npub), stay as they are."""
    sam, other_sam, carol, nameless, spoof = "ab" * 32, "cd" * 32, "ef" * 32, "12" * 32, "34" * 32
    long_a, long_b = "Robert the Accountant of Example Corp " + "Ltd", "Robert the Accountant of Example Corp " + "LLC"

    def short(pubkey: str) -> str:
        return encode_npub(pubkey)[:13] + "…"

    shown = distinct_names([sam, other_sam, carol, nameless], {sam: "Sam", other_sam: " sam ", carol: "Carol"})
    long_shown = distinct_names([sam, other_sam], {sam: long_a, other_sam: long_b})
    taken = distinct_names([sam, other_sam, spoof], {sam: "Sam", other_sam: "Sam", spoof: f"Sam ({short(sam)})"})

    assert shown == {
        sam: f"Sam ({short(sam)})", other_sam: f"sam ({short(other_sam)})", carol: "Carol",
        nameless: short(nameless),
    }
    assert long_shown[sam] != long_shown[other_sam]
    assert all(len(label) <= 40 and label.endswith(f"({short(key)})") for key, label in long_shown.items())
    assert len(set(taken.values())) == 3
    assert taken[sam] == f"Sam ({short(sam)})"
    assert person_label(sam, long_shown[sam]) == long_shown[sam]


async def test_the_run_tells_apart_two_people_of_one_profile_name(cast: Cast) -> None:
    """Through the production pipeline, two people both named "Sam" in their profiles are shown to the agent
    as two labels (it saw "[Sam]" for both, and anyone could pass for another by taking their name)."""

    class Names:
        async def names(self, pubkeys: Collection[str]) -> dict[str, str]:
            return dict.fromkeys(pubkeys, "Sam")

    shown = await shown_once_a_guest_writes(cast, Names())
    assert shown[0] == f"[Sam ({encode_npub(cast.user.pubkey)[:13]}…)]: Plan my trip"
    assert shown[-1] == f"[Sam ({encode_npub(cast.other_user.pubkey)[:13]}…)]: Lisbon, please"
