"""The ``claude-code`` backend: runs the ``claude`` command line and reads its JSON event stream.

Each call runs ``claude -p --output-format stream-json --verbose`` with the prompt on standard input,
``--resume=<session>`` (one argument, a well-formed id only) when the agent already has a Claude Code
session, ``--model`` and ``--append-system-prompt`` (the persona; one over :data:`PERSONA_ARG_BYTES` goes in a
file, ``--append-system-prompt-file``: Linux refuses an argument over 128 KiB). The stream is one JSON object
per line:

- ``{"type": "system", "subtype": "init", "session_id": ...}`` first;
- ``{"type": "assistant", "message": {"content": [{"type": "text", "text": ...}, ...]}}`` per turn;
- ``{"type": "stream_event", "event": {"type": "content_block_delta", "delta": {"text": ...}}}`` for
  partial text when ``--include-partial-messages`` is passed (option ``partial_messages``);
- ``{"type": "result", "is_error": ..., "result": <final text>, "session_id": ..., "usage": {...}}`` last.

The session id it reports is returned in :attr:`CompletionResult.session_id`, for the caller to keep per
agent and tag ``claude-session`` on the reply. Claude Code runs its own tools; the request's tools are not
passed to it. When resuming, only the messages after the agent's own last reply are sent (Claude Code
already holds the earlier ones in its session); a session it no longer has (``No conversation found``: its
transcripts are cleaned after a while, and kept per working folder) is started anew once, with every message.

Given the daemon's home, ``claude`` is kept away from what the home holds for the daemon alone (Claude Code's
file tools read without asking): deny rules (``--disallowedTools``, which hold in every permission mode) for
its key files, conversations, run folder, embedded relay and ``config.toml``, and, unless ``cwd`` says
otherwise, a working folder of the agent's own, ``<home>/workspace/<agent>`` (0700), rather than the daemon's
(the home itself under systemd). Its environment is the daemon's without what other parts of the daemon hold
(:func:`child_environment`: the ``TENEX_`` settings, the database's password, other providers' keys). A shell
(Bash) it is allowed is not held by the deny rules: it can read whatever the daemon's user can.

``claude`` runs in a process group of its own: a call that times out, fails or is cancelled (a stop) kills
the group, ``claude`` and the tools it started alike (one that left the group, with ``setsid``, is not found);
so does the daemon's forced exit (:func:`kill_running`), and, for a daemon killed outright (SIGKILL, out of
memory) outside systemd, its next start (:func:`end_leftover_calls`, from the calls recorded in the run
folder). Once the result line is in, the call waits at most :data:`KILL_WAIT_S` for ``claude`` to exit. A tool
it left running in the background that still holds its output (stdout or stderr) then is killed with the
group, and the call's pipes are closed: its output is nobody's any more (no later call can read it, and once
the pipes are closed its next write fails), and pipes left open would cost the daemon two file descriptors a
call for as long as the tool ran. A background tool that does not hold the output keeps running.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import re
import signal
import tempfile
import uuid
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import structlog

from tenex_daemon.adapters.llm.answers import AnswerSize, capped, token_count
from tenex_daemon.adapters.llm.errors import ERROR_DETAIL_CHARS, cleaned, trimmed, without_secrets
from tenex_daemon.core.llm import (
    AssistantToolCalls,
    BackendError,
    BackendErrorKind,
    CompletionRequest,
    CompletionResult,
    LLMMessage,
    ToolResult,
    backend_error,
    mentions_context_too_long,
)
from tenex_daemon.core.vocabulary import is_session_id

DEFAULT_COMMAND = "claude"
DEFAULT_TIMEOUT = 900.0
STREAM_LINE_LIMIT = 16 * 1024 * 1024
KILL_WAIT_S = 5.0
"""How long ``claude`` is waited for to exit (its pipes closed) once its answer is in, or once killed."""
STDERR_KEPT_BYTES = 4 * ERROR_DETAIL_CHARS
"""How much of the end of ``claude``'s stderr is kept (it may write megabytes there): its last words are the
error when it fails, trimmed to :data:`~tenex_daemon.adapters.llm.errors.ERROR_DETAIL_CHARS` characters."""
CUT = "length"
"""The finish reason of an answer cut at :data:`~tenex_daemon.adapters.llm.answers.MAX_ANSWER_BYTES`."""
KEY_VARIABLES = ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "CLAUDE_CODE_OAUTH_TOKEN")
"""The environment variables ``claude`` reads its credentials from: left out of its errors."""
PERSONA_ARG_BYTES = 100 * 1024
"""The largest persona passed as an argument (``--append-system-prompt``); a larger one goes in a file. Linux
refuses any one argument over 128 KiB (MAX_ARG_STRLEN: the call failed with E2BIG)."""
WORKSPACE_DIR = "workspace"
"""The home's folder of the agents' working folders (``<home>/workspace/<agent>``), used when no ``cwd`` is
configured: inside the home, so the systemd unit's ``ReadWritePaths`` allow it, outside what is denied."""
CALLS_DIR = "claude-code"
"""The run folder's folder of the calls under way, one record each (:func:`end_leftover_calls`)."""
PERSONA_PREFIX = "claude-persona-"
"""The name's start of a persona file (:meth:`ClaudeCodeBackend._persona_file`), in :data:`CALLS_DIR`."""
CALL_MARKER = "TENEXD_CLAUDE_CALL"
"""The environment variable each ``claude`` is given its call's random mark in: the tools it starts inherit
it, so a process that holds it is known to be one of that call's, never a process that took a reused pid."""
SESSION_GONE = "no conversation found"
"""What ``claude --resume`` says (lower-cased) of a session it does not have: started anew, once."""
KEPT_PREFIXES = ("ANTHROPIC_", "CLAUDE_")
"""The variables Claude Code itself reads, never withheld from it (``ANTHROPIC_API_KEY`` ends in _API_KEY)."""
WITHHELD_PREFIXES = ("TENEX_", "PG")
"""The daemon's own settings (``TENEX_STORAGE__DSN`` holds the database's password) and libpq's variables
(``PGPASSWORD``, ``PGPASSFILE``, ``PGUSER``...): withheld from ``claude``."""
WITHHELD_NAMES = frozenset({"DATABASE_URL"})
"""The database's URL (and password) as other tools name it: withheld from ``claude``."""
WITHHELD_SUFFIXES = ("_API_KEY",)
"""Other providers' keys (``OPENAI_API_KEY``...): other agents' backends read them, ``claude`` does not."""
CLAUDE_KEYS = frozenset({"ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN"})
"""The keys ``claude`` itself reads: given to it though another backend names them (``api_key_env``)."""
_SLUG_UNSAFE = re.compile(r"[^a-z0-9_-]")
_GLOB = re.compile(r"([\\*?\[\]])")

