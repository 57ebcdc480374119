"""One typed Settings object: loaded once from the home's config.toml with TENEX_* overrides.

Errors name the key and where its value came from: the file, or the environment variable that
set it. Settings are passed through constructors, never read from globals.
"""

from __future__ import annotations

import os
import shlex
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tenex_daemon.adapters.llm.factory import BACKEND_NAMES
from tenex_daemon.app.home_dir import resolve_home
from tenex_daemon.core.budget import DEFAULT_BUDGET_RATIO, BudgetStrategy
from tenex_daemon.core.errors import TenexError
from tenex_daemon.core.phases import Phase, PhaseRules
from tenex_daemon.core.threads import KEY_SEPARATOR

CONFIG_FILE = "config.toml"
ENV_PREFIX = "TENEX_"


class SettingsError(TenexError):
    """The configuration is missing or invalid; the message names the key and the file."""


class StorageKind(StrEnum):
    """Which conversation store the daemon uses."""

    FILESYSTEM = "filesystem"
    MEMORY = "memory"
    POSTGRES = "postgres"


class AnswerMode(StrEnum):
    """What agents answer (``daemon.answer``): public mentions, NIP-17 private messages, or both."""

    BOTH = "both"
    PUBLIC = "public"
    PRIVATE = "private"

    @property
    def public(self) -> bool:
        """Whether public mentions (kinds 1, 11, 1111, 1934) are answered."""
        return self is not AnswerMode.PRIVATE

    @property
    def private(self) -> bool:
        """Whether private messages (gift-wrapped kind 14) are answered."""
        return self is not AnswerMode.PUBLIC


LOG_LEVELS = ("debug", "info", "warning", "error", "critical", "warn", "fatal", "notset")
"""The levels ``daemon.log_level`` takes: Python's logging names (the last three its aliases)."""

class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BackendSettings(_Section):
    """How an agent thinks: which LLM backend and its options."""

    kind: str = "offline"
    """offline | openai | anthropic | claude-code | local."""
    model: str | None = None
    base_url: str | None = None
    api_key_env: str | None = None
    api_key_file: str | None = None
    temperature: float | None = None
    context_window: int | None = Field(default=None, ge=1)
    """The model's context window in tokens; None: unknown (no budget, except local: its n_ctx)."""
    budget_strategy: BudgetStrategy = BudgetStrategy.SLIDING_WINDOW
    """What replaces older messages over budget: sliding_window | summarize (docs/CONTEXT.md)."""
    budget_ratio: float = Field(default=DEFAULT_BUDGET_RATIO, gt=0, le=1)
    """The share of the context window the persona and messages may use."""
    price_per_million_input_tokens: float | None = Field(default=None, ge=0)
    price_per_million_output_tokens: float | None = Field(default=None, ge=0)
    """US dollars per million prompt / completion tokens; when set, replies carry ``llm-cost-usd``."""
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _known_backend(self) -> BackendSettings:
        """A backend that cannot be made is refused with the settings, before anything starts."""
        if self.kind not in BACKEND_NAMES:
            raise ValueError(f"unknown backend {self.kind!r} (available: {', '.join(BACKEND_NAMES)})")
        if self.kind == "openai" and not self.model:
            raise ValueError("the openai backend needs a model name (model = ...)")
        return self


RESERVED_SLUGS: Final = frozenset({"owner", "project", "import"})
"""The home's other key files (``keys/<name>.key``), which an agent's would overwrite or be taken for."""


class AgentSettings(_Section):
    """One agent of the project. Its secret key lives in ``keys/<slug>.key`` (mode 0600)."""

    slug: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,63}$")
    name: str
    instructions: str = ""
    orchestrator: bool = False
    role: str | None = None
    """The role of the kind-4199 definition it was installed from (its instructions begin with it)."""
    source: str | None = None
    """The ``nevent``/``naddr`` of the kind-4199 definition it was installed from (``agents add --from``)."""
    backend: BackendSettings = Field(default_factory=BackendSettings)

    @field_validator("slug")
    @classmethod
    def _no_key_separator(cls, slug: str) -> str:
        """A slug never holds ``__``: it separates the names in a delegation thread's key
        (``<conversation>__<agent>__<agent>``, docs/ARCHITECTURE.md, "Delegation threads")."""
        if KEY_SEPARATOR in slug:
            raise ValueError(f"a slug must not contain {KEY_SEPARATOR!r} (it separates names in thread keys)")
        if slug in RESERVED_SLUGS:
            raise ValueError(f"{slug!r} is not an agent's slug: keys/{slug}.key holds the {slug}'s key")
        return slug


