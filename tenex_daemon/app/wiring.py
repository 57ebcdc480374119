"""The composition root: the one place that picks concrete adapters from Settings and builds the
pipeline (manager, runner, dispatcher and its scheduler) that the daemon runs and every service test
builds the same way (:func:`build_pipeline`)."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import structlog

from tenex_daemon.adapters.llm.factory import BACKEND_NAMES, UnknownBackendError, make_backend
from tenex_daemon.adapters.nostr.metadata_event import ConversationMetadataComposer
from tenex_daemon.adapters.nostr.private import WRAPS_KEY
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.app.home import check_distinct_keys
from tenex_daemon.app.settings import AgentSettings, BackendSettings, Settings, SettingsError, StorageKind
from tenex_daemon.core.agents import Agent
from tenex_daemon.core.budget import TokenBudget, TokenCounter, estimate_tokens
from tenex_daemon.core.classify import EventClassifier
from tenex_daemon.core.llm import BackendError, LLMBackend
from tenex_daemon.core.phases import PhaseRules
from tenex_daemon.core.ports import (
    Clock,
    EventFetcher,
    EventResolver,
    PartialTextPublisher,
    PeerMessages,
    Peers,
    ProfileNames,
    Publisher,
    ReplyComposer,
    RunStatus,
    Store,
)
from tenex_daemon.core.pricing import TokenPrices
from tenex_daemon.services.agent_runner import (
    DEFAULT_MAX_TOOL_ROUNDS,
    DEFAULT_PARTIAL_INTERVAL_S,
    AgentProfile,
    AgentRunner,
    RunObserver,
)
from tenex_daemon.services.conversation_manager import DEFAULT_TASK_SESSION_TTL_H, ConversationManager
from tenex_daemon.services.descriptions import DescriptionJobs, EventPublisher
from tenex_daemon.services.dispatcher import EventDispatcher, ReplyObserver
from tenex_daemon.services.lifecycle import DEFAULT_IDLE_TIMEOUT_MIN, ConversationLifecycle
from tenex_daemon.services.live_status import LiveStatus
from tenex_daemon.services.notices import store_notice
from tenex_daemon.services.orchestrator import (
    LLMOrchestrator,
    Orchestrator,
    RuleBasedOrchestrator,
    orchestrator_system_prompt,
)
from tenex_daemon.services.outbox import DEFAULT_WARN_AFTER_S, OUTBOX_KEY, Outbox, outbox_key_for
from tenex_daemon.services.routing_limits import DEFAULT_TURN_LIMIT
from tenex_daemon.services.runs import PENDING_RUNS_KEY, RunScheduler, journal_key_for
from tenex_daemon.services.stopping import PEER_ANSWER_WAIT_S, Stopper
from tenex_daemon.services.threads import ThreadManager
from tenex_daemon.services.tools import ToolRegistry
from tenex_daemon.services.undelivered import RefusalNotices

log = structlog.get_logger(__name__)

AVAILABLE_BACKENDS = BACKEND_NAMES


def build_store(settings: Settings) -> Store:
    """Return the configured conversation store (not yet opened)."""
    kind = settings.storage.kind
    if kind is StorageKind.MEMORY:
        return MemoryStore()
    if kind is StorageKind.POSTGRES:
        assert settings.storage.dsn is not None  # the settings refuse postgres without one
        from tenex_daemon.adapters.storage.postgres import PostgresStore

        # leases held around another: a channel's or task's, one per intake lane and one per run at most
        # (a run's private answer points its channel: docs/ARCHITECTURE.md, "Lock order"), so a pool
        # larger than that never runs out for good; names: a run lease per run, the daemon's own, a takeover's
        daemon = settings.daemon
        return PostgresStore(
            settings.storage.dsn,
            lease_pool_size=daemon.intake_lanes + daemon.max_concurrent_runs + 4,
            name_pool_size=daemon.max_concurrent_runs + 2,
            cache_size=settings.storage.cache_size,
        )
    from tenex_daemon.adapters.storage.filesystem import FileSystemStore

    storage = settings.storage
    folder = settings.conversations_path.parent
    return FileSystemStore(folder, fsync=storage.fsync, cache_size=storage.cache_size)


def store_to_read(settings: Settings) -> bool:
    """Whether a command that only reads should open the configured store: false only for a filesystem
    store whose ``conversations/`` folder is not there yet, under folders (no daemon ran on it, or
    ``storage.path`` names another folder), as opening would create it. Anything else in the way (a file,
    a link to nothing: an unmounted disk, a folder this user may not look in) is left to opening, which
    says so."""
    if settings.storage.kind is not StorageKind.FILESYSTEM:
        return True
    root = place = settings.conversations_path
    while True:
        try:
            found = place.stat()
        except FileNotFoundError:
            if os.path.islink(place) or place.parent == place:
                return True
            place = place.parent
            continue
        except OSError:
            return True
        return place == root or not stat.S_ISDIR(found.st_mode)


def build_thread_manager(store: Store) -> ThreadManager:
    """Return the agent-to-agent threads (``send_message``), persisted in ``store``'s meta space."""
    return ThreadManager(store=store)