log = structlog.get_logger(__name__)

_RUNNING_GROUPS: set[int] = set()
"""The process groups of the ``claude`` calls under way (each ``claude``'s pid is its group's id)."""


def _kill_group(group: int) -> None:
    """SIGKILL a ``claude`` and the tools it started (its process group), if any is left."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signal.SIGKILL)


def _output_held(transport: asyncio.SubprocessTransport) -> bool:
    """Whether ``claude`` still runs, or its output pipes are still open (a tool it started holds them)."""
    pipes = (transport.get_pipe_transport(fd) for fd in (1, 2))
    return transport.get_returncode() is None or any(p is not None and not p.is_closing() for p in pipes)


def kill_running() -> None:
    """Kill every ``claude`` call under way, with its tools (the daemon's forced exit, which runs no
    cleanup: in their own process groups they would not get the terminal's or the stop's signal)."""
    for group in list(_RUNNING_GROUPS):
        _kill_group(group)


def _withheld(variable: str) -> bool:
    """Whether the daemon's environment variable ``variable`` is withheld from ``claude``."""
    if variable.startswith(KEPT_PREFIXES):
        return False
    return (
        variable.startswith(WITHHELD_PREFIXES)
        or variable in WITHHELD_NAMES
        or variable.endswith(WITHHELD_SUFFIXES)
    )


