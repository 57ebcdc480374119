"""tenexd init: a home with config, private key files, and public identities only in what it returns."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.app.home import (
    HomeError,
    add_agent,
    agent_identities,
    init_home,
    load_agents,
    load_project_pubkey,
    parse_pubkey,
    toml_string,
)
from tenex_daemon.app.settings import load_settings
from tenex_daemon.core import nip19
from tenex_daemon.testing import KeyPair


def mode(path: Path) -> int:
    """Return a file's permission bits."""
    return stat.S_IMODE(path.stat().st_mode)


def test_init_creates_private_keys_and_a_loadable_config(tmp_path: Path) -> None:
    """keys/ is 0700, every key file 0600 and loadable by the signer, and config.toml (0600: it may hold a
    database DSN with its password) loads."""
    result = init_home(tmp_path / "home", relays=["ws://127.0.0.1:7777"])
    keys = result.home / "keys"
    assert mode(keys) == 0o700
    assert mode(result.home / "config.toml") == 0o600
    names = sorted(p.name for p in keys.iterdir())
    assert names == ["executor.key", "orchestrator.key", "owner.key", "planner.key", "project.key"]
    for path in keys.iterdir():
        assert mode(path) == 0o600
        Signer.from_file(path)
    settings = load_settings(result.home, {})
    assert [a.slug for a in settings.agents] == ["orchestrator", "planner", "executor"]
    assert [a.orchestrator for a in settings.agents] == [True, False, False]
    assert all(a.backend.kind == "offline" and a.instructions for a in settings.agents)
    assert settings.relays.urls == ["ws://127.0.0.1:7777"]
    assert settings.owner == result.owner.pubkey


def test_init_in_an_existing_folder_makes_it_the_owners_only(tmp_path: Path) -> None:
    """A home made in a folder that exists already (TENEX's .tenex, made 0755) is tightened to 0700, as a home
    init creates is: the conversation folders' names inside it are not listable by other users."""
    folder = tmp_path / ".tenex"
    (folder / "conversations").mkdir(parents=True, mode=0o755)
    folder.chmod(0o755)

    result = init_home(folder, relays=["ws://127.0.0.1:7777"])

    assert result.home == folder
    assert mode(folder) == 0o700


def test_init_returns_matching_npubs_and_hex_for_every_identity(tmp_path: Path) -> None:
    """The result names owner, project and each agent by npub and hex, matching the key files."""
    result = init_home(tmp_path / "home")
    for info in (result.owner, result.project, *result.agents):
        assert nip19.decode(info.npub).value == info.pubkey
        assert info.key_file is not None
        assert Signer.from_file(info.key_file).pubkey == info.pubkey
    assert [a.label for a in result.agents] == ["orchestrator", "planner", "executor"]


def test_owner_is_generated_only_when_not_given(tmp_path: Path) -> None:
    """With --owner (npub or hex) no owner.key is written and the config holds that key."""
    person = KeyPair.from_seed(42)
    result = init_home(tmp_path / "a", owner=person.npub, whitelist=[KeyPair.from_seed(43).pubkey.upper()])
    assert not result.owner_generated
    assert result.owner.pubkey == person.pubkey
    assert result.owner.key_file is None
    assert not (result.home / "keys" / "owner.key").exists()
    settings = load_settings(result.home, {})
    assert settings.owner == person.pubkey
    assert settings.whitelist == [KeyPair.from_seed(43).pubkey]
    generated = init_home(tmp_path / "b")
    assert generated.owner_generated
    assert (generated.home / "keys" / "owner.key").exists()


def test_no_secret_appears_in_the_result_or_the_config(tmp_path: Path) -> None:
    """Neither the returned data nor config.toml contains any secret key, in hex or as nsec."""
    result = init_home(tmp_path / "home")
    text = repr(result.to_dict()) + (result.home / "config.toml").read_text()
    for path in (result.home / "keys").iterdir():
        secret = path.read_text().strip()
        assert secret not in text
        assert nip19.encode_nsec(secret) not in text


