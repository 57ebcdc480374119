"""Modules stay small and functions simple: no file in tenex_daemon/ over 800 lines, no function over
cyclomatic complexity 25 (radon), unless it is listed here with the reason."""

from __future__ import annotations

from pathlib import Path

from radon.complexity import cc_visit  # type: ignore[import-untyped]  # radon ships no types

PACKAGE = Path(__file__).resolve().parents[2] / "tenex_daemon"
MAX_LINES = 800
MAX_COMPLEXITY = 25
ALLOWED_COMPLEX: dict[str, str] = {}
"""``module:function`` -> why it may be more complex (a parser that reads one format in one place)."""


def sources() -> list[Path]:
    """Every Python file of the package."""
    return sorted(PACKAGE.rglob("*.py"))


def test_no_file_is_over_800_lines() -> None:
    """Every module of tenex_daemon/ has at most 800 lines."""
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in sources()
        if (n := len(path.read_text("utf-8").splitlines())) > MAX_LINES
    }
    assert long == {}


def test_no_function_is_over_complexity_25() -> None:
    """No function or method of tenex_daemon/ has a cyclomatic complexity over 25, but those allowed
    with their reason."""
    complex_ = {}
    for path in sources():
        module = str(path.relative_to(PACKAGE))
        for block in cc_visit(path.read_text("utf-8")):
            name = f"{module}:{block.fullname}"
            if block.complexity > MAX_COMPLEXITY and name not in ALLOWED_COMPLEX:
                complex_[name] = block.complexity
    assert complex_ == {}
