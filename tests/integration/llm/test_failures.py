"""Backend failures through the real SDKs against a scripted HTTP server: each maps to its typed error."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import pytest

from tenex_daemon.adapters.llm.anthropic import AnthropicBackend
from tenex_daemon.adapters.llm.openai import OpenAIBackend
from tenex_daemon.core.context import ChatMessage
from tenex_daemon.core.llm import (
    BackendAuthError,
    BackendError,
    BackendRateLimitError,
    BackendTimeoutError,
    BackendUnreachableError,
    CompletionRequest,
    ContextTooLongError,
    LLMBackend,
    ToolSpec,
)

from .conftest import Reply, ScriptedServer, free_port

pytestmark = [pytest.mark.integration]

REQUEST = CompletionRequest(
    agent_slug="alice",
    agent_name="Alice",
    system_prompt="You are Alice.",
    messages=[ChatMessage("user", "hi")],
)
OPENAI_PATH = "/v1/chat/completions"
ANTHROPIC_PATH = "/v1/messages"


def openai_backend(base_url: str, timeout: float = 10.0) -> OpenAIBackend:
    """An openai backend without retries, so each failure surfaces at once."""
    return OpenAIBackend(
        model="m", base_url=base_url + "/v1", api_key="sk-test", timeout=timeout, max_retries=0
    )


def anthropic_backend(base_url: str, timeout: float = 10.0) -> AnthropicBackend:
    """An anthropic backend without retries, so each failure surfaces at once."""
    return AnthropicBackend(
        model="claude-test", base_url=base_url, api_key="sk-ant-test", timeout=timeout, max_retries=0
    )


def openai_error(message: str, code: str | None = None) -> dict[str, object]:
    """An OpenAI-style error body."""
    return {"error": {"message": message, "type": "invalid_request_error", "code": code}}


def anthropic_error(kind: str, message: str) -> dict[str, object]:
    """An Anthropic-style error body."""
    return {"type": "error", "error": {"type": kind, "message": message}}


CASES = [
    (
        "auth",
        401,
        openai_error("Incorrect API key provided"),
        anthropic_error("authentication_error", "invalid x-api-key"),
        BackendAuthError,
    ),
    (
        "rate_limit",
        429,
        openai_error("Rate limit reached"),
        anthropic_error("rate_limit_error", "slow down"),
        BackendRateLimitError,
    ),
    (
        "context_too_long",
        400,
        openai_error(
            "This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens.",
            "context_length_exceeded",
        ),
        anthropic_error("invalid_request_error", "prompt is too long: 210000 tokens > 200000 maximum"),
        ContextTooLongError,
    ),
]


@pytest.mark.parametrize(("kind", "status", "openai_body", "anthropic_body", "cls"), CASES)
@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
async def test_http_errors_map_to_kinds(
    scripted_server: ScriptedServer,
    sdk: str,
    kind: str,
    status: int,
    openai_body: object,
    anthropic_body: object,
    cls: type[BackendError],
) -> None:
    """401, 429 and a 400 about context length become auth, rate_limit and context_too_long errors."""
    backend: LLMBackend
    if sdk == "openai":
        scripted_server.replies[OPENAI_PATH] = Reply(status, openai_body, headers={"retry-after": "7"})
        backend = openai_backend(scripted_server.base_url)
    else:
        scripted_server.replies[ANTHROPIC_PATH] = Reply(status, anthropic_body, headers={"retry-after": "7"})
        backend = anthropic_backend(scripted_server.base_url)
    with pytest.raises(cls) as info:
        await backend.complete(REQUEST)
    assert info.value.kind == kind
    assert info.value.status == status
    assert info.value.retry_after == 7.0


LLAMA_SERVER_TOO_LONG = [
    "the request exceeds the available context size, try increasing it",
    "request (5000 tokens) exceeds the available context size (2048 tokens), try increasing it",
    "request refused",
]
"""llama.cpp's server's texts for a prompt over its context (older builds, newer builds), and a wording of no
build, which its error type alone tells."""


@pytest.mark.parametrize("message", LLAMA_SERVER_TOO_LONG)
@pytest.mark.parametrize("streamed", [False, True])
async def test_llama_servers_context_overflow_is_context_too_long(
    scripted_server: ScriptedServer, message: str, *, streamed: bool
) -> None:
    """llama.cpp's server refuses a prompt over its context with HTTP 400, a numeric code and its own type
    (``exceed_context_size_error``): a context-too-long error, so the history is shortened and tried again,
    not a bad request the conversation then repeats at every message."""
    body = {"error": {"code": 400, "message": message, "type": "exceed_context_size_error"}}
    scripted_server.replies[OPENAI_PATH] = Reply(400, body)

    async def on_chunk(text: str) -> None:
        pass

    request = replace(REQUEST, on_chunk=on_chunk) if streamed else REQUEST
    with pytest.raises(ContextTooLongError):
        await openai_backend(scripted_server.base_url).complete(request)


async def test_a_context_error_sent_inside_a_stream_is_context_too_long(scripted_server: ScriptedServer) -> None:
    """A stream that answers 200 and then sends an error event about the context length (a proxy's, or a
    server's once the prompt is read) is a context-too-long error too, not an unknown one."""
    error = {"error": {"message": "This model's maximum context length is 8192 tokens", "type": "invalid_request"}}
    scripted_server.replies[OPENAI_PATH] = Reply(events=[(None, error)])

    async def on_chunk(text: str) -> None:
        pass

    with pytest.raises(ContextTooLongError):
        await openai_backend(scripted_server.base_url).complete(replace(REQUEST, on_chunk=on_chunk))


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
async def test_closed_port_is_unreachable(sdk: str) -> None:
    """A server that is not listening gives an unreachable error."""
    base_url = f"http://127.0.0.1:{free_port()}"
    backend: LLMBackend = openai_backend(base_url) if sdk == "openai" else anthropic_backend(base_url)
    with pytest.raises(BackendUnreachableError) as info:
        await backend.complete(REQUEST)
    assert info.value.kind == "unreachable"


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
async def test_silent_server_is_a_timeout(scripted_server: ScriptedServer, sdk: str) -> None:
    """A server that accepts the request and never answers gives a timeout error within the configured time."""
    path = OPENAI_PATH if sdk == "openai" else ANTHROPIC_PATH
    scripted_server.replies[path] = Reply(hang=True)
    backend: LLMBackend = (
        openai_backend(scripted_server.base_url, timeout=0.5)
        if sdk == "openai"
        else anthropic_backend(scripted_server.base_url, timeout=0.5)
    )
    started = time.monotonic()
    with pytest.raises(BackendTimeoutError) as info:
        await backend.complete(REQUEST)
    assert info.value.kind == "timeout"
    assert time.monotonic() - started < 5


async def test_openai_answer_with_tool_call_is_parsed(scripted_server: ScriptedServer) -> None:
    """An OpenAI answer's text, tool calls (arguments parsed), usage and model reach the result; the request carries tools and the forced choice."""
    scripted_server.replies[OPENAI_PATH] = Reply(
        200,
        {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": "m-served",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "tool_calls",
                    "message": {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "call_9",
                                "type": "function",
                                "function": {"name": "lookup", "arguments": '{"q": "paris"}'},
                            }
                        ],
                    },
                }
            ],
            "usage": {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17},
        },
    )
    tool = ToolSpec(
        "lookup", "Look something up.", {"type": "object", "properties": {"q": {"type": "string"}}}
    )
    request = CompletionRequest(
        agent_slug="a",
        agent_name="A",
        system_prompt="",
        messages=[ChatMessage("user", "hi")],
        tools=(tool,),
        tool_choice="lookup",
        temperature=0.0,
        max_tokens=8,
    )
    result = await openai_backend(scripted_server.base_url).complete(request)
    assert (result.text, result.model, result.finish_reason) == ("", "m-served", "tool_calls")
    assert [(c.id, c.name, dict(c.arguments)) for c in result.tool_calls] == [
        ("call_9", "lookup", {"q": "paris"})
    ]
    assert (result.prompt_tokens, result.completion_tokens) == (12, 5)
    sent = scripted_server.requests[-1][1]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "lookup"}}
    assert sent["tools"][0]["function"]["name"] == "lookup"
    assert (sent["temperature"], sent["max_tokens"]) == (0.0, 8)


