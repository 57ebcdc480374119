"""The ``claude-code`` backend: runs the ``claude`` command line and reads its JSON event stream.

Each call runs ``claude -p --output-format stream-json --verbose`` with the prompt on standard input,
``--resume=<session>`` (one argument, a well-formed id only) when the agent already has a Claude Code
session, ``--model`` and ``--append-system-prompt`` (the persona). The stream is one JSON object per line:

- ``{"type": "system", "subtype": "init", "session_id": ...}`` first;
- ``{"type": "assistant", "message": {"content": [{"type": "text", "text": ...}, ...]}}`` per turn;
- ``{"type": "stream_event", "event": {"type": "content_block_delta", "delta": {"text": ...}}}`` for
  partial text when ``--include-partial-messages`` is passed (option ``partial_messages``);
- ``{"type": "result", "is_error": ..., "result": <final text>, "session_id": ..., "usage": {...}}`` last.

The session id it reports is returned in :attr:`CompletionResult.session_id`, for the caller to keep per
agent and tag ``claude-session`` on the reply. Claude Code runs its own tools; the request's tools are not
passed to it. When resuming, only the messages after the agent's own last reply are sent (Claude Code
already holds the earlier ones in its session). ``claude`` runs in a process group of its own: a call that
times out, fails or is cancelled (a stop) kills the group, ``claude`` and the tools it started alike (one
that left the group, with ``setsid``, is not found); so does the daemon's forced exit (:func:`kill_running`).
Once the result line is in, the call waits at most :data:`KILL_WAIT_S` for ``claude`` to exit. A tool it
left running in the background that still holds its output (stdout or stderr) then is killed with the group,
and the call's pipes are closed: its output is nobody's any more (no later call can read it, and once the
pipes are closed its next write fails), and pipes left open would cost the daemon two file descriptors a
call for as long as the tool ran. A background tool that does not hold the output keeps running.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Sequence
from typing import Any

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
    """Runs one ``claude`` process per call and resumes the agent's session."""

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
    ) -> None:
        self.command = [command] if isinstance(command, str) else list(command)
        self.model = model
        self.timeout = timeout
        self.cwd = cwd
        self.partial_messages = partial_messages
        self.extra_args = list(extra_args)
        self.env = env

    def _secrets(self) -> list[str]:
        """The credentials ``claude`` is run with (:data:`KEY_VARIABLES`, and the ``env`` option's variables
        whose name says so): a command that echoes one in its error does not publish it."""
        variables = {name: os.environ.get(name, "") for name in KEY_VARIABLES} | dict(self.env or {})
        return [value for name, value in variables.items() if _names_a_secret(name)]

    def arguments(self, request: CompletionRequest) -> list[str]:
        """The command line for one call."""
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
        if request.system_prompt:
            args += ["--append-system-prompt", request.system_prompt]
        return args + self.extra_args

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Run ``claude`` once; stream assistant text into ``request.on_chunk`` when it is set."""
        prompt = build_prompt(request.messages, resuming=_resumable_session(request) is not None)
        loop = asyncio.get_running_loop()
        try:
            # asyncio.create_subprocess_exec, keeping the transport: the call closes it when it ends
            transport, protocol = await loop.subprocess_exec(
                lambda: asyncio.subprocess.SubprocessStreamProtocol(limit=STREAM_LINE_LIMIT, loop=loop),
                *self.arguments(request),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=self.cwd,
                env=None if self.env is None else {**os.environ, **self.env},
                start_new_session=True,  # a group of its own: a run cut short ends the tools it started too
            )
        except (FileNotFoundError, PermissionError) as exc:
            raise backend_error(
                BackendErrorKind.UNREACHABLE, f"claude-code: cannot run {self.command[0]!r}: {exc}"
            ) from exc
        process = asyncio.subprocess.Process(transport, protocol, loop)
        _RUNNING_GROUPS.add(process.pid)
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