class ProjectSettings(_Section):
    """The project: its name and the ``d`` identifier of its kind-31933 definition."""

    name: str = "tenex"
    identifier: str | None = None
    """The project's ``d`` tag; defaults to the name."""

    @property
    def d_tag(self) -> str:
        """The identifier used in ``31933:<owner>:<d>`` addresses."""
        return self.identifier or self.name


class StorageSettings(_Section):
    """Where conversations are kept."""

    kind: StorageKind = StorageKind.FILESYSTEM
    path: str | None = None
    """Home of the filesystem store: its conversations (and its lock) are kept in
    ``<path>/conversations``; default: the daemon's home (``<home>/conversations``). Relative: to the home
    (:func:`load_settings` makes it absolute)."""
    fsync: Literal["always", "batch"] = "batch"
    dsn: str | None = None
    """PostgreSQL DSN when kind = postgres: a ``postgresql://`` (or ``postgres://``) URI."""
    cache_size: int = Field(default=256, ge=1)

    @model_validator(mode="after")
    def _dsn_for_postgres(self) -> StorageSettings:
        if self.kind is StorageKind.POSTGRES:
            if not self.dsn:
                raise ValueError("dsn is required when kind = postgres")
            scheme = self.dsn.partition("://")[0]
            if scheme not in ("postgresql", "postgres"):
                raise ValueError("dsn must be a postgresql:// URI (postgresql://user@host:5432/database)")
        return self


class RelaySettings(_Section):
    """Relays to connect to, and the embedded relay."""

    urls: list[str] = Field(default_factory=list)
    embedded: bool = False
    embedded_host: str = "127.0.0.1"
    embedded_port: int = Field(default=7777, ge=1, le=65535)
    since_window_s: int = Field(default=300, ge=0)
    publish_timeout_s: float = Field(default=10.0, gt=0)
    """How long one publish waits for a relay's answer (a failed one is tried again by the outbox)."""

    @field_validator("embedded_port", mode="before")
    @classmethod
    def _no_chosen_port(cls, port: object) -> object:
        """Port 0 (any free port) was accepted once: say why it is not, not only pydantic's bound."""
        if (port == 0 and not isinstance(port, bool)) or (isinstance(port, str) and port.strip() == "0"):
            raise ValueError(
                "0 (a port the system picks) is not accepted: the clients and `tenexd send` must know the "
                "embedded relay's port; choose one, e.g. 7777"
            )
        return port

    @field_validator("urls")
    @classmethod
    def _ws_urls(cls, urls: list[str]) -> list[str]:
        bad = first_bad_relay_url(urls)
        if bad is not None:
            raise ValueError(bad)
        return urls


def first_bad_relay_url(urls: Sequence[str]) -> str | None:
    """Why the first of ``urls`` that is no ws:// or wss:// URL is refused (config.toml, ``init``, the
    command line's ``--relay``); None when all are."""
    bad = next((url for url in urls if not url.startswith(("ws://", "wss://"))), None)
    return None if bad is None else f"relay URL {bad!r} must start with ws:// or wss://"


class ControlSettings(_Section):
    """The local HTTP control API."""

    socket: str | None = None
    """Unix socket path; default ``<home>/run/control.sock``. Relative: to the home."""
    tcp_port: int | None = Field(default=None, ge=1, le=65535)
    """Optional loopback TCP port (127.0.0.1 only). It asks for ``Authorization: Bearer <token>``, the
    token in ``<home>/run/control.token`` (0600, made at start when missing), and refuses other Host
    headers and cross-origin requests."""


