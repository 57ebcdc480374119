"""The openai and anthropic backends against a provider that misbehaves (a real local HTTP server): a body
that keeps trickling, an answer that is no completion, a huge answer or error, a key echoed back, a 429
whose waits outlast the timeout. Each ends as a typed BackendError or a bounded answer, never as an
internal error or a run held for ever."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from tenex_daemon.adapters.llm.anthropic import AnthropicBackend
from tenex_daemon.adapters.llm.openai import OpenAIBackend
from tenex_daemon.core.context import ChatMessage
from tenex_daemon.core.llm import BackendError, CompletionRequest
from tests.llm_servers import free_port

pytestmark = [pytest.mark.integration]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
CONTENT_LIMIT = 256 * 1024
"""The most content (bytes) a daemon accepts in an event: an answer is kept under it."""
ERROR_LIMIT = 1500
"""About the most characters a backend's error text may hold (1 KiB of the provider's words, and a frame)."""
KEY = "tq7Zb1Xv9Lm3Np5Qr8St"
"""A key of no known shape (no ``sk-`` prefix): only the backend knowing its own key can leave it out."""


@dataclass
class Provider:
    """A local HTTP server whose every POST is answered by ``handle``."""

    base_url: str
    handle: Handler | None = None
    hits: list[str] = field(default_factory=list)


@pytest.fixture
async def provider() -> AsyncIterator[Provider]:
    """A misbehaving provider on 127.0.0.1; each test sets its ``handle``."""
    server = Provider(base_url="")

    async def dispatch(request: web.Request) -> web.StreamResponse:
        await request.read()
        server.hits.append(request.path)
        assert server.handle is not None
        return await server.handle(request)

    app = web.Application()
    app.router.add_post("/{tail:.*}", dispatch)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    server.base_url = f"http://127.0.0.1:{port}"
    yield server
    await runner.cleanup()


def openai_backend(provider: Provider, timeout: float = 10.0, max_retries: int = 0) -> OpenAIBackend:
    """An openai backend on the provider, with :data:`KEY`."""
    return OpenAIBackend(
        model="m", base_url=provider.base_url + "/v1", api_key=KEY, timeout=timeout, max_retries=max_retries
    )


def anthropic_backend(provider: Provider, timeout: float = 10.0, max_retries: int = 0) -> AnthropicBackend:
    """An anthropic backend on the provider, with :data:`KEY`."""
    return AnthropicBackend(
        model="c", base_url=provider.base_url, api_key=KEY, timeout=timeout, max_retries=max_retries
    )


def backend_for(sdk: str, provider: Provider, **options: Any) -> OpenAIBackend | AnthropicBackend:
    """The ``sdk`` backend on the provider."""
    return openai_backend(provider, **options) if sdk == "openai" else anthropic_backend(provider, **options)


def request(chunks: list[str] | None = None) -> CompletionRequest:
    """A one-message request, streamed into ``chunks`` when given."""

    async def on_chunk(text: str) -> None:
        assert chunks is not None
        chunks.append(text)

    return CompletionRequest(
        agent_slug="a",
        agent_name="A",
        system_prompt="",
        messages=[ChatMessage("user", "hi")],
        on_chunk=on_chunk if chunks is not None else None,
    )


def openai_whole(text: str = "hello", usage: Any = None) -> dict[str, Any]:
    """An OpenAI chat completion saying ``text``."""
    return {
        "id": "x", "object": "chat.completion", "created": 1, "model": "served",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
        "usage": usage or {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


def anthropic_whole(text: str = "hello", usage: Any = None) -> dict[str, Any]:
    """An Anthropic message saying ``text``."""
    return {
        "id": "msg", "type": "message", "role": "assistant", "model": "served",
        "content": [{"type": "text", "text": text}], "stop_reason": "end_turn", "stop_sequence": None,
        "usage": usage or {"input_tokens": 3, "output_tokens": 2},
    }


def whole(sdk: str, text: str = "hello", usage: Any = None) -> dict[str, Any]:
    """The ``sdk``'s whole answer saying ``text``."""
    return openai_whole(text, usage) if sdk == "openai" else anthropic_whole(text, usage)


