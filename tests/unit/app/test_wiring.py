"""Wiring: each agent's configured backend is built by name, and a bad one is refused naming its key."""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs

from tenex_daemon.adapters.llm import local as local_module
from tenex_daemon.adapters.llm.local import LocalBackend
from tenex_daemon.adapters.llm.offline import OfflineBackend
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.app.home import HomeError, init_home
from tenex_daemon.app.settings import BackendSettings, SettingsError, load_settings
from tenex_daemon.app.wiring import (
    build_agent_profile,
    build_agents,
    build_backend,
    build_orchestrator,
    build_store,
    build_thread_manager,
    build_token_budget,
    load_signers,
)
from tenex_daemon.core.agents import Agent
from tenex_daemon.core.budget import BudgetStrategy, TokenBudget, estimate_tokens
from tenex_daemon.core.llm import LLMBackend
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.services.orchestrator import LLMOrchestrator, RuleBasedOrchestrator


def test_init_with_the_local_backend_gives_every_demo_agent_the_bundled_model(tmp_path: Path) -> None:
    """`init --backend local` gives each working demo agent the bundled model (LocalBackend) and leaves
    the orchestrator offline, so the rules route: the 135M model cannot make routing decisions."""
    init_home(tmp_path / "h", backend="local")
    settings = load_settings(tmp_path / "h", {})

    kinds = {a.slug: a.backend.kind for a in settings.agents}
    workers = [a for a in settings.agents if not a.orchestrator]
    backends = [build_backend(a.slug, a.backend, settings) for a in workers]

    assert kinds == {"orchestrator": "offline", "planner": "local", "executor": "local"}
    assert all(isinstance(b, LocalBackend) for b in backends)


def test_default_demo_backend_is_offline(tmp_path: Path) -> None:
    """A home made without --backend uses the deterministic offline backend."""
    init_home(tmp_path / "h")
    settings = load_settings(tmp_path / "h", {})

    assert all(
        isinstance(build_backend(a.slug, a.backend, settings), OfflineBackend) for a in settings.agents
    )


def test_unknown_backend_at_init_is_refused(tmp_path: Path) -> None:
    """init refuses a backend name it does not know and writes nothing."""
    with pytest.raises(HomeError, match="unknown backend 'gpt'"):
        init_home(tmp_path / "h", backend="gpt")
    assert not (tmp_path / "h" / "config.toml").exists()


def test_init_with_the_openai_backend_writes_the_readmes_model(tmp_path: Path) -> None:
    """init with the openai backend, which `tenexd init --help` offers (it needs a model), writes the
    README's `gpt-4o-mini` for every agent, and the settings load."""
    init_home(tmp_path / "h", backend="openai")

    settings = load_settings(tmp_path / "h", {})
    assert {(a.backend.kind, a.backend.model) for a in settings.agents} == {("openai", "gpt-4o-mini")}


