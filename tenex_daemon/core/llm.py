"""The language-model boundary: what an agent run sends to a backend and gets back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tenex_daemon.core.context import ChatMessage
from tenex_daemon.core.errors import TenexError


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """One call to a backend: the persona first, then the agent's messages."""

    agent_slug: str
    agent_name: str
    system_prompt: str
    messages: list[ChatMessage]
    session_id: str | None = None
    model: str | None = None


@dataclass(frozen=True, slots=True)
class CompletionResult:
    """A backend's answer."""

    text: str
    model: str | None = None
    session_id: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    extra: dict[str, str] = field(default_factory=dict)


class BackendError(TenexError):
    """A backend failed; ``kind``: auth, rate_limit, context_too_long, unreachable, timeout, other."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class LLMBackend(Protocol):
    """Turns an agent's messages into a reply."""

    name: str

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Return the reply; raise :class:`BackendError` on failure."""
