"""What the daemon's log lines leave out (docs/ARCHITECTURE.md, "Private conversations"): a person's key
beside a private conversation, the words of an end's reason, and what a model wrote in broken tool
arguments; and what they say of a backend that fails."""

from __future__ import annotations

import asyncio
import json
from collections.abc import MutableMapping, Sequence
from typing import Any

from structlog.testing import capture_logs

from tenex_daemon.adapters.nostr.private import GiftWrapPublisher, GiftWraps
from tenex_daemon.app.logging import redact_secrets
from tenex_daemon.core.llm import BackendError, CompletionRequest, CompletionResult, ToolCall
from tenex_daemon.services.lifecycle import channel_meta_key
from tenex_daemon.services.private_messages import agent_channel
from tenex_daemon.testing.fakes import FakePublisher, ScriptedBackend, signers_for
from tests import pipeline
from tests.conftest import Cast
from tests.pipeline import cast_keys
from tests.unit.services.test_private_messages import admitted, private_rig, wrap
from tests.unit.services.test_tool_loop import text


async def test_the_log_of_a_private_conversation_names_no_person(cast: Cast) -> None:
    """A private message, its continuation and the channel they take: no log line holds the person's key
    (before, ``channel_conversation_started`` and ``private_conversation_continued`` did)."""
    rig, intake = private_rig(cast)
    with capture_logs() as logs:
        first = admitted(intake, wrap(cast.user, cast.alice.pubkey, "first", at=1_790_000_000))
        await rig.dispatcher.handle(first)
        await rig.quiet()
        conversation = await rig.manager.get_conversation(first.id)
        assert conversation is not None
        answer = conversation.history[-1]
        reply = admitted(intake, wrap(cast.user, cast.alice.pubkey, "about that",
                                      tags=[["p", cast.alice.pubkey], ["e", answer.id, "", "reply"]], at=1_790_000_100))
        await rig.dispatcher.handle(reply)
        await rig.settle()

    events = {entry["event"] for entry in logs}
    assert "channel_conversation_started" in events
    assert all(cast.user.pubkey not in json.dumps(entry, default=str) for entry in logs)


async def test_an_end_logs_its_code_but_not_the_words_of_its_reason(cast: Cast) -> None:
    """An end with an agent's own words logs that a reason was given, not the words (a model paraphrases the
    topic in them); an idle end logs its code."""
    rig = pipeline.build_rig(cast)
    said = await rig.manager.create_conversation(cast.user_says("my private debt", kind=11))
    idle = await rig.manager.create_conversation(cast.user_says("hello", kind=11))
    with capture_logs() as logs:
        await rig.manager.end_conversation(said.id, by="alice", reason="resolved the walrus loan question")
        await rig.manager.end_conversation(idle.id, by="idle", reason="idle_timeout")

    ends = [(entry["by"], entry["reason"]) for entry in logs if entry["event"] == "conversation_ended"]
    assert ends == [("alice", "(given)"), ("idle", "idle_timeout")]


async def test_a_refused_tool_call_logs_what_failed_not_the_models_words(cast: Cast) -> None:
    """A tool call whose arguments are not JSON is refused to the model with its text quoted, and logged
    without it (before, up to 200 characters of whatever the model wrote went into the log)."""
    backend = ScriptedBackend([
        CompletionResult(text="", tool_calls=(ToolCall("j1", "complete", {}, invalid_arguments="{the walrus loan"),)),
        text("Answered plainly."),
    ])
    rig = pipeline.build_rig(cast, backend=backend)
    with capture_logs() as logs:
        await rig.dispatcher.handle(cast.user_says("hi", kind=11, tags=[["p", cast.alice.pubkey]]))
        await rig.settle()

    [refused] = [entry for entry in logs if entry["event"] == "tool_call_refused"]
    assert refused["error"] == "the arguments are not a JSON object"
    assert "walrus" in backend.tool_results()[0].content