def test_refuses_an_existing_config_unless_forced_and_force_keeps_keys(tmp_path: Path) -> None:
    """A second init fails with a clear error; --force rewrites config but keeps every identity."""
    first = init_home(tmp_path / "home")
    with pytest.raises(HomeError, match="already exists; use --force"):
        init_home(tmp_path / "home")
    again = init_home(tmp_path / "home", force=True, relays=["wss://relay.example"])
    assert again.owner.pubkey == first.owner.pubkey
    assert [a.pubkey for a in again.agents] == [a.pubkey for a in first.agents]
    assert load_settings(again.home, {}).relays.urls == ["wss://relay.example"]


def test_bad_owner_whitelist_or_relay_is_refused(tmp_path: Path) -> None:
    """An nsec, garbage, or a non-websocket relay URL is refused before anything is written."""
    secret = KeyPair.from_seed(5).secret
    with pytest.raises(HomeError, match="secret key") as caught:
        init_home(tmp_path / "a", owner=nip19.encode_nsec(secret))
    assert secret not in str(caught.value)
    with pytest.raises(HomeError, match="neither an npub"):
        init_home(tmp_path / "b", whitelist=["alice"])
    with pytest.raises(HomeError, match="ws://"):
        init_home(tmp_path / "c", relays=["https://relay.example"])
    assert not (tmp_path / "a").exists()


def test_parse_pubkey_accepts_npub_nostr_uri_and_hex() -> None:
    """npub, nostr:npub and hex (any case) all give the lowercase hex key."""
    keys = KeyPair.from_seed(9)
    assert parse_pubkey(keys.npub) == keys.pubkey
    assert parse_pubkey("nostr:" + keys.npub) == keys.pubkey
    assert parse_pubkey(keys.pubkey.upper()) == keys.pubkey


def test_add_agent_writes_a_key_and_appends_to_config(tmp_path: Path) -> None:
    """agents add creates keys/<slug>.key (0600) and a loadable [[agents]] entry; duplicates are refused."""
    result = init_home(tmp_path / "home")
    settings = load_settings(result.home, {})
    info = add_agent(settings, "reviewer", "Reviewer", 'Say "no" with \\ care')
    assert mode(info.key_file) == 0o600 if info.key_file else False
    reloaded = load_settings(result.home, {})
    assert reloaded.agents[-1].slug == "reviewer"
    assert reloaded.agents[-1].instructions == 'Say "no" with \\ care'
    assert {a.slug: a.pubkey for a in load_agents(reloaded)}["reviewer"] == info.pubkey
    with pytest.raises(HomeError, match="already exists"):
        add_agent(reloaded, "reviewer", "Again")
    with pytest.raises(HomeError, match="already has an orchestrator"):
        add_agent(reloaded, "boss", "Boss", orchestrator=True)


def test_identities_report_a_missing_key_file_instead_of_failing(tmp_path: Path) -> None:
    """agent_identities names the problem of an agent whose key file is gone; the others still load."""
    result = init_home(tmp_path / "home")
    (result.home / "keys" / "planner.key").unlink()
    rows = {agent.slug: (info, problem) for agent, info, problem in agent_identities(load_settings(result.home, {}))}
    assert rows["planner"][0] is None
    assert "does not exist" in str(rows["planner"][1])
    assert rows["executor"][0] is not None
    assert load_project_pubkey(load_settings(result.home, {})) == result.project.pubkey


def test_toml_string_round_trips_awkward_text(tmp_path: Path) -> None:
    """Names and instructions with quotes, newlines, unicode and DEL survive config.toml."""
    import tomllib

    text = 'a "quote" \\ back\nnew line \t tab 🟢 \u2028 \x7f end'
    assert tomllib.loads(f"v = {toml_string(text)}")["v"] == text


def test_a_home_that_cannot_be_created_is_one_clear_error(tmp_path: Path) -> None:
    """A home under a file, or where nothing may be created, is refused with a HomeError naming it (the CLI
    prints one line and exits 2), not an OSError's traceback."""
    (tmp_path / "a-file").write_text("")
    for home in (tmp_path / "a-file" / "home", Path("/proc/no-such-home")):
        with pytest.raises(HomeError, match="cannot be created"):
            init_home(home, relays=["ws://127.0.0.1:7777"])