async def test_anthropic_answer_is_parsed(scripted_server: ScriptedServer) -> None:
    """An Anthropic answer's text, tool_use blocks, usage and stop reason reach the result; the persona goes in system."""
    scripted_server.replies[ANTHROPIC_PATH] = Reply(
        200,
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "claude-test",
            "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": "paris"}},
            ],
            "stop_reason": "tool_use",
            "stop_sequence": None,
            "usage": {"input_tokens": 20, "output_tokens": 9},
        },
    )
    tool = ToolSpec(
        "lookup", "Look something up.", {"type": "object", "properties": {"q": {"type": "string"}}}
    )
    request = CompletionRequest(
        agent_slug="a",
        agent_name="A",
        system_prompt="Be brief.",
        messages=[ChatMessage("user", "hi")],
        tools=(tool,),
        tool_choice="lookup",
    )
    result = await anthropic_backend(scripted_server.base_url).complete(request)
    assert (result.text, result.finish_reason) == ("Let me look.", "tool_use")
    assert [(c.id, c.name, dict(c.arguments)) for c in result.tool_calls] == [
        ("toolu_1", "lookup", {"q": "paris"})
    ]
    assert (result.prompt_tokens, result.completion_tokens) == (20, 9)
    sent = scripted_server.requests[-1][1]
    assert sent["system"] == "Be brief."
    assert sent["tool_choice"] == {"type": "tool", "name": "lookup"}
    assert sent["tools"][0]["input_schema"]["properties"] == {"q": {"type": "string"}}


