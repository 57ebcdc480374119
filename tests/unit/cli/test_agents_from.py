"""``tenexd agents add --from``: a verified definition becomes an agent (key, persona, role, source), and
every refusal exits with its code and changes nothing."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tenex_daemon.adapters.nostr.agent_definition import check_definition, parse_reference
from tenex_daemon.app.agent_install import install_definition
from tenex_daemon.app.home import load_public_key
from tenex_daemon.app.settings import load_settings
from tenex_daemon.cli.main import app
from tenex_daemon.core import nip19
from tenex_daemon.testing import KeyPair, sign_event

USER = KeyPair.from_seed(911)
AUTHOR = KeyPair.from_seed(912)
DEFINITION = sign_event(
    AUTHOR,
    "Read the diff; list every bug.",
    kind=4199,
    tags=[["d", "planner"], ["title", "Planner"], ["role", "You review plans."]],
    created_at=1_700_000_000,
)
NEVENT = nip19.encode_nevent(DEFINITION.id, (), AUTHOR.pubkey, 4199)


def tenexd(home: Path, *args: str) -> tuple[int, str]:
    """Run ``tenexd --home HOME ARGS`` in-process; return (exit code, stdout and stderr)."""
    result = CliRunner().invoke(app, ["--home", str(home), *args], catch_exceptions=False)
    return result.exit_code, result.output


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A home made by ``tenexd init`` with USER as the owner and a relay nobody listens on."""
    path = tmp_path / "home"
    code, out = tenexd(path, "init", "--owner", USER.npub, "--relay", "ws://127.0.0.1:1")
    assert code == 0, out
    return path


def snapshot(home: Path) -> tuple[str, list[str]]:
    """The home's config text and key file names (what a refused add must leave as it was)."""
    return (home / "config.toml").read_text(), sorted(p.name for p in (home / "keys").iterdir())


def test_install_writes_persona_role_source_and_a_new_key(home: Path) -> None:
    """An installed definition named like an existing agent gets a unique slug (``planner-2``), its title as
    name, the role then the instructions as its persona, ``role`` and ``source`` in config.toml (shown by
    ``agents list --json``), and its own new 0600 key."""
    settings = load_settings(home)
    reference = parse_reference(NEVENT)

    installed = install_definition(settings, reference, check_definition(DEFINITION, reference))

    assert (installed.slug, installed.name, installed.source) == ("planner-2", "Planner", NEVENT)
    agent = next(a for a in load_settings(home).agents if a.slug == "planner-2")
    assert (agent.name, agent.role, agent.source) == ("Planner", "You review plans.", NEVENT)
    assert agent.instructions == "You review plans.\n\nRead the diff; list every bug."
    key_file = home / "keys" / "planner-2.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert load_public_key(key_file, "planner-2") == installed.key.pubkey != AUTHOR.pubkey
    assert installed.to_dict()["definition"]["event_id"] == DEFINITION.id
    code, out = tenexd(home, "agents", "list", "--json")
    assert code == 0, out
    assert {a["slug"]: a["source"] for a in json.loads(out)}["planner-2"] == NEVENT


def test_a_definition_named_like_the_homes_other_keys_gets_a_slug_of_its_own(home: Path) -> None:
    """A definition titled "Owner" installs as ``owner-2`` (``owner`` names the owner's key file, which this
    home, its owner given by public key, does not have), not refused as an invalid slug."""
    titled = sign_event(AUTHOR, "Own it.", kind=4199, tags=[["d", "owner"], ["title", "Owner"]], created_at=1)
    reference = parse_reference(nip19.encode_nevent(titled.id, (), AUTHOR.pubkey, 4199))

    installed = install_definition(load_settings(home), reference, check_definition(titled, reference))

    assert installed.slug == "owner-2"
    assert not (home / "keys" / "owner.key").exists()


def test_install_takes_the_slug_and_name_given(home: Path) -> None:
    """``--slug``/``--name`` win over the ones made from the definition."""
    reference = parse_reference(NEVENT)

    installed = install_definition(
        load_settings(home), reference, check_definition(DEFINITION, reference), slug="critic", name="Critic"
    )

    assert (installed.slug, installed.name) == ("critic", "Critic")
    assert any(a.slug == "critic" and a.source == NEVENT for a in load_settings(home).agents)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--from", USER.npub], "is an npub"),
        (["--from", "nevent1garbage"], "not a NIP-19 reference"),
        (["--from", NEVENT, "--instructions", "Be nice."], "--instructions cannot go with --from"),
        (["--from", NEVENT, "--slug", "Not A Slug"], "invalid agent"),
        (["--from", NEVENT, "--slug", "planner"], "already exists"),
        (["critic", "--slug", "other"], "two slugs given"),
        ([], "give the new agent's SLUG"),
    ],
)
def test_usage_errors_exit_2_and_change_nothing(home: Path, args: list[str], message: str) -> None:
    """A reference that is no definition's, instructions given with --from, a bad or taken slug, two slugs,
    or no slug at all exit 2 with the reason, and the home is left as it was."""
    before = snapshot(home)

    code, out = tenexd(home, "agents", "add", *args, "--timeout", "0.3")

    assert code == 2, out
    assert message in " ".join(out.split())
    assert snapshot(home) == before


def test_a_definition_no_relay_could_be_asked_for_exits_1_saying_no_relay_answered(home: Path) -> None:
    """When no relay answers within --timeout (nobody listens on the home's relay), exit 1 saying no relay
    answered, naming it (it said "not found on the relays", as if one had been asked), nothing written."""
    before = snapshot(home)

    code, out = tenexd(home, "agents", "add", "--from", NEVENT, "--timeout", "0.3")

    assert code == 1, out
    assert "no relay answered within 0.3 s: ws://127.0.0.1:1" in " ".join(out.split())
    assert snapshot(home) == before
