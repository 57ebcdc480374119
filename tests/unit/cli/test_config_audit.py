"""Config edits the daemon cannot serve are refused at once, in one line, with exit 2 (README: "2 bad input or
configuration"): a ``default_agent`` naming the orchestrator, two key files holding one key (two agents', or an
agent's and ``project.key``), and a ``send`` signed with a key the daemon would refuse (no ``owner`` set)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tenex_daemon.adapters.nostr.signer import KeyFileError
from tenex_daemon.app.home import agent_identities, init_home, load_agents
from tenex_daemon.app.settings import SettingsError, load_settings
from tenex_daemon.app.wiring import load_signers
from tenex_daemon.cli.main import app
from tests.unit.cli.test_send_private_reply import Touched

RELAY = "ws://127.0.0.1:1"


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A home made by init (its owner key generated in keys/owner.key), pointed at a relay nobody runs."""
    path = tmp_path / "home"
    init_home(path, relays=[RELAY])
    return path


def tenexd(home: Path, *args: str) -> tuple[int, str, str]:
    """Run ``tenexd --home HOME ARGS`` in-process; return (exit code, stdout, stderr with its lines joined)."""
    result = CliRunner().invoke(app, ["--home", str(home), *args], catch_exceptions=False)
    return result.exit_code, result.stdout, " ".join(result.stderr.split())


# --- default_agent naming the orchestrator ----------------------------------------------------------------


def test_default_agent_naming_the_orchestrator_is_refused_at_load_naming_both_keys(home: Path) -> None:
    """``default_agent = "orchestrator"`` is refused when the settings load, naming the file, default_agent and
    the agent's orchestrator key, and saying to name another agent: every message nobody addressed would be
    "routed" to the orchestrator itself, and `send` would wait in vain for another agent's answer."""
    config = (home / "config.toml").read_text(encoding="utf-8")
    (home / "config.toml").write_text(config.replace('default_agent = "planner"', 'default_agent = "orchestrator"'))

    with pytest.raises(SettingsError) as caught:
        load_settings(home, {})

    said = str(caught.value)
    assert said.startswith(f"{home.resolve() / 'config.toml'}: ")
    assert "default_agent = 'orchestrator' is the orchestrator (agents.orchestrator.orchestrator = true)" in said
    assert "name another agent" in said
    assert "\n" not in said
    (home / "config.toml").write_text(config)
    with pytest.raises(SettingsError, match=r"TENEX_DEFAULT_AGENT: .*'orchestrator' is the orchestrator"):
        load_settings(home, {"TENEX_DEFAULT_AGENT": "orchestrator"})