class DaemonSettings(_Section):
    """Daemon behaviour: limits, intervals, grace periods."""

    hop_limit: int = Field(default=6, ge=0)
    """Agent-to-agent replies in a row before agents stop answering agents."""
    whitelist_may_join: bool = False
    """Whether a whitelisted person may write into a conversation someone else started (and read it through
    the agents); off: only into their own, or one the owner p-tagged them in (``not_a_participant``)."""
    answer: AnswerMode = AnswerMode.BOTH
    """What agents answer: ``both``, ``public`` mentions only, or ``private`` messages (NIP-17) only; the
    rest is ignored with its reason (``public_mentions_off``, ``private_messages_off``)."""
    orchestrator_turn_limit: int = Field(default=10, ge=1)
    """Orchestrator turns without a new user message before routing stops (a routing loop)."""
    max_concurrent_runs: int = Field(default=8, ge=1)
    intake_lanes: int = Field(default=16, ge=1)
    """Conversations whose incoming events are stored at once (one conversation's events stay in order)."""
    grace_period_s: float = Field(default=20.0, ge=0)
    """In-flight runs get this long to finish on shutdown (shorter than systemd's stop timeout)."""
    status_interval_s: float = Field(default=2.0, gt=0)
    heartbeat_interval_s: float = Field(default=15.0, gt=0)
    typing_min_interval_s: float = Field(default=5.0, ge=0)
    typing_delay_s: float = Field(default=0.25, ge=0)
    """An agent shows typing once its run has taken this long (faster replies show none)."""
    stream_partials: bool = True
    """Publish an agent's text as its backend streams it (ephemeral kind 21111)."""
    partial_interval_s: float = Field(default=0.5, gt=0)
    """Streamed text is published at most this often per run."""
    stale_after_s: float = Field(default=30.0, gt=0)
    """`tenexd status` calls a status file older than this stale."""
    max_content_bytes: int = Field(default=256 * 1024, ge=1)
    instance_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    """This daemon's name among daemons sharing a PostgreSQL database (default: a new one at each
    start). Its run journal and outbox are kept under it; a daemon that died is taken over by the
    others (its lock released), what it held is answered by them."""
    takeover_interval_s: float = Field(default=5.0, gt=0)
    """How often a daemon on a shared database looks for dead daemons to take over."""
    stop_wait_s: float = Field(default=1.5, ge=0)
    """How long a stop through the CLI or the API waits for the other daemons on a shared database to
    answer which agents they stopped (one answering later still stops them)."""
    outbox_warn_after_s: float = Field(default=300.0, gt=0)
    """A signed event still waiting for a relay after this long is logged (``outbox_entry_old``); it is
    never dropped: the outbox keeps trying."""
    log_format: Literal["auto", "json", "console"] = "auto"
    log_level: str = "info"
    """debug, info, warning, error or critical (any case; warn, fatal and notset too)."""

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        if value.strip().lower() not in LOG_LEVELS:
            raise ValueError(f"unknown log level {value!r} ({', '.join(LOG_LEVELS)})")
        return value


class ConversationSettings(_Section):
    """``[conversations]``: how conversations end, are described, remembered and expire
    (docs/ARCHITECTURE.md, "Conversation lifecycle")."""

    idle_timeout_min: float = Field(default=30.0, gt=0)
    """A conversation idle this long is ended (by the sweeper, or when a kind-1 channel's next note
    comes); a person's top-level kind-1 note to an agent continues their open conversation younger
    than this, else starts a new one."""
    sweep_interval_min: float = Field(default=5.0, gt=0)
    """How often the sweeper ends idle conversations, archives and deletes by the policies below."""
    archive_after_days: float | None = Field(default=30.0, gt=0)
    """Archive (read-only until a new message or a restore) conversations inactive this long; None: never."""
    max_retained: int = Field(default=1000, ge=1)
    """Delete the oldest ended conversations beyond this many (active ones are never deleted)."""
    delete_after_days: float | None = Field(default=None, gt=0)
    """Also delete ended conversations inactive this long; None: only ``max_retained`` deletes."""
    recent_in_persona: int = Field(default=2, ge=0)
    """How many of the person's latest ended conversations with the agent the persona recalls (0: off)."""
    list_recent: int = Field(default=10, ge=1)
    """How many conversations ``get_conversation``'s ``list_recent`` lists by default."""
    describe_after_exchanges: int = Field(default=3, ge=1)
    """A titleless active conversation is given a title and summary once it has this many exchanges
    (a person's message and an agent's answer)."""
    summarizer: BackendSettings | None = None
    """The backend that writes titles and summaries; None: the conversation's first agent's own."""


class TaskSettings(_Section):
    """``[tasks]``: task sessions (kind 1934, docs/ARCHITECTURE.md)."""

    session_ttl_h: float = Field(default=24.0, gt=0)
    """A task's session expires this long after its last activity; the next event starts a new one."""


