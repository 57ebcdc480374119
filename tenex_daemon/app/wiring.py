"""The one place that picks concrete adapters from Settings."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from tenex_daemon.adapters.llm.factory import BACKEND_NAMES, UnknownBackendError, make_backend
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.app.settings import AgentSettings, BackendSettings, Settings, SettingsError, StorageKind
from tenex_daemon.core.agents import Agent
from tenex_daemon.core.budget import TokenBudget, TokenCounter, estimate_tokens
from tenex_daemon.core.llm import BackendError, LLMBackend
from tenex_daemon.core.ports import ConversationStore
from tenex_daemon.services.agent_runner import AgentProfile
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.services.orchestrator import LLMOrchestrator, Orchestrator, RuleBasedOrchestrator
from tenex_daemon.services.threads import ThreadManager

AVAILABLE_BACKENDS = BACKEND_NAMES


def build_store(settings: Settings) -> ConversationStore:
    """Return the configured conversation store (not yet opened)."""
    kind = settings.storage.kind
    if kind is StorageKind.MEMORY:
        return MemoryStore()
    if kind is StorageKind.POSTGRES:
        if not settings.storage.dsn:
            raise SettingsError(
                f"{settings.config_path}: storage.dsn is required when storage.kind = postgres"
            )
        from tenex_daemon.adapters.storage.postgres import PostgresStore

        return PostgresStore(settings.storage.dsn)
    from tenex_daemon.adapters.storage.filesystem import FileSystemStore

    home = Path(settings.storage.path) if settings.storage.path else settings.home
    return FileSystemStore(home, fsync=settings.storage.fsync, cache_size=settings.storage.cache_size)


def build_thread_manager(store: ConversationStore) -> ThreadManager:
    """Return the agent-to-agent threads (``send_message``), persisted in ``store``'s meta space."""
    return ThreadManager(store=store)


def load_signers(settings: Settings) -> tuple[dict[str, Signer], Signer]:
    """Load every agent's key and the project key from the home (files must be mode 0600)."""
    signers = {
        a.slug: Signer.from_file(settings.agent_key_path(a.slug), label=a.slug) for a in settings.agents
    }
    project = Signer.from_file(settings.project_key_path, label="project")
    return signers, project


def build_agents(settings: Settings, signers: dict[str, Signer]) -> list[Agent]:
    """Return the configured agents with the public keys of their key files."""
    return [
        Agent(slug=a.slug, name=a.name, pubkey=signers[a.slug].pubkey, orchestrator=a.orchestrator)
        for a in settings.agents
    ]


def build_backend(slug: str, backend: BackendSettings, settings: Settings) -> LLMBackend:
    """Return the LLM backend an agent is configured with; a bad configuration names its key.

    A relative ``api_key_file`` or local model path is taken relative to the home.
    """
    where = f"{settings.config_path}: agents.{slug}.backend"
    if backend.kind not in AVAILABLE_BACKENDS:
        raise SettingsError(
            f"{where}.kind: unknown backend {backend.kind!r} (available: {', '.join(AVAILABLE_BACKENDS)})"
        )
    key_file = backend.api_key_file
    if key_file is not None and not Path(key_file).expanduser().is_absolute():
        key_file = str(settings.home / key_file)
    model = backend.model
    if backend.kind == "local" and model is not None and model.endswith(".gguf"):
        path = Path(model).expanduser()
        model = str(path if path.is_absolute() else settings.home / path)
    try:
        return make_backend(
            backend.kind,
            model=model,
            base_url=backend.base_url,
            api_key_env=backend.api_key_env,
            api_key_file=key_file,
            temperature=backend.temperature,
            options=backend.options,
        )
    except (UnknownBackendError, BackendError, ImportError) as exc:
        raise SettingsError(f"{where}: {exc}") from None
    except TypeError as exc:  # an option the backend does not take
        raise SettingsError(f"{where}.options: {exc}") from None


def build_orchestrator(
    settings: Settings, manager: ConversationManager, backends: Mapping[str, LLMBackend]
) -> Orchestrator:
    """Return how unaddressed messages and completions are routed.

    The orchestrator agent (``orchestrator = true``) routes with its language model
    (:class:`LLMOrchestrator`, the rule-based router as its fallback when the backend fails)
    unless its backend is ``offline``; without a model, or without an orchestrator agent,
    the rule-based router decides (``@slug`` mentions, else the default agent).
    """
    rules = RuleBasedOrchestrator(manager.agents, settings.default_agent_slug)
    configured = next((a for a in settings.agents if a.orchestrator), None)
    if configured is None or configured.backend.kind == "offline":
        return rules
    roles = {
        a.slug: a.instructions.strip().splitlines()[0] if a.instructions.strip() else a.name
        for a in settings.agents
        if not a.orchestrator
    }
    return LLMOrchestrator(
        manager,
        backends[configured.slug],
        rules,
        default_agent=settings.default_agent_slug,
        roles=roles,
        instructions=configured.instructions,
        model=configured.backend.model,
        temperature=configured.backend.temperature,
        max_tokens=configured.backend.options.get("max_tokens"),
    )


def build_token_budget(backend_settings: BackendSettings, backend: LLMBackend) -> TokenBudget | None:
    """Return an agent's token budget, or None (full history) when its context window is unknown.

    The window is ``context_window``, else the local backend's ``n_ctx``. Tokens are counted by
    the local backend's own tokenizer (once its model is loaded), else as characters/4.
    """
    window = backend_settings.context_window
    count: TokenCounter = estimate_tokens
    if backend_settings.kind == "local":
        from tenex_daemon.adapters.llm.local import LocalBackend

        if isinstance(backend, LocalBackend):
            count = backend.count_tokens
            window = window or backend.context_window
    if window is None:
        return None
    ratio, strategy = backend_settings.budget_ratio, backend_settings.budget_strategy
    return TokenBudget.of_window(window, ratio, strategy, count)


def build_agent_profile(agent_settings: AgentSettings, agent: Agent, settings: Settings) -> AgentProfile:
    """Return what a run of one configured agent needs: persona, backend, options and token budget."""
    backend_settings = agent_settings.backend
    backend = build_backend(agent_settings.slug, backend_settings, settings)
    return AgentProfile(
        agent=agent,
        instructions=agent_settings.instructions,
        backend=backend,
        model=backend_settings.model,
        temperature=backend_settings.temperature,
        max_tokens=backend_settings.options.get("max_tokens"),
        budget=build_token_budget(backend_settings, backend),
    )