def load_signers(settings: Settings) -> tuple[dict[str, Signer], Signer]:
    """Load every agent's key and the project key from the home (files must be mode 0600).

    Raises :class:`~tenex_daemon.adapters.nostr.signer.KeyFileError` naming a file that cannot be used, or
    both files when two agents' keys, or an agent's and the project's, are one key (``tenexd run`` exits 2
    with that line, before anything starts).
    """
    signers = {
        a.slug: Signer.from_file(settings.agent_key_path(a.slug), label=a.slug) for a in settings.agents
    }
    project = Signer.from_file(settings.project_key_path, label="project")
    check_distinct_keys(settings, {slug: s.pubkey for slug, s in signers.items()}, project.pubkey)
    return signers, project


def build_agents(settings: Settings, signers: dict[str, Signer]) -> list[Agent]:
    """Return the configured agents with the public keys of their key files."""
    return [
        Agent(slug=a.slug, name=a.name, pubkey=signers[a.slug].pubkey, orchestrator=a.orchestrator)
        for a in settings.agents
    ]


def build_backend(
    slug: str, backend: BackendSettings, settings: Settings, *, key: str | None = None
) -> LLMBackend:
    """Return the LLM backend an agent is configured with; a bad configuration names its key
    (``agents.<slug>.backend``, or ``key``).

    A relative ``api_key_file`` or local model path is taken relative to the home.
    """
    where = f"{settings.config_path}: {key or f'agents.{slug}.backend'}"
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
            home=settings.home,  # claude-code: kept out of the home's keys and conversations
            run_dir=settings.run_dir,
            store_path=settings.conversations_path,
            withheld_keys=key_variables(settings),
            withheld_files=key_files(settings),
        )
    except (UnknownBackendError, BackendError, ImportError) as exc:
        raise SettingsError(f"{where}: {exc}") from None
    except TypeError as exc:  # an option the backend does not take
        raise SettingsError(f"{where}.options: {exc}") from None


def key_variables(settings: Settings) -> frozenset[str]:
    """The environment variables the daemon's backends are configured to read their keys from
    (``api_key_env``): a claude-code agent's ``claude`` is not given them (an agent's shell, or a prompt
    injection, could print another provider's key whatever its variable is named)."""
    backends = [agent.backend for agent in settings.agents] + [settings.conversations.summarizer]
    return frozenset(b.api_key_env for b in backends if b is not None and b.api_key_env)


def routing_fallbacks(pipeline: Pipeline | None) -> Mapping[str, int]:
    """The routings the pipeline's orchestrator's model did not decide, by why (none when no model routes:
    :attr:`~tenex_daemon.services.orchestrator.LLMOrchestrator.fallbacks`)."""
    orchestrator = pipeline.orchestrator if pipeline is not None else None
    return orchestrator.fallbacks if isinstance(orchestrator, LLMOrchestrator) else {}


def key_files(settings: Settings) -> frozenset[Path]:
    """The key files the daemon's backends are configured with (``api_key_file``; relative ones in the home):
    a claude-code agent's file tools are denied them (one outside ``keys/`` is not covered otherwise)."""
    backends = [agent.backend for agent in settings.agents] + [settings.conversations.summarizer]
    files = (Path(b.api_key_file).expanduser() for b in backends if b is not None and b.api_key_file)
    return frozenset(file if file.is_absolute() else settings.home / file for file in files)


def build_summarizer(settings: Settings) -> LLMBackend | None:
    """Return the backend that writes conversations' titles and summaries (``[conversations.summarizer]``),
    or None: each conversation's first agent's own backend writes them."""
    summarizer = settings.conversations.summarizer
    if summarizer is None:
        return None
    return build_backend("summarizer", summarizer, settings, key="conversations.summarizer")


