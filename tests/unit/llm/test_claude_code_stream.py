"""The claude-code backend's pieces: the stream-json parser, the prompt, the command line."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tenex_daemon.adapters.llm.claude_code import ClaudeCodeBackend, StreamParser, build_prompt
from tenex_daemon.core.context import ChatMessage
from tenex_daemon.core.llm import BackendError, CompletionRequest


def line(event: dict[str, Any]) -> str:
    """One stream-json line."""
    return json.dumps(event) + "\n"


REQUEST = CompletionRequest(
    agent_slug="a", agent_name="A", system_prompt="", messages=[ChatMessage("user", "hi")]
)


def test_parser_reads_session_text_and_usage() -> None:
    """Init, assistant and result lines give the session id, the text chunks, the final text and the usage."""
    parser = StreamParser()
    chunks: list[str] = []
    events: list[dict[str, Any]] = [
        {"type": "system", "subtype": "init", "session_id": "s-1", "model": "claude-x"},
        {
            "type": "assistant",
            "session_id": "s-1",
            "message": {
                "content": [
                    {"type": "text", "text": "Hello"},
                    {"type": "tool_use", "id": "t", "name": "Bash", "input": {}},
                ]
            },
        },
        {
            "type": "user",
            "session_id": "s-1",
            "message": {"content": [{"type": "tool_result", "content": "ok"}]},
        },
        {
            "type": "assistant",
            "session_id": "s-1",
            "message": {"content": [{"type": "text", "text": " world"}]},
        },
        {
            "type": "result",
            "subtype": "success",
            "is_error": False,
            "result": "Hello world",
            "session_id": "s-1",
            "total_cost_usd": 0.01,
            "usage": {"input_tokens": 10, "cache_read_input_tokens": 5, "output_tokens": 3},
        },
    ]
    for event in events:
        chunks += parser.feed(line(event))
    result = parser.result(REQUEST)
    assert chunks == ["Hello", " world"]
    assert (result.text, result.session_id, result.model) == ("Hello world", "s-1", "claude-x")
    assert (result.prompt_tokens, result.completion_tokens) == (15, 3)
    assert result.extra == {"cost_usd": "0.01"}


def test_parser_prefers_partial_deltas_and_skips_noise() -> None:
    """With partial messages, chunks come from the deltas only; blank and non-JSON lines are ignored."""
    parser = StreamParser()
    chunks: list[str] = []
    for raw in (
        "\n",
        "not json\n",
        line(
            {
                "type": "stream_event",
                "session_id": "s",
                "event": {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "Hel"}},
            }
        ),
        line(
            {
                "type": "stream_event",
                "session_id": "s",
                "event": {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "lo"}},
            }
        ),
        line(
            {
                "type": "assistant",
                "session_id": "s",
                "message": {"content": [{"type": "text", "text": "Hello"}]},
            }
        ),
        line({"type": "result", "subtype": "success", "result": "Hello", "session_id": "s"}),
    ):
        chunks += parser.feed(raw)
    assert chunks == ["Hel", "lo"]
    assert parser.result(REQUEST).text == "Hello"


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("Invalid API key · Please run /login", "auth"),
        ("Claude AI usage limit reached", "rate_limit"),
        ("Prompt is too long", "context_too_long"),
        ("something odd", "other"),
    ],
)
def test_error_result_is_typed(text: str, kind: str) -> None:
    """A result line with is_error raises a BackendError of the kind its text says."""
    parser = StreamParser()
    parser.feed(
        line({"type": "result", "subtype": "success", "is_error": True, "result": text, "session_id": "s"})
    )
    with pytest.raises(BackendError) as info:
        parser.result(REQUEST)
    assert info.value.kind == kind


def test_missing_result_line_is_an_error() -> None:
    """A stream that ends without a result line is reported, not taken for an empty answer."""
    with pytest.raises(BackendError, match="without a result"):
        StreamParser().result(REQUEST)


def test_prompt_when_resuming_holds_only_what_is_new() -> None:
    """A fresh session gets every message; a resumed one only those after the agent's last reply."""
    messages = [
        ChatMessage("user", "first"),
        ChatMessage("assistant", "my answer"),
        ChatMessage("system", "[Bob]: hi"),
        ChatMessage("user", "second"),
    ]
    assert build_prompt(messages, resuming=False) == "first\n\n[You]: my answer\n\n[Bob]: hi\n\nsecond"
    assert build_prompt(messages, resuming=True) == "[Bob]: hi\n\nsecond"
    assert build_prompt(messages[:2], resuming=True) == "[You]: my answer"


def test_command_line_resumes_and_passes_persona_and_model() -> None:
    """The command line asks for stream-json, resumes the session, and passes model and persona."""
    backend = ClaudeCodeBackend(command=["claude"], model="sonnet")
    request = CompletionRequest(
        agent_slug="a", agent_name="A", system_prompt="Be brief.", messages=[], session_id="s-9"
    )
    assert backend.arguments(request) == [
        "claude",
        "-p",
        "--output-format",
        "stream-json",
        "--verbose",
        "--resume=s-9",
        "--model",
        "sonnet",
        "--append-system-prompt",
        "Be brief.",
    ]


@pytest.mark.parametrize(
    "session",
    ["--dangerously-skip-permissions", "-p", "a b", "x" * 65, "sess;rm -rf /", "sess\n--model=opus", ""],
)
def test_a_malformed_session_id_never_reaches_the_command_line(session: str) -> None:
    """A session id that is not well formed is not passed at all: no argument holds it, and the call
    starts a new session."""
    backend = ClaudeCodeBackend(command=["claude"])
    request = CompletionRequest(agent_slug="a", agent_name="A", system_prompt="", messages=[], session_id=session)

    args = backend.arguments(request)

    assert not any(arg.startswith("--resume") for arg in args)
    assert args == ["claude", "-p", "--output-format", "stream-json", "--verbose"]


def test_a_session_id_is_one_argument_joined_to_its_option() -> None:
    """A well-formed session id travels as ``--resume=<id>``, one argument, so it can never stand as an option."""
    backend = ClaudeCodeBackend(command=["claude"])
    request = CompletionRequest(
        agent_slug="a", agent_name="A", system_prompt="", messages=[], session_id="0b0c7a3e-9f1d-4c1e-8a55-1d2f3e4a5b6c"
    )

    args = backend.arguments(request)

    assert "--resume=0b0c7a3e-9f1d-4c1e-8a55-1d2f3e4a5b6c" in args
    assert "--resume" not in args