def openai_chunk(text: str | None, finish: str | None = None) -> dict[str, Any]:
    """One chat.completion.chunk."""
    delta = {} if text is None else {"content": text}
    return {
        "id": "x", "object": "chat.completion.chunk", "created": 1, "model": "served",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def anthropic_events(*texts: str) -> list[tuple[str, dict[str, Any]]]:
    """A whole Anthropic stream saying ``texts`` in turn."""
    started = {**anthropic_whole(), "content": [], "stop_reason": None}
    deltas = [
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": text}})
        for text in texts
    ]
    return [
        ("message_start", {"type": "message_start", "message": started}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
        *deltas,
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                           "usage": {"output_tokens": 3}}),
        ("message_stop", {"type": "message_stop"}),
    ]


def json_answer(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Handler:
    """Answer with ``body`` as JSON."""

    async def handle(request: web.Request) -> web.StreamResponse:
        return web.json_response(body, status=status, headers=headers)

    return handle


def raw_answer(body: bytes, content_type: str = "application/json") -> Handler:
    """Answer HTTP 200 with ``body`` as it is."""

    async def handle(request: web.Request) -> web.StreamResponse:
        return web.Response(body=body, content_type=content_type)

    return handle


def sse(*events: tuple[str | None, Any]) -> Handler:
    """Answer with a server-sent event stream of (event name, data) pairs; data as JSON unless bytes."""

    async def handle(request: web.Request) -> web.StreamResponse:
        stream = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await stream.prepare(request)
        for name, data in events:
            payload = data if isinstance(data, bytes) else json.dumps(data).encode()
            await stream.write((f"event: {name}\n" if name else "").encode() + b"data: " + payload + b"\n\n")
        await stream.write_eof()
        return stream

    return handle


def trickle(answer: dict[str, Any], gap_s: float, count: int) -> Handler:
    """Answer HTTP 200 with one space each ``gap_s`` (each read well within the timeout), then ``answer``."""

    async def handle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "application/json"})
        await response.prepare(request)
        for _ in range(count):
            await response.write(b" ")
            await asyncio.sleep(gap_s)
        await response.write(json.dumps(answer).encode())
        return response

    return handle


def echo_credentials(request: web.Request) -> str:
    """What the request carried as its key (OpenAI's Authorization header, Anthropic's x-api-key)."""
    return request.headers.get("Authorization", "") or request.headers.get("x-api-key", "")


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
async def test_an_answer_that_does_not_stream_but_keeps_trickling_is_a_timeout(provider: Provider, sdk: str) -> None:
    """A non-streamed answer whose body comes a byte every 0.1 s (each read within the 0.5 s timeout) is a
    TIMEOUT error once the timeout of every try is spent (here 2 tries: 1 s), not held for its 30 s."""
    provider.handle = trickle(whole(sdk), gap_s=0.1, count=300)
    started = time.monotonic()

    with pytest.raises(BackendError) as caught:
        await backend_for(sdk, provider, timeout=0.5, max_retries=1).complete(request())

    assert caught.value.kind == "timeout"
    assert "no whole answer within 1 s" in str(caught.value)
    assert time.monotonic() - started < 20  # not the 30 s the answer would take (room for a loaded machine)


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
async def test_a_backends_own_key_echoed_by_the_server_is_left_out_of_its_error(
    provider: Provider, sdk: str
) -> None:
    """A 401 whose message echoes the key the backend sent (a key of no known shape) gives an error whose
    text holds no piece of it: the backend replaces its own key, whatever its shape."""

    async def handle(request: web.Request) -> web.StreamResponse:
        said = f"invalid credentials: {echo_credentials(request)}"
        return web.json_response({"type": "error", "error": {"type": "auth", "message": said}}, status=401)

    provider.handle = handle

    with pytest.raises(BackendError) as caught:
        await backend_for(sdk, provider).complete(request())

    assert caught.value.kind == "auth"
    assert KEY not in str(caught.value)
    assert KEY[:8] not in str(caught.value)
    assert "invalid credentials:" in str(caught.value)
    assert "<redacted>" in str(caught.value)


