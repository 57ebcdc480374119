"""The ``openai`` backend: any OpenAI-compatible chat server through the official ``openai`` SDK.

OpenAI, OpenRouter, Ollama, vLLM and llama.cpp's server all speak this API; pick one with ``base_url``.
The key comes from a 0600 file, a named environment variable, or ``OPENAI_API_KEY``; a server given by
``base_url`` may need no key at all.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from tenex_daemon.adapters.llm.errors import MissingExtraError, note_refusal, sdk_answer
from tenex_daemon.adapters.llm.keys import resolve_api_key
from tenex_daemon.adapters.llm.openai_answer import StreamFold, read_completion
from tenex_daemon.adapters.llm.openai_format import openai_tool_choice, to_openai_messages, to_openai_tools
from tenex_daemon.core.llm import BackendAuthError, CompletionRequest, CompletionResult

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
        self.max_retries = max_retries
        self.extra_body = dict(extra_body or {})
        self._secrets = (key,)
        """Left out of every error's text (a server may echo the key it was sent)."""
        self._client = openai.AsyncOpenAI(
            api_key=key,
            base_url=base_url,
            timeout=timeout,
            max_retries=max_retries,
            # the SDK's own client, with a hook that notes the HTTP errors it tries again after
            http_client=openai.DefaultAsyncHttpxClient(event_hooks={"response": [note_refusal]}),
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
        """Send the request; stream into ``request.on_chunk`` when it is set; bounded whole
        (:func:`~tenex_daemon.adapters.llm.errors.sdk_answer`)."""
        kwargs = self._arguments(request)
        streamed = request.on_chunk is not None
        call = self._complete_streamed(request, kwargs) if streamed else self._complete_once(request, kwargs)
        return await sdk_answer(
            call, streamed=streamed, read_timeout=self.timeout, max_retries=self.max_retries,
            backend=self.name, sdk=openai, sdk_error=openai.OpenAIError, secrets=self._secrets,
        )

    async def _complete_once(self, request: CompletionRequest, kwargs: dict[str, Any]) -> CompletionResult:
        response = await self._client.chat.completions.create(**kwargs)
        return read_completion(response, request, kwargs["model"], self.name)

    async def _complete_streamed(
        self, request: CompletionRequest, kwargs: dict[str, Any]
    ) -> CompletionResult:
        assert request.on_chunk is not None
        if self.stream_usage:
            kwargs["stream_options"] = {"include_usage": True}
        stream = await self._client.chat.completions.create(stream=True, **kwargs)
        fold = StreamFold()
        async for chunk in stream:
            for piece in fold.feed(chunk):
                await request.on_chunk(piece)
            if fold.full:  # the rest is not read: it could not be published
                await stream.close()
                break
        return fold.result(request, kwargs, self.name)
