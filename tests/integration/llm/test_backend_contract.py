"""One contract, every backend that runs here: offline, local, openai (llama.cpp's server) and claude-code (stand-in)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tenex_daemon.adapters.llm.factory import make_backend
from tenex_daemon.core.context import ChatMessage
from tenex_daemon.core.llm import CompletionRequest, LLMBackend

from .conftest import LlamaServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BACKENDS = ["offline", "local", "openai", "claude-code"]


@pytest.fixture(params=BACKENDS)
async def backend(
    request: pytest.FixtureRequest, smollm2_path: Path, stand_in: tuple[list[str], Path]
) -> AsyncIterator[LLMBackend]:
    """Each backend in turn, built by the factory as the daemon builds it."""
    kind: str = request.param
    if kind == "local":
        yield make_backend("local", model=str(smollm2_path), options={"n_threads": 2, "n_ctx": 1024})
    elif kind == "openai":
        server: LlamaServer = request.getfixturevalue("llama_server")
        built = make_backend(
            "openai",
            model=server.model,
            base_url=server.base_url,
            options={"max_retries": 0, "timeout": 120.0},
        )
        yield built
        await built.aclose()  # type: ignore[attr-defined]
    elif kind == "claude-code":
        command, _ = stand_in
        yield make_backend("claude-code", options={"command": command})
    else:
        yield make_backend(kind)


def question(**options: object) -> CompletionRequest:
    """A short question at temperature 0, in an existing session."""
    return CompletionRequest(
        agent_slug="alice",
        agent_name="Alice",
        system_prompt="",
        messages=[ChatMessage("user", "What is the capital of France?")],
        session_id="session-1",
        temperature=0.0,
        max_tokens=24,
        **options,  # type: ignore[arg-type]
    )


async def test_answers_with_text_usage_and_session(backend: LLMBackend) -> None:
    """Every backend answers with non-empty text, token counts, and the session id it was given."""
    result = await backend.complete(question())
    assert result.text.strip()
    assert isinstance(result.prompt_tokens, int)
    assert isinstance(result.completion_tokens, int)
    assert result.completion_tokens > 0
    assert result.session_id == "session-1"


async def test_streamed_chunks_make_the_text(backend: LLMBackend) -> None:
    """With on_chunk, every backend hands over chunks whose concatenation is the returned text."""
    chunks: list[str] = []

    async def on_chunk(text: str) -> None:
        chunks.append(text)

    result = await backend.complete(question(on_chunk=on_chunk))
    assert chunks
    assert "".join(chunks) == result.text
