"""A reader that goes away before tenexd has written everything (`tenexd status | head -1`) ends the command
quietly, as standard Unix tools do: exit status 0 and nothing on stderr (no BrokenPipeError traceback)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from tenex_daemon.app.settings import load_settings
from tenex_daemon.app.status import DaemonState, new_status, write_status
from tenex_daemon.cli.main import app
from tenex_daemon.cli.output import err, out
from tenex_daemon.cli.typer_app import TenexTyper
from tests.unit.cli.test_cli import seed_conversation

SMALL_PIPE = 4096
"""Bytes a pipe holds in the `head -1` test (a page, the least Linux allows): the output outgrows it."""


@pytest.fixture
def picnic(home: Path) -> str:
    """A conversation of 60 messages in ``home``, whose daemon's status file says it runs (a healthy
    `status` exits 0 whatever its reader does); return its id."""
    settings = load_settings(home)
    status = new_status("0.0.0", home=str(home))
    status["state"] = DaemonState.RUNNING.value
    write_status(settings.status_path, status)
    return seed_conversation(home, "Picnic plans", *[f"message {n}: {'bring bread ' * 10}" for n in range(60)])


def entry_point_with_reader_gone(monkeypatch: pytest.MonkeyPatch, home: Path, *args: str) -> int:
    """Run ``tenexd --home HOME ARGS`` as its console script does (``sys.exit(app())``), its stdout a pipe
    whose reading end is closed (every write that reaches it fails: a broken pipe), buffered as a user's
    stdout is; then flush stdout as the interpreter does at exit, where a failure is reported on stderr
    and makes the status 120. Return the exit status. What the entry point changes process-wide is put
    back after the test (stdout, the except hook, and the quiet rich sets on a console after a broken
    pipe)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    stream = open(write_end, "w", encoding="utf-8")  # noqa: SIM115 - closed below
    monkeypatch.setattr(sys, "stdout", stream)
    monkeypatch.setattr(sys, "argv", ["tenexd", "--home", str(home), *args])
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(out, "quiet", out.quiet)
    monkeypatch.setattr(err, "quiet", err.quiet)
    try:
        try:
            result = app()
        except SystemExit as exc:
            result = exc.code
        try:
            sys.stdout.flush()
        except BrokenPipeError as exc:
            print(f"Exception ignored in: {sys.stdout!r}\n{exc!r}", file=sys.stderr)
            result = 120
    finally:
        with contextlib.suppress(OSError):
            stream.close()
    return 0 if result is None else int(result)


READER_GONE_COMMANDS = [
    ("status",),
    ("status", "--json"),
    ("conversations", "list"),
    ("conversations", "list", "--json"),
    ("conversations", "search", "picnic"),
    ("conversations", "show", "{id}"),
    ("conversations", "show", "{id}", "--json"),
    ("conversations", "export", "{id}"),
    ("context", "{id}", "--agent", "planner"),
    ("agents", "list"),
    ("--help",),
    ("conversations", "list", "--help"),
]
"""Commands printing in each of the CLI's ways: rich tables and lines, JSON, export's text, help."""


@pytest.mark.parametrize("args", READER_GONE_COMMANDS, ids=" ".join)
def test_a_reader_gone_before_the_output_ends_the_command_with_status_0_and_nothing_on_stderr(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], home: Path, picnic: str,
    args: tuple[str, ...],
) -> None:
    """With stdout a pipe nobody reads any more, the entry point ends the command with status 0 and
    writes nothing on stderr."""
    status = entry_point_with_reader_gone(monkeypatch, home, *(arg.format(id=picnic) for arg in args))

    assert (status, capsys.readouterr().err) == (0, "")


def test_head_1_takes_the_first_line_and_the_command_still_writing_exits_0_quietly(
    home: Path, picnic: str
) -> None:
    """As `tenexd conversations show ID | head -1`, in a process of its own (stdout buffered, as a user's
    is): the reader takes the first line of more output than the pipe holds and closes it; the command
    exits 0 with nothing on stderr."""
    read_end, write_end = os.pipe()
    fcntl.fcntl(read_end, fcntl.F_SETPIPE_SZ, SMALL_PIPE)
    command = [sys.executable, "-m", "tenex_daemon.cli.main", "--home", str(home), "conversations", "show", picnic]
    environment = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}
    with subprocess.Popen(command, stdout=write_end, stderr=subprocess.PIPE, env=environment) as process:
        os.close(write_end)
        first = first_line_then_close(read_end)
        _, stderr = process.communicate(timeout=120)

    assert (process.returncode, stderr.decode()) == (0, "")
    assert first == b"Picnic plans\n"


def first_line_then_close(read_end: int) -> bytes:
    """Read the pipe up to its first line break (a byte at a time: nothing more), then close it."""
    line = b""
    try:
        while not line.endswith(b"\n"):
            byte = os.read(read_end, 1)
            if not byte:
                break
            line += byte
    finally:
        os.close(read_end)
    return line


def run_app(app_: TenexTyper, monkeypatch: pytest.MonkeyPatch, *, reader_open: bool) -> int:
    """Run ``app_`` as an entry point, its stdout a pipe whose reader is open or gone; return the exit status."""
    read_end, write_end = os.pipe()
    if not reader_open:
        os.close(read_end)
    stream = open(write_end, "w", encoding="utf-8")  # noqa: SIM115 - closed below
    monkeypatch.setattr(sys, "stdout", stream)
    monkeypatch.setattr(sys, "argv", ["tenexd"])
    try:
        app_()
    except SystemExit as exc:
        return int(exc.code or 0)
    finally:
        with contextlib.suppress(OSError):
            stream.close()
        if reader_open:
            os.close(read_end)
    return 0


def test_a_failed_commands_status_is_kept_when_its_reader_went_away(monkeypatch: pytest.MonkeyPatch) -> None:
    """A command that wrote to stdout and failed (exit 1) keeps its status 1 when the reader went away before
    the output was flushed: only the broken pipe is made quiet, not the failure."""
    failing = TenexTyper()

    @failing.command()
    def fail_after_output() -> None:
        sys.stdout.write("partial output\n")  # buffered: it reaches the pipe at the flush
        raise typer.Exit(1)

    assert run_app(failing, monkeypatch, reader_open=False) == 1


def test_a_broken_pipe_that_is_not_stdouts_is_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken pipe of something other than stdout (a socket, a child's pipe), stdout's reader still there,
    fails the command (exit 1), never a quiet success."""
    broken = TenexTyper()

    @broken.command()
    def lose_a_socket() -> None:
        raise BrokenPipeError(32, "Broken pipe")

    assert run_app(broken, monkeypatch, reader_open=True) == 1


@pytest.mark.parametrize("args", [("version",), ("status", "--json"), ("conversations", "show", "{id}")])
def test_output_that_cannot_be_written_ends_with_one_line_saying_why_and_exit_1(
    home: Path, picnic: str, args: tuple[str, ...]
) -> None:
    """Output sent to /dev/full (every write fails: no space left on the device) ends the command with exit 1
    and one line on stderr saying the output could not be written, not a traceback."""
    command = [sys.executable, "-m", "tenex_daemon.cli.main", "--home", str(home),
               *(arg.format(id=picnic) for arg in args)]
    with open("/dev/full", "w") as full:
        done = subprocess.run(command, stdout=full, stderr=subprocess.PIPE, timeout=120, check=False)

    assert (done.returncode, done.stderr.decode()) == (1, "error: cannot write the output: No space left on device\n")
