"""`tenexd ... --help` shows what each option takes as a person reads it: a flag nothing, a text TEXT, a number
INTEGER or FLOAT, a file PATH, and arguments by their names in the usage line (not Typer 0.29's Python
type labels: `<bool>`, `<str>`, `<int range>`, `<list[str]>`, `{text}`)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from tenex_daemon.cli.main import app

TYPE_LABEL = re.compile(r"<[a-z][a-z_ \[\],|]*>")
"""A Python type as Typer 0.29 labels it in help (``<bool>``, ``<str>``, ``<int range>``, ``<list[str]>``)."""


def command_paths(command: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The path of names of ``command`` and of every command and group under it."""
    subcommands = getattr(command, "commands", None) or {}
    return [path, *(p for name, sub in subcommands.items() for p in command_paths(sub, (*path, name)))]


PATHS = command_paths(typer.main.get_command(app))


def help_of(*path: str) -> str:
    """The help ``tenexd PATH --help`` prints, 120 columns wide."""
    result = CliRunner().invoke(app, [*path, "--help"], prog_name="tenexd", terminal_width=120)
    assert result.exit_code == 0, result.output
    return result.stdout


def test_every_command_and_group_is_walked() -> None:
    """The walk reaches tenexd, its groups and every command in them (a group added later is walked too)."""
    assert {(), ("conversations",), ("agents",), ("send",), ("conversations", "list")} <= set(PATHS)
    assert len(PATHS) >= 20


@pytest.mark.parametrize("path", PATHS, ids=lambda path: " ".join(path) or "tenexd")
def test_no_help_shows_a_python_type_label(path: tuple[str, ...]) -> None:
    """The help of each command and group shows no Python type label (`<bool>`, `<str>`...) and no
    argument in braces (`{text}`)."""
    text = help_of(*path)

    assert TYPE_LABEL.findall(text) == []
    assert re.findall(r"\{\w+\}", text) == []


def option_row(text: str, option: str) -> str:
    """The words of the help table's row of ``option`` up to its help text (the option, its secondary
    option and what it takes), borders and the required mark left out."""
    for line in text.splitlines():
        cells = line.strip("│ ").removeprefix("* ").split("  ")
        names = [cell.strip() for cell in cells if cell.strip()]
        if names and names[0] == option:
            return " ".join(names[:-1])
    raise AssertionError(f"no row for {option} in:\n{text}")


def test_flags_take_nothing_and_values_say_what_they_are() -> None:
    """Flags (`--json`, `--archived/--active`, `--help`) show no metavar; text options TEXT (repeatable ones
    too), numbers INTEGER or FLOAT with their range, files PATH; the usage line names the arguments, an
    optional one in brackets."""
    listing = help_of("conversations", "list")
    assert option_row(listing, "--archived") == "--archived"
    assert option_row(listing, "--json") == "--json"
    assert option_row(listing, "--help") == "--help"
    assert option_row(listing, "--phase") == "--phase TEXT"
    assert option_row(listing, "--limit") == "--limit INTEGER [x>=1]"
    assert option_row(help_of("conversations", "search"), "--archived") == "--archived --active"
    send = help_of("send")
    assert "Usage: tenexd send [OPTIONS] TEXT" in send
    assert option_row(send, "--relay") == "--relay TEXT"
    assert option_row(send, "--kind") == "--kind INTEGER"
    assert option_row(send, "--timeout") == "--timeout FLOAT [x>=0.1]"
    assert option_row(help_of("conversations", "export"), "--output") == "--output -o PATH"
    assert "Usage: tenexd conversations show [OPTIONS] ID" in help_of("conversations", "show")
    assert "Usage: tenexd conversations rebuild [OPTIONS] [ID]" in help_of("conversations", "rebuild")
    assert "Usage: tenexd agents add [OPTIONS] [SLUG]" in help_of("agents", "add")


def test_a_missing_argument_is_named_as_the_usage_line_names_it() -> None:
    """`tenexd send` without its text says the argument the usage line calls TEXT is missing (exit 2)."""
    result = CliRunner().invoke(app, ["send"], prog_name="tenexd", terminal_width=120)

    assert result.exit_code == 2
    assert "Usage: tenexd send [OPTIONS] TEXT" in result.stderr
    assert "Missing argument 'TEXT'." in result.stderr
