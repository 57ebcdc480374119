"""A real model, offline: SmolLM2-135M-Instruct through llama.cpp's server (openai backend) and in-process (local backend)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from tenex_daemon.adapters.llm.local import LocalBackend
from tenex_daemon.adapters.llm.openai import OpenAIBackend
from tenex_daemon.core.context import ChatMessage
from tenex_daemon.core.llm import (
    CompletionRequest,
    CompletionResult,
    ContextTooLongError,
    LLMBackend,
    ToolResult,
    ToolSpec,
)
from tenex_daemon.core.vocabulary import TAG_TOOL, TOOL_COMPLETE
from tenex_daemon.services.agent_runner import AgentProfile
from tenex_daemon.services.runs import RunRequest
from tests import pipeline
from tests.conftest import Cast

from .conftest import LlamaServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PARIS_QUESTION = "What is the capital of France?"
WEATHER = ToolSpec(
    name="get_weather",
    description="Get the current weather in a city.",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)


def ask(question: str, **options: object) -> CompletionRequest:
    """A one-question request at temperature 0 with a short answer.

    No persona: SmolLM2-135M answers "The capital of France is Paris." to the bare question, but drifts
    into French prose after any system prompt tried here (measured; a 135M model is that fragile).
    """
    return CompletionRequest(
        agent_slug="alice",
        agent_name="Alice",
        system_prompt="",
        messages=[ChatMessage("user", question)],
        temperature=0.0,
        max_tokens=32,
        **options,  # type: ignore[arg-type]
    )


@pytest.fixture
async def served(llama_server: LlamaServer) -> AsyncIterator[OpenAIBackend]:
    """The openai backend pointed at the llama.cpp server (no key needed)."""
    backend = OpenAIBackend(
        model=llama_server.model, base_url=llama_server.base_url, timeout=120.0, max_retries=0
    )
    yield backend
    await backend.aclose()


async def test_openai_backend_answers_paris(served: OpenAIBackend) -> None:
    """At temperature 0 the served model answers the capital question with Paris, and usage is recorded."""
    result = await served.complete(ask(PARIS_QUESTION))
    assert "paris" in result.text.lower()
    assert result.prompt_tokens is not None
    assert result.prompt_tokens > 0
    assert result.completion_tokens is not None
    assert result.completion_tokens > 0


async def test_openai_backend_streams_in_several_chunks(served: OpenAIBackend) -> None:
    """Streaming hands over several chunks whose concatenation is the returned text, and usage is recorded (estimated)."""
    chunks: list[str] = []

    async def on_chunk(text: str) -> None:
        chunks.append(text)

    result = await served.complete(ask("Name three colours.", on_chunk=on_chunk))
    assert len(chunks) >= 3
    assert "".join(chunks) == result.text
    assert result.text.strip()
    # llama.cpp's Python server sends no usage in a stream: the backend estimates it and says so.
    assert result.extra.get("usage") == "estimated"
    assert result.completion_tokens is not None
    assert result.completion_tokens > 0


async def test_openai_backend_forced_tool_call_is_parsed(served: OpenAIBackend) -> None:
    """A tool_choice naming the tool yields a call of that tool with its arguments parsed into a dict."""
    result = await served.complete(
        ask("What is the weather in Paris?", tools=(WEATHER,), tool_choice="get_weather")
    )
    assert len(result.tool_calls) == 1
    call = result.tool_calls[0]
    assert call.name == "get_weather"
    assert call.invalid_arguments is None
    assert isinstance(call.arguments.get("city"), str)


class ForcedFirstTool:
    """Passes requests to a backend, naming ``tool`` as the tool_choice of the first one."""

    def __init__(self, backend: LLMBackend, tool: str) -> None:
        self.name = backend.name
        self.backend = backend
        self.tool = tool
        self.requests: list[CompletionRequest] = []
        self.results: list[CompletionResult] = []

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Force the tool on the first call; record requests and results."""
        if not self.requests:
            request = replace(request, tool_choice=self.tool)
        self.requests.append(request)
        result = await self.backend.complete(request)
        self.results.append(result)
        return result


async def test_forced_tool_call_runs_the_tool_in_an_agent_run(served: OpenAIBackend, cast: Cast) -> None:
    """A run whose first call forces `complete` makes the served model call it; the runner runs the tool
    and the saved reply is a completion (tagged ["tool", "complete"], addressed to the orchestrator)."""
    backend = ForcedFirstTool(served, "complete")
    profiles = {a.slug: AgentProfile(a, "", backend, temperature=0.0, max_tokens=64) for a in cast.agents}
    rig = pipeline.build_rig(cast, profiles=profiles, composer=pipeline.real_composer(cast))
    manager, runner, publisher = rig.manager, rig.runner, rig.publisher
    root = cast.user_says("Say that the task is done.", kind=11, tags=[["p", cast.alice.pubkey]])
    await manager.create_conversation(root)

    reply = await runner.run(RunRequest(root.id, root.id, "alice"))

    assert reply is not None
    assert [call.name for call in backend.results[0].tool_calls] == ["complete"]
    assert len(backend.requests) == 1, "complete ends the run without another model call"
    assert [TAG_TOOL, TOOL_COMPLETE] in reply.tags
    assert ["p", cast.orchestrator.pubkey] in reply.tags
    assert reply.content.strip()
    await runner.flush(5.0)
    assert [event.id for event in publisher.published] == [reply.id]


