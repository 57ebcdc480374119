"""The offline backend: deterministic answers built from what the agent was given. For tests and demos."""

from __future__ import annotations

from tenex_daemon.core.llm import CompletionRequest, CompletionResult

OFFLINE_MODEL = "offline"
PREVIEW_CHARS = 280


class OfflineBackend:
    """Answers without any language model: it reports what it received, deterministically.

    The reply names the agent, counts the messages it was sent, and quotes the last
    one (the trigger), so a person can see the conversation machinery work. It does not
    stream: a request's ``on_chunk`` gets the whole text once.
    """

    name = "offline"

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Return a deterministic reply built from the request."""
        last = request.messages[-1].content if request.messages else ""
        preview = last if len(last) <= PREVIEW_CHARS else last[:PREVIEW_CHARS] + "…"
        count = len(request.messages)
        text = (
            f"{request.agent_name} (offline backend) received {count} message"
            f"{'' if count == 1 else 's'}. Latest: {preview}"
        )
        prompt_chars = len(request.system_prompt) + sum(len(m.content) for m in request.messages)
        if request.on_chunk is not None:
            await request.on_chunk(text)
        return CompletionResult(
            text=text,
            model=OFFLINE_MODEL,
            session_id=request.session_id,
            prompt_tokens=(prompt_chars + 3) // 4,
            completion_tokens=(len(text) + 3) // 4,
        )
