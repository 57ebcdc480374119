"""Settings: the home's config.toml, TENEX_* overrides, and errors that name the key and the file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tenex_daemon.app.home_dir import resolve_home
from tenex_daemon.app.settings import Settings, SettingsError, StorageKind, load_settings
from tenex_daemon.core.phases import Phase

CONFIG = """
owner = "{owner}"
[project]
name = "demo"
[relays]
urls = ["ws://127.0.0.1:7777"]
[[agents]]
slug = "orchestrator"
name = "Orchestrator"
orchestrator = true
[[agents]]
slug = "planner"
name = "Planner"
"""
OWNER = "a" * 64


def write_home(tmp_path: Path, text: str = CONFIG.format(owner=OWNER)) -> Path:
    """Write a config.toml into a fresh home and return the home."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text(text, encoding="utf-8")
    return home


def test_loads_config_and_derives_home_paths(tmp_path: Path) -> None:
    """A config.toml loads into Settings whose paths all live in the home."""
    home = write_home(tmp_path)
    settings = load_settings(home, {})
    assert settings.owner == OWNER
    assert [a.slug for a in settings.agents] == ["orchestrator", "planner"]
    assert settings.default_agent_slug == "planner"
    assert settings.storage.kind is StorageKind.FILESYSTEM
    assert settings.agent_key_path("planner") == home.resolve() / "keys" / "planner.key"
    assert settings.status_path == home.resolve() / "run" / "status.json"
    assert settings.control_socket_path == home.resolve() / "run" / "control.sock"


def test_environment_overrides_nested_keys_with_toml_values(tmp_path: Path) -> None:
    """TENEX_SECTION__KEY variables override the file, parsed as TOML values when they can be."""
    home = write_home(tmp_path)
    env = {
        "TENEX_DAEMON__HOP_LIMIT": "3",
        "TENEX_RELAYS__URLS": '["ws://127.0.0.1:1", "wss://relay.example"]',
        "TENEX_DAEMON__LOG_FORMAT": "json",
        "TENEX_PROJECT__NAME": "not toml at all",
    }
    settings = load_settings(home, env)
    assert settings.daemon.hop_limit == 3
    assert settings.relays.urls == ["ws://127.0.0.1:1", "wss://relay.example"]
    assert settings.daemon.log_format == "json"
    assert settings.project.name == "not toml at all"


def test_home_comes_from_argument_then_environment_then_default(tmp_path: Path) -> None:
    """resolve_home prefers the argument, then $TENEX_HOME, then ./.tenex."""
    assert resolve_home(tmp_path / "a", {"TENEX_HOME": str(tmp_path / "b")}) == (tmp_path / "a").resolve()
    assert resolve_home(None, {"TENEX_HOME": str(tmp_path / "b")}) == (tmp_path / "b").resolve()
    assert resolve_home(None, {}) == Path(".tenex").resolve()


def test_invalid_value_error_names_the_key_and_the_file(tmp_path: Path) -> None:
    """A bad value is reported with its dotted key and the config file's path."""
    home = write_home(tmp_path, CONFIG.format(owner=OWNER) + "[daemon]\nhop_limit = -1\n")
    with pytest.raises(SettingsError) as caught:
        load_settings(home, {})
    assert "daemon.hop_limit" in str(caught.value)
    assert str(home.resolve() / "config.toml") in str(caught.value)


def test_an_embedded_port_of_0_once_accepted_is_refused_saying_why(tmp_path: Path) -> None:
    """``embedded_port = 0``, which earlier versions took, is refused with why and what to choose, not only
    with the bound."""
    config = CONFIG.format(owner=OWNER).replace("[relays]\n", "[relays]\nembedded_port = 0\n")
    home = write_home(tmp_path, config)
    with pytest.raises(SettingsError) as caught:
        load_settings(home, {})
    assert "relays.embedded_port" in str(caught.value)
    assert "0 (a port the system picks) is not accepted" in str(caught.value)
    assert "e.g. 7777" in str(caught.value)
    (tmp_path / "env").mkdir()
    with pytest.raises(SettingsError, match=r"0 \(a port the system picks\) is not accepted"):
        load_settings(write_home(tmp_path / "env"), {"TENEX_RELAYS__EMBEDDED_PORT": '"0"'})


def test_an_agents_refused_setting_is_named_by_its_slug(tmp_path: Path) -> None:
    """A bad value in an agent's settings is named by the agent's slug (``agents.planner.backend``), not by its
    place in the file; the file is named as for any bad value."""
    home = write_home(tmp_path, CONFIG.format(owner=OWNER) + '[agents.backend]\nkind = "nope"\n')
    with pytest.raises(SettingsError) as caught:
        load_settings(home, {})
    assert f"{home.resolve() / 'config.toml'}: agents.planner.backend: unknown backend 'nope'" in str(
        caught.value
    )


