"""What the CLI prints: the consoles, JSON, times and durations, and failures with their exit codes.

Exit codes: 0 success, 1 not found / not running / no answer, 2 bad input or configuration.
"""

from __future__ import annotations

import json
import math
import re
import sys
from datetime import UTC, datetime
from typing import Annotated, Any, Final, NoReturn

import typer
from rich.console import Console
from rich.text import Text

EXIT_FAILURE: Final = 1
EXIT_USAGE: Final = 2

WIDE: Final = 220
"""Console width when output is not a terminal: ids and npubs are never cut."""


def _console_width(stream: Any) -> int | None:
    try:
        return None if stream.isatty() else WIDE
    except (AttributeError, ValueError):
        return WIDE


# markup and emoji codes off: what the CLI prints holds people's and models' words (titles, reasons, names),
# which Rich would read as markup ("[/x]" raised, "[draft]" vanished) or emoji (":rocket:" became a
# picture); styles are given as Text's style instead
out = Console(soft_wrap=True, markup=False, emoji=False, width=_console_width(sys.stdout))
err = Console(stderr=True, soft_wrap=True, markup=False, emoji=False, width=_console_width(sys.stderr))

JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]

_CONTROL_CHARACTERS: Final = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(value: object) -> str:
    """``value`` as text safe to print on a terminal: each C0 and C1 control character but line feed and tab
    (ESC among them) written as a visible escape, ``\\x1b``.

    Titles, summaries, reasons and messages come from people and models: an escape sequence in them would
    reach the operator's terminal (Rich drops only a few control characters) and set its title, write its
    clipboard (OSC 52) or move the cursor over what was printed. An escape rather than U+FFFD shows which
    character was there. ``--json`` needs none of this: JSON escapes them.
    """
    return _CONTROL_CHARACTERS.sub(lambda match: f"\\x{ord(match.group()):02x}", str(value))


def fail(message: str, code: int = EXIT_FAILURE) -> NoReturn:
    """Print ``error: message`` on stderr (its control characters shown, as it may quote the daemon or a
    relay) and exit with ``code``."""
    err.print(Text(f"error: {printable(message)}", style="bold red"))
    raise typer.Exit(code)


def print_json(data: Any) -> None:
    """Write ``data`` to stdout as indented JSON (non-ASCII kept as is)."""
    sys.stdout.write(json.dumps(data, ensure_ascii=False, indent=2) + "\n")


def ms_time(ms: int | float | None) -> str:
    """A time in milliseconds since the epoch as ``YYYY-MM-DD HH:MM:SS`` (UTC), ``-`` when unset."""
    if not ms:
        return "-"
    try:
        return datetime.fromtimestamp(float(ms) / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, ValueError, OSError):  # past what a calendar shows: say the number
        return f"{ms} ms (out of range)"


def s_time(seconds: float | None) -> str:
    """A time in seconds since the epoch as ``YYYY-MM-DD HH:MM:SSZ``, ``-`` when unset."""
    if seconds is None:
        return "-"
    try:
        return datetime.fromtimestamp(float(seconds), UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    except (OverflowError, ValueError, OSError):  # past what a calendar shows: say the number
        return f"{seconds} s (out of range)"


def duration(seconds: float) -> str:
    """A duration in its two largest units: ``2d 3h 4m``, ``3h 4m``, ``4m 5s`` or ``5s``; one that is not a
    finite number (a status file of another writer's: NaN, Infinity, a whole number past any float) as
    written."""
    try:
        finite = math.isfinite(seconds)
    except OverflowError:
        finite = False
    if not finite:
        return f"{seconds} s"
    total = int(seconds)
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h {minutes}m"
    if hours:
        return f"{hours}h {minutes}m"
    if minutes:
        return f"{minutes}m {secs}s"
    return f"{secs}s"
