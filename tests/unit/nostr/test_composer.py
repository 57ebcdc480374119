"""The reply composer: a reply has the kind its conversation speaks (kind 1 with NIP-10 tags in a kind-1
conversation, kind 1111 with NIP-22 tags otherwise), with every tag of docs/PROTOCOL.md and its cost."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from tenex_daemon.adapters.nostr.codec import (
    build_agent_reply,
    note_tags,
    person_note_reply_tags,
    read_threading,
    reply_kind,
    usd_text,
    verify_event,
)
from tenex_daemon.adapters.nostr.composer import SignedReplyComposer
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.ports import ReplySpec
from tenex_daemon.core.pricing import TokenPrices
from tenex_daemon.core.thread_tags import ThreadStyle
from tenex_daemon.testing import KeyPair, sign_event
from tenex_daemon.testing.fakes import signers_for

USER = KeyPair.from_seed(501)
AGENT = KeyPair.from_seed(502)
OTHER_AGENT = KeyPair.from_seed(503)
ORCHESTRATOR = KeyPair.from_seed(504)
PROJECT = (USER.pubkey, "proj")
ADDRESS = ["a", f"31933:{USER.pubkey}:proj"]


def composer() -> SignedReplyComposer:
    """The daemon's composer over the test agents' keys, with a project."""
    return SignedReplyComposer(
        signers_for({"agent": AGENT, "other": OTHER_AGENT, "orchestrator": ORCHESTRATOR}), PROJECT
    )


def spec(trigger: NostrEvent, root: NostrEvent | None, **fields: Any) -> ReplySpec:
    """A reply by ``agent`` to ``trigger`` in the conversation of ``root``, to the user unless told."""
    base = ReplySpec(
        agent_slug="agent", trigger=trigger, root=root, content="the answer",
        destinations=(USER.pubkey,), phase="chat", net_time_seconds=7,
    )
    return replace(base, **fields)


def test_a_reply_to_a_kind_1_root_is_a_kind_1_with_one_e_marked_root() -> None:
    """In a kind-1 conversation the answer to the root itself is a kind 1 with one `e` marked root, the
    person's `p`, then the other tags in docs/PROTOCOL.md's order; it verifies and reads as NIP-10 marked."""
    note = sign_event(USER, "hello agent", kind=1, tags=[["p", AGENT.pubkey]])

    reply = composer().compose(spec(note, note, model="m", prompt_tokens=10, completion_tokens=5))

    assert reply.kind == 1
    assert reply.pubkey == AGENT.pubkey
    assert verify_event(reply)
    assert reply.tags == [
        ["e", note.id, "", "root"],
        ["p", USER.pubkey],
        ADDRESS, ["phase", "chat"], ["net-time", "7"],
        ["llm-model", "m"], ["llm-prompt-tokens", "10"], ["llm-completion-tokens", "5"],
    ]
    threading = read_threading(reply)
    assert (threading.style, threading.root_id, threading.parent_id) == (
        ThreadStyle.NIP10_MARKED, note.id, note.id
    )


def test_a_reply_to_a_later_note_of_a_kind_1_conversation_names_root_and_reply() -> None:
    """A trigger that is not the root (a NIP-10 reply, or a channel's later top-level note) gives `e` root
    = the conversation's root and `e` reply = the trigger; a completion p-tags the person and the
    orchestrator, in that order."""
    note = sign_event(USER, "first", kind=1, tags=[["p", AGENT.pubkey]])
    later = sign_event(USER, "second, top-level", kind=1, tags=[["p", AGENT.pubkey]])

    reply = composer().compose(
        spec(later, note, destinations=(USER.pubkey, ORCHESTRATOR.pubkey), complete=True, session_id="s-1")
    )

    assert reply.kind == 1
    assert reply.tags == [
        ["e", note.id, "", "root"],
        ["e", later.id, "", "reply"],
        ["p", USER.pubkey],
        ["p", ORCHESTRATOR.pubkey],
        ADDRESS, ["phase", "chat"], ["net-time", "7"], ["claude-session", "s-1"], ["tool", "complete"],
    ]
    threading = read_threading(reply)
    assert (threading.root_id, threading.parent_id) == (note.id, later.id)


def test_without_a_stored_root_the_kind_comes_from_the_triggers_thread() -> None:
    """With no root given, a NIP-10 kind-1 trigger's marked root names the thread and the reply is a kind 1;
    a NIP-22 trigger in a kind-11 thread gives a kind 1111."""
    root_id = "ab" * 32
    nip10 = sign_event(USER, "re", kind=1, tags=[["e", root_id, "", "root"], ["p", AGENT.pubkey]])
    nip22 = sign_event(USER, "re", tags=[["E", root_id, "", USER.pubkey], ["K", "11"], ["P", USER.pubkey]])

    assert build_agent_reply(nip10, [USER.pubkey]) == (
        1, [["e", root_id, "", "root"], ["e", nip10.id, "", "reply"], ["p", USER.pubkey]]
    )
    kind, tags = build_agent_reply(nip22, [USER.pubkey])
    assert kind == 1111
    assert tags[:2] == [["E", root_id, "", USER.pubkey], ["K", "11"]]


@pytest.mark.parametrize("root_kind", [11, 1934])
def test_kind_11_and_task_conversations_keep_nip22_comments(root_kind: int) -> None:
    """In a kind-11 or kind-1934 conversation the reply stays a kind 1111 with E/K/P, e/k and p, as before."""
    root = sign_event(USER, "root", kind=root_kind, tags=[["p", AGENT.pubkey]])
    trigger = sign_event(USER, "go on", tags=[["E", root.id, "", USER.pubkey], ["K", str(root_kind)]])

    reply = composer().compose(spec(trigger, root))

    assert reply.kind == 1111
    assert reply.tags == [
        ["E", root.id, "", USER.pubkey], ["K", str(root_kind)], ["P", USER.pubkey],
        ["e", trigger.id, "", USER.pubkey], ["k", "1111"],
        ["p", USER.pubkey],
        ADDRESS, ["phase", "chat"], ["net-time", "7"],
    ]


def test_an_error_reply_has_its_conversations_kind_and_the_error_tag() -> None:
    """A reply reporting a failure is a kind 1 in a kind-1 conversation and a kind 1111 in a kind-11 one,
    tagged `["error", "system"]` either way."""
    note = sign_event(USER, "hello", kind=1, tags=[["p", AGENT.pubkey]])
    root = sign_event(USER, "hello", kind=11, tags=[["p", AGENT.pubkey]])

    in_note = composer().compose(spec(note, note, error=True))
    in_thread = composer().compose(spec(root, root, error=True))

    assert (in_note.kind, in_thread.kind) == (1, 1111)
    assert in_note.tags[-1] == in_thread.tags[-1] == ["error", "system"]


def test_delegation_copies_follow_the_conversations_kind() -> None:
    """Both published sides of a send_message exchange in a kind-1 conversation are kind 1: the request
    replies to the trigger p-tagging the asked agent, the answer replies to the request p-tagging the
    asker, each tagged with the thread."""
    note = sign_event(USER, "ask the other", kind=1, tags=[["p", AGENT.pubkey]])
    thread = f"{note.id}__agent__other"
    request = composer().compose(
        spec(note, note, destinations=(OTHER_AGENT.pubkey,), delegation=thread, content="2+2?")
    )
    answer = composer().compose(
        spec(request, note, agent_slug="other", destinations=(AGENT.pubkey,), delegation=thread, content="4")
    )

    assert (request.kind, answer.kind) == (1, 1)
    assert request.tags == [
        ["e", note.id, "", "root"], ["p", OTHER_AGENT.pubkey],
        ADDRESS, ["phase", "chat"], ["net-time", "7"], ["delegation", thread],
    ]
    assert answer.tags[:3] == [["e", note.id, "", "root"], ["e", request.id, "", "reply"], ["p", AGENT.pubkey]]
    assert answer.tags[-1] == ["delegation", thread]


def test_the_cost_tag_follows_the_token_counts_and_is_absent_without_a_price() -> None:
    """A reply with a cost carries `llm-cost-usd` right after the token counts (at most 6 decimals, no
    exponent); without a cost there is no such tag."""
    note = sign_event(USER, "hello", kind=1, tags=[["p", AGENT.pubkey]])
    cost = TokenPrices(3.0, 15.0).cost_usd(1234, 56)
    assert cost is not None

    priced = composer().compose(spec(note, note, prompt_tokens=1234, completion_tokens=56, cost_usd=cost))
    unpriced = composer().compose(spec(note, note, prompt_tokens=1234, completion_tokens=56))

    names = [t[0] for t in priced.tags]
    assert names.index("llm-cost-usd") == names.index("llm-completion-tokens") + 1
    assert priced.tag_value("llm-cost-usd") == "0.004542"
    assert unpriced.tag_value("llm-cost-usd") is None


def test_prices_and_the_dollar_text() -> None:
    """Prices per million tokens give the cost of a reply; unknown counts of a priced side or no price give
    None; the text has at most 6 decimals, no exponent and no trailing zeros."""
    assert TokenPrices.of(None, None) is None
    assert TokenPrices(2.5, None).cost_usd(1_000_000, None) == 2.5
    assert TokenPrices(2.5, 10.0).cost_usd(1000, None) is None
    assert TokenPrices(None, 10.0).cost_usd(None, 100) == pytest.approx(0.001)
    assert TokenPrices().cost_usd(10, 10) is None
    assert [usd_text(v) for v in (0.004542, 2.5, 2.0, 1e-9, 0.0, 1e-7 * 6, 12345.6789)] == [
        "0.004542", "2.5", "2", "0", "0", "0.000001", "12345.6789"
    ]
    assert usd_text(None) is None


def test_reply_kind_and_a_persons_kind_1_tags() -> None:
    """Only a kind-1 root gives kind-1 replies; a person's note carries one p per destination; a person's
    NIP-10 reply to an agent's kind-1 answer names the answer's root and the answer."""
    assert [reply_kind(k) for k in (1, 11, 1934, 1111)] == [1, 1111, 1111, 1111]
    assert note_tags([AGENT.pubkey, AGENT.pubkey]) == [["p", AGENT.pubkey]]
    note = sign_event(USER, "hello", kind=1, tags=[["p", AGENT.pubkey]])
    answer = sign_event(AGENT, "hi", kind=1, tags=[["e", note.id, "", "root"], ["p", USER.pubkey]])

    assert person_note_reply_tags(note, [AGENT.pubkey]) == (note.id, [["e", note.id, "", "root"], ["p", AGENT.pubkey]])
    assert person_note_reply_tags(answer, [AGENT.pubkey]) == (
        note.id, [["e", note.id, "", "root"], ["e", answer.id, "", "reply"], ["p", AGENT.pubkey]]
    )


def test_of_several_reply_markers_the_last_is_the_parent() -> None:
    """NDK's reply to a reply copies the parent's marked `e` tags and adds its own `reply` last: the root
    is the `root` marker and the parent the last `reply` marker."""
    root_id, trigger_id, answer_id = "aa" * 32, "bb" * 32, "cc" * 32
    event = sign_event(USER, "re", kind=1, tags=[
        ["e", root_id, "", "root"], ["e", trigger_id, "", "reply"], ["p", USER.pubkey],
        ["e", answer_id, "", "reply", AGENT.pubkey], ["p", AGENT.pubkey],
    ])

    threading = read_threading(event)

    assert (threading.root_id, threading.parent_id, threading.parent_author) == (root_id, answer_id, AGENT.pubkey)


def _replied_to_cases() -> list[tuple[str, NostrEvent, NostrEvent]]:
    note = sign_event(USER, "hello agent", kind=1, tags=[["p", AGENT.pubkey]])
    later_note = sign_event(USER, "and then?", kind=1, tags=[["e", note.id, "", "root"], ["p", AGENT.pubkey]])
    thread = sign_event(USER, "a thread", kind=11, tags=[["p", AGENT.pubkey]])
    comment = sign_event(USER, "more", tags=[["E", thread.id, "", USER.pubkey], ["K", "11"], ["e", thread.id]])
    return [
        ("kind 1, the root", note, note),
        ("kind 1, a later note", later_note, note),
        ("kind 1111, the root", thread, thread),
        ("kind 1111, a comment", comment, thread),
    ]


@pytest.mark.parametrize(("case", "trigger", "root"), _replied_to_cases())
def test_the_composer_reads_back_the_trigger_of_each_reply_it_makes(
    case: str, trigger: NostrEvent, root: NostrEvent
) -> None:
    """Whatever the conversation's kind and wherever the trigger stands, the threading of a composed reply
    names its trigger as the event answered (a run redone after a crash finds its saved reply by it, an
    orchestrator turn its completion), a delegation request's too."""
    made = composer()

    reply = made.compose(spec(trigger, root))
    request = made.compose(spec(trigger, root, delegation="ask"))

    assert read_threading(reply).parent_id == trigger.id, case
    assert read_threading(request).parent_id == trigger.id, case


@pytest.mark.parametrize(
    ("ahead_s", "dated"),
    [(-600, "now"), (90, "after the question"), (2 * 86_400, "at most 300 s ahead")],
    ids=["question-in-the-past", "question-90-s-ahead", "question-2-days-ahead"],
)
def test_a_reply_is_dated_after_its_question_even_when_the_question_is_dated_ahead(
    ahead_s: int, dated: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reply is dated now, or a second after its question when the question is dated later (a person's
    clock ahead of the daemon's, or the daemon's stepped back), so a client ordering by date shows it after
    the question; never more than 300 s ahead of the daemon's clock (relays refuse events dated far ahead)."""
    now = 1_800_000_000
    monkeypatch.setattr("tenex_daemon.adapters.nostr.signer.time.time", lambda: now + 0.7)
    question = sign_event(USER, "when?", kind=11, tags=[["p", AGENT.pubkey]], created_at=now + ahead_s)

    reply = composer().compose(spec(question, question))

    expected = {"now": now, "after the question": now + 91, "at most 300 s ahead": now + 300}[dated]
    assert reply.created_at == expected
    assert verify_event(reply)


def test_a_private_reply_rumor_is_dated_after_its_question_too() -> None:
    """A private conversation's reply (a kind-14 rumor) follows the same rule: a second after a question
    dated 90 s ahead of the daemon's clock."""
    from tenex_daemon.adapters.nostr.private import PrivateReplyComposer

    now = 1_800_000_000
    question = sign_event(USER, "when?", kind=14, tags=[["p", AGENT.pubkey]], created_at=now + 90)
    private = PrivateReplyComposer(composer(), {"agent": AGENT.pubkey}, clock=lambda: now)

    rumor = private.compose(spec(question, question))

    assert (rumor.kind, rumor.created_at) == (14, now + 91)