def test_the_claude_backends_have_their_models_window_and_an_openai_one_without_it_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without context_window the anthropic and claude-code backends get 80% of the Claude models' 200,000
    tokens (docs/CONTEXT.md's default budget); an openai agent (any server speaking that API) gets none,
    and its profile's build logs a warning naming the agent and the setting to give."""
    init_home(tmp_path / "h")
    settings = load_settings(tmp_path / "h", {})
    monkeypatch.setenv("TEST_OPENAI_KEY", "sk-test")
    for kind in ("anthropic", "claude-code"):
        budget = build_token_budget(BackendSettings(kind=kind, model="claude-sonnet-4-5"), None)
        assert budget == TokenBudget(160_000, BudgetStrategy.SLIDING_WINDOW, estimate_tokens)
    assert build_token_budget(BackendSettings(kind="anthropic", context_window=1000), None) is not None
    openai = settings.agents[0].model_copy(
        update={"backend": BackendSettings(kind="openai", model="some-model", api_key_env="TEST_OPENAI_KEY")}
    )
    agent = Agent(slug=openai.slug, name=openai.name, pubkey="b" * 64)
    with capture_logs() as logs:
        profile = build_agent_profile(openai, agent, settings)
    assert profile.budget is None
    [warning] = [e for e in logs if e["event"] == "context_window_unknown"]
    assert (warning["agent"], warning["model"]) == (openai.slug, "some-model")


@pytest.mark.parametrize(
    ("backend", "key"),
    [
        (BackendSettings.model_construct(kind="gpt"), "agents.planner.backend.kind"),
        (BackendSettings(kind="local", model="missing.gguf"), "agents.planner.backend"),
        (BackendSettings.model_construct(kind="openai"), "agents.planner.backend"),
        (BackendSettings(kind="local", options={"colour": "blue"}), "agents.planner.backend.options"),
    ],
)
def test_bad_backend_settings_name_the_agent_and_key(
    tmp_path: Path, backend: BackendSettings, key: str
) -> None:
    """Unknown kinds, a missing model file, a missing model name and unknown options are SettingsErrors naming the key
    (the first and third are refused when the settings are read already; built unchecked here, the wiring
    names them all the same)."""
    init_home(tmp_path / "h")
    settings = load_settings(tmp_path / "h", {})

    with pytest.raises(SettingsError) as caught:
        build_backend("planner", backend, settings)

    assert f"config.toml: {key}" in str(caught.value)


@pytest.mark.parametrize(
    ("backend", "says"),
    [('kind = "gpt"', "unknown backend 'gpt'"), ('kind = "openai"', "the openai backend needs a model name")],
)
def test_a_backend_that_cannot_be_made_is_refused_when_the_settings_are_read(
    tmp_path: Path, backend: str, says: str
) -> None:
    """An unknown backend kind, or the openai backend without a model, is a configuration error naming the
    agent's key (by its slug) when config.toml is read (``run`` exits 2 before its store or relay starts, ``agents list``
    too), not a failure of the daemon's start."""
    init_home(tmp_path / "h")
    config = tmp_path / "h" / "config.toml"
    config.write_text(config.read_text().replace('kind = "offline"', backend, 1))

    with pytest.raises(SettingsError, match=rf"config.toml: agents\.orchestrator\.backend: .*{says}"):
        load_settings(tmp_path / "h", {})


async def test_the_daemons_threads_persist_in_its_configured_store(tmp_path: Path) -> None:
    """The ThreadManager the daemon gives its runner saves agent-to-agent threads in the home's store, across a restart."""
    init_home(tmp_path / "h")
    settings = load_settings(tmp_path / "h", {})
    store = build_store(settings)
    await store.open()
    threads = build_thread_manager(store)
    thread = await threads.get_thread("conv", "alice", "bob")
    await threads.add_items_and_save(thread, [{"from": "alice", "to": "bob", "content": "hi"}])
    await store.close()

    reopened = build_store(settings)
    await reopened.open()
    again = await build_thread_manager(reopened).get_thread("conv", "bob", "alice")
    await reopened.close()

    assert again.items == [{"from": "alice", "to": "bob", "content": "hi"}]


def test_the_orchestrator_routes_with_its_model_unless_its_backend_is_offline(tmp_path: Path) -> None:
    """The orchestrator agent's offline backend keeps rule-based routing; any other backend gives the LLM router,
    with the orchestrator agent's token budget (budget_ratio of its context_window) for its routing context."""
    init_home(tmp_path / "h")
    settings = load_settings(tmp_path / "h", {})
    signers, project = load_signers(settings)
    manager = ConversationManager(MemoryStore(), build_agents(settings, signers), project.pubkey)
    backends: dict[str, LLMBackend] = {a.slug: OfflineBackend() for a in settings.agents}

    offline = build_orchestrator(settings, manager, backends)
    [configured] = [a for a in settings.agents if a.orchestrator]
    configured.backend.kind = "local"
    configured.backend.context_window = 1000
    with_model = build_orchestrator(settings, manager, backends)

    assert isinstance(offline, RuleBasedOrchestrator)
    assert isinstance(with_model, LLMOrchestrator)
    assert "- planner:" in with_model.system_prompt
    assert "- orchestrator:" not in with_model.system_prompt
    assert with_model.budget is not None
    assert with_model.budget.limit == 800


def test_profile_budget_comes_from_the_context_window_ratio_and_strategy(tmp_path: Path) -> None:
    """An agent's profile gets budget_ratio of its context_window, its strategy, and characters/4 counting."""
    init_home(tmp_path / "h")
    settings = load_settings(tmp_path / "h", {})
    agent_settings = settings.agents[0].model_copy(
        update={"backend": BackendSettings(context_window=1000, budget_strategy=BudgetStrategy.SUMMARIZE)}
    )
    agent = Agent(slug=agent_settings.slug, name=agent_settings.name, pubkey="b" * 64)

    profile = build_agent_profile(agent_settings, agent, settings)

    assert profile.budget == TokenBudget(800, BudgetStrategy.SUMMARIZE, estimate_tokens)


def test_no_context_window_means_no_budget_except_for_the_local_model(tmp_path: Path) -> None:
    """Without context_window no budget applies; the local backend lends its n_ctx and its own token counter."""
    init_home(tmp_path / "h")
    settings = load_settings(tmp_path / "h", {})
    local_settings = BackendSettings(kind="local", budget_ratio=0.5)
    local = build_backend("planner", local_settings, settings)
    assert isinstance(local, LocalBackend)

    budget = build_token_budget(local_settings, local)

    assert build_token_budget(BackendSettings(), OfflineBackend()) is None
    assert budget is not None
    assert budget.limit == local.context_window // 2
    assert budget.count == local.count_tokens
    assert local.count_tokens("12345678") == 2  # characters/4 until the model is loaded


@pytest.mark.parametrize(
    ("setting", "key"),
    [
        ('budget_strategy = "forget"', "backend.budget_strategy"),
        ("budget_ratio = 0", "backend.budget_ratio"),
        ("context_window = 0", "backend.context_window"),
    ],
)
def test_bad_budget_settings_name_their_key(tmp_path: Path, setting: str, key: str) -> None:
    """An unknown budget strategy, a ratio outside (0, 1] or a window under 1 token is refused naming the key."""
    init_home(tmp_path / "h")
    config = tmp_path / "h" / "config.toml"
    text = config.read_text(encoding="utf-8")
    config.write_text(
        text.replace("[agents.backend]\n", f"[agents.backend]\n{setting}\n", 1), encoding="utf-8"
    )

    with pytest.raises(SettingsError) as caught:
        load_settings(tmp_path / "h", {})

    assert key in str(caught.value)


def test_the_local_counter_uses_the_loaded_models_tokenizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the local model is loaded its own tokenizer counts (here a fake vocabulary: one token per byte)."""
    init_home(tmp_path / "h")
    settings = load_settings(tmp_path / "h", {})
    local = build_backend("planner", BackendSettings(kind="local"), settings)
    assert isinstance(local, LocalBackend)

    class ByteVocabulary:
        """Stands for a loaded llama.cpp model: tokenizes one token per byte."""

        def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
            """Return one token per byte."""
            return list(text)

    monkeypatch.setitem(local_module._MODELS, local._key, local_module._LoadedModel(ByteVocabulary()))

    assert local.count_tokens("héllo") == 6


def test_a_postgres_lease_pool_has_a_place_for_every_lane_and_run_that_may_hold_a_lease_around_another(
    tmp_path: Path,
) -> None:
    """On PostgreSQL a channel's or task's lease is held around a conversation's step by an intake lane or
    by a run (its private answer points its channel): with no more connections than lanes plus four, eight
    runs and a lane holding one each left none for the steps they waited on, and every write stopped for
    good. The lease pool has a place for each lane and each run, and more."""
    from tenex_daemon.adapters.storage.postgres import PostgresStore

    init_home(tmp_path / "h")
    settings = load_settings(tmp_path / "h", {
        "TENEX_STORAGE__KIND": "postgres", "TENEX_STORAGE__DSN": "postgresql://localhost/tenex",
        "TENEX_DAEMON__INTAKE_LANES": "3", "TENEX_DAEMON__MAX_CONCURRENT_RUNS": "8",
    })

    store = build_store(settings)

    assert isinstance(store, PostgresStore)
    assert store.lease_pool_size > 3 + 8
