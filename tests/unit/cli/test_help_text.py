"""A command's help wraps at the terminal's width: its paragraphs are not cut where the docstring's lines
end ("and the" / "settings' error"), and a docstring's double backquotes show as single ones."""

from __future__ import annotations

import os
import subprocess
import sys

from tenex_daemon.cli.typer_app import flowing


def test_each_paragraph_flows_on_one_line_and_a_marked_one_is_kept() -> None:
    """Paragraphs are joined into one line each; one marked ``\\b`` keeps its lines; what follows ``\\f``
    (not shown by the help) is kept as it is."""
    text = "First line\n    goes on.\n\nSecond ``code``\n    paragraph.\n\n\b\nkept\n  as is\f\nhidden\n  lines"

    assert flowing(text) == "First line goes on.\n\nSecond `code` paragraph.\n\n\b\nkept\n  as is\f\nhidden\n  lines"


def test_status_help_shows_its_second_paragraph_unbroken_at_a_wide_terminal() -> None:
    """``tenexd status --help`` at 200 columns has the sentence its docstring breaks after "and the" on one
    line, with `settings_error` in single backquotes."""
    environment = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "tenex_daemon.cli.main", "status", "--help"],
        capture_output=True, text=True, env=environment, timeout=60, check=True,
    )
    lines = [" ".join(line.split()) for line in done.stdout.splitlines()]

    assert any("reported all the same, and the settings' error is a warning line" in line for line in lines)
    assert "``" not in done.stdout
