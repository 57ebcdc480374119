"""The language-model boundary: what an agent run sends to a backend and gets back.

A backend takes a :class:`CompletionRequest` (persona, messages, optional tools) and returns a
:class:`CompletionResult` (text, tool calls, usage, session id). Streaming is a callback: when the
request carries ``on_chunk``, a backend that can stream awaits it with each piece of text as it
arrives, and still returns the whole result at the end (a backend that cannot stream calls it once
with the whole text). Failures are :class:`BackendError` subclasses whose ``kind`` says what failed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, Protocol

from tenex_daemon.core.context import ChatMessage
from tenex_daemon.core.errors import TenexError

ChunkCallback = Callable[[str], Awaitable[None]]
"""Awaited with each piece of streamed text, in order."""


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A tool a model may call: its name, what it does, and its parameters as a JSON schema."""

    name: str
    description: str
    parameters: Mapping[str, Any] = field(
        default_factory=lambda: {"type": "object", "properties": {}, "required": []}
    )


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A model's request to run a tool: the provider's call id, the tool name and parsed arguments."""

    id: str
    name: str
    arguments: Mapping[str, Any]
    invalid_arguments: str | None = None
    """The raw argument text when the model sent something that is not a JSON object (arguments is empty)."""


@dataclass(frozen=True, slots=True)
class AssistantToolCalls:
    """An assistant turn that asked for tools (sent back to the model with the results that follow it)."""

    tool_calls: tuple[ToolCall, ...]
    content: str = ""
    role: Literal["assistant"] = "assistant"


@dataclass(frozen=True, slots=True)
class ToolResult:
    """The result of one tool call, sent back to the model right after the call that asked for it."""

    tool_call_id: str
    name: str
    content: str
    is_error: bool = False
    role: Literal["tool"] = "tool"


LLMMessage = ChatMessage | AssistantToolCalls | ToolResult
"""One message sent to a backend: a chat message, an assistant's tool calls, or a tool's result."""


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """One call to a backend: the persona first, then the agent's messages, then the tools it may call."""

    agent_slug: str
    agent_name: str
    system_prompt: str
    messages: Sequence[LLMMessage]
    session_id: str | None = None
    model: str | None = None
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: str | None = None
    """The name of a tool the model must call; None lets the model choose."""
    temperature: float | None = None
    max_tokens: int | None = None
    on_chunk: ChunkCallback | None = None
    """When set, streamed text is passed here as it arrives (see the module docstring)."""


@dataclass(frozen=True, slots=True)
class CompletionResult:
    """A backend's answer."""

    text: str
    model: str | None = None
    session_id: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    extra: dict[str, str] = field(default_factory=dict)
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: str | None = None

    @property
    def total_tokens(self) -> int | None:
        """Prompt plus completion tokens, when the backend reported both."""
        if self.prompt_tokens is None or self.completion_tokens is None:
            return None
        return self.prompt_tokens + self.completion_tokens


class BackendErrorKind(StrEnum):
    """What failed in a backend call; the values are the strings logged and tagged on error replies."""

    AUTH = "auth"
    RATE_LIMIT = "rate_limit"
    CONTEXT_TOO_LONG = "context_too_long"
    UNREACHABLE = "unreachable"
    TIMEOUT = "timeout"
    BAD_REQUEST = "bad_request"
    UNAVAILABLE = "unavailable"
    """The backend cannot run here: a missing extra, command or model file."""
    OTHER = "other"


class BackendError(TenexError):
    """A backend failed; ``kind`` says how (a :class:`BackendErrorKind`, equal to its string value)."""

    default_kind = BackendErrorKind.OTHER

    def __init__(
        self,
        kind: str | BackendErrorKind | None = None,
        message: str = "",
        *,
        retry_after: float | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = BackendErrorKind(kind) if kind is not None else self.default_kind
        self.retry_after = retry_after
        """Seconds the provider asked to wait before retrying (rate limits), when it said."""
        self.status = status
        """The HTTP status the provider answered, when there was one."""


class BackendAuthError(BackendError):
    """The provider refused the credentials (missing, wrong or expired key)."""

    default_kind = BackendErrorKind.AUTH


class BackendRateLimitError(BackendError):
    """The provider asked to slow down or the quota is spent."""

    default_kind = BackendErrorKind.RATE_LIMIT


class ContextTooLongError(BackendError):
    """The messages do not fit the model's context window."""

    default_kind = BackendErrorKind.CONTEXT_TOO_LONG


class BackendUnreachableError(BackendError):
    """The backend could not be reached (connection refused, DNS, a command not found)."""

    default_kind = BackendErrorKind.UNREACHABLE


class BackendTimeoutError(BackendError):
    """The backend did not answer in time."""

    default_kind = BackendErrorKind.TIMEOUT


class BackendUnavailableError(BackendError):
    """The backend cannot run on this installation (a missing extra, model file or command)."""

    default_kind = BackendErrorKind.UNAVAILABLE


_ERROR_CLASSES: dict[BackendErrorKind, type[BackendError]] = {
    BackendErrorKind.AUTH: BackendAuthError,
    BackendErrorKind.RATE_LIMIT: BackendRateLimitError,
    BackendErrorKind.CONTEXT_TOO_LONG: ContextTooLongError,
    BackendErrorKind.UNREACHABLE: BackendUnreachableError,
    BackendErrorKind.TIMEOUT: BackendTimeoutError,
    BackendErrorKind.UNAVAILABLE: BackendUnavailableError,
}


def backend_error(
    kind: str | BackendErrorKind,
    message: str,
    *,
    retry_after: float | None = None,
    status: int | None = None,
) -> BackendError:
    """Return the :class:`BackendError` subclass instance for ``kind``."""
    kind = BackendErrorKind(kind)
    cls = _ERROR_CLASSES.get(kind, BackendError)
    return cls(kind, message, retry_after=retry_after, status=status)


_CONTEXT_TOO_LONG_MARKERS = (
    "context length",
    "context_length",
    "context window",
    "maximum context",
    "too many tokens",
    "prompt is too long",
    "exceeds the context",
    "exceed context",
    "available context size",  # llama.cpp's server: "the request exceeds the available context size"
    "exceed_context_size",  # its error type
    "reduce the length",
    "input is too long",
)


def mentions_context_too_long(message: str) -> bool:
    """Whether a provider's error text says the prompt does not fit the context window."""
    lowered = message.lower()
    return any(marker in lowered for marker in _CONTEXT_TOO_LONG_MARKERS)


class LLMBackend(Protocol):
    """Turns an agent's messages into a reply."""

    name: str

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Return the reply; raise :class:`BackendError` on failure."""
