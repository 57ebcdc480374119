"""The claude-code backend keeps ``claude`` within bounds: its working folder, its environment, a session it lost,
a persona over an argument's limit, and the calls a daemon killed outright left running; against a stand-in
``claude`` that records what it was given."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from tenex_daemon.adapters.llm.claude_code import CALLS_DIR, ClaudeCodeBackend, end_leftover_calls
from tenex_daemon.adapters.llm.factory import make_backend
from tenex_daemon.core.context import ChatMessage
from tenex_daemon.core.llm import BackendAuthError, BackendError, CompletionRequest
from tenex_daemon.services.agent_runner import AgentProfile
from tenex_daemon.services.runs import RunRequest
from tests import pipeline
from tests.conftest import Cast
from tests.integration.llm.test_claude_code import alive

pytestmark = [pytest.mark.integration]

STAND_IN = r"""
import json, os, sys, time, uuid
args = sys.argv[1:]
prompt = sys.stdin.read()
persona = None
if "--append-system-prompt-file" in args:
    with open(args[args.index("--append-system-prompt-file") + 1], encoding="utf-8") as file:
        persona = file.read()
elif "--append-system-prompt" in args:
    persona = args[args.index("--append-system-prompt") + 1]
with open(os.environ["FAKE_CLAUDE_LOG"], "a") as log:
    log.write(json.dumps({"args": [a[:300] for a in args], "longest": max(len(a.encode()) for a in args),
                          "stdin": prompt, "cwd": os.getcwd(), "env": dict(os.environ), "persona": persona,
                          "pid": os.getpid()}) + "\n")
mode = os.environ.get("FAKE_CLAUDE_MODE", "ok")
resume = next((a.split("=", 1)[1] for a in args if a.startswith("--resume=")), None)
def emit(event):
    print(json.dumps(event), flush=True)
if mode == "forget" and resume:  # claude's own words for a session it does not have
    print(f"No conversation found with session ID: {resume}", file=sys.stderr)
    sys.exit(1)
if mode == "forget-result" and resume:
    emit({"type": "result", "subtype": "error_during_execution", "is_error": True,
          "result": f"No conversation found with session ID: {resume}"})
    sys.exit(1)
if mode == "auth":
    print("Invalid API key · Please run /login", file=sys.stderr)
    sys.exit(1)
if mode == "tool":  # a tool it started, still working, then claude works on
    import subprocess
    tool = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.environ["FAKE_CLAUDE_PIDS"], "w") as pids:
        pids.write(f"{os.getpid()} {tool.pid}")
    time.sleep(600)
session = resume or str(uuid.uuid4())
emit({"type": "system", "subtype": "init", "session_id": session, "model": "claude-stand-in"})
emit({"type": "assistant", "session_id": session, "message": {"content": [{"type": "text", "text": "Hello"}]}})
emit({"type": "result", "subtype": "success", "is_error": False, "result": "Hello", "session_id": session})
"""

GONE = "0b0c7a3e-9f1d-4c1e-8a55-1d2f3e4a5b6c"
"""A session id the stand-in (in the ``forget`` modes) does not have."""


@pytest.fixture
def claude(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], Path]:
    """The stand-in's command line and the log where it records each call (arguments, stdin, folder, environment)."""
    script = tmp_path / "claude"
    script.write_text(STAND_IN)
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_CLAUDE_LOG", str(log))
    monkeypatch.delenv("FAKE_CLAUDE_MODE", raising=False)
    return [sys.executable, str(script)], log


def calls(log: Path) -> list[dict[str, Any]]:
    """The recorded calls, in order."""
    return [json.loads(line) for line in log.read_text().splitlines()]


def request(*messages: ChatMessage, session: str | None = None, persona: str = "") -> CompletionRequest:
    """Alice's request with ``messages``."""
    return CompletionRequest(
        agent_slug="alice", agent_name="Alice", system_prompt=persona, messages=messages, session_id=session
    )


def a_home(tmp_path: Path) -> Path:
    """A daemon's home, with what it keeps for itself: keys, conversations, run folder, config.toml."""
    home = tmp_path / "home"
    for folder in ("keys", "conversations", "run"):
        (home / folder).mkdir(parents=True, mode=0o700)
    (home / "keys" / "alice.key").write_text("nsec-of-alice")
    (home / "config.toml").write_text("owner = 'x'\n")
    return home


