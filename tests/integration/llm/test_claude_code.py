"""The claude-code backend against a stand-in ``claude`` executable that speaks the same stream-json."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest

from tenex_daemon.adapters.llm import claude_code
from tenex_daemon.adapters.llm.claude_code import ClaudeCodeBackend
from tenex_daemon.core.context import ChatMessage
from tenex_daemon.core.llm import (
    BackendAuthError,
    BackendTimeoutError,
    BackendUnreachableError,
    CompletionRequest,
)
from tenex_daemon.services.agent_runner import AgentProfile
from tenex_daemon.services.runs import RunRequest
from tests import pipeline
from tests.conftest import Cast

pytestmark = [pytest.mark.integration]


def calls(log: Path) -> list[dict[str, object]]:
    """The recorded calls, in order."""
    return [json.loads(line) for line in log.read_text().splitlines()]


async def test_session_is_reported_then_resumed(stand_in: tuple[list[str], Path]) -> None:
    """The first call reports the session id and streams text; the second passes --resume with it and sends only new messages."""
    command, log = stand_in
    backend = ClaudeCodeBackend(command=command, model="sonnet")
    chunks: list[str] = []

    async def on_chunk(text: str) -> None:
        chunks.append(text)

    first = await backend.complete(
        CompletionRequest(
            agent_slug="alice",
            agent_name="Alice",
            system_prompt="You are Alice.",
            messages=[ChatMessage("user", "Hi Alice")],
            on_chunk=on_chunk,
        )
    )
    assert (first.text, first.session_id, first.model) == (
        "Hello from Claude",
        "sess-new-1",
        "claude-stand-in",
    )
    assert (first.prompt_tokens, first.completion_tokens) == (42, 4)
    assert chunks == ["Hello ", "from Claude"]

    second = await backend.complete(
        CompletionRequest(
            agent_slug="alice",
            agent_name="Alice",
            system_prompt="You are Alice.",
            messages=[
                ChatMessage("user", "Hi Alice"),
                ChatMessage("assistant", first.text),
                ChatMessage("user", "And now?"),
            ],
            session_id=first.session_id,
        )
    )
    assert second.session_id == "sess-new-1"
    recorded = calls(log)
    first_args = recorded[0]["args"]
    assert isinstance(first_args, list)
    assert not any(a.startswith("--resume") for a in first_args)
    assert recorded[0]["stdin"] == "Hi Alice"
    args = recorded[1]["args"]
    assert isinstance(args, list)
    assert "--resume=sess-new-1" in args
    assert args[args.index("--append-system-prompt") + 1] == "You are Alice."
    assert args[args.index("--output-format") : args.index("--output-format") + 2] == [
        "--output-format",
        "stream-json",
    ]
    assert recorded[1]["stdin"] == "And now?"


async def test_login_failure_is_an_auth_error(
    stand_in: tuple[list[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claude that exits non-zero saying the key is invalid gives an auth error."""
    monkeypatch.setenv("FAKE_CLAUDE_MODE", "auth")
    command, _ = stand_in
    with pytest.raises(BackendAuthError, match="Invalid API key"):
        await ClaudeCodeBackend(command=command).complete(
            CompletionRequest(
                agent_slug="a", agent_name="A", system_prompt="", messages=[ChatMessage("user", "hi")]
            )
        )


