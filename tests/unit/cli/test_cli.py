"""The tenexd command line on a home with no daemon running: init, agents, status, conversations, context."""

from __future__ import annotations

import asyncio
import itertools
import json
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import pytest
import typer
from typer.testing import CliRunner

from tenex_daemon import __version__
from tenex_daemon.app.home import load_agents, load_project_pubkey
from tenex_daemon.app.settings import load_settings
from tenex_daemon.app.status import DaemonState, new_status, write_status
from tenex_daemon.app.wiring import build_store
from tenex_daemon.cli.main import app
from tenex_daemon.cli.references import AccessError, ConversationAccess, resolve_conversation
from tenex_daemon.cli.send_command import _reply_to_argument
from tenex_daemon.core import nip19
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.testing import EventFactory
from tests.unit.cli.conftest import USER, tenexd


def tenexd_home_after(home: Path, *args: str, before: Path | None = None) -> tuple[int, str]:
    """Run ``tenexd [--home BEFORE] ARGS --home HOME`` in-process; return (exit code, stdout)."""
    leading = [] if before is None else ["--home", str(before)]
    result = CliRunner().invoke(app, [*leading, *args, "--home", str(home)], catch_exceptions=False)
    return result.exit_code, result.stdout


def tenexd_json(home: Path, *args: str) -> Any:
    """Run a ``--json`` command that must succeed and return its JSON."""
    code, out = tenexd(home, *args, "--json")
    assert code == 0, out
    return json.loads(out)


def seed_conversation(home: Path, title: str, *texts: str) -> str:
    """Store a conversation started by USER (p-tagging the planner) with follow-ups; return its id."""

    async def go() -> str:
        settings = load_settings(home)
        store = build_store(settings)
        await store.open()
        try:
            agents = load_agents(settings)
            manager = ConversationManager(store, agents, load_project_pubkey(settings))
            planner = next(a for a in agents if a.slug == "planner")
            events = EventFactory()
            root = events.event(USER, texts[0], kind=11, tags=[["title", title], ["p", planner.pubkey]])
            await manager.create_conversation(root)
            for text in texts[1:]:
                reply = events.event(USER, text, tags=[["E", root.id], ["e", root.id], ["p", planner.pubkey]])
                await manager.add_event(root.id, reply)
            return root.id
        finally:
            await store.close()

    return asyncio.run(go())


def test_init_writes_config_and_0600_keys_and_prints_npubs(tmp_path: Path) -> None:
    """`init --json` names the owner given, the project and three demo agents; every key file is 0600."""
    result = tenexd_json(tmp_path / "h", "init", "--owner", USER.pubkey)

    assert result["owner"]["pubkey"] == USER.pubkey
    assert result["owner"]["npub"] == USER.npub
    assert [a["label"] for a in result["agents"]] == ["orchestrator", "planner", "executor"]
    keys = list((tmp_path / "h" / "keys").iterdir())
    assert keys
    assert all(stat.S_IMODE(k.stat().st_mode) == 0o600 for k in keys)
    assert stat.S_IMODE((tmp_path / "h" / "keys").stat().st_mode) == 0o700
    assert (tmp_path / "h" / "config.toml").is_file()


def test_init_refuses_a_bad_owner_key(tmp_path: Path) -> None:
    """A malformed --owner is a usage error (exit 2) and creates no config."""
    code, _ = tenexd(tmp_path / "h", "init", "--owner", "npub1nonsense")

    assert code == 2
    assert not (tmp_path / "h" / "config.toml").exists()


def test_agents_list_shows_slug_name_npub_and_hex(home: Path) -> None:
    """`agents list --json` gives each agent's slug, name, npub and matching hex pubkey."""
    agents = tenexd_json(home, "agents", "list")

    assert [a["slug"] for a in agents] == ["orchestrator", "planner", "executor"]
    for agent in agents:
        assert agent["name"]
        assert nip19.decode(agent["npub"]).value == agent["pubkey"]
    code, table = tenexd(home, "agents", "list")
    assert code == 0
    assert all(a["npub"] in table and a["pubkey"] in table for a in agents)


