"""What the claude-code backend tells ``claude`` to keep it within bounds: the deny rules for the home's secret
places, how they sit with an operator's own, the environment it is given, and the daemon's wiring of the home."""

from __future__ import annotations

from pathlib import Path

import pytest

from tenex_daemon.adapters.llm.claude_code import ClaudeCodeBackend, child_environment, deny_rules
from tenex_daemon.app.home import init_home
from tenex_daemon.app.settings import AgentSettings, BackendSettings, Settings, load_settings
from tenex_daemon.app.wiring import build_backend
from tenex_daemon.core.llm import CompletionRequest

REQUEST = CompletionRequest(agent_slug="a", agent_name="A", system_prompt="Be brief.", messages=[])


def test_deny_rules_name_the_homes_secret_places_by_absolute_path() -> None:
    """Read and Edit are denied on the keys, conversations, run folder, relay (each folder and all under it),
    config.toml and a store kept elsewhere, each path starting ``//`` (absolute, in Claude Code's rules)."""
    rules = deny_rules(Path("/var/lib/tenexd"), Path("/var/lib/tenexd/run"), Path("/srv/tenex/conversations"))

    for place in ("keys", "conversations", "run", "relay"):
        for tool in ("Read", "Edit"):
            assert f"{tool}(//var/lib/tenexd/{place})" in rules
            assert f"{tool}(//var/lib/tenexd/{place}/**)" in rules
    assert {"Read(//var/lib/tenexd/config.toml)", "Edit(//var/lib/tenexd/config.toml)"} <= set(rules)
    assert {"Read(//srv/tenex/conversations/**)", "Edit(//srv/tenex/conversations/**)"} <= set(rules)
    assert not any("workspace" in rule for rule in rules)


def test_a_homes_pattern_characters_are_escaped_in_its_rules() -> None:
    """A home whose path holds gitignore pattern characters is named literally (escaped), never as a pattern
    that could miss it."""
    rules = deny_rules(Path("/srv/te[st]*"))

    assert r"Read(//srv/te\[st\]\*/keys/**)" in rules


def test_an_operators_own_disallowed_tools_add_to_the_deny_rules() -> None:
    """The deny rules go one argument each, joined to ``--disallowedTools=``, before the operator's
    ``extra_args``, which are passed unchanged: their own ``--disallowedTools`` list adds to the rules (values
    of a repeated option add up) and no rule can be taken for a value of their options."""
    extra = ["--disallowedTools", "Bash", "WebFetch", "--permission-mode", "acceptEdits"]
    backend = ClaudeCodeBackend(command=["claude"], home="/var/lib/tenexd", extra_args=extra)

    args = backend.arguments(REQUEST)

    assert args[-len(extra) :] == extra
    ours = args[args.index("Be brief.") + 1 : -len(extra)]
    assert ours == [f"--disallowedTools={rule}" for rule in backend.denied]
    assert "--disallowedTools=Read(//var/lib/tenexd/keys/**)" in ours


@pytest.mark.parametrize(
    "name",
    ["TENEX_STORAGE__DSN", "TENEX_HOME", "PGPASSWORD", "PGPASSFILE", "PGUSER", "PGSERVICEFILE", "DATABASE_URL",
     "OPENAI_API_KEY", "OPENROUTER_API_KEY", "GOOGLE_API_KEY"],
)
def test_what_other_parts_of_the_daemon_hold_is_withheld_from_claude(name: str) -> None:
    """The daemon's settings, libpq's variables, DATABASE_URL and other providers' keys are not passed on."""
    assert name not in child_environment({name: "secret", "PATH": "/usr/bin"})


@pytest.mark.parametrize(
    "name",
    ["PATH", "HOME", "LANG", "HTTPS_PROXY", "ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL", "CLAUDE_CODE_USE_VERTEX",
     "CLAUDE_CONFIG_DIR", "AWS_REGION", "AWS_SECRET_ACCESS_KEY", "GOOGLE_APPLICATION_CREDENTIALS", "CLOUD_ML_REGION"],
)
def test_what_claude_code_reads_is_passed_on(name: str) -> None:
    """Claude Code's own variables, its cloud's (Bedrock, Vertex), proxies, locale, PATH and HOME are kept."""
    assert child_environment({name: "value"}) == {name: "value"}