async def test_silent_claude_is_a_timeout_and_is_killed(
    stand_in: tuple[list[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claude that never answers gives a timeout error within the configured time."""
    monkeypatch.setenv("FAKE_CLAUDE_MODE", "hang")
    command, _ = stand_in
    started = time.monotonic()
    with pytest.raises(BackendTimeoutError):
        await ClaudeCodeBackend(command=command, timeout=1.0).complete(
            CompletionRequest(
                agent_slug="a", agent_name="A", system_prompt="", messages=[ChatMessage("user", "hi")]
            )
        )
    assert time.monotonic() - started < 10


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie waiting to be reaped does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


async def ended_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` (a tool of another process tree) has ended within ``seconds``."""
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:  # noqa: ASYNC110 - a process of another tree
        await asyncio.sleep(0.05)
    return not alive(pid)


HI = CompletionRequest(agent_slug="a", agent_name="A", system_prompt="", messages=[ChatMessage("user", "hi")])
"""The request of the tests that look at how a call ends, not at what it sends."""


async def test_a_timed_out_claude_ends_with_the_tools_it_started(
    stand_in: tuple[list[str], Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A claude that times out while a tool it started still works (holding its output): the error comes
    within the time limit, not when the tool ends, and the tool is ended with it (before, it ran on for good
    and the run waited for it)."""
    pid_file = tmp_path / "tool.pid"
    monkeypatch.setenv("FAKE_CLAUDE_MODE", "tool")
    monkeypatch.setenv("FAKE_CLAUDE_TOOL_PID", str(pid_file))
    command, _ = stand_in
    started = time.monotonic()
    with pytest.raises(BackendTimeoutError):
        await ClaudeCodeBackend(command=command, timeout=2.0).complete(HI)
    assert time.monotonic() - started < 6
    assert await ended_within(int(pid_file.read_text()), 5)


async def test_an_answer_is_taken_at_its_result_line_though_a_tool_left_running_holds_the_output(
    stand_in: tuple[list[str], Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A claude that answers and exits, leaving a tool running in the background that holds its output, gives
    its answer at once, not at the time limit (before, the call read the output until the limit)."""
    pid_file = tmp_path / "tool.pid"
    monkeypatch.setenv("FAKE_CLAUDE_MODE", "background")
    monkeypatch.setenv("FAKE_CLAUDE_TOOL_PID", str(pid_file))
    command, _ = stand_in
    started = time.monotonic()
    try:
        result = await ClaudeCodeBackend(command=command, timeout=60.0).complete(
            CompletionRequest(
                agent_slug="a", agent_name="A", system_prompt="", messages=[ChatMessage("user", "hi")]
            )
        )
        assert result.text == "Hello from Claude"
        assert time.monotonic() - started < 10
    finally:
        with contextlib.suppress(ProcessLookupError, ValueError, FileNotFoundError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        await asyncio.sleep(0.5)  # the pipes the tool held close: the call's process transport ends


def open_fds() -> int:
    """How many file descriptors this process holds."""
    return len(os.listdir("/proc/self/fd"))


async def test_calls_whose_claude_left_a_tool_holding_its_output_leave_no_pipe_nor_tool_behind(
    stand_in: tuple[list[str], Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Three calls whose claude answers and exits, each leaving a tool in the background that holds its
    output: once each answer is in, the tool is ended with its group and the pipes closed (before, each
    call left two pipes and its process transport open for as long as the tool ran, and the tool running:
    a daemon doing this every day ran out of file descriptors within months)."""
    pid_file = tmp_path / "tool.pid"
    monkeypatch.setenv("FAKE_CLAUDE_MODE", "background")
    monkeypatch.setenv("FAKE_CLAUDE_TOOL_PID", str(pid_file))
    monkeypatch.setattr(claude_code, "KILL_WAIT_S", 0.5)  # the grace for claude to exit, waited per call
    command, _ = stand_in
    backend = ClaudeCodeBackend(command=command, timeout=60.0)
    tools: list[int] = []
    before = open_fds()
    try:
        for _ in range(3):
            assert (await backend.complete(HI)).text == "Hello from Claude"
            tools.append(int(pid_file.read_text()))
        await asyncio.sleep(0.1)  # the pipes closed are let go at the event loop's next turn

        assert open_fds() <= before
        assert [await ended_within(tool, 5) for tool in tools] == [True, True, True]
    finally:
        for tool in tools:
            with contextlib.suppress(ProcessLookupError):
                os.kill(tool, signal.SIGKILL)
        await asyncio.sleep(0.5)  # the pipes the tools held close: the calls' transports end


async def test_a_claude_gone_without_its_result_takes_the_tools_it_started_with_it(
    stand_in: tuple[list[str], Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A claude that exits without a result line while a tool it started holds its output: the call fails
    within its time limit and the tool is ended (before, the tool ran on: the call only killed a claude
    still running)."""
    pid_file = tmp_path / "tool.pid"
    monkeypatch.setenv("FAKE_CLAUDE_MODE", "gone")
    monkeypatch.setenv("FAKE_CLAUDE_TOOL_PID", str(pid_file))
    command, _ = stand_in
    with pytest.raises(BackendTimeoutError):
        await ClaudeCodeBackend(command=command, timeout=2.0).complete(HI)
    assert await ended_within(int(pid_file.read_text()), 5)


async def test_missing_command_is_unreachable(tmp_path: Path) -> None:
    """A claude command that does not exist gives an unreachable error naming it."""
    missing = str(tmp_path / "no-such-claude")
    with pytest.raises(BackendUnreachableError, match="no-such-claude"):
        await ClaudeCodeBackend(command=missing).complete(
            CompletionRequest(
                agent_slug="a", agent_name="A", system_prompt="", messages=[ChatMessage("user", "hi")]
            )
        )


async def test_agent_runs_keep_and_resume_the_claude_session(
    stand_in: tuple[list[str], Path], cast: Cast
) -> None:
    """In agent runs, the session the command reports is kept for the agent and tagged claude-session on
    the reply; the agent's next run in the conversation resumes it."""
    command, log = stand_in
    backend = ClaudeCodeBackend(command=command, model="sonnet")
    profiles = {a.slug: AgentProfile(a, "", backend) for a in cast.agents if a.slug in ("alice", "bob")}
    rig = pipeline.build_rig(
        cast, profiles=profiles, agents=[cast.alice, cast.bob], composer=pipeline.real_composer(cast)
    )
    manager, runner = rig.manager, rig.runner
    root = cast.user_says("Hi Alice", kind=11, tags=[["p", cast.alice.pubkey]])
    await manager.create_conversation(root)

    first = await runner.run(RunRequest(root.id, root.id, "alice"))
    assert first is not None
    assert ["claude-session", "sess-new-1"] in first.tags
    conversation = await manager.get_conversation(root.id)
    assert conversation is not None
    assert conversation.agent_state("alice").session_id == "sess-new-1"

    follow = cast.user_says("And now?", tags=[["E", root.id, "", root.pubkey], ["p", cast.alice.pubkey]])
    await manager.add_event(root.id, follow)
    second = await runner.run(RunRequest(root.id, follow.id, "alice"))
    assert second is not None
    assert ["claude-session", "sess-new-1"] in second.tags
    args = calls(log)[1]["args"]
    assert isinstance(args, list)
    assert "--resume=sess-new-1" in args
    await runner.flush(5.0)
