"""The ``anthropic`` backend: Claude models through the official ``anthropic`` SDK (Messages API).

The Messages API has no ``system`` role inside the conversation and wants user and assistant turns to
alternate: the persona goes in ``system``, other agents' system messages become user text, and
neighbouring turns of the same role are merged. Tool results travel in a user turn, right after the
assistant turn that called the tools.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from tenex_daemon.adapters.llm.answers import AnswerSize, capped, token_count
from tenex_daemon.adapters.llm.errors import (
    MissingExtraError,
    malformed_answer,
    note_refusal,
    sdk_answer,
    unfinished_stream,
)
from tenex_daemon.adapters.llm.keys import resolve_api_key
from tenex_daemon.core.llm import (
    AssistantToolCalls,
    BackendAuthError,
    CompletionRequest,
    CompletionResult,
    ToolCall,
    ToolResult,
)

try:
    import anthropic
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingExtraError("anthropic", "anthropic", "anthropic") from exc

DEFAULT_MODEL = "claude-sonnet-4-5"
DEFAULT_MAX_TOKENS = 4096
DEFAULT_TIMEOUT = 300.0


def to_anthropic_messages(request: CompletionRequest) -> list[dict[str, Any]]:
    """The request's messages as alternating Messages-API turns (content as lists of blocks)."""
    turns: list[dict[str, Any]] = []

    def add(role: str, block: dict[str, Any]) -> None:
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].append(block)
        else:
            turns.append({"role": role, "content": [block]})

    for message in request.messages:
        if isinstance(message, AssistantToolCalls):
            if message.content:
                add("assistant", {"type": "text", "text": message.content})
            for call in message.tool_calls:
                add(
                    "assistant",
                    {"type": "tool_use", "id": call.id, "name": call.name, "input": dict(call.arguments)},
                )
        elif isinstance(message, ToolResult):
            add(
                "user",
                {
                    "type": "tool_result",
                    "tool_use_id": message.tool_call_id,
                    "content": message.content,
                    "is_error": message.is_error,
                },
            )
        elif message.content:
            add(
                "assistant" if message.role == "assistant" else "user",
                {"type": "text", "text": message.content},
            )
    if turns and turns[0]["role"] != "user":
        turns.insert(0, {"role": "user", "content": [{"type": "text", "text": "(conversation so far)"}]})
    return turns


CUT = "max_tokens"
"""The stop reason of an answer cut at :data:`~tenex_daemon.adapters.llm.answers.MAX_ANSWER_BYTES`."""