OPENAI_MALFORMED: list[tuple[str, Handler, str, str]] = [
    (
        "error_200",
        json_answer({"error": {"message": "Upstream provider returned 502: model overloaded", "code": 502}}),
        "unreachable",
        "the provider said: Upstream provider returned 502: model overloaded",
    ),
    ("choices_empty", json_answer({**openai_whole(), "choices": []}), "other", "its choices are empty"),
    ("choices_null", json_answer({**openai_whole(), "choices": None}), "other", "it has no choices"),
    ("html", raw_answer(b"<html>gateway</html>", "text/html"), "other", "<html>gateway</html>"),
    ("invalid_json", raw_answer(b"{not json"), "other", "JSONDecodeError"),
    ("non_utf8", raw_answer(json.dumps(openai_whole("@@")).encode().replace(b"@@", b"\xff\xfe")), "other",
     "UnicodeDecodeError"),
]


@pytest.mark.parametrize(("case", "handle", "kind", "said"), OPENAI_MALFORMED, ids=[c[0] for c in OPENAI_MALFORMED])
async def test_an_openai_answer_that_is_no_completion_is_a_typed_error(
    provider: Provider, case: str, handle: Handler, kind: str, said: str
) -> None:
    """An HTTP 200 that holds no completion (the provider's error, no choices, an HTML page, broken JSON, a
    body not UTF-8) is a BackendError saying the answer was malformed (with the provider's own message when
    it sends one), not an internal error."""
    provider.handle = handle

    with pytest.raises(BackendError) as caught:
        await openai_backend(provider).complete(request())

    assert caught.value.kind == kind
    assert "openai: malformed answer" in str(caught.value)
    assert said in str(caught.value)


@pytest.mark.parametrize(
    ("case", "data"),
    [("invalid_json", b"{not json"), ("non_utf8", b'{"choices":[{"index":0,"delta":{"content":"\xff"}}]}')],
)
async def test_a_streamed_openai_chunk_that_cannot_be_read_is_a_typed_error(
    provider: Provider, case: str, data: bytes
) -> None:
    """A streamed chunk that is not JSON or not UTF-8 is a BackendError saying the answer was malformed."""
    provider.handle = sse((None, openai_chunk("partial ")), (None, data), (None, openai_chunk("more", "stop")))

    with pytest.raises(BackendError) as caught:
        await openai_backend(provider).complete(request([]))

    assert caught.value.kind == "other"
    assert "openai: malformed answer" in str(caught.value)


@pytest.mark.parametrize(
    ("handle", "kind", "said"),
    [
        (raw_answer(b"<html>gateway</html>", "text/html"), "other", "it is no JSON object: '<html>gateway</html>'"),
        (json_answer({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}), "other",
         "the provider said: Overloaded"),
    ],
)
async def test_an_anthropic_answer_that_is_no_message_is_a_typed_error(
    provider: Provider, handle: Handler, kind: str, said: str
) -> None:
    """An HTTP 200 holding no message (an HTML page, an error body) is a BackendError saying so."""
    provider.handle = handle

    with pytest.raises(BackendError) as caught:
        await anthropic_backend(provider).complete(request())

    assert caught.value.kind == kind
    assert "anthropic: malformed answer" in str(caught.value)
    assert said in str(caught.value)