def child_environment(
    environ: Mapping[str, str], extra: Mapping[str, str] | None = None, keys: Collection[str] = ()
) -> dict[str, str]:
    """The environment ``claude`` runs with: ``environ`` (the daemon's) without what other parts of the daemon
    hold and Claude Code never reads, then the ``env`` option's variables (``extra``) on top.

    Withheld: every ``TENEX_`` variable (settings: the database's DSN with its password), libpq's ``PG...``
    ones and ``DATABASE_URL``, the keys of other providers (names ending in ``_API_KEY``) an agent's shell
    or a prompt injection could otherwise print, and ``keys``: the variables the daemon's backends are
    configured to read their keys from (``api_key_env``, whatever their names), but for :data:`CLAUDE_KEYS`.
    Kept: ``ANTHROPIC_*`` and ``CLAUDE_*``, ``PATH``, ``HOME``, locale, proxies, and the cloud's (``AWS_*``,
    ``GOOGLE_*``, ``CLOUD_ML_*``: Bedrock, Vertex). The ``env`` option may give back what is withheld: it
    names what this agent's ``claude`` is to have.
    """
    configured = frozenset(keys) - CLAUDE_KEYS
    kept = {name: value for name, value in environ.items() if not _withheld(name) and name not in configured}
    return kept | dict(extra or {})


def _rule_path(path: str) -> str:
    """``path`` (absolute) in a Claude Code permission rule: ``//`` starts an absolute path (one ``/`` is the
    settings file's folder), and the pattern characters of gitignore's syntax it holds are escaped."""
    return "/" + _GLOB.sub(r"\\\1", path)


def deny_rules(
    home: Path, run_dir: Path | None = None, store_path: Path | None = None, files: Collection[Path] = ()
) -> list[str]:
    """The ``--disallowedTools`` rules that keep Claude Code's file tools out of what ``home`` holds for the
    daemon alone: its keys (``keys/``: the agents', the project's, the owner's), conversations (the store,
    ``conversations/`` or ``store_path``: private ones too), run folder (the control token), embedded relay
    and ``config.toml``, and ``files`` (the backends' key files kept elsewhere). ``Read`` rules hold for the
    tools that read (Read, Grep, Glob, LS), ``Edit`` ones for
    those that write; a folder's rules name it and all under it, under its path as given and as resolved."""
    folders = [home / "keys", home / "conversations", run_dir or home / "run", home / "relay"]
    if store_path is not None:
        folders.append(store_path)
    places = [(folder, True) for folder in folders]
    places += [(file, False) for file in (home / "config.toml", *files)]
    patterns: list[str] = []
    for place, folder in places:
        for path in dict.fromkeys((os.path.abspath(place), os.path.realpath(place))):
            escaped = _rule_path(path)
            patterns += [escaped, f"{escaped}/**"] if folder else [escaped]
    return [f"{tool}({pattern})" for pattern in dict.fromkeys(patterns) for tool in ("Read", "Edit")]


def _workspace_name(agent_slug: str) -> str:
    """The agent's working folder's name: its slug, any character a folder name should not hold replaced."""
    return _SLUG_UNSAFE.sub("_", agent_slug.lower())[:64] or "_"


def _processes() -> Iterator[int]:
    """The pids of the processes now running (none where there is no ``/proc``)."""
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                yield int(entry.name)


def _group_of(pid: int) -> int | None:
    """Process ``pid``'s process group, None when it is gone (or a zombie, which nothing can end further)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[2]) if fields[0] not in ("Z", "X") else None


def _marked(pid: int, mark: str) -> bool:
    """Whether process ``pid`` runs with the call's mark (:data:`CALL_MARKER`) in its environment."""
    try:
        environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:  # gone, or another user's
        return False
    return f"{CALL_MARKER}={mark}".encode() in environment


