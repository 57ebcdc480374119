"""Wiring: each agent's configured backend is built by name, and a bad one is refused naming its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from tenex_daemon.adapters.llm.local import LocalBackend
from tenex_daemon.adapters.llm.offline import OfflineBackend
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.app.home import HomeError, init_home
from tenex_daemon.app.settings import BackendSettings, SettingsError, load_settings
from tenex_daemon.app.wiring import (
    build_agents,
    build_backend,
    build_orchestrator,
    build_store,
    build_thread_manager,
    load_signers,
)
from tenex_daemon.core.llm import LLMBackend
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.services.orchestrator import LLMOrchestrator, RuleBasedOrchestrator


def test_init_with_the_local_backend_gives_every_demo_agent_the_bundled_model(tmp_path: Path) -> None:
    """`init --backend local` writes kind = "local" for each demo agent, and wiring builds LocalBackend."""
    init_home(tmp_path / "h", backend="local")
    settings = load_settings(tmp_path / "h", {})

    backends = [build_backend(a.slug, a.backend, settings) for a in settings.agents]

    assert [a.backend.kind for a in settings.agents] == ["local"] * 3
    assert all(isinstance(b, LocalBackend) for b in backends)


def test_default_demo_backend_is_offline(tmp_path: Path) -> None:
    """A home made without --backend uses the deterministic offline backend."""
    init_home(tmp_path / "h")
    settings = load_settings(tmp_path / "h", {})

    assert all(isinstance(build_backend(a.slug, a.backend, settings), OfflineBackend) for a in settings.agents)


def test_unknown_backend_at_init_is_refused(tmp_path: Path) -> None:
    """init refuses a backend name it does not know and writes nothing."""
    with pytest.raises(HomeError, match="unknown backend 'gpt'"):
        init_home(tmp_path / "h", backend="gpt")
    assert not (tmp_path / "h" / "config.toml").exists()


@pytest.mark.parametrize(
    ("backend", "key"),
    [
        (BackendSettings(kind="gpt"), "agents.planner.backend.kind"),
        (BackendSettings(kind="local", model="missing.gguf"), "agents.planner.backend"),
        (BackendSettings(kind="openai"), "agents.planner.backend"),
        (BackendSettings(kind="local", options={"colour": "blue"}), "agents.planner.backend.options"),
    ],
)
def test_bad_backend_settings_name_the_agent_and_key(tmp_path: Path, backend: BackendSettings, key: str) -> None:
    """Unknown kinds, a missing model file, a missing model name and unknown options are SettingsErrors naming the key."""
    init_home(tmp_path / "h")
    settings = load_settings(tmp_path / "h", {})

    with pytest.raises(SettingsError) as caught:
        build_backend("planner", backend, settings)

    assert f"config.toml: {key}" in str(caught.value)


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
    """The orchestrator agent's offline backend keeps rule-based routing; any other backend gives the LLM router."""
    init_home(tmp_path / "h")
    settings = load_settings(tmp_path / "h", {})
    signers, project = load_signers(settings)
    manager = ConversationManager(MemoryStore(), build_agents(settings, signers), project.pubkey)
    backends: dict[str, LLMBackend] = {a.slug: OfflineBackend() for a in settings.agents}

    offline = build_orchestrator(settings, manager, backends)
    [configured] = [a for a in settings.agents if a.orchestrator]
    configured.backend.kind = "local"
    with_model = build_orchestrator(settings, manager, backends)

    assert isinstance(offline, RuleBasedOrchestrator)
    assert isinstance(with_model, LLMOrchestrator)
    assert "- planner:" in with_model.system_prompt
    assert "- orchestrator:" not in with_model.system_prompt