def openai_chunk(delta: dict[str, object], finish: str | None = None) -> dict[str, object]:
    """One chat.completion.chunk with a single choice."""
    return {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "m-served",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


async def test_openai_stream_assembles_text_tool_call_and_usage(scripted_server: ScriptedServer) -> None:
    """A streamed OpenAI answer gives each text delta to on_chunk, joins split tool-call arguments, and keeps the usage chunk."""
    scripted_server.replies[OPENAI_PATH] = Reply(
        events=[
            (None, openai_chunk({"role": "assistant", "content": "Look"})),
            (None, openai_chunk({"content": "ing up"})),
            (
                None,
                openai_chunk(
                    {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "lookup", "arguments": '{"q": '},
                            }
                        ]
                    }
                ),
            ),
            (
                None,
                openai_chunk(
                    {"tool_calls": [{"index": 0, "function": {"arguments": '"paris"}'}}]}, "tool_calls"
                ),
            ),
            (
                None,
                {
                    "id": "c",
                    "object": "chat.completion.chunk",
                    "created": 0,
                    "model": "m-served",
                    "choices": [],
                    "usage": {"prompt_tokens": 11, "completion_tokens": 6, "total_tokens": 17},
                },
            ),
            (None, "[DONE]"),
        ]
    )
    chunks: list[str] = []

    async def on_chunk(text: str) -> None:
        chunks.append(text)

    request = CompletionRequest(
        agent_slug="a",
        agent_name="A",
        system_prompt="",
        messages=[ChatMessage("user", "hi")],
        on_chunk=on_chunk,
    )
    result = await openai_backend(scripted_server.base_url).complete(request)
    assert chunks == ["Look", "ing up"]
    assert result.text == "Looking up"
    assert [(c.id, c.name, dict(c.arguments)) for c in result.tool_calls] == [
        ("call_1", "lookup", {"q": "paris"})
    ]
    assert (result.prompt_tokens, result.completion_tokens, result.finish_reason) == (11, 6, "tool_calls")
    assert "usage" not in result.extra
    sent = scripted_server.requests[-1][1]
    assert (sent["stream"], sent["stream_options"]) == (True, {"include_usage": True})


async def test_anthropic_stream_gives_chunks_and_usage(scripted_server: ScriptedServer) -> None:
    """A streamed Anthropic answer gives each text delta to on_chunk and the final message's usage."""
    message: dict[str, object] = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude-test",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 14, "output_tokens": 1},
    }
    scripted_server.replies[ANTHROPIC_PATH] = Reply(
        events=[
            ("message_start", {"type": "message_start", "message": message}),
            (
                "content_block_start",
                {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
            ),
            (
                "content_block_delta",
                {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Bon"}},
            ),
            (
                "content_block_delta",
                {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "jour"}},
            ),
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                    "usage": {"output_tokens": 3},
                },
            ),
            ("message_stop", {"type": "message_stop"}),
        ]
    )
    chunks: list[str] = []

    async def on_chunk(text: str) -> None:
        chunks.append(text)

    request = CompletionRequest(
        agent_slug="a",
        agent_name="A",
        system_prompt="",
        messages=[ChatMessage("user", "hi")],
        on_chunk=on_chunk,
    )
    result = await anthropic_backend(scripted_server.base_url).complete(request)
    assert chunks == ["Bon", "jour"]
    assert (result.text, result.finish_reason) == ("Bonjour", "end_turn")
    assert (result.prompt_tokens, result.completion_tokens) == (14, 3)