def _group_is_the_calls(group: int, mark: str) -> bool:
    """Whether process group ``group`` is that of the call with ``mark``: one of its processes holds the mark.
    A group's id is the pid of the process that made it, which is not given to another process while any of
    the group lives; a group of a process that took the pid since holds no process with the mark."""
    if _group_of(group) == group and _marked(group, mark):
        return True
    return any(_group_of(pid) == group and _marked(pid, mark) for pid in _processes())


def end_leftover_calls(run_dir: Path) -> list[int]:
    """End the ``claude`` calls a daemon killed outright left running (their process groups), from the records
    of :data:`CALLS_DIR` in ``run_dir``, and remove the records and the calls' persona files (they hold the
    person's recent conversations' summaries: a deletion would leave them behind); return the groups ended.

    The daemon calls it as it starts (its home is its own by then), before any run is recovered: a run redone
    would have a second ``claude`` working on the session. A group is ended only when one of its processes
    still holds the call's mark, never a process that took one of its pids since. Under systemd a daemon
    killed ends with its whole control group; this is for a daemon run otherwise.
    """
    folder = run_dir / CALLS_DIR
    try:
        records = sorted(folder.glob("*.json"))
    except OSError:
        return []
    ended: list[int] = []
    for record in records:
        try:
            fields = json.loads(record.read_text())
            group, mark = int(fields["group"]), str(fields["mark"])
        except (OSError, ValueError, KeyError, TypeError):
            group, mark = 0, ""
        if group > 1 and mark and _group_is_the_calls(group, mark):
            _kill_group(group)
            ended.append(group)
            log.warning("claude_left_running_ended", group=group, record=str(record))
        with contextlib.suppress(OSError):
            record.unlink()
    for persona in folder.glob(f"{PERSONA_PREFIX}*"):  # no call is under way yet: each is a killed call's
        with contextlib.suppress(OSError):
            persona.unlink()
    return ended


def _session_gone(error: BackendError) -> bool:
    """Whether a failed call says the session it resumed is not there (``No conversation found``)."""
    return SESSION_GONE in str(error).lower()


def _resumable_session(request: CompletionRequest) -> str | None:
    """The request's session id when it is well formed; a malformed one (stored before ids were
    checked, say) is never passed on: the call starts a new session instead."""
    return request.session_id if is_session_id(request.session_id) else None


def _render(message: LLMMessage) -> str:
    if isinstance(message, AssistantToolCalls):
        calls = ", ".join(f"{c.name}({json.dumps(dict(c.arguments))})" for c in message.tool_calls)
        return f"[You called]: {calls}" if not message.content else f"[You]: {message.content}\n{calls}"
    if isinstance(message, ToolResult):
        return f"[Result of {message.name}]: {message.content}"
    if message.role == "assistant":
        return f"[You]: {message.content}"
    return message.content


def build_prompt(messages: Sequence[LLMMessage], *, resuming: bool) -> str:
    """The text sent on standard input: every message, or only those after the agent's last reply.

    User and system messages are sent as they are (other agents' messages already carry their
    ``[Name]:`` label); the agent's own earlier replies are labelled ``[You]:``.
    """
    selected = list(messages)
    if resuming:
        last_own = max(
            (i for i, m in enumerate(selected) if m.role == "assistant"),
            default=-1,
        )
        selected = selected[last_own + 1 :] or selected[-1:]
    return "\n\n".join(_render(m) for m in selected if _render(m))


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _names_a_secret(variable: str) -> bool:
    """Whether an environment variable's name says it holds a credential."""
    return any(word in variable.upper() for word in ("KEY", "TOKEN", "SECRET", "PASSWORD"))


async def _line(stdout: asyncio.StreamReader) -> bytes:
    """The next line of ``claude``'s output (b"" at its end); a line over :data:`STREAM_LINE_LIMIT` is an
    error (asyncio's reader refuses it)."""
    try:
        return await stdout.readline()
    except ValueError:  # the reader's LimitOverrunError, as readline raises it
        raise backend_error(
            BackendErrorKind.OTHER,
            f"claude-code: a line of its output is over {STREAM_LINE_LIMIT // 2**20} MiB, the most read",
        ) from None