def test_the_cli_exits_2_when_default_agent_is_the_orchestrator(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``default_agent`` naming the agent made the orchestrator by hand, `send` and `agents list` exit 2
    in one line naming default_agent, before anything is signed or any relay is opened."""
    config = (home / "config.toml").read_text(encoding="utf-8")
    edited = config.replace("orchestrator = true\n", "").replace(
        'slug = "planner"\n', 'slug = "planner"\norchestrator = true\n', 1
    )
    (home / "config.toml").write_text(edited, encoding="utf-8")
    touched = Touched(monkeypatch)

    code, _, said = tenexd(home, "send", "hi", "--timeout", "0.2")

    assert code == 2
    assert "default_agent = 'planner' is the orchestrator" in said
    assert (touched.signed, touched.pools) == ([], [])
    assert tenexd(home, "agents", "list")[0] == 2


def test_init_never_makes_the_orchestrator_the_default_agent(home: Path) -> None:
    """`tenexd init` writes default_agent = the first agent that is not the orchestrator (and its config loads)."""
    settings = load_settings(home, {})
    orchestrator = next(a.slug for a in settings.agents if a.orchestrator)
    assert settings.default_agent == "planner"
    assert settings.default_agent_slug != orchestrator


# --- two key files holding one key ---------------------------------------------------------------------------


def test_run_refuses_two_agents_sharing_a_key_in_one_line_with_exit_2(home: Path) -> None:
    """`cp keys/planner.key keys/executor.key`: `tenexd run` exits 2 with one line naming both key files (it
    crashed with a 65-line traceback, "agents 'planner' and 'executor' share a key"), as load_signers raises."""
    keys = home / "keys"
    shutil.copy2(keys / "planner.key", keys / "executor.key")
    settings = load_settings(home, {})

    with pytest.raises(KeyFileError) as caught:
        load_signers(settings)
    code, _, said = tenexd(home, "run", "--relay", RELAY)

    expected = f"key file {keys / 'executor.key'} holds the same key as {keys / 'planner.key'}"
    assert str(caught.value).startswith(expected)
    assert "agents 'planner' and 'executor' would be one Nostr identity" in str(caught.value)
    assert code == 2
    assert said.startswith(f"error: {expected}")
    assert "Traceback" not in said


def test_an_agent_key_equal_to_the_project_key_is_refused(home: Path) -> None:
    """An agent's key file holding project.key's key (accepted silently: the daemon ran) is refused as two agents
    sharing one are: load_signers and load_agents (send, the conversation commands) raise one line naming both
    files, and `run` exits 2 with it."""
    keys = home / "keys"
    shutil.copy2(keys / "project.key", keys / "planner.key")
    settings = load_settings(home, {})

    for load in (load_signers, load_agents):  # before `run`, which served with the shared key until stopped
        with pytest.raises(KeyFileError, match=r"the project and agent 'planner' would be one Nostr identity"):
            load(settings)
    code, _, said = tenexd(home, "run", "--relay", RELAY)

    assert code == 2
    assert said.startswith(f"error: key file {keys / 'planner.key'} holds the same key as {keys / 'project.key'}")


def test_send_and_conversation_commands_refuse_a_shared_key_with_exit_2(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With two agents sharing a key, `send` exits 2 naming both files before signing anything or opening a
    relay, and so does `conversations list` (the store read without a daemon)."""
    keys = home / "keys"
    shutil.copy2(keys / "planner.key", keys / "executor.key")
    touched = Touched(monkeypatch)

    code, _, said = tenexd(home, "send", "hi", "--to", "planner", "--timeout", "0.2")
    listed, _, listed_said = tenexd(home, "conversations", "list")

    expected = f"key file {keys / 'executor.key'} holds the same key as {keys / 'planner.key'}"
    assert (code, listed) == (2, 2)
    assert said.startswith(f"error: {expected}")
    assert expected in listed_said
    assert (touched.signed, touched.pools) == ([], [])


def test_agents_list_names_a_shared_key_in_place_of_the_npub_and_exits_1(home: Path) -> None:
    """`agents list` no longer shows the duplicate npub and exits 0: the agent whose key file repeats another's
    has the reason (both files named) in place of its npub, and the command exits 1 as for any key file that
    cannot be used (the daemon would not start)."""
    keys = home / "keys"
    shutil.copy2(keys / "planner.key", keys / "executor.key")

    code, out, said = tenexd(home, "agents", "list", "--json")

    assert code == 1
    rows = {row["slug"]: row for row in json.loads(out)}
    assert rows["planner"]["npub"] is not None
    assert rows["executor"]["npub"] is None
    assert rows["executor"]["problem"].startswith(
        f"key file {keys / 'executor.key'} holds the same key as {keys / 'planner.key'}"
    )
    assert "1 agent(s) without a usable key (executor)" in said
    identities = {agent.slug: info for agent, info, _ in agent_identities(load_settings(home, {}))}
    assert identities["executor"] is None


# --- send with a key the daemon would refuse ----------------------------------------------------------------


def test_send_without_an_owner_refuses_the_owner_key_with_a_hint_and_exit_2(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the owner line removed from config.toml, `send` exits 2 at once (it published, waited out its
    timeout, then said "daemon has not taken it in": the daemon refuses it, author_not_allowed), naming the
    owner key's hex in the hint to set owner or whitelist it; nothing signed, no relay opened. Whitelisted,
    the key is one the daemon answers (is_allowed_author), and send goes on to the relays."""
    config = home / "config.toml"
    settings = load_settings(home, {})
    assert settings.owner is not None
    owner = settings.owner
    text = config.read_text(encoding="utf-8")
    config.write_text(text.replace(f'owner = "{owner}"\n', ""), encoding="utf-8")
    assert load_settings(home, {}).owner is None
    touched = Touched(monkeypatch)

    code, _, said = tenexd(home, "send", "hi", "--to", "planner", "--timeout", "0.2")

    assert code == 2
    assert said.startswith(f"error: {config.resolve()} sets no owner")
    assert f'set owner = "{owner}" in {config.resolve()}, or add "{owner}" to whitelist' in said
    assert "author_not_allowed" in said
    assert (touched.signed, touched.pools) == ([], [])
    config.write_text(
        text.replace(f'owner = "{owner}"\n', "").replace("whitelist = []", f'whitelist = ["{owner}"]'),
        encoding="utf-8",
    )
    assert "sets no owner" not in tenexd(home, "send", "hi", "--to", "planner", "--timeout", "0.2")[2]
    assert touched.pools == [[RELAY]]