class FailingBackend:
    """A backend whose every call fails as an HTTP 401 does."""

    name = "failing"

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Fail."""
        raise BackendError("auth", "401 Unauthorized: invalid api key")


async def test_a_failing_backend_is_logged_with_its_kind_and_what_to_check(cast: Cast) -> None:
    """A backend that fails (a wrong API key) is one warning in the daemon's log, with the agent, the kind
    of failure and what to check (before, only the HTTP library's own info line showed it)."""
    rig = pipeline.build_rig(cast, backend=FailingBackend())
    with capture_logs() as logs:
        await rig.dispatcher.handle(cast.user_says("hi", kind=11, tags=[["p", cast.alice.pubkey]]))
        await rig.settle()

    [failed] = [entry for entry in logs if entry["event"] == "backend_failed"]
    assert (failed["log_level"], failed["agent"], failed["error_kind"]) == ("warning", "alice", "auth")
    assert "api_key_env" in failed["action"]


async def test_a_description_logs_its_title_shortened_as_a_creation_does(cast: Cast) -> None:
    """A title made for a conversation is logged cut to 120 characters, as at its creation (before, whole:
    a fallback title is the first words of the person's message)."""
    from tenex_daemon.core.conversation import TitleSource

    rig = pipeline.build_rig(cast)
    conversation = await rig.manager.create_conversation(cast.user_says("hello", kind=11))
    with capture_logs() as logs:
        await rig.manager.describe(
            conversation.id, title="word " * 60, summary="A summary.", source=TitleSource.FALLBACK,
            for_activity=conversation.activity_at,
        )

    [described] = [entry for entry in logs if entry["event"] == "conversation_described"]
    assert len(described["title"]) <= 121


def _naming(logs: Sequence[MutableMapping[str, Any]], needle: str) -> list[str]:
    """The log lines, as the daemon writes them (its redaction applied), that hold ``needle``."""
    written = [json.dumps(redact_secrets(None, "info", dict(entry)), default=str, ensure_ascii=False) for entry in logs]
    return [line for line in written if needle in line]


async def test_a_private_channel_repaired_or_adopted_is_logged_without_the_persons_key(cast: Cast) -> None:
    """The pointer a crash left unwritten, repaired at the restart's dispatch, and a channel a rebuild adopts
    are logged as ``dm:alice:…``: neither line names the person (both logged the whole channel key)."""
    rig, intake = private_rig(cast)
    rumor = admitted(intake, wrap(cast.user, cast.alice.pubkey, "secret question"))
    channel = agent_channel("alice", cast.user.pubkey)
    conversation = await rig.manager.create_conversation(rumor, exclusive=True, channel=channel)
    with capture_logs() as logs:
        await rig.dispatcher.stored_dispatches([rumor.id])  # the crash came before the pointer was written
        await rig.store.set_meta(channel_meta_key(channel), "f" * 64)  # a home restored: its current one gone
        assert await rig.pipeline.lifecycle.adopt_channel(conversation)

    assert {entry["event"] for entry in logs} >= {"conversation_pointer_repaired", "channel_conversation_adopted"}
    assert _naming(logs, cast.user.pubkey) == []
    assert _naming(logs, "dm:alice:…")


def test_the_logs_cut_a_persons_key_from_any_private_channel_they_are_given() -> None:
    """Whatever field holds a private channel's key (a lease's name, a pointer's key), the daemon's redaction
    writes it as ``dm:<agent>:…``; other channels and event ids stay as they are."""
    person = "79be667ef9dcbbac55a06295ce870b07029bfcdb2dce28d959f2815b16f81798"
    line = redact_secrets(None, "info", {
        "event": "postgres_unlock_skipped", "name": f"channel.dm:alice:{person}", "event_id": person,
        "note": f"lease dm:bob:{person} and kind1:alice:{person}",
    })

    assert line["name"] == "channel.dm:alice:…"
    assert line["note"] == f"lease dm:bob:… and kind1:alice:{person}"
    assert line["event_id"] == person


async def test_gift_wraps_not_delivered_or_not_made_are_logged_naming_no_person(cast: Cast) -> None:
    """Relays down (the outbox retrying a private answer) and an answer too long to gift-wrap: their errors,
    logged and quoted in the notice, name the wrap's recipient by role, not by key (the first 12 characters
    of the person's key, and the whole key, were logged)."""
    inner = FakePublisher(fail=True)
    rig, intake = private_rig(cast, publisher=GiftWrapPublisher(inner, GiftWraps(signers_for(cast_keys(cast)))))
    with capture_logs() as down:
        await rig.dispatcher.handle(admitted(intake, wrap(cast.user, cast.alice.pubkey, "hello")))
        await rig.quiet()
        await asyncio.sleep(1.2)  # the outbox's first retry
    inner.fail = False
    rig.pipeline.outbox.wake()
    await rig.settle()
    long = ScriptedBackend([CompletionResult(text="x" * 70_000, model="m")])
    wraps = GiftWrapPublisher(FakePublisher(), GiftWraps(signers_for(cast_keys(cast))))
    rig, intake = private_rig(cast, publisher=wraps, backend=long)
    with capture_logs() as too_long:
        await rig.dispatcher.handle(admitted(intake, wrap(cast.user, cast.alice.pubkey, "write a lot")))
        await rig.settle()

    retries = [str(entry["error"]) for entry in down if entry["event"] == "outbox_retry"]
    refused = [str(entry["error"]) for entry in too_long if entry["event"] == "outbox_entry_refused"]
    assert retries
    assert "recipient: " in retries[0]
    assert refused
    assert "cannot be wrapped for its recipient" in refused[0]
    assert _naming(down + too_long, cast.user.pubkey[:12]) == []