async def _tail(stream: asyncio.StreamReader, keep: int = STDERR_KEPT_BYTES) -> bytes:
    """All ``stream`` says, keeping its last ``keep`` bytes only."""
    kept = b""
    while chunk := await stream.read(64 * 1024):
        kept = (kept + chunk)[-keep:]
    return kept


def _kind_for_text(text: str) -> BackendErrorKind:
    lowered = text.lower()
    if mentions_context_too_long(text):
        return BackendErrorKind.CONTEXT_TOO_LONG
    if any(w in lowered for w in ("rate limit", "rate_limit", "usage limit", "429", "overloaded")):
        return BackendErrorKind.RATE_LIMIT
    if any(w in lowered for w in ("invalid api key", "authentication", "/login", "unauthorized", "401")):
        return BackendErrorKind.AUTH
    if any(w in lowered for w in ("connection", "network", "econnrefused", "enotfound")):
        return BackendErrorKind.UNREACHABLE
    return BackendErrorKind.OTHER


class StreamParser:
    """Folds the stream-json lines of one run into a result; feed lines in order, then call :meth:`result`."""

    def __init__(self) -> None:
        self.session_id: str | None = None
        self.model: str | None = None
        self.assistant_text: list[str] = []
        self.partial_text: list[str] = []
        self.final: dict[str, Any] | None = None
        self.streamed = AnswerSize()
        """What of the streamed text fits an answer's size limit (the rest is neither streamed nor kept)."""
        self._assistant_size = AnswerSize()

    def feed(self, line: str) -> list[str]:
        """Read one line; return the text chunks it carries (none for bookkeeping lines)."""
        line = line.strip()
        if not line:
            return []
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            return []
        if not isinstance(event, dict):
            return []
        if is_session_id(event.get("session_id")):
            self.session_id = event["session_id"]
        kind = event.get("type")
        if kind == "system" and isinstance(event.get("model"), str):
            self.model = event["model"]
        elif kind == "stream_event":
            text = _dict(_dict(event.get("event")).get("delta")).get("text")
            if isinstance(text, str) and text:
                kept = self.streamed.take(text)
                self.partial_text.append(kept)
                return [kept] if kept else []
        elif kind == "assistant":
            return self._assistant(_dict(event.get("message")))
        elif kind == "result":
            self.final = event
        return []

    def _assistant(self, message: dict[str, Any]) -> list[str]:
        """Read an assistant turn; return its text chunks when no partial deltas stream the text."""
        model = message.get("model")
        self.model = model if isinstance(model, str) and model else self.model
        content = message.get("content")
        texts = [
            block["text"]
            for block in (content if isinstance(content, list) else ())
            if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)
        ]
        self.assistant_text.extend(kept for text in texts if (kept := self._assistant_size.take(text)))
        if self.partial_text:
            return []
        return [kept for text in texts if (kept := self.streamed.take(text))]

    def result(self, request: CompletionRequest) -> CompletionResult:
        """The run's answer, or the :class:`BackendError` its result line reports. A usage count that is no
        number is left out, never the answer with it; an answer over the size limit is cut (finish reason
        ``length``)."""
        final = self.final
        if final is None:
            raise backend_error(BackendErrorKind.OTHER, "claude-code: the stream ended without a result line")
        text = final.get("result")
        if not isinstance(text, str):
            text = "\n\n".join(self.assistant_text)
        if final.get("is_error") or str(final.get("subtype", "success")) != "success":
            detail = trimmed(text or str(final.get("subtype")))
            raise backend_error(_kind_for_text(detail), f"claude-code: {detail}")
        usage = _dict(final.get("usage"))
        prompt = token_count(usage.get("input_tokens"))
        if prompt is not None:
            prompt += token_count(usage.get("cache_read_input_tokens")) or 0
            prompt += token_count(usage.get("cache_creation_input_tokens")) or 0
        extra: dict[str, str] = {}
        if final.get("total_cost_usd") is not None:
            extra["cost_usd"] = str(final["total_cost_usd"])
        text, cut = capped(text)
        return CompletionResult(
            text=text,
            model=self.model or request.model,
            session_id=self.session_id or _resumable_session(request),
            prompt_tokens=prompt,
            completion_tokens=token_count(usage.get("output_tokens")),
            extra=extra,
            finish_reason=CUT if cut else None,
        )