class Settings(_Section):
    """Everything the daemon is configured with."""

    home: Path
    owner: str | None = None
    """Hex public key of the person who owns the project (allowed to trigger agents)."""
    whitelist: list[str] = Field(default_factory=list)
    """Other hex public keys allowed to trigger agents."""
    default_agent: str | None = None
    """Where the orchestrator routes when nothing names an agent; default the first non-orchestrator."""
    project: ProjectSettings = Field(default_factory=ProjectSettings)
    agents: list[AgentSettings] = Field(default_factory=list)
    storage: StorageSettings = Field(default_factory=StorageSettings)
    relays: RelaySettings = Field(default_factory=RelaySettings)
    control: ControlSettings = Field(default_factory=ControlSettings)
    daemon: DaemonSettings = Field(default_factory=DaemonSettings)
    conversations: ConversationSettings = Field(default_factory=ConversationSettings)
    tasks: TaskSettings = Field(default_factory=TaskSettings)
    phases: dict[str, list[str]] = Field(default_factory=dict)
    """Allowed phase transitions, ``from = [to, ...]``; empty keeps docs/ARCHITECTURE.md's default table."""

    @field_validator("phases")
    @classmethod
    def _phase_names(cls, table: dict[str, list[str]]) -> dict[str, list[str]]:
        """Every name in the table is a phase name (a phase it names that is not built in is added)."""
        for source, targets in table.items():
            for name in (source, *targets):
                Phase(name)  # ValueError saying what a phase name is
        return table

    def phase_rules(self) -> PhaseRules:
        """The project's phase transition rules (the default table when ``phases`` is empty)."""
        if not self.phases:
            return PhaseRules()
        table = {Phase(source): [Phase(t) for t in targets] for source, targets in self.phases.items()}
        return PhaseRules(table)

    @field_validator("owner")
    @classmethod
    def _hex_owner(cls, value: str | None) -> str | None:
        if value is not None:
            _check_hex_key(value)
        return value

    @field_validator("whitelist")
    @classmethod
    def _hex_whitelist(cls, values: list[str]) -> list[str]:
        for value in values:
            _check_hex_key(value)
        return values

    @model_validator(mode="after")
    def _agents_consistent(self) -> Settings:
        slugs = [a.slug for a in self.agents]
        duplicates = sorted({s for s in slugs if slugs.count(s) > 1})
        if duplicates:
            raise ValueError(f"duplicate agent slugs: {', '.join(duplicates)}")
        if sum(a.orchestrator for a in self.agents) > 1:
            raise ValueError("at most one agent may be the orchestrator")
        if self.default_agent is not None and self.default_agent not in slugs:
            raise ValueError(f"default_agent {self.default_agent!r} is not one of the agents")
        if any(a.orchestrator and a.slug == self.default_agent for a in self.agents):
            # what nobody addressed would be "routed" to the orchestrator itself, and no agent would answer
            raise ValueError(
                f"default_agent = {self.default_agent!r} is the orchestrator (agents.{self.default_agent}."
                "orchestrator = true): name another agent, or leave default_agent out (the first agent that "
                "is not the orchestrator)"
            )
        return self

    # --- derived paths ------------------------------------------------------------------

    @property
    def config_path(self) -> Path:
        """The config file."""
        return self.home / CONFIG_FILE

    @property
    def keys_dir(self) -> Path:
        """Secret key files (0600), one per agent plus ``project.key`` and maybe ``owner.key``."""
        return self.home / "keys"

    def agent_key_path(self, slug: str) -> Path:
        """The secret key file of an agent."""
        return self.keys_dir / f"{slug}.key"

    @property
    def project_key_path(self) -> Path:
        """The project's secret key file."""
        return self.keys_dir / "project.key"

    @property
    def owner_key_path(self) -> Path:
        """The owner's secret key, present only when ``tenexd init`` generated it."""
        return self.keys_dir / "owner.key"

    @property
    def run_dir(self) -> Path:
        """Runtime files: status, control socket, lock."""
        return self.home / "run"

    @property
    def status_path(self) -> Path:
        """The status file the daemon rewrites every few seconds."""
        return self.run_dir / "status.json"

    @property
    def control_socket_path(self) -> Path:
        """The control API's Unix socket."""
        return Path(self.control.socket) if self.control.socket else self.run_dir / "control.sock"

    @property
    def control_token_path(self) -> Path:
        """The control API's TCP token (0600), made at the daemon's start when ``control.tcp_port`` is set."""
        return self.run_dir / "control.token"

    @property
    def conversations_path(self) -> Path:
        """The filesystem store's folder, ``<storage.path or home>/conversations``: build_store's."""
        return (Path(self.storage.path) if self.storage.path else self.home) / "conversations"

    @property
    def embedded_relay_path(self) -> Path:
        """LMDB folder of the embedded relay."""
        return self.home / "relay"

    @property
    def default_agent_slug(self) -> str | None:
        """The configured default agent (never the orchestrator: :meth:`_agents_consistent` refuses it), else
        the first agent that is not the orchestrator."""
        if self.default_agent is not None:
            return self.default_agent
        return next((a.slug for a in self.agents if not a.orchestrator), None)


