"""What the command line tells a person on the way: `status` reports the daemon and warns of settings the other
commands refuse; `init` names the `run` that fits the relays given; `conversations search` names its own
options in errors; `agents add` refuses a reserved or malformed slug in a plain sentence; the command listings
of `--help` show each command's summary on one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import typer
from typer import rich_utils
from typer.testing import CliRunner

from tenex_daemon.app.settings import load_settings
from tenex_daemon.app.status import DaemonState, new_status, write_status
from tenex_daemon.cli.main import app


def tenexd(home: Path, *args: str) -> tuple[int, str, str]:
    """Run ``tenexd --home HOME ARGS``; return (exit code, stdout, stderr with its lines joined)."""
    result = CliRunner().invoke(app, ["--home", str(home), *args], catch_exceptions=False)
    return result.exit_code, result.stdout, " ".join(result.stderr.split())


def write_running_status(home: Path) -> None:
    """A fresh status file of a running daemon in ``home`` (no control API answers: the file is read)."""
    data = new_status("0.0.0", home=str(home))
    data["state"] = DaemonState.RUNNING.value
    write_status(load_settings(home).status_path, data)


def test_status_reports_the_daemon_and_warns_of_settings_the_other_commands_refuse(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a misspelt setting in the environment (TENEX_DAEMON__HOP_LIMT), which `conversations list` refuses
    with exit 2, `status` still says the daemon runs (exit 0) and prints the settings' error as a warning line
    on stderr; --json carries it as `settings_error` (null when the settings load)."""
    write_running_status(home)
    assert tenexd(home, "status", "--json")[2] == ""
    assert json.loads(tenexd(home, "status", "--json")[1])["settings_error"] is None
    monkeypatch.setenv("TENEX_DAEMON__HOP_LIMT", "3")

    code, printed, said = tenexd(home, "status")
    json_code, as_json, json_said = tenexd(home, "status", "--json")

    refused = tenexd(home, "conversations", "list")
    assert refused[0] == 2
    error = refused[2].removeprefix("error: ")
    assert "TENEX_DAEMON__HOP_LIMT" in error
    assert (code, json_code) == (0, 0)
    assert printed.startswith("tenexd: running")
    assert said.startswith(f"warning: {error} (other commands refuse these settings")
    assert json_said == said
    report = json.loads(as_json)
    assert (report["healthy"], report["settings_error"]) == (True, error)


@pytest.mark.parametrize(
    ("relays", "next_step"),
    [(["--relay", "wss://relay.example"], "run"), ([], "run --embedded-relay")],
)
def test_init_names_the_run_that_fits_the_relays_given(tmp_path: Path, relays: list[str], next_step: str) -> None:
    """`init --relay URL` ends with `Next: tenexd --home H run` (the daemon uses that relay), and `init` without
    relays with `run --embedded-relay` (without a relay `run` refuses to start)."""
    path = tmp_path / "home"

    code, printed, _ = tenexd(path, "init", *relays)

    assert code == 0
    assert printed.splitlines()[-1] == f"Next: tenexd --home {path} {next_step}"


@pytest.mark.parametrize(("option", "value"), [("--from", "yesterday"), ("--to", "tomorrow")])
def test_search_names_its_own_date_option_in_errors(home: Path, option: str, value: str) -> None:
    """`conversations search --from yesterday` exits 2 naming --from (not the control API's `date_from`), and
    --to likewise."""
    code, _, said = tenexd(home, "conversations", "search", option, value)

    assert (code, said) == (2, f"error: {option} must be an ISO 8601 date or Unix seconds, got {value!r}")


OWNER_REFUSAL = (
    "error: 'owner' cannot be an agent's slug: keys/owner.key holds the home's owner key; choose another slug "
    "(it may not be import, owner, project)"
)


@pytest.mark.parametrize(
    ("args", "refusal"),
    [
        (["owner"], OWNER_REFUSAL),
        (["--from", "nevent1qqs0000", "--slug", "owner"], OWNER_REFUSAL),
        (["a__b"], "error: invalid agent: a slug must not contain '__' (it separates names in thread keys)"),
    ],
    ids=["owner", "from-owner", "double-underscore"],
)
def test_agents_add_refuses_a_reserved_or_malformed_slug_in_a_plain_sentence(
    home: Path, args: list[str], refusal: str
) -> None:
    """`agents add owner` (or `--from ... --slug owner`) and `agents add a__b` exit 2 with a plain sentence,
    without the validation library's wording (`slug: Value error, ...`)."""
    code, _, said = tenexd(home, "agents", "add", *args)

    assert (code, said) == (2, refusal)


def command_rows(*path: str) -> tuple[list[str], list[str]]:
    """The commands a group lists, and the rows of its help's Commands panel (printed 1,000 columns wide)."""
    group = typer.main.get_command(app)
    for name in path:
        group = group.commands[name]  # type: ignore[attr-defined]  # a click Group: it has commands
    result = CliRunner().invoke(app, [*path, "--help"], prog_name="tenexd")
    assert result.exit_code == 0, result.output
    panel = result.stdout.split("─ Commands ─", 1)[1].split("╰", 1)[0]
    rows = [line.strip("│ \n") for line in panel.splitlines()[1:] if line.strip("│ ")]
    return list(group.commands), rows  # type: ignore[attr-defined]


@pytest.mark.parametrize("path", [(), ("conversations",), ("agents",)], ids=lambda p: " ".join(p) or "tenexd")
def test_each_listed_command_is_summed_up_on_one_line(path: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    """Printed wide enough, each command a group's help lists takes one row, its summary whole (the first
    paragraph of its help: the status row reads "degraded (the reason is shown)", not cut after "degraded")."""
    monkeypatch.setattr(rich_utils, "MAX_WIDTH", 1000)

    commands, rows = command_rows(*path)

    assert [re.split(r"\s+", row, maxsplit=1)[0] for row in rows] == commands
    if not path:
        status = next(row for row in rows if row.startswith("status "))
        assert "stale or degraded (the reason is shown), 2 when the home" in status