def _string(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _tool_calls(content: list[Any]) -> tuple[ToolCall, ...]:
    calls: list[ToolCall] = []
    for i, block in enumerate(content):
        if getattr(block, "type", None) == "tool_use":
            arguments = getattr(block, "input", None)
            calls.append(
                ToolCall(
                    id=_string(getattr(block, "id", None)) or f"call_{i}",
                    name=_string(getattr(block, "name", None)),
                    arguments=arguments if isinstance(arguments, dict) else {},
                )
            )
    return tuple(calls)


def _text(content: list[Any]) -> str:
    return "".join(
        _string(getattr(block, "text", None)) for block in content if getattr(block, "type", None) == "text"
    )


def read_message(message: Any, request: CompletionRequest, model: str, backend: str) -> CompletionResult:
    """The result of a Messages-API answer (``model``: the one asked for, when the answer names none); a
    :func:`malformed_answer` error for one that holds no content (a proxy's HTTP 200 with an error, an HTML
    page); a usage count that is no number is left out, never the answer with it."""
    content = getattr(message, "content", None)
    if isinstance(message, str | bytes) or not isinstance(content, list):
        why = "it is no JSON object" if not hasattr(message, "content") else "it holds no content list"
        raise malformed_answer(backend, why, message)
    text, cut = capped(_text(content))
    usage = getattr(message, "usage", None)
    stop_reason = getattr(message, "stop_reason", None)
    return CompletionResult(
        text=text,
        model=_string(getattr(message, "model", None)) or model,
        session_id=request.session_id,
        prompt_tokens=token_count(getattr(usage, "input_tokens", None)),
        completion_tokens=token_count(getattr(usage, "output_tokens", None)),
        tool_calls=_tool_calls(content),
        finish_reason=CUT if cut else stop_reason if isinstance(stop_reason, str) else None,
    )


class AnthropicBackend:
    """Claude over the Messages API, streamed when the request asks for chunks."""

    name = "anthropic"

    def __init__(
        self,
        *,
        model: str = DEFAULT_MODEL,
        base_url: str | None = None,
        api_key: str | None = None,
        api_key_env: str | None = None,
        api_key_file: str | os.PathLike[str] | None = None,
        temperature: float | None = None,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        timeout: float = DEFAULT_TIMEOUT,
        max_retries: int = 2,
    ) -> None:
        key = api_key or resolve_api_key(
            key_file=api_key_file, env_var=api_key_env, default_env_var="ANTHROPIC_API_KEY"
        )
        if key is None:
            raise BackendAuthError(
                message="anthropic: no API key: set ANTHROPIC_API_KEY, api_key_env or api_key_file"
            )
        self.model = model
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.timeout = timeout
        self.max_retries = max_retries
        self._secrets = (key,)
        """Left out of every error's text (a server may echo the key it was sent)."""
        self._client = anthropic.AsyncAnthropic(
            api_key=key,
            base_url=base_url,
            timeout=timeout,
            max_retries=max_retries,
            # the SDK's own client, with a hook that notes the HTTP errors it tries again after
            http_client=anthropic.DefaultAsyncHttpxClient(event_hooks={"response": [note_refusal]}),
        )

    async def aclose(self) -> None:
        """Close the HTTP connections."""
        await self._client.close()

    def _arguments(self, request: CompletionRequest) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "model": request.model or self.model,
            "max_tokens": request.max_tokens or self.max_tokens,
            "messages": to_anthropic_messages(request),
        }
        if request.system_prompt:
            kwargs["system"] = request.system_prompt
        temperature = request.temperature if request.temperature is not None else self.temperature
        if temperature is not None:
            kwargs["temperature"] = temperature
        if request.tools:
            kwargs["tools"] = [
                {"name": t.name, "description": t.description, "input_schema": dict(t.parameters)}
                for t in request.tools
            ]
            if request.tool_choice is not None:
                kwargs["tool_choice"] = {"type": "tool", "name": request.tool_choice}
        return kwargs

    async def _streamed(self, request: CompletionRequest, kwargs: dict[str, Any]) -> CompletionResult:
        assert request.on_chunk is not None
        size = AnswerSize()
        kept: list[str] = []
        async with self._client.messages.stream(**kwargs) as stream:
            async for text in stream.text_stream:
                piece = size.take(text)
                if piece:
                    kept.append(piece)
                    await request.on_chunk(piece)
                if size.full:  # the rest is not read: it could not be published
                    snapshot = stream.current_message_snapshot
                    so_far = read_message(snapshot, request, kwargs["model"], self.name)
                    return replace(so_far, text="".join(kept), finish_reason=CUT)
            message = await stream.get_final_message()
        if message.stop_reason is None:  # the stream was closed before its message_stop
            raise unfinished_stream(self.name)
        return read_message(message, request, kwargs["model"], self.name)

    async def _once(self, request: CompletionRequest, kwargs: dict[str, Any]) -> CompletionResult:
        message = await self._client.messages.create(**kwargs)
        return read_message(message, request, kwargs["model"], self.name)

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Send the request; stream into ``request.on_chunk`` when it is set; bounded whole
        (:func:`~tenex_daemon.adapters.llm.errors.sdk_answer`)."""
        kwargs = self._arguments(request)
        streamed = request.on_chunk is not None
        call = self._streamed(request, kwargs) if streamed else self._once(request, kwargs)
        return await sdk_answer(
            call, streamed=streamed, read_timeout=self.timeout, max_retries=self.max_retries,
            backend=self.name, sdk=anthropic, sdk_error=anthropic.AnthropicError, secrets=self._secrets,
        )
