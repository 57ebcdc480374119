"""The ``openai`` backend: any OpenAI-compatible chat server through the official ``openai`` SDK.

OpenAI, OpenRouter, Ollama, vLLM and llama.cpp's server all speak this API; pick one with ``base_url``.
The key comes from a 0600 file, a named environment variable, or ``OPENAI_API_KEY``; a server given by
``base_url`` may need no key at all.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from tenex_daemon.adapters.llm.errors import (
    MissingExtraError,
    map_sdk_error,
    streamed_answer,
    unfinished_stream,
)
from tenex_daemon.adapters.llm.keys import resolve_api_key
from tenex_daemon.adapters.llm.openai_format import (
    openai_tool_choice,
    parse_tool_call,
    to_openai_messages,
    to_openai_tools,
)
from tenex_daemon.core.llm import BackendAuthError, CompletionRequest, CompletionResult, ToolCall

try:
    import openai
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingExtraError("openai", "openai", "openai") from exc

DEFAULT_TIMEOUT = 120.0
NO_KEY = "no-key"
"""Sent to servers that need no key (the SDK insists on one)."""


class OpenAIBackend:
    """Chat completions over the OpenAI API, streamed when the request asks for chunks."""

    name = "openai"

    def __init__(
        self,
        *,
        model: str,
        base_url: str | None = None,
        api_key: str | None = None,
        api_key_env: str | None = None,
        api_key_file: str | os.PathLike[str] | None = None,
        temperature: float | None = None,
        max_tokens: int | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        max_retries: int = 2,
        stream_usage: bool = True,
        extra_body: Mapping[str, Any] | None = None,
    ) -> None:
        key = api_key or resolve_api_key(
            key_file=api_key_file, env_var=api_key_env, default_env_var="OPENAI_API_KEY"
        )
        if key is None:
            if base_url is None:
                raise BackendAuthError(
                    message="openai: no API key: set OPENAI_API_KEY, api_key_env or api_key_file"
                )
            key = NO_KEY
        self.model = model
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.stream_usage = stream_usage
        self.timeout = timeout
        self.extra_body = dict(extra_body or {})
        self._client = openai.AsyncOpenAI(
            api_key=key, base_url=base_url, timeout=timeout, max_retries=max_retries
        )

    async def aclose(self) -> None:
        """Close the HTTP connections."""
        await self._client.close()

    def _arguments(self, request: CompletionRequest) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "model": request.model or self.model,
            "messages": to_openai_messages(request),
        }
        temperature = request.temperature if request.temperature is not None else self.temperature
        if temperature is not None:
            kwargs["temperature"] = temperature
        max_tokens = request.max_tokens if request.max_tokens is not None else self.max_tokens
        if max_tokens is not None:
            kwargs["max_tokens"] = max_tokens
        if request.tools:
            kwargs["tools"] = to_openai_tools(request)
            choice = openai_tool_choice(request)
            if choice is not None:
                kwargs["tool_choice"] = choice
        if self.extra_body:
            kwargs["extra_body"] = self.extra_body
        return kwargs

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Send the request; stream into ``request.on_chunk`` when it is set."""
        kwargs = self._arguments(request)
        try:
            if request.on_chunk is None:
                return await self._complete_once(request, kwargs)
            return await streamed_answer(self.timeout, self.name, self._complete_streamed(request, kwargs))
        except openai.OpenAIError as exc:
            raise map_sdk_error(exc, openai, self.name) from exc

    async def _complete_once(self, request: CompletionRequest, kwargs: dict[str, Any]) -> CompletionResult:
        response = await self._client.chat.completions.create(**kwargs)
        choice = response.choices[0]
        message = choice.message
        calls = tuple(
            parse_tool_call(call.id, call.function.name, call.function.arguments, i)
            for i, call in enumerate(message.tool_calls or ())
            if getattr(call, "function", None) is not None
        )
        usage = response.usage
        return CompletionResult(
            text=message.content or getattr(message, "refusal", None) or "",  # a refusal is its answer
            model=response.model or kwargs["model"],
            session_id=request.session_id,
            prompt_tokens=usage.prompt_tokens if usage is not None else None,
            completion_tokens=usage.completion_tokens if usage is not None else None,
            tool_calls=calls,
            finish_reason=choice.finish_reason,
        )

    async def _complete_streamed(
        self, request: CompletionRequest, kwargs: dict[str, Any]
    ) -> CompletionResult:
        assert request.on_chunk is not None
        if self.stream_usage:
            kwargs["stream_options"] = {"include_usage": True}
        stream = await self._client.chat.completions.create(stream=True, **kwargs)
        text: list[str] = []
        calls: dict[int, dict[str, str]] = {}
        model: str | None = None
        finish_reason: str | None = None
        prompt_tokens: int | None = None
        completion_tokens: int | None = None
        async for chunk in stream:
            model = chunk.model or model
            if chunk.usage is not None:
                prompt_tokens = chunk.usage.prompt_tokens
                completion_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                finish_reason = choice.finish_reason or finish_reason
                delta = choice.delta
                said = delta.content or getattr(delta, "refusal", None)  # a refusal streams as its answer
                if said:
                    text.append(said)
                    await request.on_chunk(said)
                for call in delta.tool_calls or ():
                    slot = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                    if call.id:
                        slot["id"] = call.id
                    if call.function is not None:
                        slot["name"] += call.function.name or ""
                        slot["arguments"] += call.function.arguments or ""
        if finish_reason is None:  # the stream was closed before its last chunk
            raise unfinished_stream(self.name)
        tool_calls: tuple[ToolCall, ...] = tuple(
            parse_tool_call(slot["id"] or None, slot["name"], slot["arguments"], index)
            for index, slot in sorted(calls.items())
        )
        answer = "".join(text)
        extra: dict[str, str] = {}
        if prompt_tokens is None or completion_tokens is None:
            # Some servers (llama.cpp's Python server among them) send no usage when streaming:
            # count characters/4, the project's rule when no tokenizer is known, and say so.
            prompt_chars = sum(len(str(m.get("content") or "")) for m in kwargs["messages"])
            answer_chars = len(answer) + sum(len(s["arguments"]) for s in calls.values())
            prompt_tokens = (prompt_chars + 3) // 4
            completion_tokens = (answer_chars + 3) // 4
            extra["usage"] = "estimated"
        return CompletionResult(
            text=answer,
            model=model or kwargs["model"],
            session_id=request.session_id,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            tool_calls=tool_calls,
            finish_reason=finish_reason,
            extra=extra,
        )