def test_a_slug_with_the_thread_key_separator_is_refused(tmp_path: Path) -> None:
    """A slug holding ``__`` (which separates the names in a delegation thread's key, so send_message would fail
    for that agent) is refused when the config loads, naming the agent's key and the reason."""
    home = write_home(tmp_path, CONFIG.format(owner=OWNER) + '[[agents]]\nslug = "code__review"\nname = "Reviewer"\n')
    with pytest.raises(SettingsError) as caught:
        load_settings(home, {})
    assert "agents.2.slug" in str(caught.value)
    assert "must not contain '__'" in str(caught.value)


@pytest.mark.parametrize(
    ("storage", "says"),
    [
        ('kind = "postgres"', "dsn is required when kind = postgres"),
        ('kind = "postgres"\ndsn = "mysql://u:hunter2@db/x"', "dsn must be a postgresql:// URI"),
    ],
)
def test_a_postgres_store_needs_a_postgresql_dsn(tmp_path: Path, storage: str, says: str) -> None:
    """storage.kind = postgres without a dsn, or with one that is no postgresql:// URI, is refused when the
    settings are read (a configuration error, exit 2), naming the section and never echoing the dsn."""
    home = write_home(tmp_path, CONFIG.format(owner=OWNER) + f"[storage]\n{storage}\n")
    with pytest.raises(SettingsError) as caught:
        load_settings(home, {})
    assert "storage" in str(caught.value)
    assert says in str(caught.value)
    assert "hunter2" not in str(caught.value)
    (tmp_path / "ok").mkdir()
    text = CONFIG.format(owner=OWNER) + '[storage]\nkind = "postgres"\ndsn = "postgres://h/x"\n'
    assert load_settings(write_home(tmp_path / "ok", text), {}).storage.kind is StorageKind.POSTGRES


def test_bad_environment_override_names_the_key(tmp_path: Path) -> None:
    """An override with a wrong type fails with the key it set."""
    home = write_home(tmp_path)
    with pytest.raises(SettingsError, match=r"daemon\.max_concurrent_runs"):
        load_settings(home, {"TENEX_DAEMON__MAX_CONCURRENT_RUNS": "zero"})


def test_unknown_key_missing_file_and_bad_toml_are_errors(tmp_path: Path) -> None:
    """Unknown keys, a missing config.toml and broken TOML each raise SettingsError naming the file."""
    home = write_home(tmp_path, CONFIG.format(owner=OWNER) + "[daemon]\nhop_limt = 2\n")
    with pytest.raises(SettingsError, match=r"daemon\.hop_limt"):
        load_settings(home, {})
    with pytest.raises(SettingsError, match="not found"):
        load_settings(tmp_path / "nowhere", {})
    (home / "config.toml").write_text("owner = ", encoding="utf-8")
    with pytest.raises(SettingsError, match="invalid TOML"):
        load_settings(home, {})


def test_a_home_that_is_a_file_a_config_not_utf8_and_a_bad_log_level_are_settings_errors(tmp_path: Path) -> None:
    """A home naming a file (config.toml itself), a config.toml that is not UTF-8 text, and an unknown log
    level (from the environment) are SettingsErrors saying which (the CLI prints one line, exit 2), not
    tracebacks."""
    home = write_home(tmp_path)
    with pytest.raises(SettingsError, match=r"config\.toml: not a folder"):
        load_settings(home / "config.toml", {})
    with pytest.raises(SettingsError, match=r"environment TENEX_DAEMON__LOG_LEVEL: daemon\.log_level: .*'loud'"):
        load_settings(home, {"TENEX_DAEMON__LOG_LEVEL": '"loud"'})
    for alias in ("warn", "FATAL", "notset"):  # Python's logging names them: accepted as before
        assert load_settings(home, {"TENEX_DAEMON__LOG_LEVEL": f'"{alias}"'}).daemon.log_level == alias
    (home / "config.toml").write_bytes(CONFIG.format(owner=OWNER).encode() + b"\xff\xfe")
    with pytest.raises(SettingsError, match="not UTF-8 text"):
        load_settings(home, {})


def test_owner_must_be_hex_and_relays_websocket_urls(tmp_path: Path) -> None:
    """An npub where hex is expected, or an http relay URL, are refused with the key named."""
    home = write_home(tmp_path, CONFIG.format(owner="npub1xyz"))
    with pytest.raises(SettingsError, match="owner"):
        load_settings(home, {})
    (tmp_path / "2").mkdir()
    home2 = write_home(tmp_path / "2", CONFIG.format(owner=OWNER).replace("ws://", "http://"))
    with pytest.raises(SettingsError, match=r"relays\.urls"):
        load_settings(home2, {})


