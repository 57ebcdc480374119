"""`tenexd send --kind`: which kind is sent and with which tags (a kind-1 note, a NIP-10 reply, a kind-11
root, a NIP-22 reply), and the usage errors of a kind that does not fit."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.app.home import init_home, load_agents
from tenex_daemon.app.settings import Settings, load_settings
from tenex_daemon.cli.main import app
from tenex_daemon.cli.send import ReplyWatch, SendError, _Answers, check_kind, compose_message, message_kind
from tenex_daemon.core.agents import Agent
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.testing import KeyPair, sign_event


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A home made by init (its owner key generated), pointed at a relay nobody listens on."""
    path = tmp_path / "home"
    init_home(path, relays=["ws://127.0.0.1:1"])
    return path


def parts(home: Path) -> tuple[Settings, Signer, Agent, set[str]]:
    """The home's settings, the owner's signer, the planner and every agent's key."""
    settings = load_settings(home, {})
    agents = load_agents(settings)
    planner = next(a for a in agents if a.slug == "planner")
    return settings, Signer.from_file(settings.owner_key_path), planner, {a.pubkey for a in agents}


def test_the_kind_sent_by_default_and_on_request() -> None:
    """Without --kind: a new message is a kind 11, a reply to a kind 1 a kind 1, any other reply a kind 1111;
    --kind 1 sends kind 1 either way; 11 with a parent, 1111 without one, and other kinds are refused."""
    agent = KeyPair.from_seed(71)
    note = sign_event(agent, "a note", kind=1)
    comment = sign_event(agent, "a comment", kind=1111)

    assert [message_kind(None, p) for p in (None, note, comment)] == [11, 1, 1111]
    assert [message_kind(1, p) for p in (None, note, comment)] == [1, 1, 1]
    assert (message_kind(11, None), message_kind(1111, comment)) == (11, 1111)
    for kind, replying in ((11, True), (1111, False), (7, False), (30023, True)):
        with pytest.raises(SendError):
            check_kind(kind, replying)
    check_kind(None, True)


def test_a_kind_1_note_and_a_nip10_reply_to_an_agents_kind_1_answer(home: Path) -> None:
    """--kind 1 without a parent signs a top-level kind-1 note p-tagging the agent (no `e`, no title); a reply
    to an agent's kind-1 answer is a kind 1 whose `e` root is the answer's root and `e` reply the answer."""
    settings, owner, planner, agent_keys = parts(home)

    note, root_id = compose_message(
        settings, owner, "hello", planner, agent_keys, parent=None, kind=1, title="ignored"
    )
    planner_key = Signer.from_file(settings.agent_key_path("planner"))
    answer = planner_key.sign(1, "hi", [["e", note.id, "", "root"], ["p", owner.pubkey]])
    reply, reply_root = compose_message(
        settings, owner, "more", planner, agent_keys, parent=answer, kind=None, title=None
    )

    assert (note.kind, note.pubkey, root_id) == (1, owner.pubkey, note.id)
    assert note.tags == [["p", planner.pubkey]]
    assert reply.kind == 1
    assert reply_root == note.id
    assert reply.tags == [
        ["e", note.id, "", "root"], ["e", answer.id, "", "reply"], ["p", planner.pubkey]
    ]


def test_without_kind_a_new_message_is_still_a_kind_11_root(home: Path) -> None:
    """The default new message is the kind-11 root it always was: the agent's `p`, the project's `a`, and a
    `title` only when one is given (untitled, the daemon titles it, as any untitled conversation)."""
    settings, owner, planner, agent_keys = parts(home)

    root, root_id = compose_message(settings, owner, "Plan it", planner, agent_keys, parent=None, kind=None, title=None)
    titled, _ = compose_message(settings, owner, "Plan it", planner, agent_keys, parent=None, kind=None, title="Picnic")

    assert (root.kind, root_id) == (11, root.id)
    assert root.tags[0] == ["p", planner.pubkey]
    assert [tag[0] for tag in root.tags] == ["p", "a"]
    assert titled.tags[:2] == [["title", "Picnic"], ["p", planner.pubkey]]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kind", "11", "--reply-to", "ab" * 32], "--kind 11"),
        (["--kind", "1111"], "--kind 1111"),
        (["--kind", "7"], "--kind must be one of 1, 11, 1111"),
        (["--private", "--reply-to", "ab" * 32], "--private sends a new private message"),
        (["--private", "--kind", "1"], "--private sends a new private message"),
    ],
)
def test_a_kind_that_does_not_fit_is_a_usage_error(home: Path, args: list[str], message: str) -> None:
    """`tenexd send` with a kind that does not fit --reply-to (or no such kind), or --private with what only a
    public message takes, exits 2 and says why, before any relay is tried."""
    result = CliRunner().invoke(app, ["--home", str(home), "send", "hi", *args, "--timeout", "0.2"])

    assert result.exit_code == 2, result.output
    assert message in result.output