def test_the_env_option_comes_on_top_of_what_is_withheld() -> None:
    """A variable the ``env`` option names is given to claude though it would be withheld from the daemon's."""
    environment = child_environment({"PGHOST": "db", "OPENAI_API_KEY": "sk"}, {"OPENAI_API_KEY": "given"})

    assert environment == {"OPENAI_API_KEY": "given"}


def test_the_variables_other_backends_read_their_keys_from_are_withheld_whatever_their_names() -> None:
    """A key variable another backend is configured with (``api_key_env``), not ending in ``_API_KEY``, is
    withheld from claude; the ``env`` option still gives it back, and claude's own key is never withheld."""
    environ = {"GROQ_TOKEN": "gsk", "ANTHROPIC_API_KEY": "sk-ant", "PATH": "/usr/bin"}

    assert child_environment(environ, keys=["GROQ_TOKEN", "ANTHROPIC_API_KEY"]) == {
        "ANTHROPIC_API_KEY": "sk-ant",
        "PATH": "/usr/bin",
    }
    assert child_environment(environ, {"GROQ_TOKEN": "given"}, ["GROQ_TOKEN"])["GROQ_TOKEN"] == "given"


def with_other_backends(tmp_path: Path, coder: BackendSettings, summarizer: BackendSettings) -> Settings:
    """A home's settings with one more agent (``coder``) on ``coder``'s backend and a summarizer."""
    init_home(tmp_path / "h")
    loaded = load_settings(tmp_path / "h", {})
    return loaded.model_copy(
        update={
            "agents": [*loaded.agents, AgentSettings(slug="coder", name="Coder", backend=coder)],
            "conversations": loaded.conversations.model_copy(update={"summarizer": summarizer}),
        }
    )


def test_the_daemon_tells_claude_code_backends_every_configured_key_variable(tmp_path: Path) -> None:
    """The daemon builds a claude-code backend knowing the key variables of every agent's backend and of the
    summarizer, and its calls' environment leaves them out."""
    settings = with_other_backends(
        tmp_path,
        BackendSettings(kind="openai", model="m", api_key_env="GROQ_TOKEN"),
        BackendSettings(kind="openai", model="m", api_key_env="SUMMARY_SECRET"),
    )

    backend = build_backend("planner", BackendSettings(kind="claude-code"), settings)

    assert isinstance(backend, ClaudeCodeBackend)
    assert backend.withheld_keys == {"GROQ_TOKEN", "SUMMARY_SECRET"}
    environment = child_environment({"GROQ_TOKEN": "g", "SUMMARY_SECRET": "s"}, backend.env, backend.withheld_keys)
    assert environment == {}


def test_the_daemon_denies_claude_code_the_key_files_other_backends_read(tmp_path: Path) -> None:
    """A key file another backend is configured with (``api_key_file``) outside ``keys/`` is denied to a
    claude-code agent's file tools, an absolute path as given and a relative one in the home."""
    settings = with_other_backends(
        tmp_path,
        BackendSettings(kind="openai", model="m", api_key_file="/srv/secrets/openai.key"),
        BackendSettings(kind="openai", model="m", api_key_file="secrets/summary.key"),
    )

    backend = build_backend("planner", BackendSettings(kind="claude-code"), settings)

    assert isinstance(backend, ClaudeCodeBackend)
    assert "Read(//srv/secrets/openai.key)" in backend.denied
    assert f"Read(/{settings.home}/secrets/summary.key)" in backend.denied
    assert f"Edit(/{settings.home}/secrets/summary.key)" in backend.denied


def test_the_daemon_builds_claude_code_backends_with_its_home(tmp_path: Path) -> None:
    """An agent's claude-code backend is built knowing the home, its run folder and its store, so its
    ``claude`` is denied them and works in the agent's own folder."""
    init_home(tmp_path / "h")
    settings = load_settings(tmp_path / "h", {})

    backend = build_backend("planner", BackendSettings(kind="claude-code"), settings)

    assert isinstance(backend, ClaudeCodeBackend)
    assert (backend.home, backend.run_dir) == (settings.home, settings.run_dir)
    assert f"Read(/{settings.home}/keys/**)" in backend.denied
    assert f"Read(/{settings.conversations_path}/**)" in backend.denied