def test_agents_list_exits_1_naming_the_agents_whose_key_cannot_be_used(home: Path) -> None:
    """With one agent's key file gone, `agents list` (table and --json) still lists every agent, the reason in
    place of that agent's npub, and exits 1 with an error naming it, as `tenexd run` would not start."""
    (home / "keys" / "planner.key").unlink()

    result = CliRunner().invoke(app, ["--home", str(home), "agents", "list"], catch_exceptions=False)
    code, out = tenexd(home, "agents", "list", "--json")

    assert result.exit_code == 1
    assert all(slug in result.stdout for slug in ("orchestrator", "planner", "executor"))
    assert "1 agent(s) without a usable key (planner)" in result.stderr
    assert code == 1
    rows = json.loads(out)
    assert [(a["slug"], a["npub"] is None) for a in rows] == [
        ("orchestrator", False), ("planner", True), ("executor", False)
    ]
    assert [a["problem"] for a in rows][1].endswith("planner.key does not exist")


def test_agents_add_creates_a_key_and_lists_it(home: Path) -> None:
    """`agents add` adds an agent with its own 0600 key file, shown by `agents list`, and says which
    backend it was given (the other agents', here the offline one)."""
    code, out = tenexd(home, "agents", "add", "critic", "--name", "Critic", "--instructions", "Find flaws.")

    assert code == 0, out
    assert "backend: offline" in out
    assert tenexd_json(home, "agents", "add", "judge")["backend"] == "offline"
    agents = tenexd_json(home, "agents", "list")
    critic = next(a for a in agents if a["slug"] == "critic")
    assert critic["name"] == "Critic"
    key_files = [p for p in (home / "keys").iterdir() if "critic" in p.name]
    assert len(key_files) == 1
    assert stat.S_IMODE(key_files[0].stat().st_mode) == 0o600


@pytest.mark.parametrize("slug", ["owner", "project", "import"])
def test_agents_add_refuses_the_names_of_the_homes_other_keys(home: Path, slug: str) -> None:
    """`agents add owner` (or project, import) exits 2: the agent's key file would be the owner's, the
    project's or the importer's, which send, the daemon and migrate read as theirs; nothing is written."""
    keys = {p.name: p.read_bytes() for p in (home / "keys").iterdir()}
    config = (home / "config.toml").read_text()

    code, out = tenexd(home, "agents", "add", slug)

    assert code == 2, out
    assert {p.name: p.read_bytes() for p in (home / "keys").iterdir()} == keys
    assert (home / "config.toml").read_text() == config


def test_status_of_a_daemon_never_started_exits_1(home: Path) -> None:
    """`status --json` without a daemon says stopped, unhealthy, and exits 1."""
    code, out = tenexd(home, "status", "--json")

    assert code == 1
    report = json.loads(out)
    assert (report["state"], report["healthy"]) == ("stopped", False)


def test_conversations_list_show_search_archive_restore_export(home: Path, tmp_path: Path) -> None:
    """The conversation commands read the store when no daemon runs, with the same JSON shapes."""
    picnic = seed_conversation(home, "Picnic plans", "Plan a picnic", "Saturday works")
    seed_conversation(home, "Logo design", "We need a logo")

    rows = tenexd_json(home, "conversations", "list")
    assert {r["title"] for r in rows} == {"Picnic plans", "Logo design"}
    found = tenexd_json(home, "conversations", "search", "picnic")
    assert [r["id"] for r in found] == [picnic]
    shown = tenexd_json(home, "conversations", "show", nip19.encode_note(picnic))
    assert [e["content"] for e in shown["history"]] == ["Plan a picnic", "Saturday works"]

    assert tenexd(home, "conversations", "archive", picnic)[0] == 0
    assert [r["title"] for r in tenexd_json(home, "conversations", "list")] == ["Logo design"]
    assert [r["id"] for r in tenexd_json(home, "conversations", "list", "--archived")] == [picnic]
    assert tenexd(home, "conversations", "restore", picnic)[0] == 0
    assert len(tenexd_json(home, "conversations", "list")) == 2

    target = tmp_path / "export.json"
    code, _ = tenexd(home, "conversations", "export", picnic, "--output", str(target))
    assert code == 0
    exported = json.loads(target.read_text())
    assert exported["id"] == picnic
    assert len(exported["history"]) == 2


def test_unknown_and_malformed_ids_exit_1_and_2(home: Path) -> None:
    """An id nobody stored exits 1; text that is no id at all exits 2."""
    assert tenexd(home, "conversations", "show", "ab" * 32)[0] == 1
    assert tenexd(home, "conversations", "show", "not-an-id")[0] == 2