def test_phases_table_replaces_the_default_rules(tmp_path: Path) -> None:
    """A [phases] table becomes the project's phase rules; empty keeps the default; a name it adds is a phase
    of the project; a name that cannot be a phase's fails, saying what one may be."""
    home = write_home(tmp_path, CONFIG.format(owner=OWNER) + '[phases]\nchat = ["plan"]\nplan = ["chat"]\n')
    rules = load_settings(home, {}).phase_rules()
    assert rules.is_allowed(Phase.CHAT, Phase.PLAN)
    assert not rules.is_allowed(Phase.CHAT, Phase.EXECUTE)
    assert Settings(home=tmp_path).phase_rules().is_allowed(Phase.CHAT, Phase.EXECUTE)
    (home / "config.toml").write_text(CONFIG.format(owner=OWNER) + '[phases]\nchat = ["review"]\nreview = ["chat"]\n')
    added = load_settings(home, {}).phase_rules()
    assert added.phases == (Phase.CHAT, Phase("review"))
    assert added.is_allowed(Phase.CHAT, Phase("review"))
    (home / "config.toml").write_text(CONFIG.format(owner=OWNER) + '[phases]\nchat = ["Dance Party"]\n')
    with pytest.raises(SettingsError, match="'Dance Party' is not a phase name"):
        load_settings(home, {})


def test_example_home_of_the_repository_loads() -> None:
    """The committed example home (.tenex/config.toml, with its [phases] table) is valid."""
    example = Path(__file__).resolve().parents[3] / ".tenex"
    settings = load_settings(example, {})
    assert {a.slug for a in settings.agents} == {"orchestrator", "planner", "executor"}


def test_bad_environment_value_is_reported_with_the_variable_not_the_file(tmp_path: Path) -> None:
    """A bad value set by TENEX_DAEMON__HOP_LIMIT is reported as the environment variable's, not config.toml's."""
    home = write_home(tmp_path)
    with pytest.raises(SettingsError) as caught:
        load_settings(home, {"TENEX_DAEMON__HOP_LIMIT": "abc"})
    message = str(caught.value)
    assert message.startswith("environment TENEX_DAEMON__HOP_LIMIT: daemon.hop_limit: Input should be a valid integer")
    assert "config.toml" not in message


def test_each_bad_value_is_reported_with_its_own_source(tmp_path: Path) -> None:
    """With a bad value in config.toml and another in the environment, each is reported with where it came from."""
    home = write_home(tmp_path, CONFIG.format(owner=OWNER) + "[daemon]\nhop_limit = -1\n")
    with pytest.raises(SettingsError) as caught:
        load_settings(home, {"TENEX_RELAYS__URLS": '["http://relay.example"]'})
    message = str(caught.value)
    assert f"{home.resolve() / 'config.toml'}: daemon.hop_limit: " in message
    assert "environment TENEX_RELAYS__URLS: relays.urls: " in message
    assert f"{home.resolve() / 'config.toml'}: relays.urls" not in message


def test_tenex_variables_without_double_underscore_are_not_settings(tmp_path: Path) -> None:
    """The scripts' own TENEX_ variables (and TENEX_HOME) are ignored by load_settings, not refused as unknown keys."""
    home = write_home(tmp_path)
    env = {
        "TENEX_BENCH_FIGURES": "/tmp/f.jsonl",
        "TENEX_BENCH_PROFILE": "/tmp/p.prof",
        "TENEX_FAULTS_FULL": "1",
        "TENEX_FAULTS_REPORT": "/tmp/r.jsonl",
        "TENEX_CRASH_SEED": "3",
        "TENEX_CRASH_ROUNDS": "5",
        "TENEX_REQUIRE_TEST_PARTS": "1",
        "TENEX_HOME": str(tmp_path / "elsewhere"),
    }
    assert load_settings(home, env) == load_settings(home, {})


def test_a_sections_key_with_one_underscore_is_refused_with_the_right_name(tmp_path: Path) -> None:
    """TENEX_DAEMON_HOP_LIMIT (one underscore) is refused, naming TENEX_DAEMON__HOP_LIMIT: ignored, the person
    would believe the setting applies."""
    home = write_home(tmp_path)
    with pytest.raises(SettingsError, match="TENEX_DAEMON_HOP_LIMIT: not a setting; TENEX_DAEMON__HOP_LIMIT is"):
        load_settings(home, {"TENEX_DAEMON_HOP_LIMIT": "3"})


