"""The claude-code backend against a ``claude`` that misbehaves: a usage count that is no number, a huge
answer or error, a line over the reader's limit, a key echoed on stderr."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tenex_daemon.adapters.llm import claude_code
from tenex_daemon.adapters.llm.claude_code import ClaudeCodeBackend, StreamParser
from tenex_daemon.core.context import ChatMessage
from tenex_daemon.core.llm import BackendError, CompletionRequest

REQUEST = CompletionRequest(agent_slug="a", agent_name="A", system_prompt="", messages=[ChatMessage("user", "hi")])
SESSION = "0c7b3a5e-2f4e-4a8c-9d3e-1a2b3c4d5e6f"
CONTENT_LIMIT = 256 * 1024
"""The most content (bytes) a daemon accepts in an event: an answer is kept under it."""
ERROR_LIMIT = 1500
"""About the most characters a backend's error text may hold (1 KiB of the command's words, and a frame)."""


def result_line(**fields: Any) -> str:
    """A stream-json result line."""
    return json.dumps({"type": "result", "subtype": "success", "is_error": False, "session_id": SESSION, **fields})


def test_a_usage_count_that_is_no_number_keeps_the_answer() -> None:
    """A result whose cache_read_input_tokens is a word is the answer, its input tokens counted without it
    (it was an internal error, ValueError, and the answer was lost)."""
    parser = StreamParser()
    parser.feed(result_line(result="a whole answer", usage={
        "input_tokens": 5, "cache_read_input_tokens": "n/a", "cache_creation_input_tokens": 2, "output_tokens": 3,
    }))

    result = parser.result(REQUEST)

    assert result.text == "a whole answer"
    assert (result.prompt_tokens, result.completion_tokens) == (7, 3)


def test_a_result_over_the_size_limit_is_cut_and_said_to_be_cut() -> None:
    """A 1 MB result is cut under the 256 KiB a daemon accepts in an event, with finish reason ``length``
    (the reply then says it is not whole)."""
    parser = StreamParser()
    parser.feed(result_line(result="x" * 1_000_000))

    result = parser.result(REQUEST)

    assert CONTENT_LIMIT - 2048 <= len(result.text) <= CONTENT_LIMIT - 1024
    assert result.finish_reason == "length"


def test_streamed_text_stops_at_the_size_limit() -> None:
    """Partial deltas past the size limit are neither streamed nor kept."""
    parser = StreamParser()
    delta = {"type": "stream_event", "event": {"type": "content_block_delta", "delta": {"text": "y" * 100_000}}}
    chunks = [chunk for _ in range(10) for chunk in parser.feed(json.dumps(delta))]

    assert CONTENT_LIMIT - 2048 <= sum(len(c) for c in chunks) <= CONTENT_LIMIT - 1024


def test_an_error_results_huge_text_is_trimmed() -> None:
    """An error result of 2 MB gives an error text of about 1 KB."""
    parser = StreamParser()
    parser.feed(result_line(is_error=True, result="Overloaded. " + "z" * 2_000_000))

    with pytest.raises(BackendError) as caught:
        parser.result(REQUEST)

    assert str(caught.value).startswith("claude-code: Overloaded. zzz")
    assert len(str(caught.value)) <= ERROR_LIMIT


def stand_in(tmp_path: Path, body: str) -> list[str]:
    """A ``claude`` stand-in running the Python ``body`` (after reading its prompt)."""
    script = tmp_path / "claude"
    script.write_text("import json, os, sys\nsys.stdin.read()\n" + body)
    return [sys.executable, str(script)]


@pytest.mark.integration
async def test_an_output_line_over_the_readers_limit_is_a_backend_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stdout line longer than the reader's limit is a BackendError naming the limit (it was an internal
    error, ValueError)."""
    monkeypatch.setattr(claude_code, "STREAM_LINE_LIMIT", 1024 * 1024)
    command = stand_in(tmp_path, f"""
print(json.dumps({{"type": "assistant", "message": {{"content": [{{"type": "text", "text": "x" * 2_000_000}}]}}}}))
print({result_line(result="short")!r})
""")

    with pytest.raises(BackendError) as caught:
        await ClaudeCodeBackend(command=command, timeout=30).complete(REQUEST)

    assert caught.value.kind == "other"
    assert "a line of its output is over 1 MiB" in str(caught.value)


@pytest.mark.integration
async def test_a_failures_huge_stderr_gives_its_last_words_only(tmp_path: Path) -> None:
    """A ``claude`` that writes 5 MB on stderr and fails gives an error of about 1 KB: the end of its stderr,
    where its last words are."""
    command = stand_in(tmp_path, 'sys.stderr.write("E" * 5_000_000 + " Error: the last words")\nsys.exit(2)\n')

    with pytest.raises(BackendError) as caught:
        await ClaudeCodeBackend(command=command, timeout=30).complete(REQUEST)

    assert str(caught.value).endswith("EEE Error: the last words")
    assert len(str(caught.value)) <= ERROR_LIMIT


@pytest.mark.integration
async def test_a_key_claude_is_given_is_left_out_of_its_error(tmp_path: Path) -> None:
    """A key passed to ``claude`` in its environment and echoed in its error is left out of the error."""
    key = "tq7Zb1Xv9Lm3Np5Qr8St"
    command = stand_in(tmp_path, 'print("bad key:", os.environ["ANTHROPIC_API_KEY"], file=sys.stderr)\nsys.exit(1)\n')

    with pytest.raises(BackendError) as caught:
        await ClaudeCodeBackend(command=command, timeout=30, env={"ANTHROPIC_API_KEY": key}).complete(REQUEST)

    assert key not in str(caught.value)
    assert "bad key: <redacted>" in str(caught.value)