def test_only_answers_to_the_message_sent_end_the_wait() -> None:
    """An agent event naming the message sent answers it, whatever its time; one naming only the thread's
    root answers it when not older than the message and the root is an agent's (a person's root: it
    answers that first message); the parent replied to and older thread events do not."""
    person, agent = KeyPair.from_seed(73), KeyPair.from_seed(74)
    root = sign_event(person, "root", kind=1, created_at=1000)
    parent = sign_event(agent, "first answer", kind=1, tags=[["e", root.id, "", "root"]], created_at=1010)
    sent = sign_event(person, "more", kind=1, tags=[["e", root.id, "", "root"], ["e", parent.id, "", "reply"]],
                      created_at=1010)
    watch = ReplyWatch(sent, root.id, parent.id)
    answer = sign_event(agent, "a", kind=1, tags=[["e", root.id, "", "root"], ["e", sent.id, "", "reply"]],
                        created_at=1009)
    chained = sign_event(agent, "b", kind=1, tags=[["e", root.id, "", "root"]], created_at=1011)
    older = sign_event(agent, "c", kind=1, tags=[["e", root.id, "", "root"]], created_at=1005)

    assert [bool(watch.take(e)) for e in (answer, chained, parent, older)] == [True, False, False, False]
    assert watch.ids() == [root.id, sent.id]
    assert not ReplyWatch().take(answer)
    by_agent = ReplyWatch(sent, root.id, parent.id, root_by_agent=True)
    assert [bool(by_agent.take(e)) for e in (answer, chained, parent, older)] == [True, True, False, False]


def test_an_answer_to_the_persons_earlier_message_is_not_taken_for_the_answer_to_this_one() -> None:
    """Asked several times in a row, a late answer to the first (the person's root) or to the second does
    not answer the third, though newer than it; the third's answer does, and so does a routed agent's
    answer to that answer's completion, even when it comes first."""
    person, agent, other = KeyPair.from_seed(73), KeyPair.from_seed(74), KeyPair.from_seed(75)
    root = sign_event(person, "Capital of France?", kind=11, created_at=1000)

    def reply(keys: KeyPair, content: str, parent: str, at: int) -> NostrEvent:
        return sign_event(keys, content, kind=1111, tags=[["E", root.id, "", root.pubkey], ["e", parent]],
                          created_at=at)

    germany = reply(person, "And of Germany?", root.id, 1010)
    spain = reply(person, "And of Spain?", root.id, 1011)
    watch = ReplyWatch(spain, root.id, None)
    paris = reply(agent, "Paris.", root.id, 1012)  # late, to the person's root
    berlin = reply(agent, "Berlin.", germany.id, 1012)
    madrid = reply(agent, "Madrid.", spain.id, 1013)
    checked = reply(other, "Checked: Madrid.", madrid.id, 1014)

    assert watch.take(paris) == []
    assert watch.take(berlin) == []
    assert watch.take(checked) == []  # held: it replies to an answer not seen yet
    assert watch.take(madrid) == [madrid, checked]
    assert watch.take(madrid) == []


async def test_addressing_the_orchestrator_waits_for_the_agent_it_routes_to_as_the_default_does() -> None:
    """The orchestrator routes and does not answer: `send --to orchestrator`, like `send` without --to, ends
    its wait at the first answer of another agent; `--to planner` waits for the planner's own; an
    orchestrator that is the only agent answers itself."""
    orchestrator = Agent(slug="orchestrator", name="O", pubkey="0" * 64, orchestrator=True)
    planner = Agent(slug="planner", name="P", pubkey="1" * 64)
    executor = Agent(slug="executor", name="E", pubkey="2" * 64)
    agents = [orchestrator, planner, executor]
    answer = sign_event(KeyPair.from_seed(75), "done", kind=1111)

    async def ended(to: Agent | None, by: Agent) -> bool:
        answers = _Answers(agents, to or orchestrator, to.slug if to else None, None)
        answers.add(by, answer)
        return await answers.wait(0.01)

    assert await ended(orchestrator, planner)
    assert await ended(None, planner)
    assert not await ended(orchestrator, orchestrator)
    assert not await ended(planner, executor)
    assert await ended(planner, planner)
    alone = _Answers([orchestrator], orchestrator, None, None)  # the only agent: its own answer counts
    alone.add(orchestrator, answer)
    assert await alone.wait(0.01)


def test_an_empty_message_is_refused_before_anything_is_sent(home: Path) -> None:
    """`send` with no text, or only blanks, exits 2 saying so; nothing is published."""
    for text in ("", "   \n"):
        result = CliRunner().invoke(app, ["--home", str(home), "send", text], catch_exceptions=False)
        assert result.exit_code == 2
        assert "TEXT is empty" in result.stderr