async def test_tool_result_goes_back_to_the_served_model(served: OpenAIBackend, cast: Cast) -> None:
    """A forced get_conversation call runs, and its result is sent back to the model right after the call."""
    backend = ForcedFirstTool(served, "get_conversation")
    profiles = {a.slug: AgentProfile(a, "", backend, temperature=0.0, max_tokens=48) for a in cast.agents}
    rig = pipeline.build_rig(
        cast, profiles=profiles, composer=pipeline.real_composer(cast), max_tool_rounds=3
    )
    manager, runner = rig.manager, rig.runner
    root = cast.user_says("What did we talk about recently?", kind=11, tags=[["p", cast.alice.pubkey]])
    await manager.create_conversation(root)

    reply = await runner.run(RunRequest(root.id, root.id, "alice"))

    assert reply is not None
    assert [call.name for call in backend.results[0].tool_calls] == ["get_conversation"]
    assert len(backend.requests) >= 2
    second = list(backend.requests[1].messages)
    results = [m for m in second if isinstance(m, ToolResult)]
    assert [r.name for r in results] == ["get_conversation"]
    assert second.index(results[0]) == len(second) - 1, "the result follows its call, last"
    await runner.flush(5.0)


@pytest.fixture(scope="module")
def local_backend(smollm2_path: Path) -> LocalBackend:
    """The local backend with the bundled SmolLM2 (two threads, a small context)."""
    return LocalBackend(model=smollm2_path, n_threads=2, n_ctx=1024)


async def test_local_backend_answers_paris(local_backend: LocalBackend) -> None:
    """In-process at temperature 0 the model answers the capital question with Paris, with usage."""
    result = await local_backend.complete(ask(PARIS_QUESTION))
    assert "paris" in result.text.lower()
    assert result.prompt_tokens is not None
    assert result.prompt_tokens > 0
    assert result.completion_tokens is not None
    assert result.completion_tokens > 0


async def test_local_backend_streams_off_the_event_loop(local_backend: LocalBackend) -> None:
    """Streaming gives several chunks while the event loop keeps running other tasks during generation: a
    ticker task ticks during the call, and between its first chunk and its last (a model run on the loop's
    own thread would tick at most once, when the call ends)."""
    await local_backend.load()
    chunks: list[str] = []
    ticks = 0
    ticks_at_chunk: list[int] = []

    async def on_chunk(text: str) -> None:
        chunks.append(text)
        ticks_at_chunk.append(ticks)

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticking = asyncio.create_task(ticker())
    try:
        result = await local_backend.complete(ask("Name three colours.", on_chunk=on_chunk))
    finally:
        ticking.cancel()
    assert len(chunks) >= 3
    assert "".join(chunks) == result.text
    assert result.completion_tokens == len(chunks)
    assert ticks >= 3
    assert ticks_at_chunk[-1] > ticks_at_chunk[0]


async def test_local_backend_serializes_concurrent_calls(local_backend: LocalBackend) -> None:
    """Two concurrent calls on one model both complete (the model's lock lets one run at a time)."""
    results: tuple[CompletionResult, CompletionResult] = await asyncio.gather(
        local_backend.complete(ask(PARIS_QUESTION)), local_backend.complete(ask(PARIS_QUESTION))
    )
    assert results[0].text == results[1].text
    assert "paris" in results[0].text.lower()


async def test_local_backend_prompt_too_long_is_typed(smollm2_path: Path) -> None:
    """A prompt larger than the context window gives a context_too_long error."""
    small = LocalBackend(model=smollm2_path, n_threads=2, n_ctx=256)
    with pytest.raises(ContextTooLongError):
        await small.complete(ask("word " * 600))


async def test_local_backend_forced_tool_call_is_parsed(local_backend: LocalBackend) -> None:
    """In-process, a tool_choice naming the tool yields a call of that tool with its arguments parsed."""
    result = await local_backend.complete(
        ask("What is the weather in Paris?", tools=(WEATHER,), tool_choice="get_weather")
    )
    assert [call.name for call in result.tool_calls] == ["get_weather"]
    assert result.tool_calls[0].invalid_arguments is None
    assert isinstance(result.tool_calls[0].arguments.get("city"), str)
    assert result.completion_tokens is not None
    assert result.completion_tokens > 0  # the call's own tokens, counted as they stream


async def test_a_cancelled_local_call_stops_generating_at_its_next_token(local_backend: LocalBackend) -> None:
    """A call cancelled while the model generates (a stop, a shutdown) ends the generation within a few
    tokens: once the model's lock is free, the context holds the prompt and a few tokens, where the same
    request left alone generates hundreds (the thread used to generate them all, holding the lock). (A call
    that does not stream reads the model's output by the same code; it is not cancelled here: nothing shows
    when its generation has begun.)"""
    from tenex_daemon.adapters.llm import local

    await local_backend.load()
    loaded = local._MODELS[local_backend._key]
    first_chunk = asyncio.Event()

    async def on_chunk(text: str) -> None:
        first_chunk.set()

    def held_after_generation() -> int:
        with loaded.lock:  # free once a generation has ended
            return int(loaded.llama.n_tokens)

    request = replace(ask("Write a long story about a dragon who loves to cook.", on_chunk=on_chunk), max_tokens=400)
    left_alone = await local_backend.complete(request)
    assert left_alone.completion_tokens is not None
    assert left_alone.completion_tokens > 200
    prompt = await asyncio.to_thread(held_after_generation) - left_alone.completion_tokens

    first_chunk.clear()
    call = asyncio.create_task(local_backend.complete(request))
    await asyncio.wait_for(first_chunk.wait(), 60)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call

    generated = await asyncio.to_thread(held_after_generation) - prompt
    assert generated < 50