async def test_claude_works_in_the_agents_own_folder_with_the_homes_secrets_denied(
    claude: tuple[list[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run from the home (systemd's WorkingDirectory), claude works in ``<home>/workspace/alice`` (0700), not
    in the home, and is told deny rules for the keys, the conversations (the store's elsewhere too), the run
    folder and config.toml (before, it ran in the home and its read tools read the keys without asking)."""
    command, log = claude
    home = a_home(tmp_path)
    store = tmp_path / "store" / "conversations"
    monkeypatch.chdir(home)
    backend = make_backend(
        "claude-code", options={"command": command}, home=home, run_dir=home / "run", store_path=store
    )

    assert (await backend.complete(request(ChatMessage("user", "hi")))).text == "Hello"

    call = calls(log)[0]
    workspace = home / "workspace" / "alice"
    assert call["cwd"] == str(workspace)
    assert workspace.stat().st_mode & 0o777 == 0o700
    denied = [a.removeprefix("--disallowedTools=") for a in call["args"] if a.startswith("--disallowedTools=")]
    for place in (f"{home}/keys/**", f"{home}/conversations/**", f"{home}/run/**", f"{home}/config.toml",
                  f"{store}/**"):
        assert f"Read(/{place})" in denied
        assert f"Edit(/{place})" in denied


async def test_a_configured_cwd_is_kept(
    claude: tuple[list[str], Path], tmp_path: Path
) -> None:
    """An agent's configured ``cwd`` is where claude works, the deny rules told all the same."""
    command, log = claude
    home = a_home(tmp_path)
    project = tmp_path / "project"
    project.mkdir()
    backend = ClaudeCodeBackend(command=command, cwd=project, home=home)

    await backend.complete(request(ChatMessage("user", "hi")))

    call = calls(log)[0]
    assert call["cwd"] == str(project)
    assert f"--disallowedTools=Read(/{home}/keys/**)" in call["args"]
    assert not (home / "workspace").exists()


async def test_claude_gets_none_of_the_daemons_other_secrets(
    claude: tuple[list[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """claude's environment holds no TENEX_ setting (the database's DSN), no libpq variable, no DATABASE_URL
    and no other provider's key, but its own key, its cloud's variables and the env option's (before, it had
    the daemon's whole environment)."""
    withheld = {
        "OPENAI_API_KEY": "sk-other-agents-key",
        "GEMINI_API_KEY": "gm-key",
        "TENEX_STORAGE__DSN": "postgresql://tenex:hunter2@db/tenex",
        "TENEX_HOME": "/var/lib/tenexd",
        "PGPASSWORD": "hunter2",
        "PGPASSFILE": "/var/lib/tenexd/.pgpass",
        "DATABASE_URL": "postgresql://tenex:hunter2@db/tenex",
    }
    kept = {"ANTHROPIC_API_KEY": "sk-ant-own", "CLAUDE_CODE_USE_BEDROCK": "1", "AWS_REGION": "eu-west-1"}
    for name, value in (withheld | kept).items():
        monkeypatch.setenv(name, value)
    command, log = claude
    backend = ClaudeCodeBackend(command=command, env={"TENEX_GIVEN": "by the option", "HTTPS_PROXY": "http://p"})

    await backend.complete(request(ChatMessage("user", "hi")))

    env = calls(log)[0]["env"]
    assert not set(withheld) & set(env)
    assert {name: env.get(name) for name in kept} == kept
    assert (env["TENEX_GIVEN"], env["HTTPS_PROXY"], env["PATH"]) == ("by the option", "http://p", os.environ["PATH"])


@pytest.mark.parametrize("mode", ["forget", "forget-result"])
async def test_a_session_claude_no_longer_has_is_started_anew_with_every_message(
    claude: tuple[list[str], Path], monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """A resumed session claude says it has no conversation of (on stderr, or in its error result) is
    started anew once, every message sent, and the new session's id returned (before, the call failed, and
    so did every later one of the agent in that conversation)."""
    monkeypatch.setenv("FAKE_CLAUDE_MODE", mode)
    command, log = claude
    history = (ChatMessage("user", "Hi Alice"), ChatMessage("assistant", "Hello"), ChatMessage("user", "And now?"))

    with capture_logs() as logs:
        result = await ClaudeCodeBackend(command=command).complete(request(*history, session=GONE))

    assert result.text == "Hello"
    assert result.session_id not in (None, GONE)
    first, second = calls(log)
    assert f"--resume={GONE}" in first["args"]
    assert first["stdin"] == "And now?"
    assert not any(a.startswith("--resume") for a in second["args"])
    assert second["stdin"] == "Hi Alice\n\n[You]: Hello\n\nAnd now?"
    assert [e["session"] for e in logs if e["event"] == "claude_session_not_found"] == [GONE]


async def test_another_failure_of_a_resumed_call_is_not_tried_again(
    claude: tuple[list[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resumed call that fails otherwise (a refused key) fails once, its session kept for the next call."""
    monkeypatch.setenv("FAKE_CLAUDE_MODE", "auth")
    command, log = claude

    with pytest.raises(BackendAuthError):
        await ClaudeCodeBackend(command=command).complete(request(ChatMessage("user", "hi"), session=GONE))

    assert len(calls(log)) == 1


async def test_an_agent_whose_session_is_gone_answers_and_keeps_the_new_one(
    claude: tuple[list[str], Path], monkeypatch: pytest.MonkeyPatch, cast: Cast
) -> None:
    """In agent runs, once claude has lost the agent's session the next run still answers, and the new
    session's id replaces the stored one (before, every later run in the conversation failed)."""
    command, _ = claude
    backend = ClaudeCodeBackend(command=command)
    rig = pipeline.build_rig(
        cast, profiles={"alice": AgentProfile(cast.alice, "", backend)}, agents=[cast.alice],
        composer=pipeline.real_composer(cast),
    )
    manager, runner = rig.manager, rig.runner
    root = cast.user_says("Hi Alice", kind=11, tags=[["p", cast.alice.pubkey]])
    await manager.create_conversation(root)
    await runner.run(RunRequest(root.id, root.id, "alice"))
    conversation = await manager.get_conversation(root.id)
    assert conversation is not None
    lost = conversation.agent_state("alice").session_id
    monkeypatch.setenv("FAKE_CLAUDE_MODE", "forget")  # every session it had is gone

    follow = cast.user_says("And now?", tags=[["E", root.id, "", root.pubkey], ["p", cast.alice.pubkey]])
    await manager.add_event(root.id, follow)
    second = await runner.run(RunRequest(root.id, follow.id, "alice"))

    assert second is not None
    assert second.content == "Hello"
    conversation = await manager.get_conversation(root.id)
    assert conversation is not None
    kept = conversation.agent_state("alice").session_id
    assert kept not in (None, lost)
    assert ["claude-session", kept] in second.tags
    await runner.flush(5.0)


async def test_a_persona_over_an_arguments_limit_is_passed_in_a_file(
    claude: tuple[list[str], Path], tmp_path: Path
) -> None:
    """A 160 KB persona (a long referenced article) reaches claude whole, through a file removed after the
    call, no argument over 128 KiB (before, every run failed: the system refused the argument, E2BIG)."""
    command, log = claude
    home = a_home(tmp_path)
    persona = "You are Alice.\n" + "An article's word. " * 8_500

    result = await ClaudeCodeBackend(command=command, home=home).complete(
        request(ChatMessage("user", "hi"), persona=persona)
    )

    assert result.text == "Hello"
    call = calls(log)[0]
    assert len(persona.encode()) > 160_000
    assert call["persona"] == persona
    assert call["longest"] < 128 * 1024
    assert "--append-system-prompt" not in call["args"]
    assert list((home / "run").rglob("claude-persona-*")) == []


def test_a_persona_file_a_killed_call_left_is_removed_at_the_next_start(tmp_path: Path) -> None:
    """The persona file of a call whose daemon was killed outright (it holds the person's recent
    conversations' summaries) is removed by the next start's :func:`end_leftover_calls` (before, one file
    stayed in the run folder per killed call, for good, whatever was deleted since)."""
    calls_dir = a_home(tmp_path) / "run" / CALLS_DIR
    calls_dir.mkdir(parents=True)
    left = calls_dir / "claude-persona-k1ll3d.md"
    left.write_text("## Recent conversations\n- a summary")

    assert end_leftover_calls(calls_dir.parent) == []

    assert not left.exists()


async def test_a_command_line_the_system_refuses_as_too_long_is_a_backend_error(
    claude: tuple[list[str], Path],
) -> None:
    """A command line the system refuses as too long (an operator's 200 KB extra argument) is a backend error
    saying so (before: an internal error, OSError)."""
    command, _ = claude
    backend = ClaudeCodeBackend(command=command, extra_args=["--append-system-prompt", "x" * 200_000])

    with pytest.raises(BackendError) as caught:
        await backend.complete(request(ChatMessage("user", "hi")))

    assert caught.value.kind == "bad_request"
    assert "too long (E2BIG)" in str(caught.value)
    assert "the longest 200000 bytes" in str(caught.value)


def ended_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` has ended within ``seconds``."""
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


DAEMON = """
import asyncio, sys
from tenex_daemon.adapters.llm.claude_code import ClaudeCodeBackend
from tenex_daemon.core.context import ChatMessage
from tenex_daemon.core.llm import CompletionRequest
backend = ClaudeCodeBackend(command=sys.argv[2:], home=sys.argv[1])
asyncio.run(backend.complete(CompletionRequest("alice", "Alice", "", [ChatMessage("user", "hi")])))
"""
"""A daemon that makes one claude-code call."""


def test_the_calls_a_daemon_killed_outright_left_running_are_ended_at_its_next_start(
    claude: tuple[list[str], Path], tmp_path: Path
) -> None:
    """A daemon SIGKILLed during a call leaves claude and its tool running (their own process group); the
    next start's :func:`end_leftover_calls` ends both and removes the record (before, they ran on, and the
    run redone started a second claude on the session)."""
    command, _ = claude
    home = a_home(tmp_path)
    pids_file = tmp_path / "pids"
    env = dict(os.environ, FAKE_CLAUDE_MODE="tool", FAKE_CLAUDE_PIDS=str(pids_file))
    daemon = subprocess.Popen(
        [sys.executable, "-c", DAEMON, str(home), *command], env=env, cwd=Path(__file__).parents[3]
    )
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while not pids_file.exists() or len(pids_file.read_text().split()) < 2:
            assert time.monotonic() < deadline, "claude never started its tool"
            assert daemon.poll() is None, "the daemon ended before claude started its tool"
            time.sleep(0.05)
        pids = [int(pid) for pid in pids_file.read_text().split()]
        daemon.kill()
        daemon.wait()
        assert [alive(pid) for pid in pids] == [True, True]

        assert end_leftover_calls(home / "run") == [pids[0]]

        assert [ended_within(pid, 5) for pid in pids] == [True, True]
        assert list((home / "run" / CALLS_DIR).iterdir()) == []
    finally:
        daemon.kill()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_record_whose_group_holds_no_process_of_the_call_ends_nothing(tmp_path: Path) -> None:
    """A record naming a process group none of whose processes holds the call's mark (its pid taken since by
    another process) ends nothing, and is removed."""
    other = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
    )
    try:
        records = tmp_path / "run" / CALLS_DIR
        records.mkdir(parents=True)
        (records / f"{other.pid}.json").write_text(json.dumps({"group": other.pid, "mark": "not-its-mark"}))
        (records / "broken.json").write_text("{")

        assert end_leftover_calls(tmp_path / "run") == []

        assert alive(other.pid)
        assert list(records.iterdir()) == []
    finally:
        other.kill()
        other.wait()


async def test_a_call_that_ended_leaves_no_record(
    claude: tuple[list[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call's record is there while it runs only: once it ended, answered or failed, none is left."""
    command, _ = claude
    home = a_home(tmp_path)
    backend = ClaudeCodeBackend(command=command, home=home)
    seen: list[int] = []

    async def on_chunk(text: str) -> None:
        seen.append(len(list((home / "run" / CALLS_DIR).iterdir())))

    await backend.complete(replace(request(ChatMessage("user", "hi")), on_chunk=on_chunk))
    monkeypatch.setenv("FAKE_CLAUDE_MODE", "auth")
    with pytest.raises(BackendAuthError):
        await backend.complete(request(ChatMessage("user", "hi")))

    assert seen == [1]
    assert list((home / "run" / CALLS_DIR).iterdir()) == []
