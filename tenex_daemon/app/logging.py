"""Structured logs: JSON lines under systemd (stderr not a TTY), pretty on a terminal.

Ids bound with ``structlog.contextvars.bind_contextvars(conversation_id=..., event_id=...,
agent=...)`` appear on every line logged in that context. Standard-library loggers
(aiohttp, websockets, asyncpg) go through the same renderer. :func:`redact_secrets` keeps
secret keys out of every line: values under secret-like names are replaced, key-like
names lose 64-hex values and any ``nsec1...`` anywhere is cut. Public keys and event ids
stay intact (redaction goes by the field's name, not by the look of a hex string alone).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import MutableMapping
from typing import Any, Literal, TextIO

import structlog
from structlog.types import EventDict, Processor

LogFormat = Literal["auto", "json", "console"]
REDACTED = "[REDACTED]"

_SECRET_NAME = re.compile(
    r"secret|nsec|private|privkey|priv_key|seckey|password|passwd|token|credential|api_?key", re.IGNORECASE
)
"""Field names whose string values are always redacted."""
_KEY_NAME = re.compile(r"(?:^|_)(?:key|sk)$", re.IGNORECASE)
"""Field names like ``key`` / ``agent_key``: 64-hex values are redacted (``pubkey`` does not match)."""
_HEX64 = re.compile(r"^(?:0x)?[0-9a-fA-F]{64}$")
_NSEC = re.compile(r"nsec1[02-9ac-hj-np-z]{20,}", re.IGNORECASE)
_HANDLER_MARK = "_tenexd_handler"
_OWN_STREAM_MARK = "_tenexd_own_stream"


_PRIVATE_CHANNEL = re.compile(r"(dm:[^:\s]+:)[0-9a-fA-F]{64}")
"""A private conversation's channel (``dm:<agent>:<person's key>``): the person's key is cut, as
``loggable_channel`` cuts it, wherever one reaches a log line (a pointer's key, a lease's name)."""


def _scrub_text(text: str) -> str:
    if "nsec1" in text.lower():
        text = _NSEC.sub("nsec1" + REDACTED, text)
    return _PRIVATE_CHANNEL.sub(r"\1…", text) if "dm:" in text else text


def _redact(name: str, value: Any) -> Any:
    lowered = name.lower()
    public = "pub" in lowered
    if isinstance(value, str | bytes) and not public:
        if _SECRET_NAME.search(lowered):
            return REDACTED
        if _KEY_NAME.search(lowered) and isinstance(value, str) and _HEX64.match(value.strip()):
            return REDACTED
    if isinstance(value, str):
        return _scrub_text(value)
    if isinstance(value, MutableMapping):
        return {k: _redact(str(k), v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_redact(name, v) for v in value)
    return value


def redact_secrets(logger: Any, method_name: str, event_dict: EventDict) -> EventDict:
    """structlog processor: replace secrets by ``[REDACTED]`` (see the module doc for the rules)."""
    for name in list(event_dict):
        event_dict[name] = _redact(str(name), event_dict[name])
    return event_dict


def _resolve_format(log_format: str, stream: TextIO) -> Literal["json", "console"]:
    if log_format == "json":
        return "json"
    if log_format == "console":
        return "console"
    if log_format != "auto":
        raise ValueError(f"log format must be auto, json or console, not {log_format!r}")
    try:
        return "console" if stream.isatty() else "json"
    except (AttributeError, ValueError):
        return "json"


def _resolve_level(level: str | int) -> int:
    if isinstance(level, int):
        return level
    value = logging.getLevelName(level.strip().upper())
    if not isinstance(value, int):
        raise ValueError(f"unknown log level {level!r} (debug, info, warning, error, critical)")
    return value


QUIET_LIBRARIES = ("httpx", "httpx2", "httpcore", "httpcore2", "openai", "anthropic", "websockets", "asyncio")
"""Libraries whose own log lines are kept to warnings and errors: ``httpx`` writes one line per model call
at info, ``websockets`` some 200,000 a day at debug (every relay connection, the embedded relay's liveness
probe); the daemon says what matters of them in its own lines."""


def configure_logging(
    format: LogFormat | str = "auto",
    level: str | int = "info",
    *,
    stream: TextIO | None = None,
) -> Literal["json", "console"]:
    """Configure structlog and the standard library's logging; return the format chosen.

    ``auto`` writes JSON lines unless ``stream`` (default stderr) is a terminal. Calling
    it again replaces the previous configuration (tests do).
    """
    output = sys.stderr if stream is None else stream
    chosen = _resolve_format(format, output)
    numeric_level = _resolve_level(level)
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.stdlib.PositionalArgumentsFormatter(),
        redact_secrets,
    ]
    renderer: Processor
    final: list[Processor]
    if chosen == "json":
        renderer = structlog.processors.JSONRenderer(ensure_ascii=False, default=str)
        final = [structlog.processors.format_exc_info, redact_secrets, renderer]
    else:
        # no local variables in a traceback: they may hold what nothing else logs (a decrypted private
        # message), and redact_secrets never sees them
        tracebacks = structlog.dev.RichTracebackFormatter(show_locals=False)
        renderer = structlog.dev.ConsoleRenderer(colors=_colors(output), exception_formatter=tracebacks)
        final = [renderer]
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *final],
    )
    own = _own_stream(output)
    handler = logging.StreamHandler(own or output)
    handler.setFormatter(formatter)
    setattr(handler, _HANDLER_MARK, True)
    setattr(handler, _OWN_STREAM_MARK, own is not None)
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _HANDLER_MARK, False)]:
        root.removeHandler(old)
        if getattr(old, _OWN_STREAM_MARK, False) and isinstance(old, logging.StreamHandler):
            old.stream.close()
    root.addHandler(handler)
    root.setLevel(numeric_level)
    for library in QUIET_LIBRARIES:  # their own lines: one per model call at info, a flood at debug
        logging.getLogger(library).setLevel(max(numeric_level, logging.WARNING))
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        context_class=dict,
        cache_logger_on_first_use=False,
    )
    return chosen




def _own_stream(stream: TextIO) -> TextIO | None:
    """A stream of the log's own for the process's stdout or stderr (on a duplicate of its descriptor);
    None for any other stream (written to as it is).

    A library may point descriptors 1 and 2 at /dev/null for a while, process-wide, to silence its own
    output: llama-cpp-python does while a model loads and while it builds a tool-call grammar, in a worker
    thread, and every line the daemon logged meanwhile was lost (``daemon_ready`` among them). The
    duplicate keeps pointing where the descriptor pointed when logging was configured.
    """
    try:
        descriptor = stream.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a test's StringIO, pytest's capture)
        return None
    if descriptor not in (1, 2):
        return None
    stream.flush()
    encoding = getattr(stream, "encoding", None) or "utf-8"
    return os.fdopen(os.dup(descriptor), "w", encoding=encoding, errors="backslashreplace", buffering=1)


def _colors(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