def _in_home(home: Path, value: str) -> Path:
    """``value`` made absolute: ``~`` expanded, a relative path joined to ``home``."""
    try:
        path = Path(value).expanduser()
    except RuntimeError:  # "~" with no user's home known
        raise ValueError(f"{value!r}: '~' cannot be expanded here; write the full path") from None
    return path if path.is_absolute() else home / path


def _store_left_behind(value: str, in_home: Path) -> None:
    """Refuse a relative ``storage.path`` (``value``, now ``in_home``) whose store is found only under the
    current folder, where versions before this one looked, naming both: the daemon would start on an empty
    store and answer again what the relays hold. An absolute one is the same path either way."""
    try:
        earlier = Path.cwd() / Path(value).expanduser()
    except OSError:  # the current folder was removed
        return
    if earlier.resolve() != in_home.resolve() and _a_store_in(earlier) and not _a_store_in(in_home):
        raise ValueError(
            f"{value!r} is taken relative to the home ({in_home}), where no store is; the store is at "
            f"{earlier} (relative to the current folder, where tenexd looked before): give that full path"
        )


def _a_store_in(folder: Path) -> bool:
    """Whether ``folder`` holds a filesystem store's ``conversations/`` (one this user may not look into:
    no)."""
    try:
        return (folder / "conversations").is_dir()
    except OSError:
        return False


def _paths_in_home(data: dict[str, Any], root: Path, overrides: list[_Override], config: Path) -> None:
    """Make a relative ``storage.path`` or ``control.socket`` absolute, relative to the home ``root``, as a
    relative ``api_key_file`` is, whatever folder the daemon or a command starts in (``~``: the user's home);
    refused (:class:`SettingsError`) naming where the value came from."""
    for section, key in (("storage", "path"), ("control", "socket")):
        table = data.get(section)
        value = table.get(key) if isinstance(table, dict) else None
        if not isinstance(table, dict) or not isinstance(value, str) or not value:
            continue
        try:
            path = _in_home(root, value)
            if section == "storage":
                _store_left_behind(value, path)
            table[key] = str(path)
        except ValueError as exc:
            source = _source((section, key), overrides, config)
            raise SettingsError(f"{source}: {section}.{key}: {exc}") from None


def _check_hex_key(value: str) -> None:
    if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise ValueError(f"{value!r} is not a 64-character lowercase hex public key")


SECTION_SEPARATOR = "__"


@dataclass(frozen=True)
class _Override:
    """One ``TENEX_`` variable that sets a setting: its name, its path of keys, its value."""

    name: str
    path: tuple[str, ...]
    value: Any


def _env_overrides(env: Mapping[str, str]) -> list[_Override]:
    """The ``TENEX_`` variables that set settings, each with its path of keys and its value.

    A variable is a setting when what follows ``TENEX_`` contains ``__`` (``TENEX_SECTION__KEY``,
    ``__`` separating levels) or is a top-level key (``TENEX_OWNER``, ``TENEX_DAEMON`` as a whole
    table); any other ``TENEX_`` variable (``TENEX_HOME``, which picks the home, and the scripts'
    own, such as ``TENEX_BENCH_FIGURES``) is not a setting and is ignored, but one that reads as a
    section's key with a single underscore (``TENEX_DAEMON_HOP_LIMIT``) is refused. A ``__`` variable
    whose first part names no top-level key is refused, naming it. Values are parsed as TOML values when
    they can be (numbers, booleans, arrays, inline tables), else taken as strings.
    """
    top_level = set(Settings.model_fields) - {"home"}
    found: list[_Override] = []
    for name, raw in sorted(env.items()):
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX) :]
        path = tuple(part.lower() for part in rest.split(SECTION_SEPARATOR) if part)
        if not path or (SECTION_SEPARATOR not in rest and path[0] not in top_level):
            _refuse_one_underscore(name, rest.lower(), top_level)
            continue  # not a setting: TENEX_HOME, a script's own variable
        if path[0] not in top_level:
            raise SettingsError(
                f"environment {name}: {path[0]}: not a section or key of the settings "
                f"(top level: {', '.join(sorted(top_level))})"
            )
        try:
            value: Any = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        found.append(_Override(name, path, value))
    return found


