"""Reading an OpenAI-compatible server's answer, whole or streamed, into a :class:`CompletionResult`.

The SDK builds its objects without checking them, so every field is read as what it may be: a server (a
proxy, a gateway) may answer HTTP 200 with ``{"error": {...}}``, no choices, an HTML page, a usage block
whose counts are not numbers. An answer that holds no completion is a :func:`malformed_answer` error (with
the provider's own message when it sends one); a bad usage count is left out, never the answer with it.
"""

from __future__ import annotations

import json
from typing import Any

from tenex_daemon.adapters.llm.answers import AnswerSize, capped, text_of, token_count
from tenex_daemon.adapters.llm.errors import malformed_answer, unfinished_stream
from tenex_daemon.adapters.llm.openai_format import parse_tool_call
from tenex_daemon.core.llm import BackendError, CompletionRequest, CompletionResult, ToolCall

CUT = "length"
"""The finish reason of an answer cut at :data:`~tenex_daemon.adapters.llm.answers.MAX_ANSWER_BYTES`."""


def _string(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _arguments(value: Any) -> str:
    """A tool call's arguments as their JSON text (a server that sends an object is read too)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return json.dumps(value)
    return ""


def _no_completion(response: Any, backend: str) -> BackendError:
    """The error for a whole answer with no choice to read."""
    choices = getattr(response, "choices", None)
    if isinstance(response, str | bytes) or not hasattr(response, "choices"):
        why = "it is no JSON object"
    elif choices is None:
        why = "it has no choices"
    elif isinstance(choices, list):
        why = "its choices are empty"
    else:
        why = "its choices are no list"
    return malformed_answer(backend, why, response)


def read_completion(response: Any, request: CompletionRequest, model: str, backend: str) -> CompletionResult:
    """The answer of a call that did not stream (``model``: the one asked for, when the answer names none)."""
    choices = getattr(response, "choices", None)
    if isinstance(response, str | bytes) or not isinstance(choices, list) or not choices:
        raise _no_completion(response, backend)
    choice = choices[0]
    message = getattr(choice, "message", None)
    if message is None:
        raise malformed_answer(backend, "its first choice holds no message", response)
    listed = getattr(message, "tool_calls", None)
    calls = tuple(
        parse_tool_call(
            _string(getattr(call, "id", None)),
            _string(getattr(call.function, "name", None)) or "",
            _arguments(getattr(call.function, "arguments", None)),
            i,
        )
        for i, call in enumerate(listed if isinstance(listed, list) else ())
        if getattr(call, "function", None) is not None
    )
    # a refusal is its answer
    text = text_of(getattr(message, "content", None)) or text_of(getattr(message, "refusal", None))
    text, cut = capped(text)
    usage = getattr(response, "usage", None)
    return CompletionResult(
        text=text,
        model=_string(getattr(response, "model", None)) or model,
        session_id=request.session_id,
        prompt_tokens=token_count(getattr(usage, "prompt_tokens", None)),
        completion_tokens=token_count(getattr(usage, "completion_tokens", None)),
        tool_calls=calls,
        finish_reason=CUT if cut else _string(getattr(choice, "finish_reason", None)),
    )


class StreamFold:
    """Folds the chunks of a streamed answer into its result: feed each chunk, pass on the text it gives,
    stop reading once :attr:`full`, then call :meth:`result`."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.calls: dict[int, dict[str, str]] = {}
        self.model: str | None = None
        self.finish_reason: str | None = None
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.size = AnswerSize()

    @property
    def full(self) -> bool:
        """Whether the answer reached its size limit (the rest is not read)."""
        return self.size.full

    def feed(self, chunk: Any) -> list[str]:
        """Read one chunk; return the pieces of text it adds (to stream on)."""
        self.model = _string(getattr(chunk, "model", None)) or self.model
        usage = getattr(chunk, "usage", None)
        if usage is not None:
            self.prompt_tokens = token_count(getattr(usage, "prompt_tokens", None))
            self.completion_tokens = token_count(getattr(usage, "completion_tokens", None))
        choices = getattr(chunk, "choices", None)
        pieces: list[str] = []
        for choice in choices if isinstance(choices, list) else ():  # a usage chunk's may be null
            self.finish_reason = _string(getattr(choice, "finish_reason", None)) or self.finish_reason
            delta = getattr(choice, "delta", None)
            said = text_of(getattr(delta, "content", None)) or text_of(getattr(delta, "refusal", None))
            said = self.size.take(said)  # a refusal streams as its answer
            if said:
                self.text.append(said)
                pieces.append(said)
            listed = getattr(delta, "tool_calls", None)
            for call in listed if isinstance(listed, list) else ():
                self._add_call(call)
        return pieces

    def _add_call(self, call: Any) -> None:
        index = getattr(call, "index", None)
        key = index if isinstance(index, int) else len(self.calls)
        slot = self.calls.setdefault(key, {"id": "", "name": "", "arguments": ""})
        slot["id"] = _string(getattr(call, "id", None)) or slot["id"]
        function = getattr(call, "function", None)
        if function is not None:
            slot["name"] += _string(getattr(function, "name", None)) or ""
            slot["arguments"] += self.size.take(_arguments(getattr(function, "arguments", None)))

    def result(self, request: CompletionRequest, kwargs: dict[str, Any], backend: str) -> CompletionResult:
        """The answer; an :func:`unfinished_stream` error when the stream ended before its finish reason."""
        finish_reason = CUT if self.full else self.finish_reason
        if finish_reason is None:  # the stream was closed before its last chunk
            raise unfinished_stream(backend)
        tool_calls: tuple[ToolCall, ...] = tuple(
            parse_tool_call(slot["id"] or None, slot["name"], slot["arguments"], index)
            for index, slot in sorted(self.calls.items())
        )
        answer = "".join(self.text)
        extra: dict[str, str] = {}
        prompt_tokens, completion_tokens = self.prompt_tokens, self.completion_tokens
        if prompt_tokens is None or completion_tokens is None:
            # Some servers (llama.cpp's Python server among them) send no usage when streaming:
            # count characters/4, the project's rule when no tokenizer is known, and say so.
            prompt_chars = sum(len(str(m.get("content") or "")) for m in kwargs["messages"])
            answer_chars = len(answer) + sum(len(s["arguments"]) for s in self.calls.values())
            prompt_tokens = (prompt_chars + 3) // 4
            completion_tokens = (answer_chars + 3) // 4
            extra["usage"] = "estimated"
        return CompletionResult(
            text=answer,
            model=self.model or kwargs["model"],
            session_id=request.session_id,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            tool_calls=tool_calls,
            finish_reason=finish_reason,
            extra=extra,
        )