def build_descriptions(
    settings: Settings,
    pipeline: Pipeline,
    profiles: Mapping[str, AgentProfile],
    project_signer: Signer,
    publisher: EventPublisher,
    *,
    on_described: Callable[[str], None] | None = None,
) -> DescriptionJobs:
    """Return the service that describes conversations (titles, summaries, kind 513), told by the manager
    of each ended conversation and saved reply; it asks models only while no agent run is in flight."""
    project = (settings.owner, settings.project.d_tag) if settings.owner else None
    return DescriptionJobs(
        pipeline.manager,
        ConversationMetadataComposer(project_signer, project),
        publisher,
        backends={slug: profile.backend for slug, profile in profiles.items()},
        summarizer=build_summarizer(settings),
        describe_after_exchanges=settings.conversations.describe_after_exchanges,
        idle=lambda: pipeline.scheduler.in_flight == 0,
        on_described=on_described,
    )


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
    configured = _routing_model_agent(settings)
    if configured is None:
        return rules
    return LLMOrchestrator(
        manager,
        backends[configured.slug],
        rules,
        default_agent=settings.default_agent_slug,
        roles=_routing_roles(settings),
        instructions=configured.instructions,
        model=configured.backend.model,
        temperature=configured.backend.temperature,
        max_tokens=configured.backend.options.get("max_tokens"),
        budget=build_token_budget(configured.backend, backends[configured.slug]),
    )


def _routing_model_agent(settings: Settings) -> AgentSettings | None:
    """The orchestrator agent when it routes with a model (its backend is not ``offline``)."""
    configured = next((a for a in settings.agents if a.orchestrator), None)
    return None if configured is None or configured.backend.kind == "offline" else configured


def _routing_roles(settings: Settings) -> dict[str, str]:
    """Each routable agent's role for the orchestrator: its instructions' first line, else its name."""
    return {
        a.slug: a.instructions.strip().splitlines()[0] if a.instructions.strip() else a.name
        for a in settings.agents
        if not a.orchestrator
    }


def routing_system_prompt(settings: Settings) -> str | None:
    """The system prompt the orchestrator's model routes with (None: it routes by rules, no model), as
    :func:`build_orchestrator` builds it, for the context preview without a running daemon."""
    configured = _routing_model_agent(settings)
    if configured is None:
        return None
    roles = _routing_roles(settings)
    return orchestrator_system_prompt(roles, settings.phase_rules(), configured.instructions)


CLAUDE_CONTEXT_WINDOW = 200_000
"""The context window of the Claude models (tokens): the ``anthropic`` and ``claude-code`` backends'
window when ``context_window`` is not set."""


def build_token_budget(backend_settings: BackendSettings, backend: LLMBackend | None) -> TokenBudget | None:
    """Return an agent's token budget, or None (full history) when its context window is unknown.

    The window is ``context_window``, else the local backend's ``n_ctx``, else for the Claude backends
    (``anthropic``, ``claude-code``) :data:`CLAUDE_CONTEXT_WINDOW`; an ``openai`` one (any server speaking
    its API, whose models differ) has none unless set. Tokens are counted by the local backend's own
    tokenizer (once its model is loaded), else as characters/4 (also without a ``backend``: the CLI's
    context preview builds none).
    """
    window = backend_settings.context_window
    if window is None and backend_settings.kind in ("anthropic", "claude-code"):
        window = CLAUDE_CONTEXT_WINDOW
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
    budget = build_token_budget(backend_settings, backend)
    if budget is None and backend_settings.kind == "openai":
        log.warning(
            "context_window_unknown", agent=agent_settings.slug, model=backend_settings.model,
            action="full history sent; set the agent's backend.context_window for a budget",
        )
    return AgentProfile(
        agent=agent,
        instructions=agent_settings.instructions,
        backend=backend,
        model=backend_settings.model,
        temperature=backend_settings.temperature,
        max_tokens=backend_settings.options.get("max_tokens"),
        budget=budget,
        recent_in_persona=settings.conversations.recent_in_persona,
        list_recent=settings.conversations.list_recent,
        prices=TokenPrices.of(
            backend_settings.price_per_million_input_tokens, backend_settings.price_per_million_output_tokens
        ),
    )


# --- the pipeline ---------------------------------------------------------------------------