def test_a_conversation_is_named_by_the_first_hex_digits_of_its_id(home: Path) -> None:
    """The commands taking a conversation id take its first 4 or more hex digits (any case) when no other
    id starts with them: show, context, export, archive, restore, end and stop act on it and print the whole
    id, and send's --reply-to names the conversation's root by them. Listings show the first 12."""
    picnic = seed_conversation(home, "Picnic plans", "Plan a picnic", "Saturday works")
    short = picnic[:6]
    listed = tenexd(home, "conversations", "list")[1]
    assert picnic[:12] in listed
    assert picnic[:13] not in listed
    assert tenexd_json(home, "conversations", "show", picnic[:12])["id"] == picnic

    assert tenexd_json(home, "conversations", "show", short.upper())["id"] == picnic
    assert tenexd_json(home, "context", short, "--agent", "planner")["conversation_id"] == picnic
    assert tenexd(home, "conversations", "end", short, "--reason", "done") == (0, f"ended {picnic}\n")
    code, printed = tenexd(home, "conversations", "archive", short)
    assert (code, printed.strip()) == (0, f"archived {picnic}")
    assert tenexd_json(home, "conversations", "show", short)["archived"] is True  # found while archived
    assert tenexd(home, "conversations", "restore", short) == (0, f"restored {picnic}\n")
    assert tenexd(home, "conversations", "stop", short) == (0, f"nothing was running in {picnic}\n")
    assert tenexd_json(home, "conversations", "show", picnic)["end_reason"] == "done"
    assert json.loads(tenexd(home, "conversations", "export", short)[1])["id"] == picnic
    assert _reply_to_argument(load_settings(home), short) == picnic
    with pytest.raises(typer.Exit) as unknown:
        _reply_to_argument(load_settings(home), "0000" if not picnic.startswith("0000") else "1111")
    assert unknown.value.exit_code == 1


def test_a_short_id_that_names_no_conversation_or_several_fails_and_says_which(home: Path) -> None:
    """A short id no conversation has exits 1; one that starts two ids exits 2 naming both and changes
    nothing; fewer than 4 hex digits exit 2 saying what an id may be."""
    first, second = _two_roots_sharing_four_digits(home)
    one = seed_conversation(home, f"Chat {first}", f"Hello {first}")
    other = seed_conversation(home, f"Chat {second}", f"Hello {second}")
    shared = one[:4]
    assert other.startswith(shared)
    unused = next(f"{n:04x}" for n in range(1 << 16) if f"{n:04x}" != shared)

    assert _failure(home, "conversations", "show", unused) == (1, f"error: no conversation id starts with {unused}")
    code, printed = _failure(home, "conversations", "archive", shared)
    assert code == 2
    assert printed.startswith(f"error: {shared} starts more than one conversation id (")
    assert one in printed
    assert other in printed
    assert not any(row["archived"] for row in tenexd_json(home, "conversations", "list", "--all"))
    code, printed = _failure(home, "conversations", "show", one[:3])
    assert code == 2
    assert "64 hex characters, the first 4 or more of a conversation's id, a note1 or an nevent1" in printed
    broken_note = nip19.encode_note(one)[:-1] + ("q" if not nip19.encode_note(one).endswith("q") else "p")
    code, printed = _failure(home, "conversations", "show", broken_note)
    assert code == 2
    assert printed.startswith("error: conversation id: ")  # the NIP-19 error, not the generic one


async def test_an_ambiguous_short_id_names_five_of_the_conversations_it_starts_and_says_there_are_more() -> None:
    """Past five conversations starting with a short id, the error names the first five, then "..."."""

    class Found:
        via = "test"

        async def search(self, query: Mapping[str, str]) -> list[dict[str, Any]]:
            assert query == {"id_prefix": "abcd", "limit": "6"}
            return [{"id": f"abcd{n:060x}"} for n in range(6)]

    with pytest.raises(AccessError) as raised:
        await resolve_conversation(cast(ConversationAccess, Found()), "abcd")

    assert raised.value.status == 400
    assert raised.value.message == (
        "abcd starts more than one conversation id ("
        + ", ".join(f"abcd{n:060x}" for n in range(5)) + ", ...): give more of it"
    )


def _two_roots_sharing_four_digits(home: Path) -> tuple[int, int]:
    """Two numbers n whose conversations ``seed_conversation(home, "Chat n", "Hello n")`` would store under
    ids with the same first 4 hex digits (found by making the roots; a few hundred tries)."""
    planner = next(agent for agent in load_agents(load_settings(home)) if agent.slug == "planner")
    seen: dict[str, int] = {}
    for n in itertools.count():
        tags = [["title", f"Chat {n}"], ["p", planner.pubkey]]
        prefix = EventFactory().event(USER, f"Hello {n}", kind=11, tags=tags).id[:4]
        if prefix in seen:
            return seen[prefix], n
        seen[prefix] = n
    raise AssertionError("unreachable")