async def test_a_usage_chunk_with_null_choices_keeps_the_answer_streamed_before_it(provider: Provider) -> None:
    """A streamed answer followed by a usage chunk whose choices are null is the answer, with that usage
    (it was thrown away as an internal error)."""
    usage_chunk = {**openai_chunk(None), "choices": None, "usage": {"prompt_tokens": 3, "completion_tokens": 4}}
    provider.handle = sse((None, openai_chunk("a whole answer", "stop")), (None, usage_chunk), (None, b"[DONE]"))
    chunks: list[str] = []

    result = await openai_backend(provider).complete(request(chunks))

    assert (result.text, result.finish_reason) == ("a whole answer", "stop")
    assert (result.prompt_tokens, result.completion_tokens) == (3, 4)
    assert chunks == ["a whole answer"]


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
async def test_a_usage_count_that_is_no_number_keeps_the_answer(provider: Provider, sdk: str) -> None:
    """An answer whose usage counts are words is the answer, with the unreadable count left out (None)."""
    usage = (
        {"prompt_tokens": "n/a", "completion_tokens": 2} if sdk == "openai"
        else {"input_tokens": "n/a", "output_tokens": 2}
    )
    provider.handle = json_answer(whole(sdk, "fine", usage))

    result = await backend_for(sdk, provider).complete(request())

    assert result.text == "fine"
    assert (result.prompt_tokens, result.completion_tokens) == (None, 2)


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
async def test_an_answer_over_the_size_limit_is_cut_there_and_said_to_be_cut(
    provider: Provider, sdk: str, streamed: bool
) -> None:
    """An answer of 640 KiB is cut under the 256 KiB a daemon accepts in an event and ends as cut at the length
    limit (the reply then says it is not whole); streamed, no more than that is passed on."""
    piece = "é" * 32 * 1024  # 64 KiB a piece, two bytes a character: a cut falls inside no character
    if not streamed:
        provider.handle = json_answer(whole(sdk, piece * 10))
    elif sdk == "openai":
        provider.handle = sse(*[(None, openai_chunk(piece)) for _ in range(10)], (None, openai_chunk("", "stop")))
    else:
        provider.handle = sse(*anthropic_events(*[piece] * 10))
    chunks: list[str] | None = [] if streamed else None

    result = await backend_for(sdk, provider).complete(request(chunks))

    assert result.finish_reason in ("length", "max_tokens")
    assert CONTENT_LIMIT - 2048 <= len(result.text.encode()) <= CONTENT_LIMIT - 1024
    assert set(result.text) == {"é"}
    if chunks is not None:
        assert "".join(chunks) == result.text


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
async def test_a_huge_error_message_is_trimmed(provider: Provider, sdk: str) -> None:
    """A provider's 200 KB error message gives an error text of about 1 KB that says what was left out."""
    provider.handle = json_answer({"type": "error", "error": {"type": "x", "message": "boom " + "y" * 200_000}}, 400)

    with pytest.raises(BackendError) as caught:
        await backend_for(sdk, provider).complete(request())

    text = str(caught.value)
    assert caught.value.kind == "bad_request"
    assert text.startswith(f"{sdk}: HTTP 400: boom yyy")
    assert len(text) <= ERROR_LIMIT
    assert text.endswith("more characters left out]")


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
async def test_a_streamed_429_whose_waits_outlast_the_timeout_is_a_rate_limit(provider: Provider, sdk: str) -> None:
    """A stream refused with 429 and Retry-After: 1 until the 1.5 s timeout is spent (the SDK waiting to try
    again) is reported as the rate limit it is, with its status and wait, not as a timeout."""
    provider.handle = json_answer(
        {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}, 429, {"Retry-After": "1"}
    )

    with pytest.raises(BackendError) as caught:
        await backend_for(sdk, provider, timeout=1.5, max_retries=5).complete(request([]))

    assert caught.value.kind == "rate_limit"
    assert (caught.value.status, caught.value.retry_after) == (429, 1.0)
    assert f"{sdk}: HTTP 429: slow down" in str(caught.value)
    assert len(provider.hits) >= 2


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
async def test_a_429_tried_again_with_success_then_too_slow_an_answer_is_a_timeout(
    provider: Provider, sdk: str
) -> None:
    """A 429 the SDK tries again after, answered then but too slowly (a body trickling past the deadline),
    is a timeout: the refusal was over once the try again got through."""
    refused = json_answer({"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}, 429,
                          {"Retry-After": "0"})
    slow = trickle(whole(sdk), gap_s=0.1, count=100)

    async def handle(request: web.Request) -> web.StreamResponse:
        return await (refused if len(provider.hits) == 1 else slow)(request)

    provider.handle = handle

    with pytest.raises(BackendError) as caught:
        await backend_for(sdk, provider, timeout=0.5, max_retries=1).complete(request())

    assert len(provider.hits) == 2
    assert caught.value.kind == "timeout"