def streamed(on_chunk: Any) -> CompletionRequest:
    """REQUEST, streamed into ``on_chunk``."""
    return CompletionRequest(
        agent_slug="a", agent_name="A", system_prompt="", messages=[ChatMessage("user", "hi")], on_chunk=on_chunk
    )


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
async def test_a_stream_that_keeps_trickling_is_a_timeout_once_the_timeout_is_spent(
    scripted_server: ScriptedServer, sdk: str
) -> None:
    """A streamed answer whose chunks keep coming, each sooner than the read timeout, is a TIMEOUT error once
    the backend's timeout is spent for the whole answer: a model stuck repeating itself does not hold its run
    (and publish partial texts) for ever."""
    chunks: list[str] = []

    async def on_chunk(text: str) -> None:
        chunks.append(text)

    if sdk == "openai":
        events: list[tuple[str | None, Any]] = [(None, openai_chunk({"content": "la "})) for _ in range(100)]
        scripted_server.replies[OPENAI_PATH] = Reply(events=events, event_gap_s=0.1)
        backend: OpenAIBackend | AnthropicBackend = openai_backend(scripted_server.base_url, timeout=1.0)
    else:
        delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "la "}}
        events = [
            ("message_start", {"type": "message_start", "message": ANTHROPIC_STARTED}),
            ("content_block_start", {"type": "content_block_start", "index": 0,
                                     "content_block": {"type": "text", "text": ""}}),
            *(("content_block_delta", delta) for _ in range(100)),
        ]
        scripted_server.replies[ANTHROPIC_PATH] = Reply(events=events, event_gap_s=0.1)
        backend = anthropic_backend(scripted_server.base_url, timeout=1.0)
    started = time.monotonic()

    with pytest.raises(BackendError) as caught:
        await backend.complete(streamed(on_chunk))

    assert caught.value.kind == "timeout"
    assert "no whole answer within 1 s" in str(caught.value)
    assert time.monotonic() - started < 8  # not the 10 s the stream would take
    assert chunks


async def test_an_anthropic_stream_broken_off_is_unreachable(scripted_server: ScriptedServer) -> None:
    """An Anthropic stream whose connection drops mid-answer is an UNREACHABLE backend error naming the break
    (it surfaced as the HTTP library's own exception, an internal error)."""
    delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hel"}}
    scripted_server.replies[ANTHROPIC_PATH] = Reply(
        events=[
            ("message_start", {"type": "message_start", "message": ANTHROPIC_STARTED}),
            ("content_block_start", {"type": "content_block_start", "index": 0,
                                     "content_block": {"type": "text", "text": ""}}),
            ("content_block_delta", delta),
        ],
        cut=True,
    )

    async def on_chunk(text: str) -> None:
        return None

    with pytest.raises(BackendError) as caught:
        await anthropic_backend(scripted_server.base_url).complete(streamed(on_chunk))

    assert caught.value.kind == "unreachable"
    assert "stream broke off" in str(caught.value)


async def test_an_openai_refusal_is_the_answer(scripted_server: ScriptedServer) -> None:
    """An OpenAI answer with no content and a refusal gives the refusal as its text (it was an empty answer)."""
    scripted_server.replies[OPENAI_PATH] = Reply(body={
        "id": "c", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": None, "refusal": "I can't help with that."}}],
        "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14},
    })

    result = await openai_backend(scripted_server.base_url).complete(REQUEST)

    assert result.text == "I can't help with that."


ANTHROPIC_STARTED: dict[str, object] = {
    "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test", "content": [],
    "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 14, "output_tokens": 1},
}


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
async def test_a_stream_closed_before_the_models_finish_is_unreachable_not_an_answer(
    scripted_server: ScriptedServer, sdk: str
) -> None:
    """A streamed answer whose server closes the stream cleanly before the model's finish marker (no
    finish_reason, no message_stop) is an UNREACHABLE error: the text so far may be cut anywhere, so it is
    never published as a whole reply."""
    chunks: list[str] = []

    async def on_chunk(text: str) -> None:
        chunks.append(text)

    if sdk == "openai":
        events: list[tuple[str | None, Any]] = [
            (None, openai_chunk({"role": "assistant", "content": "The answer is"})),
            (None, "[DONE]"),
        ]
        scripted_server.replies[OPENAI_PATH] = Reply(events=events)
        backend: OpenAIBackend | AnthropicBackend = openai_backend(scripted_server.base_url)
    else:
        delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "The answer is"}}
        events = [
            ("message_start", {"type": "message_start", "message": ANTHROPIC_STARTED}),
            ("content_block_start", {"type": "content_block_start", "index": 0,
                                     "content_block": {"type": "text", "text": ""}}),
            ("content_block_delta", delta),
        ]
        scripted_server.replies[ANTHROPIC_PATH] = Reply(events=events)
        backend = anthropic_backend(scripted_server.base_url)

    with pytest.raises(BackendError) as caught:
        await backend.complete(streamed(on_chunk))

    assert caught.value.kind == "unreachable"
    assert "ended before the model finished it" in str(caught.value)
    assert chunks == ["The answer is"]