def wraps_key_for(outbox_key: str) -> str:
    """Where the gift wraps of the private replies in the outbox under ``outbox_key`` are kept (not under
    the outbox's own prefix: a scan for daemons' outboxes does not take it for one)."""
    return WRAPS_KEY + outbox_key.removeprefix(OUTBOX_KEY)


def instance_keys(project_pubkey: str, instance: str | None) -> tuple[str, str]:
    """(run journal key, outbox key) of one daemon among those sharing a database: its project key and
    its instance name (``daemon.instance_id``, else a new name at each start)."""
    name = f"{project_pubkey}.{instance}" if instance else project_pubkey
    return journal_key_for(name), outbox_key_for(name)


@dataclass(frozen=True, slots=True)
class PipelineOptions:
    """The settings the pipeline is built with (:meth:`from_settings` reads them from a home's Settings)."""

    owner: str | None
    project_pubkey: str | None = None
    whitelist: Collection[str] = ()
    whitelist_may_join: bool = False
    default_agent: str | None = None
    hop_limit: int = 6
    turn_limit: int = DEFAULT_TURN_LIMIT
    max_concurrent_runs: int = 8
    journal_key: str = PENDING_RUNS_KEY
    typing_delay_s: float = 0.0
    partial_interval_s: float = DEFAULT_PARTIAL_INTERVAL_S
    max_tool_rounds: int = DEFAULT_MAX_TOOL_ROUNDS
    outbox_key: str = OUTBOX_KEY
    outbox_warn_after_s: float = DEFAULT_WARN_AFTER_S
    phase_rules: PhaseRules | None = None
    idle_timeout_min: float = DEFAULT_IDLE_TIMEOUT_MIN
    task_session_ttl_h: float = DEFAULT_TASK_SESSION_TTL_H
    instance: str = ""
    """This daemon among those sharing a PostgreSQL database (empty: alone with its store)."""
    stop_wait_s: float = PEER_ANSWER_WAIT_S
    """How long a stop through the CLI or the API waits for the other daemons' answers."""

    @classmethod
    def from_settings(
        cls, settings: Settings, project_pubkey: str, instance: str | None = None
    ) -> PipelineOptions:
        """The options of a home: its owner, allow-list, limits, phases and run journal key.

        A home's files have one daemon (the store's lock); daemons sharing a PostgreSQL database
        each keep their run journal and outbox under keys of their own (:func:`instance_keys`).
        """
        shared = settings.storage.kind is StorageKind.POSTGRES
        journal_key, outbox_key = instance_keys(project_pubkey, instance)
        return cls(
            owner=settings.owner,
            project_pubkey=project_pubkey,
            whitelist=tuple(settings.whitelist),
            whitelist_may_join=settings.daemon.whitelist_may_join,
            default_agent=settings.default_agent_slug,
            hop_limit=settings.daemon.hop_limit,
            turn_limit=settings.daemon.orchestrator_turn_limit,
            max_concurrent_runs=settings.daemon.max_concurrent_runs,
            journal_key=journal_key if shared else PENDING_RUNS_KEY,
            outbox_key=outbox_key if shared else OUTBOX_KEY,
            outbox_warn_after_s=settings.daemon.outbox_warn_after_s,
            typing_delay_s=settings.daemon.typing_delay_s,
            partial_interval_s=settings.daemon.partial_interval_s,
            phase_rules=settings.phase_rules(),
            idle_timeout_min=settings.conversations.idle_timeout_min,
            task_session_ttl_h=settings.tasks.session_ttl_h,
            instance=instance if shared and instance is not None else "",
            stop_wait_s=settings.daemon.stop_wait_s,
        )


@dataclass(frozen=True, slots=True)
class PipelinePorts:
    """What the pipeline talks to: the store, the Nostr edge (composer, publisher, partials, resolver,
    fetcher), the classifier, a clock and the run observer. Production passes the real adapters; tests
    pass the fakes of :mod:`tenex_daemon.testing`."""

    store: Store
    composer: ReplyComposer
    publisher: Publisher
    classify: EventClassifier
    partials: PartialTextPublisher | None = None
    resolver: EventResolver | None = None
    names: ProfileNames | None = None
    """People's profile names, labelling them where several people write."""
    fetcher: EventFetcher | None = None
    clock: Clock | None = None
    observer: RunObserver | None = None
    reply_observer: ReplyObserver | None = None
    peers: Peers | None = None
    """Daemons sharing the store (PostgreSQL): runs then hold their conversation's run lease."""
    messages: PeerMessages | None = None
    """Messages to and from the daemons sharing the store: a stop through the CLI or API reaches them."""
    status: RunStatus | None = None
    """Where the live status of each conversation goes (kind 24133) as runs start and end."""


