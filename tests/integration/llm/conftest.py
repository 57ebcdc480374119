"""Fixtures for the LLM backend tests: the claude stand-in (model servers: tests/llm_servers.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.llm_servers import LlamaServer, Reply, ScriptedServer, free_port

__all__ = ["LlamaServer", "Reply", "ScriptedServer", "free_port"]

STAND_IN = r"""
import json, os, sys, time
args = sys.argv[1:]
prompt = sys.stdin.read()
with open(os.environ["FAKE_CLAUDE_LOG"], "a") as log:
    log.write(json.dumps({"args": args, "stdin": prompt}) + "\n")
mode = os.environ.get("FAKE_CLAUDE_MODE", "ok")
if mode == "auth":
    print("Invalid API key · Please run /login", file=sys.stderr)
    sys.exit(1)
if mode == "tool":  # a tool it started, still working (it holds the output too), then claude hangs
    import subprocess
    tool = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.environ["FAKE_CLAUDE_TOOL_PID"], "w") as pid_file:
        pid_file.write(str(tool.pid))
    time.sleep(60)
if mode == "hang":
    time.sleep(60)
if mode in ("background", "gone"):  # a tool left running in the background, holding the output too
    import subprocess
    tool = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.environ["FAKE_CLAUDE_TOOL_PID"], "w") as pid_file:
        pid_file.write(str(tool.pid))
    if mode == "gone":  # claude itself ends without its result line
        sys.exit(0)
session = next((a.split("=", 1)[1] for a in args if a.startswith("--resume=")), "sess-new-1")
def emit(event):
    print(json.dumps(event), flush=True)
emit({"type": "system", "subtype": "init", "session_id": session, "model": "claude-stand-in", "tools": ["Bash"]})
emit({"type": "assistant", "session_id": session, "message": {"model": "claude-stand-in", "content": [{"type": "text", "text": "Hello "}]}})
emit({"type": "assistant", "session_id": session, "message": {"model": "claude-stand-in", "content": [{"type": "text", "text": "from Claude"}]}})
emit({"type": "result", "subtype": "success", "is_error": False, "result": "Hello from Claude", "session_id": session,
      "usage": {"input_tokens": 42, "output_tokens": 4}, "total_cost_usd": 0.002})
"""


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], Path]:
    """The stand-in's command line and the log where it records each call's arguments and stdin."""
    script = tmp_path / "claude"
    script.write_text(STAND_IN)
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_CLAUDE_LOG", str(log))
    monkeypatch.delenv("FAKE_CLAUDE_MODE", raising=False)
    return [sys.executable, str(script)], log