class ClaudeCodeBackend:
    """Runs one ``claude`` process per call and resumes the agent's session.

    ``home`` (the daemon's home; ``run_dir`` its run folder, ``store_path`` its store's conversations when
    not in the home) keeps ``claude`` out of what the home holds for the daemon alone (:func:`deny_rules`),
    gives each agent a working folder of its own when ``cwd`` is not set and records the calls under way for
    the next start (:func:`end_leftover_calls`); without it (a backend made outside a daemon) there are no
    deny rules, ``claude`` works in the current folder and nothing is recorded.
    """

    name = "claude-code"

    def __init__(
        self,
        *,
        command: str | Sequence[str] = DEFAULT_COMMAND,
        model: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        cwd: str | os.PathLike[str] | None = None,
        partial_messages: bool = False,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        home: str | os.PathLike[str] | None = None,
        run_dir: str | os.PathLike[str] | None = None,
        store_path: str | os.PathLike[str] | None = None,
        withheld_keys: Collection[str] = (),
        withheld_files: Collection[str | os.PathLike[str]] = (),
    ) -> None:
        self.command = [command] if isinstance(command, str) else list(command)
        self.model = model
        self.timeout = timeout
        self.cwd = cwd
        self.partial_messages = partial_messages
        self.extra_args = list(extra_args)
        self.env = env
        self.withheld_keys = frozenset(withheld_keys)
        """The variables other backends of the daemon read their keys from (``api_key_env``): withheld."""
        self.home = None if home is None else Path(home)
        self.run_dir = None if home is None else Path(run_dir) if run_dir is not None else Path(home) / "run"
        self.denied = (
            []
            if self.home is None
            else deny_rules(
                self.home,
                self.run_dir,
                None if store_path is None else Path(store_path),
                [Path(file) for file in withheld_files],
            )
        )
        """The deny rules passed on each call (``--disallowedTools=<rule>``, one argument each: an operator's
        own ``--disallowedTools`` in ``extra_args`` adds to them, as a repeated option's values do)."""

    def _secrets(self) -> list[str]:
        """The credentials ``claude`` is run with (:data:`KEY_VARIABLES`, and the ``env`` option's variables
        whose name says so): a command that echoes one in its error does not publish it."""
        variables = {name: os.environ.get(name, "") for name in KEY_VARIABLES} | dict(self.env or {})
        return [value for name, value in variables.items() if _names_a_secret(name)]

    def arguments(self, request: CompletionRequest, persona_file: str | None = None) -> list[str]:
        """The command line for one call; the persona is read from ``persona_file`` when it is given."""
        args = [*self.command, "-p", "--output-format", "stream-json", "--verbose"]
        if self.partial_messages:
            args.append("--include-partial-messages")
        session = _resumable_session(request)
        if session is not None:
            # One argument: the id can only ever be the option's value, never an option of its own.
            args.append(f"--resume={session}")
        model = request.model or self.model
        if model:
            args += ["--model", model]
        if persona_file is not None:
            args += ["--append-system-prompt-file", persona_file]
        elif request.system_prompt:
            args += ["--append-system-prompt", request.system_prompt]
        # joined to the option: a rule can never be taken for the value of an operator's option that follows
        args += [f"--disallowedTools={rule}" for rule in self.denied]
        return args + self.extra_args

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Run ``claude``; stream assistant text into ``request.on_chunk`` when it is set.

        A session to resume that ``claude`` no longer has (its transcripts are cleaned after a while, and kept
        per working folder: another ``cwd``, a home moved) would fail every later call of the agent in that
        conversation the same: the call is made once more as a first one, every message sent, and the new
        session's id is returned, to replace the stored one.
        """
        try:
            return await self._call(request)
        except BackendError as exc:
            if _resumable_session(request) is None or not _session_gone(exc):
                raise
            log.warning("claude_session_not_found", agent=request.agent_slug, session=request.session_id)
        return await self._call(replace(request, session_id=None))

    def _working_folder(self, request: CompletionRequest) -> str | os.PathLike[str] | None:
        """Where ``claude`` runs: ``cwd`` when set; else, given the home, the agent's own working folder
        (made 0700), never the daemon's folder, which is the home itself under systemd."""
        if self.cwd is not None or self.home is None:
            return self.cwd
        folder = self.home / WORKSPACE_DIR / _workspace_name(request.agent_slug)
        try:
            folder.parent.mkdir(mode=0o700, exist_ok=True)
            folder.mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            raise backend_error(
                BackendErrorKind.UNAVAILABLE, f"claude-code: cannot make its working folder {folder}: {exc}"
            ) from exc
        return folder

    def _persona_file(self, request: CompletionRequest) -> str | None:
        """A file holding the persona (0600, in the run folder when there is one), when it is over
        :data:`PERSONA_ARG_BYTES`; the caller removes it."""
        size = len(request.system_prompt.encode("utf-8"))
        if size <= PERSONA_ARG_BYTES:
            return None
        folder = None if self.run_dir is None or not self.run_dir.is_dir() else self.run_dir / CALLS_DIR
        path = None
        try:
            if folder is not None:  # beside the calls' records: a daemon killed outright leaves it there
                folder.mkdir(mode=0o700, exist_ok=True)
            descriptor, path = tempfile.mkstemp(prefix=PERSONA_PREFIX, suffix=".md", dir=folder)
            with os.fdopen(descriptor, "w", encoding="utf-8") as file:
                file.write(request.system_prompt)
        except OSError as exc:
            if path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            message = f"claude-code: cannot write the persona ({size} bytes) to a file: {exc}"
            raise backend_error(BackendErrorKind.OTHER, message) from exc
        return path

    def _record(self, group: int, mark: str) -> Path | None:
        """Record a call under way in the run folder (:func:`end_leftover_calls`); a record that cannot be
        written is logged, never the call's failure."""
        if self.run_dir is None:
            return None
        record = self.run_dir / CALLS_DIR / f"{group}.json"
        try:
            record.parent.mkdir(mode=0o700, exist_ok=True)
            record.write_text(json.dumps({"group": group, "mark": mark}))
        except OSError as exc:
            log.warning("claude_call_not_recorded", group=group, error=str(exc))
            return None
        return record

    async def _call(self, request: CompletionRequest) -> CompletionResult:
        """Run ``claude`` once."""
        prompt = build_prompt(request.messages, resuming=_resumable_session(request) is not None)
        cwd = self._working_folder(request)
        persona_file = self._persona_file(request)
        try:
            return await self._run(request, prompt, self.arguments(request, persona_file), cwd)
        finally:
            if persona_file is not None:
                with contextlib.suppress(OSError):
                    os.unlink(persona_file)

    def _too_long(self, request: CompletionRequest, args: Sequence[str]) -> BackendError:
        """The error of a command line the system refused as too long (E2BIG), saying what was long."""
        sizes = [len(os.fsencode(arg)) + 1 for arg in args]
        persona = len(request.system_prompt.encode("utf-8"))
        return backend_error(
            BackendErrorKind.BAD_REQUEST,
            f"claude-code: the system refused its command line as too long (E2BIG): {len(args)} arguments, "
            f"{sum(sizes)} bytes, the longest {max(sizes) - 1} bytes (Linux takes 128 KiB an argument); "
            f"the persona is {persona} bytes, the options' arguments (extra_args) {len(self.extra_args)}",
        )

    async def _run(
        self,
        request: CompletionRequest,
        prompt: str,
        args: Sequence[str],
        cwd: str | os.PathLike[str] | None,
    ) -> CompletionResult:
        """Run ``claude`` with ``args`` in ``cwd``, ``prompt`` on its standard input."""
        mark = uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        try:
            # asyncio.create_subprocess_exec, keeping the transport: the call closes it when it ends
            transport, protocol = await loop.subprocess_exec(
                lambda: asyncio.subprocess.SubprocessStreamProtocol(limit=STREAM_LINE_LIMIT, loop=loop),
                *args,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=cwd,
                env=child_environment(os.environ, self.env, self.withheld_keys) | {CALL_MARKER: mark},
                start_new_session=True,  # a group of its own: a run cut short ends the tools it started too
            )
        except (FileNotFoundError, PermissionError) as exc:
            raise backend_error(
                BackendErrorKind.UNREACHABLE, f"claude-code: cannot run {self.command[0]!r}: {exc}"
            ) from exc
        except OSError as exc:
            if exc.errno != errno.E2BIG:
                raise
            raise self._too_long(request, args) from None
        process = asyncio.subprocess.Process(transport, protocol, loop)
        _RUNNING_GROUPS.add(process.pid)
        record = self._record(process.pid, mark)
        answered = False
        try:
            async with asyncio.timeout(self.timeout):
                result = await self._converse(process, prompt, request)
            answered = True
            return result
        except TimeoutError:
            raise backend_error(
                BackendErrorKind.TIMEOUT, f"claude-code: no result within {self.timeout:g} s"
            ) from None
        except BackendError as exc:
            clean = cleaned(exc, self._secrets())
            if clean is exc:
                raise
            raise clean from exc
        finally:
            _RUNNING_GROUPS.discard(process.pid)
            try:
                # timed out, stopped or failed, or answered while a tool holds the output: the group goes
                if not answered or _output_held(transport):
                    _kill_group(process.pid)  # (claude may have exited already, leaving a tool running)
                    with contextlib.suppress(ProcessLookupError, TimeoutError):
                        # a tool that left the group may still hold the pipes, which wait() waits for
                        await asyncio.wait_for(process.wait(), KILL_WAIT_S)
            finally:
                transport.close()  # the pipes such a tool holds still are closed on it
                if record is not None:
                    with contextlib.suppress(OSError):
                        record.unlink()

    async def _converse(
        self, process: asyncio.subprocess.Process, prompt: str, request: CompletionRequest
    ) -> CompletionResult:
        assert process.stdin is not None
        assert process.stdout is not None
        assert process.stderr is not None
        stderr_task = asyncio.ensure_future(_tail(process.stderr))
        try:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                process.stdin.write(prompt.encode("utf-8"))
                await process.stdin.drain()
                process.stdin.close()
            parser = StreamParser()
            while raw := await _line(process.stdout):
                for chunk in parser.feed(raw.decode("utf-8", errors="replace")):
                    if request.on_chunk is not None:
                        await request.on_chunk(chunk)
                if parser.final is not None:
                    break  # the answer is whole: a tool left running may keep the pipe open
            with contextlib.suppress(TimeoutError):  # wait() may also wait for the pipes a tool holds
                await asyncio.wait_for(process.wait(), KILL_WAIT_S)
            code = process.returncode
            stderr = ""
            if parser.final is None:  # no answer: what it said on stderr is the error
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(stderr_task), KILL_WAIT_S)
                if stderr_task.done() and not stderr_task.cancelled():
                    said = stderr_task.result().decode("utf-8", errors="replace").strip()
                    # its last words, without a key (replaced before the cut: no piece of one is left)
                    stderr = trimmed(without_secrets(said, self._secrets()), tail=True)
        finally:
            if not stderr_task.done():
                stderr_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await stderr_task
        if parser.final is None and code != 0:
            detail = stderr or (f"exit status {code}" if code is not None else "no result line")
            raise backend_error(_kind_for_text(detail), f"claude-code: {detail}")
        return parser.result(request)