def test_top_level_keys_are_set_by_their_own_variable(tmp_path: Path) -> None:
    """TENEX_<KEY> sets a top-level key (TENEX_DEFAULT_AGENT, TENEX_WHITELIST) and TENEX_<SECTION> a whole table."""
    home = write_home(tmp_path)
    env = {
        "TENEX_DEFAULT_AGENT": "planner",
        "TENEX_WHITELIST": f'["{"b" * 64}"]',
        "TENEX_DAEMON": "{ hop_limit = 2 }",
        "TENEX_DAEMON__GRACE_PERIOD_S": "3",
    }
    settings = load_settings(home, env)
    assert settings.default_agent == "planner"
    assert settings.whitelist == ["b" * 64]
    assert (settings.daemon.hop_limit, settings.daemon.grace_period_s) == (2, 3.0)


def test_double_underscore_variable_naming_no_setting_is_refused_with_its_name(tmp_path: Path) -> None:
    """A TENEX_<SECTION>__<KEY> variable whose section or key the settings do not know is refused, naming the variable."""
    home = write_home(tmp_path)
    with pytest.raises(SettingsError, match=r"^environment TENEX_BENCH__FIGURES: bench: not a section"):
        load_settings(home, {"TENEX_BENCH__FIGURES": "/tmp/f.jsonl"})
    with pytest.raises(SettingsError, match=r"^environment TENEX_DAEMON__HOP_LIMT: daemon\.hop_limt: Extra inputs"):
        load_settings(home, {"TENEX_DAEMON__HOP_LIMT": "2"})
    with pytest.raises(SettingsError, match=r"^environment TENEX_DAEMON__HOP_LIMIT: .*TENEX_DAEMON sets daemon"):
        load_settings(home, {"TENEX_DAEMON": "3", "TENEX_DAEMON__HOP_LIMIT": "2"})


def test_error_about_the_whole_settings_names_the_variables_that_took_part(tmp_path: Path) -> None:
    """An error about the settings as a whole (a default_agent that is no agent) names the file and the variables applied."""
    home = write_home(tmp_path)
    with pytest.raises(SettingsError) as caught:
        load_settings(home, {"TENEX_DEFAULT_AGENT": "nobody"})
    assert str(caught.value).startswith(f"{home.resolve() / 'config.toml'} with environment TENEX_DEFAULT_AGENT: ")
    assert "'nobody' is not one of the agents" in str(caught.value)


def test_relative_store_and_socket_paths_are_taken_relative_to_the_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative storage.path and control.socket mean the same folder whatever folder tenexd starts in."""
    home = write_home(tmp_path, CONFIG.format(owner=OWNER) + '[storage]\npath = "data"\n'
                      '[control]\nsocket = "sockets/c.sock"\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    settings = load_settings(home, {})
    assert settings.conversations_path == home.resolve() / "data" / "conversations"
    assert settings.control_socket_path == home.resolve() / "sockets" / "c.sock"
    from_env = load_settings(home, {"TENEX_STORAGE__PATH": '"other"'})
    assert from_env.conversations_path == home.resolve() / "other" / "conversations"


def test_a_relative_store_path_whose_store_is_under_the_current_folder_is_refused_naming_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where earlier versions found the store (the current folder's), a start is refused rather than made on
    an empty store in the home, the message naming both folders and where the value came from (the file, or
    its variable); a current folder this user may not look into is no store."""
    home = write_home(tmp_path, CONFIG.format(owner=OWNER) + '[storage]\npath = "data"\n')
    cwd = tmp_path / "cwd"
    (cwd / "data" / "conversations").mkdir(parents=True)
    monkeypatch.chdir(cwd)
    with pytest.raises(SettingsError) as refused:
        load_settings(home, {})
    message = str(refused.value)
    assert message.startswith(f"{home.resolve() / 'config.toml'}: storage.path: 'data' is taken relative to the home")
    assert str(home.resolve() / "data") in message
    assert str(cwd / "data") in message
    with pytest.raises(SettingsError, match=r"^environment TENEX_STORAGE__PATH: storage\.path: 'data'"):
        load_settings(home, {"TENEX_STORAGE__PATH": '"data"', "TENEX_STORAGE__FSYNC": '"always"'})
    # a folder this user may not look into holds no store for it (EACCES was a traceback of every command)
    monkeypatch.setattr(Path, "is_dir", _denied_is_dir(Path.is_dir, cwd / "data" / "conversations"))
    assert load_settings(home, {}).conversations_path == home.resolve() / "data" / "conversations"
    monkeypatch.undo()
    monkeypatch.chdir(cwd)
    (home / "data" / "conversations").mkdir(parents=True)  # the store copied into the home: taken
    assert load_settings(home, {}).conversations_path == home.resolve() / "data" / "conversations"


def _denied_is_dir(is_dir: Callable[[Path], bool], denied: Path) -> Callable[[Path], bool]:
    """``Path.is_dir`` raising EACCES for ``denied`` (as for a user who may not look into its folder)."""

    def checked(path: Path) -> bool:
        if path == denied:
            raise PermissionError(13, "Permission denied", str(path))
        return is_dir(path)

    return checked