OrchestratorFactory = Callable[[ConversationManager], Orchestrator]
"""Builds the orchestrator once the manager exists (it reads the conversations it routes)."""


@dataclass(frozen=True, slots=True)
class Pipeline:
    """The whole event-to-reply pipeline, built once by :func:`build_pipeline`."""

    manager: ConversationManager
    runner: AgentRunner
    dispatcher: EventDispatcher
    orchestrator: Orchestrator
    threads: ThreadManager
    outbox: Outbox
    lifecycle: ConversationLifecycle
    stopper: Stopper
    """Carries out stops; hears the stops other daemons sharing the database tell."""
    live_status: LiveStatus | None = None
    """Which agents work where now (told by the scheduler); None without a ``status`` port."""

    @property
    def scheduler(self) -> RunScheduler:
        """The dispatcher's run scheduler (journal, concurrency, recovery, drain)."""
        return self.dispatcher.scheduler


def build_pipeline(
    agents: Sequence[Agent],
    profiles: Mapping[str, AgentProfile],
    ports: PipelinePorts,
    options: PipelineOptions,
    *,
    orchestrator: OrchestratorFactory | None = None,
    tools: ToolRegistry | None = None,
) -> Pipeline:
    """Build the pipeline the daemon runs: manager, runner, orchestrator, dispatcher and scheduler.

    Everything is passed to constructors; nothing is wired after construction. ``orchestrator``
    defaults to the rule-based router (``@slug`` mentions, else ``options.default_agent``).
    """
    manager = ConversationManager(
        ports.store,
        agents,
        options.project_pubkey,
        resolver=ports.resolver,
        names=ports.names,
        phase_rules=options.phase_rules,
        clock=ports.clock,
        owner_pubkey=options.owner,
        task_session_ttl_h=options.task_session_ttl_h,
    )
    threads = build_thread_manager(ports.store)  # agents may ask each other (send_message)
    outbox = Outbox(
        ports.store,
        ports.publisher,
        key=options.outbox_key,
        warn_after_s=options.outbox_warn_after_s,
        observer=ports.observer,
        on_refused=RefusalNotices(manager, ports.composer).notice,
        save_missing=partial(store_notice, manager, kind_of="recovered"),
    )
    live_status = LiveStatus(manager, ports.status) if ports.status is not None else None
    runner = AgentRunner(
        manager,
        profiles,
        ports.composer,
        ports.publisher,
        observer=ports.observer,
        typing_delay_s=options.typing_delay_s,
        tools=tools,
        max_tool_rounds=options.max_tool_rounds,
        partials=ports.partials,
        partial_interval_s=options.partial_interval_s,
        threads=threads,
        outbox=outbox,
        shared_store=ports.peers is not None,
        run_listener=live_status,
    )
    router = (
        orchestrator(manager)
        if orchestrator is not None
        else RuleBasedOrchestrator(manager.agents, options.default_agent)
    )
    lifecycle = ConversationLifecycle(manager, idle_timeout_min=options.idle_timeout_min)
    stopper = Stopper(
        manager,
        ports.composer,
        outbox,
        owner=options.owner,
        whitelist=options.whitelist,
        whitelist_may_join=options.whitelist_may_join,
        messages=ports.messages,
        instance=options.instance,
        wait_s=options.stop_wait_s,
        answers=runner.delegation,
    )
    dispatcher = EventDispatcher(
        manager,
        runner,
        ports.classify,
        router,
        owner=options.owner,
        whitelist=options.whitelist,
        whitelist_may_join=options.whitelist_may_join,
        hop_limit=options.hop_limit,
        turn_limit=options.turn_limit,
        fetcher=ports.fetcher,
        max_concurrent_runs=options.max_concurrent_runs,
        journal_key=options.journal_key,
        observer=ports.reply_observer,
        peers=ports.peers,
        lifecycle=lifecycle,
        run_listener=live_status,
        stopper=stopper,
    )
    return Pipeline(manager, runner, dispatcher, router, threads, outbox, lifecycle, stopper, live_status)
