"""The ``anthropic`` backend: Claude models through the official ``anthropic`` SDK (Messages API).

The Messages API has no ``system`` role inside the conversation and wants user and assistant turns to
alternate: the persona goes in ``system``, other agents' system messages become user text, and
neighbouring turns of the same role are merged. Tool results travel in a user turn, right after the
assistant turn that called the tools.
"""

from __future__ import annotations

import os
from typing import Any

from tenex_daemon.adapters.llm.errors import (
    MissingExtraError,
    map_sdk_error,
    streamed_answer,
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


def _tool_calls(content: Any) -> tuple[ToolCall, ...]:
    calls: list[ToolCall] = []
    for block in content:
        if getattr(block, "type", None) == "tool_use":
            arguments = block.input if isinstance(block.input, dict) else {}
            calls.append(ToolCall(id=block.id, name=block.name, arguments=arguments))
    return tuple(calls)


def _text(content: Any) -> str:
    return "".join(block.text for block in content if getattr(block, "type", None) == "text")


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
        self._client = anthropic.AsyncAnthropic(
            api_key=key, base_url=base_url, timeout=timeout, max_retries=max_retries
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

    async def _streamed(self, request: CompletionRequest, kwargs: dict[str, Any]) -> Any:
        assert request.on_chunk is not None
        async with self._client.messages.stream(**kwargs) as stream:
            async for text in stream.text_stream:
                await request.on_chunk(text)
            message = await stream.get_final_message()
        if message.stop_reason is None:  # the stream was closed before its message_stop
            raise unfinished_stream(self.name)
        return message

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Send the request; stream into ``request.on_chunk`` when it is set."""
        kwargs = self._arguments(request)
        try:
            if request.on_chunk is None:
                message = await self._client.messages.create(**kwargs)
            else:
                message = await streamed_answer(self.timeout, self.name, self._streamed(request, kwargs))
        except anthropic.AnthropicError as exc:
            raise map_sdk_error(exc, anthropic, self.name) from exc
        usage = message.usage
        return CompletionResult(
            text=_text(message.content),
            model=message.model or kwargs["model"],
            session_id=request.session_id,
            prompt_tokens=usage.input_tokens if usage is not None else None,
            completion_tokens=usage.output_tokens if usage is not None else None,
            tool_calls=_tool_calls(message.content),
            finish_reason=message.stop_reason,
        )