def _failure(home: Path, *args: str) -> tuple[int, str]:
    """Run a command expected to fail; return its exit code and its one error line (stderr)."""
    result = CliRunner().invoke(app, ["--home", str(home), *args], catch_exceptions=False)
    return result.exit_code, result.stderr.strip()


def test_context_shows_what_an_agent_would_be_sent_without_storing_it(home: Path) -> None:
    """`context --json` for a first-time agent gives the history block and marker; nothing is persisted."""
    conversation = seed_conversation(home, "Picnic", "Plan a picnic", "Saturday works")

    context = tenexd_json(home, "context", conversation, "--agent", "executor")

    roles = [m["role"] for m in context["messages"]]
    assert "=== MESSAGES WHILE YOU WERE AWAY ===" in context["messages"][1]["content"]
    assert roles[-1] == "user"
    assert context["messages"][-1]["content"] == "Saturday works"
    again = tenexd_json(home, "context", conversation, "--agent", "executor")
    assert again == context
    shown = tenexd_json(home, "conversations", "show", conversation)
    assert "executor" not in shown["agent_states"]


def test_context_for_an_unknown_agent_is_bad_input(home: Path) -> None:
    """An agent slug not in the home is bad input, as `send --to nobody` is: exit 2, nothing on stdout, and the
    error names the agents there are, also before the conversation is looked up (a short id nobody has)."""
    conversation = seed_conversation(home, "Picnic", "Plan a picnic")

    assert tenexd(home, "context", conversation, "--agent", "nobody") == (2, "")
    result = CliRunner().invoke(app, ["--home", str(home), "context", conversation, "--agent", "nobody"])
    assert " ".join(result.stderr.split()) == "error: unknown agent 'nobody' (agents: orchestrator, planner, executor)"
    assert tenexd(home, "context", "ffff", "--agent", "nobody") == (2, "")


def test_commands_on_a_home_without_config_fail_clearly(tmp_path: Path) -> None:
    """Reading conversations of a directory that is no home exits non-zero instead of creating one."""
    code, _ = tenexd(tmp_path / "nothing", "conversations", "list")

    assert code != 0
    assert not (tmp_path / "nothing" / "config.toml").exists()


def test_conversations_show_reports_token_usage(home: Path) -> None:
    """`conversations show` prints the tokens each agent's backend used, and the JSON has the totals."""
    conversation = seed_conversation(home, "Picnic", "Plan a picnic")

    async def record_usage() -> None:
        settings = load_settings(home)
        store = build_store(settings)
        await store.open()
        try:
            manager = ConversationManager(store, load_agents(settings), load_project_pubkey(settings))
            await manager.update_agent_state(conversation, "planner", add_tokens=(1200, 80))
        finally:
            await store.close()

    asyncio.run(record_usage())

    shown = tenexd_json(home, "conversations", "show", conversation)
    assert shown["tokens"]["prompt"] == 1200
    assert shown["tokens"]["by_agent"] == {"planner": {"prompt": 1200, "completion": 80}}
    code, text = tenexd(home, "conversations", "show", conversation)
    assert code == 0
    assert "tokens: 1,200 prompt + 80 completion" in text


