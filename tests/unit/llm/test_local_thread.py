"""Calls to the local backend wait for its model in the model's own thread: the event loop's shared worker
threads stay free for the store and the status file, and a call stopped while it waits never runs."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import pytest

from tenex_daemon.adapters.llm.local import LocalBackend
from tenex_daemon.core.context import ChatMessage
from tenex_daemon.core.llm import CompletionRequest


def request(text: str) -> CompletionRequest:
    """A call with one person's message, ``text``."""
    return CompletionRequest("alice", "Alice", "You are Alice.", messages=(ChatMessage("user", text),))



class BusyModel:
    """Stands in for ``LocalBackend._run``: each generation holds the model until ``release`` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started: list[str] = []
        self.began = asyncio.Event()
        self._loop = asyncio.get_running_loop()

    def run(self, kwargs: dict[str, Any], emit: Any, cancelled: threading.Event) -> Any:
        """Wait for ``release``, then answer with the message's text."""
        self.started.append(kwargs["messages"][-1]["content"])
        self._loop.call_soon_threadsafe(self.began.set)
        self.release.wait(30)
        emit(None)
        message = {"role": "assistant", "content": f"answered {kwargs['messages'][-1]['content']}"}
        return {"choices": [{"message": message, "finish_reason": "stop"}], "_seconds": 0.0}


async def test_calls_waiting_for_the_model_leave_the_event_loops_worker_threads_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With more calls waiting for a busy model than the event loop has worker threads, ``asyncio.to_thread``
    (the store's reads, the status file's writes) still runs at once."""
    model = BusyModel()
    monkeypatch.setattr(LocalBackend, "_run", model.run)
    backend = LocalBackend()
    shared_threads = min(32, (os.cpu_count() or 1) + 4)  # the loop's default executor
    calls = [asyncio.create_task(backend.complete(request(str(n)))) for n in range(shared_threads + 2)]
    try:
        await asyncio.wait_for(model.began.wait(), 10)
        await asyncio.sleep(0.1)  # the other calls are waiting
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "free"), 10) == "free"
        assert len(model.started) == 1  # one call at a time uses the model
    finally:
        model.release.set()
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)


async def test_a_call_stopped_while_it_waits_for_the_model_never_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Of three calls, the second is cancelled (a stop) while the first holds the model: the first and the
    third are answered, and the second never reaches the model."""
    model = BusyModel()
    monkeypatch.setattr(LocalBackend, "_run", model.run)
    backend = LocalBackend()

    first, second, third = (asyncio.create_task(backend.complete(request(t))) for t in ("one", "two", "three"))
    await asyncio.wait_for(model.began.wait(), 10)
    second.cancel()
    await asyncio.gather(second, return_exceptions=True)
    model.release.set()
    answers = await asyncio.wait_for(asyncio.gather(first, third), 10)
    assert [answer.text for answer in answers] == ["answered one", "answered three"]
    assert model.started == ["one", "three"]


def test_the_models_thread_is_found_while_another_model_loads() -> None:
    """A model's load holds the models' lock for seconds: finding a model's thread (on the event loop, at each
    call) does not wait for it, so a call to one agent never freezes the loop while another's model loads."""
    from tenex_daemon.adapters.llm import local

    loading, loaded = threading.Event(), threading.Event()

    def load() -> None:
        with local._MODELS_LOCK:
            loading.set()
            loaded.wait(10)

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    loading.wait(10)
    try:
        found = threading.Thread(target=local._thread, args=(LocalBackend()._key,), daemon=True)
        found.start()
        found.join(5)
        assert not found.is_alive()
    finally:
        loaded.set()
        loader.join(10)