def _refuse_one_underscore(name: str, rest: str, top_level: set[str]) -> None:
    """Refuse ``TENEX_DAEMON_HOP_LIMIT``: a section's key with one underscore, a setting mistyped (ignored,
    the person would believe it applies)."""
    section = next((key for key in sorted(top_level) if rest.startswith(f"{key}_")), None)
    if section is not None:
        key = rest[len(section) + 1 :].upper()
        raise SettingsError(
            f"environment {name}: not a setting; {ENV_PREFIX}{section.upper()}{SECTION_SEPARATOR}{key} is "
            f"(two underscores between the section and its key)"
        )


def _apply(data: dict[str, Any], overrides: list[_Override]) -> dict[str, Any]:
    """``data`` with each override set at its path (whole tables first, their keys then merged in)."""
    result = dict(data)
    for override in sorted(overrides, key=lambda o: len(o.path)):
        tables = (o for o in overrides if _within(override.path, o.path))
        clash = next((o for o in tables if not isinstance(o.value, Mapping)), None)
        if clash is not None:
            raise SettingsError(
                f"environment {override.name}: {'.'.join(override.path)}: "
                f"{clash.name} sets {'.'.join(clash.path)} to a value that is not a table"
            )
        nested: dict[str, Any] = {override.path[-1]: override.value}
        for part in reversed(override.path[:-1]):
            nested = {part: nested}
        result = _merge(result, nested)
    return result


def _within(path: tuple[str, ...], table: tuple[str, ...]) -> bool:
    """Whether ``path`` names a key inside ``table`` (at any depth)."""
    return len(table) < len(path) and path[: len(table)] == table


def _where(loc: tuple[str | int, ...], data: Mapping[str, Any]) -> str:
    """The dotted key of a refused value; an agent's own settings are named by its slug
    (``agents.planner.backend``) where it has a readable one, else by its place (``agents.2.slug``)."""
    parts = [str(part) for part in loc]
    agents = data.get("agents")
    if len(loc) > 2 and loc[0] == "agents" and isinstance(loc[1], int) and loc[2] != "slug":
        entry = agents[loc[1]] if isinstance(agents, list) and 0 <= loc[1] < len(agents) else None
        slug = entry.get("slug") if isinstance(entry, dict) else None
        if isinstance(slug, str) and slug:
            parts[1] = slug
    return ".".join(parts) or "(top level)"


def _source(loc: tuple[str | int, ...], overrides: list[_Override], path: Path) -> str:
    """Where the value an error is about came from: the variable that set it, else the file (naming
    the variables that also took part when the error is about the whole settings)."""
    keys = tuple(str(part) for part in loc)
    setting = [
        o for o in overrides if keys and (o.path == keys or _within(keys, o.path) or _within(o.path, keys))
    ]
    if setting:
        return "environment " + ", ".join(o.name for o in setting)
    if not keys and overrides:
        return f"{path} with environment {', '.join(o.name for o in overrides)}"
    return str(path)


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_settings(home: str | Path | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Load ``<home>/config.toml`` and apply the ``TENEX_`` variables that set settings (see
    :func:`_env_overrides`).

    Raises :class:`SettingsError` naming the key, and the file or the variable its value came from,
    when something is wrong.
    """
    environment = os.environ if env is None else env
    root = resolve_home(home, environment)
    path = root / CONFIG_FILE
    if root.exists() and not root.is_dir():
        raise SettingsError(f"{root}: not a folder (--home, TENEX_HOME: the home folder, not a file in it)")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SettingsError(
            f"{path}: not found (run `tenexd init --home {shlex.quote(str(root))}` first)"
        ) from None
    except UnicodeDecodeError as exc:
        raise SettingsError(f"{path}: not UTF-8 text (byte {exc.start}): {exc.reason}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{path}: invalid TOML: {exc}") from None
    except OSError as exc:
        raise SettingsError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    overrides = _env_overrides(environment)
    data = _apply(data, overrides)
    data["home"] = root
    _paths_in_home(data, root, overrides, path)
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        problems: dict[str, list[str]] = {}
        for error in exc.errors():
            problem = f"{_where(error['loc'], data)}: {str(error['msg']).removeprefix('Value error, ')}"
            problems.setdefault(_source(error["loc"], overrides, path), []).append(problem)
        raise SettingsError(
            "; ".join(f"{source}: {'; '.join(found)}" for source, found in problems.items())
        ) from None