def _leaf_commands(command: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """Every runnable command under ``command`` with its path of names (groups walked into)."""
    subcommands = getattr(command, "commands", None)
    if subcommands is None:
        return [(path, command)]
    return [leaf for name, sub in subcommands.items() for leaf in _leaf_commands(sub, (*path, name))]


def test_every_command_accepts_home_after_its_name() -> None:
    """Each command of tenexd, in every group, declares its own --home option."""
    leaves = _leaf_commands(typer.main.get_command(app))

    assert len(leaves) >= 14
    missing = [
        " ".join(path) for path, command in leaves
        if "--home" not in [opt for param in command.params for opt in getattr(param, "opts", [])]
    ]
    assert missing == []


def test_status_reads_the_home_given_after_the_command(home: Path) -> None:
    """`status --json --home H` judges H's status file: a fresh running status there is healthy (exit 0)."""
    settings = load_settings(home)
    data = new_status("0.0.0", home=str(home))
    data["state"] = DaemonState.RUNNING.value
    write_status(settings.status_path, data)

    code, out = tenexd_home_after(home, "status", "--json")

    assert code == 0, out
    report = json.loads(out)
    assert report["healthy"] is True
    assert report["path"] == str(settings.status_path)


def test_conversations_list_reads_the_home_given_after_the_command(home: Path) -> None:
    """`conversations list --json --home H` lists H's conversations."""
    seed_conversation(home, "Picnic plans", "Plan a picnic")

    code, out = tenexd_home_after(home, "conversations", "list", "--json")

    assert code == 0, out
    assert [r["title"] for r in json.loads(out)] == ["Picnic plans"]


def test_context_reads_the_home_given_after_the_command(home: Path) -> None:
    """`context ID --agent SLUG --json --home H` previews the agent's context from H's store."""
    conversation = seed_conversation(home, "Picnic", "Plan a picnic", "Saturday works")

    code, out = tenexd_home_after(home, "context", conversation, "--agent", "executor", "--json")

    assert code == 0, out
    context = json.loads(out)
    assert context["conversation_id"] == conversation
    assert context["messages"][-1]["content"] == "Saturday works"


def test_home_after_the_command_wins_over_home_before_it(home: Path, tmp_path: Path) -> None:
    """Given both, the --home nearest the command is used (the one before it names no home here)."""
    seed_conversation(home, "Picnic plans", "Plan a picnic")

    code, out = tenexd_home_after(home, "conversations", "list", "--json", before=tmp_path / "elsewhere")

    assert code == 0, out
    assert [r["title"] for r in json.loads(out)] == ["Picnic plans"]
    assert not (tmp_path / "elsewhere").exists()


def test_home_between_a_group_and_its_command_is_taken_nearest_first(home: Path, tmp_path: Path) -> None:
    """`tenexd conversations --home H list` (and `agents --home H list`) reads H, as the README's "before the
    command or after it" lets people type it; one given after the command still wins over it."""
    seed_conversation(home, "Picnic plans", "Plan a picnic")
    elsewhere = str(tmp_path / "elsewhere")

    def run(*args: str) -> tuple[int, str]:
        result = CliRunner().invoke(app, list(args), catch_exceptions=False)
        return result.exit_code, result.stdout

    listed = run("conversations", "--home", str(home), "list", "--json")
    agents = run("agents", "--home", str(home), "list", "--json")
    nearest = run("--home", elsewhere, "conversations", "--home", elsewhere, "list", "--json", "--home", str(home))
    group_over_root = run("--home", elsewhere, "conversations", "--home", str(home), "list", "--json")

    assert listed[0] == 0, listed[1]
    assert [r["title"] for r in json.loads(listed[1])] == ["Picnic plans"]
    assert agents[0] == 0, agents[1]
    assert [a["slug"] for a in json.loads(agents[1])] == ["orchestrator", "planner", "executor"]
    assert nearest[0] == 0, nearest[1]
    assert [r["title"] for r in json.loads(nearest[1])] == ["Picnic plans"]
    assert group_over_root[0] == 0, group_over_root[1]
    assert [r["title"] for r in json.loads(group_over_root[1])] == ["Picnic plans"]
    assert not (tmp_path / "elsewhere").exists()


def test_conversations_show_and_list_say_whether_it_ended_by_whom_and_why(home: Path) -> None:
    """`conversations show` prints the end (when, by whom, why) and `list` a status column: ended, then active."""
    picnic = seed_conversation(home, "Picnic plans", "Plan a picnic")
    code, shown = tenexd(home, "conversations", "show", picnic)
    assert code == 0
    assert "active, last activity" in shown

    tenexd(home, "conversations", "end", picnic, "--reason", "picnic happened")
    shown = tenexd(home, "conversations", "show", picnic)[1]
    listed = tenexd(home, "conversations", "list")[1]

    assert "by owner: picnic happened" in shown
    assert "ended" in listed


def test_conversations_end_records_the_owner_and_the_reason(home: Path) -> None:
    """`tenexd conversations end ID --reason ...` (no daemon: the store) ends the conversation, ended by
    the owner with the reason, not archived; a second end exits 1 (it is ended already)."""
    picnic = seed_conversation(home, "Picnic plans", "Plan a picnic")

    assert tenexd(home, "conversations", "end", picnic, "--reason", "picnic happened")[0] == 0

    shown = tenexd_json(home, "conversations", "show", picnic)
    assert shown["archived"] is False
    assert shown["status"] == "ended"
    assert shown["ended_by"] == "owner"
    assert shown["end_reason"] == "picnic happened"
    assert tenexd(home, "conversations", "end", picnic)[0] == 1


def test_a_bad_agent_slug_is_refused_with_its_rule_in_words(home: Path) -> None:
    """`agents add "Bad Slug"` exits 2 saying what a slug may hold, not a validation library's report."""
    result = CliRunner().invoke(app, ["--home", str(home), "agents", "add", "Bad Slug"], catch_exceptions=False)

    assert result.exit_code == 2
    assert result.stderr.strip() == (
        "error: invalid agent: slug 'Bad Slug' must be 1 to 64 lowercase letters, digits, '-' or '_', "
        "starting with a letter or a digit"
    )


def test_agents_add_on_a_postgres_home_whose_dsn_comes_from_the_environment(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A home on PostgreSQL whose dsn is a TENEX_STORAGE__DSN variable (the password kept out of
    config.toml) adds agents: the config written is checked with the variables it will be read with (it
    was refused, "dsn is required", and rolled back)."""
    config = home / "config.toml"
    config.write_text(config.read_text(encoding="utf-8").replace('kind = "filesystem"', 'kind = "postgres"'))
    monkeypatch.setenv("TENEX_STORAGE__DSN", '"postgresql://u:secret@127.0.0.1:1/x"')

    code, out = tenexd(home, "agents", "add", "critic")

    assert code == 0, out
    assert "backend: offline" in out
    assert "critic" in config.read_text(encoding="utf-8")


def test_a_listing_shortens_a_long_title_and_json_keeps_it_whole(home: Path) -> None:
    """A person's title tag of 2,000 characters is shown cut to 80 in `conversations list` (the rows stay
    readable); `--json` and `show` keep the whole title."""
    title = "Budget " * 300
    cid = seed_conversation(home, title.strip(), "Plan the budget")
    listed = tenexd(home, "conversations", "list")[1]
    assert listed.count("Budget") < 20  # 11 words in 80 characters, where the whole title has 300
    assert "…" in listed
    rows = json.loads(tenexd(home, "conversations", "list", "--json")[1])
    assert [r["title"] for r in (rows["conversations"] if isinstance(rows, dict) else rows)] == [title.strip()]
    assert tenexd_json(home, "conversations", "show", cid)["title"] == title.strip()


def test_version_option_prints_what_the_version_command_prints_and_runs_nothing_else(tmp_path: Path) -> None:
    """`tenexd --version` prints the version `tenexd version` prints and exits 0, even before a command it
    then does not run (no home is made)."""
    runner = CliRunner()
    command = runner.invoke(app, ["version"], catch_exceptions=False)
    option = runner.invoke(app, ["--version"], catch_exceptions=False)
    before_init = runner.invoke(app, ["--version", "init", "--home", str(tmp_path / "h")], catch_exceptions=False)

    assert (option.exit_code, option.output) == (0, command.output)
    assert option.output.strip() == __version__
    assert (before_init.exit_code, before_init.output) == (0, command.output)
    assert not (tmp_path / "h").exists()


def test_reading_a_home_no_daemon_ran_in_lists_nothing_and_creates_no_store(home: Path) -> None:
    """In a home whose daemon never ran, `conversations list`, `search` and `show` answer as for an empty store
    (an empty list, exit 0; not found, exit 1) and leave no `conversations/` folder behind."""
    listed = tenexd_json(home, "conversations", "list")
    searched = tenexd_json(home, "conversations", "search", "x")
    shown, _ = tenexd(home, "conversations", "show", "abcd")

    assert (listed, searched, shown) == ([], [], 1)
    assert not (home / "conversations").exists()


def test_a_storage_path_linking_to_nothing_is_an_error_not_an_empty_store(home: Path, tmp_path: Path) -> None:
    """`storage.path` a link to a folder that is not there (a disk not mounted) makes `conversations list`
    exit 2 saying the store cannot be opened, as before: only a store not made yet reads as empty."""
    link = tmp_path / "mounted"
    link.symlink_to(tmp_path / "not-mounted")
    config = home / "config.toml"
    config.write_text(config.read_text().replace("[storage]", f'[storage]\npath = "{link}"', 1))

    code, _ = tenexd(home, "conversations", "list")

    assert code == 2
    assert not (tmp_path / "not-mounted").exists()
