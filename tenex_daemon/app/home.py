"""The project home: ``tenexd init`` creates it, ``tenexd agents add`` extends it.

A home holds ``config.toml`` (no secrets), ``keys/`` (mode 0700) with one secret key file
per agent plus ``project.key`` and, when tenexd generated the owner's key, ``owner.key``
(each mode 0600, 64 hex characters: the format :class:`~tenex_daemon.adapters.nostr.signer.Signer`
loads). Secrets are written to their files and nowhere else: never printed, never logged.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import structlog
from pydantic import ValidationError

from tenex_daemon.adapters.llm.factory import BACKEND_NAMES
from tenex_daemon.adapters.nostr.signer import KeyFileError, Signer, write_key_file
from tenex_daemon.app.files import write_text_atomic
from tenex_daemon.app.settings import (
    CONFIG_FILE,
    AgentSettings,
    BackendSettings,
    Settings,
    first_bad_relay_url,
    load_settings,
)
from tenex_daemon.core import nip19
from tenex_daemon.core.agents import Agent
from tenex_daemon.core.errors import TenexError

log = structlog.get_logger(__name__)

KEYS_DIR = "keys"
PROJECT_KEY = "project"
OWNER_KEY = "owner"
DEFAULT_PROJECT_NAME = "demo"


@dataclass(frozen=True, slots=True)
class DemoAgent:
    """An agent ``tenexd init`` creates."""

    slug: str
    name: str
    instructions: str
    orchestrator: bool = False


DEMO_AGENTS: tuple[DemoAgent, ...] = (
    DemoAgent(
        "orchestrator",
        "Orchestrator",
        "You route each request to the agent best placed to answer it.",
        orchestrator=True,
    ),
    DemoAgent("planner", "Planner", "You turn requests into short, concrete plans."),
    DemoAgent("executor", "Executor", "You carry out plans and report what you did."),
)


class HomeError(TenexError):
    """The home cannot be created or changed as asked; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """A public identity of the home: who it is (label), its hex pubkey and npub, and its key file."""

    label: str
    pubkey: str
    npub: str
    key_file: Path | None
    """The secret key file, or None when the home holds no secret for it (an owner given by pubkey)."""

    @classmethod
    def of(cls, label: str, pubkey: str, key_file: Path | None) -> KeyInfo:
        """Describe ``pubkey`` (hex) under ``label``."""
        return cls(label, pubkey, nip19.encode_npub(pubkey), key_file)

    def to_dict(self) -> dict[str, str | None]:
        """Return JSON-ready data (no secret: only the key file's path)."""
        return {
            "label": self.label,
            "pubkey": self.pubkey,
            "npub": self.npub,
            "key_file": str(self.key_file) if self.key_file is not None else None,
        }


@dataclass(frozen=True, slots=True)
class InitResult:
    """What :func:`init_home` made: the home's public identities, never a secret."""

    home: Path
    config_path: Path
    owner: KeyInfo
    owner_generated: bool
    """True when the owner's key pair was generated here (its secret is in ``keys/owner.key``)."""
    project: KeyInfo
    agents: list[KeyInfo] = field(default_factory=list)
    whitelist: list[str] = field(default_factory=list)
    relays: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        """Return JSON-ready data."""
        return {
            "home": str(self.home),
            "config": str(self.config_path),
            "owner": self.owner.to_dict(),
            "owner_generated": self.owner_generated,
            "project": self.project.to_dict(),
            "agents": [a.to_dict() for a in self.agents],
            "whitelist": list(self.whitelist),
            "relays": list(self.relays),
        }


def require_utf8(text: str, what: str) -> None:
    """Raise :class:`HomeError` when ``text`` cannot be written as UTF-8: it came from bytes that are not
    UTF-8 (Python hands such bytes of the command line over as lone surrogates), or from an escape of a
    lone surrogate. ``what`` names it (an option, ``--name``); the text itself is not repeated."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise HomeError(
            f"{what}: the text is not valid UTF-8 (at character {exc.start + 1}); give it in UTF-8"
        ) from None


def parse_pubkey(text: str) -> str:
    """Return the hex public key of an ``npub`` or of 64 hex characters (any case).

    Raises :class:`ValueError` for anything else; an ``nsec`` is refused with a warning
    that it is a secret (the secret itself is never repeated in the message).
    """
    value = text.strip()
    if value.startswith("nostr:"):
        value = value[len("nostr:") :]
    if value.startswith("nsec1"):
        raise ValueError("that is a secret key (nsec); give the public key (npub or hex) instead")
    if value.startswith("npub1"):
        try:
            entity = nip19.decode(value)
        except nip19.Nip19Error as exc:
            raise ValueError(f"{value!r} is not a valid npub ({exc})") from None
        return entity.value
    lowered = value.lower()
    if len(lowered) == 64 and all(c in "0123456789abcdef" for c in lowered):
        return lowered
    raise ValueError(f"{value!r} is neither an npub nor a 64-character hex public key")


def toml_string(value: str) -> str:
    """Return ``value`` as a TOML basic string (JSON escapes are TOML escapes; DEL is escaped too)."""
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_list(values: Sequence[str]) -> str:
    return "[" + ", ".join(toml_string(v) for v in values) + "]"


def _write_atomic(path: Path, text: str, mode: int = 0o600) -> None:
    """Write a home file whole (0600: config.toml may hold a database DSN with its password)."""
    write_text_atomic(path, text, mode)


def _ensure_private_dir(path: Path) -> None:
    """Create ``path`` with mode 0700 (or tighten an existing one to 0700)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def _key_for(keys_dir: Path, label: str) -> tuple[Signer, bool]:
    """Load ``keys/<label>.key`` or create it (0600) with a fresh key; return (signer, created)."""
    path = keys_dir / f"{label}.key"
    if path.exists():
        return Signer.from_file(path, label=label), False
    signer = Signer.generate(label=label)
    write_key_file(path, signer)
    log.info("key_created", label=label, pubkey=signer.pubkey, file=str(path))
    return signer, True


def _toml_value(value: object) -> str:
    """``value`` (a settings value dumped as JSON data) as a TOML value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_string(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML value for {value!r}")


def _backend_lines(backend: BackendSettings) -> list[str]:
    """The ``[agents.backend]`` keys of ``backend``: its kind, then what it sets besides the defaults."""
    values = backend.model_dump(mode="json", exclude_defaults=True, exclude_none=True)
    values.pop("kind", None)
    return [f"kind = {toml_string(backend.kind)}", *(f"{k} = {_toml_value(v)}" for k, v in values.items())]


def shared_backend(agents: Sequence[AgentSettings]) -> BackendSettings | None:
    """The backend every agent but the orchestrator has, when there are some and they all have the same."""
    backends = [a.backend for a in agents if not a.orchestrator]
    if backends and all(b == backends[0] for b in backends):
        return backends[0]
    return None


def _agent_block(agent: DemoAgent | AgentSettings, backend: str | BackendSettings = "offline") -> str:
    lines = [
        "[[agents]]",
        f"slug = {toml_string(agent.slug)}",
        f"name = {toml_string(agent.name)}",
        f"instructions = {toml_string(agent.instructions)}",
    ]
    if agent.orchestrator:
        lines.append("orchestrator = true")
    if isinstance(agent, AgentSettings):
        recorded = (("role", agent.role), ("source", agent.source))
        lines += [f"{key} = {toml_string(value)}" for key, value in recorded if value]
    lines += ["", "[agents.backend]"]
    if isinstance(backend, str):
        backend = backend_of(backend)
    if agent.orchestrator and backend.kind == "local":
        # The bundled 135M model cannot produce routing decisions; the rules route instead.
        lines += [
            "# Routing by rules (@mentions, else default_agent). Give the orchestrator a capable",
            "# model (openai, anthropic, claude-code) to have it route with the model.",
            'kind = "offline"',
            "",
        ]
    else:
        lines += [*_backend_lines(backend), ""]
    return "\n".join(lines) + "\n"


def render_config(
    *,
    project_name: str,
    owner: str,
    whitelist: Sequence[str],
    relays: Sequence[str],
    agents: Sequence[DemoAgent],
    default_agent: str | None,
    backend: str = "offline",
) -> str:
    """Return the text of a new ``config.toml`` (public keys only)."""
    parts = [
        "# A tenexd project home, written by `tenexd init`.\n"
        "# Secret keys live in keys/ (mode 0600), one file per agent plus project.key; never commit them.\n"
        "# Every key can be overridden from the environment: TENEX_SECTION__KEY=value.\n\n",
        f"owner = {toml_string(owner)}\n",
        f"whitelist = {_toml_list(whitelist)}\n",
    ]
    if default_agent is not None:
        parts.append(f"default_agent = {toml_string(default_agent)}\n")
    parts += [
        f"\n[project]\nname = {toml_string(project_name)}\n",
        f"\n[relays]\nurls = {_toml_list(relays)}\n",
        "\n[storage]\nkind = \"filesystem\"\n",
        "\n[daemon]\nlog_format = \"auto\"\nlog_level = \"info\"\n\n",
    ]
    parts += [_agent_block(agent, backend) for agent in agents]
    return "".join(parts)


def init_home(
    home: Path,
    owner: str | None = None,
    whitelist: Sequence[str] = (),
    relays: Sequence[str] = (),
    *,
    force: bool = False,
    project_name: str = DEFAULT_PROJECT_NAME,
    backend: str = "offline",
) -> InitResult:
    """Create a project home: config, keys (0700 folder, 0600 files), owner, orchestrator and demo agents.

    ``owner`` and ``whitelist`` are public keys (npub or hex). Without ``owner`` an owner
    key pair is generated and its secret saved in ``keys/owner.key``. An existing
    ``config.toml`` is refused unless ``force``; with ``force`` the config is rewritten
    and existing key files are kept (so the identities stay the same). ``backend`` is the
    LLM backend of the demo agents (``offline``, or ``local`` for the bundled small model).
    """
    home = Path(home).expanduser().resolve()
    config_path = home / CONFIG_FILE
    if home.exists() and not home.is_dir():
        raise HomeError(f"{home}: not a folder (--home, TENEX_HOME: the home folder to create, not a file)")
    if config_path.exists() and not force:
        raise HomeError(f"{config_path} already exists; use --force to rewrite it (key files are kept)")
    try:
        owner_hex = parse_pubkey(owner) if owner is not None else None
        whitelist_hex = list(dict.fromkeys(parse_pubkey(w) for w in whitelist))
    except ValueError as exc:
        raise HomeError(str(exc)) from None
    bad = first_bad_relay_url(relays)
    if bad is not None:
        raise HomeError(bad)
    if backend not in BACKEND_NAMES:
        raise HomeError(f"unknown backend {backend!r} (available: {', '.join(BACKEND_NAMES)})")
    require_utf8(project_name, "the project name")
    backend_of(backend)  # one that cannot be made without more settings is refused before anything is written

    try:
        if not home.exists():
            home.mkdir(mode=0o700, parents=True)
        else:  # a folder made before (TENEX's .tenex, say): its conversations' names are the owner's only too
            os.chmod(home, 0o700)
        keys_dir = home / KEYS_DIR
        _ensure_private_dir(keys_dir)
    except OSError as exc:  # a file in the way, a read-only place, no permission
        raise HomeError(f"{home}: the home cannot be created here ({exc.strerror or exc})") from None

    owner_generated = False
    if owner_hex is None:
        owner_signer, _ = _key_for(keys_dir, OWNER_KEY)
        owner_hex = owner_signer.pubkey
        owner_generated = True
        owner_info = KeyInfo.of(OWNER_KEY, owner_hex, keys_dir / f"{OWNER_KEY}.key")
    else:
        owner_info = KeyInfo.of(OWNER_KEY, owner_hex, None)
    project_signer, _ = _key_for(keys_dir, PROJECT_KEY)
    agent_infos: list[KeyInfo] = []
    for agent in DEMO_AGENTS:
        signer, _ = _key_for(keys_dir, agent.slug)
        agent_infos.append(KeyInfo.of(agent.slug, signer.pubkey, keys_dir / f"{agent.slug}.key"))

    default_agent = next((a.slug for a in DEMO_AGENTS if not a.orchestrator), None)
    text = render_config(
        project_name=project_name,
        owner=owner_hex,
        whitelist=whitelist_hex,
        relays=relays,
        agents=DEMO_AGENTS,
        default_agent=default_agent,
        backend=backend,
    )
    _write_atomic(config_path, text)
    load_settings(home, {})  # what we wrote must load; a failure here is a bug worth seeing
    log.info("home_initialized", home=str(home), owner=owner_hex, owner_generated=owner_generated)
    return InitResult(
        home=home,
        config_path=config_path,
        owner=owner_info,
        owner_generated=owner_generated,
        project=KeyInfo.of(PROJECT_KEY, project_signer.pubkey, keys_dir / f"{PROJECT_KEY}.key"),
        agents=agent_infos,
        whitelist=whitelist_hex,
        relays=list(relays),
    )


def invalid_agent(error: ValidationError) -> HomeError:
    """The refusal of an agent's settings, naming each bad field in words (the slug's rule spelled out)."""
    problems = []
    for found in error.errors():
        field_name = ".".join(str(part) for part in found["loc"])
        if field_name == "slug" and found["type"] == "string_pattern_mismatch":
            problems.append(
                f"slug {found['input']!r} must be 1 to 64 lowercase letters, digits, '-' or '_', "
                "starting with a letter or a digit"
            )
        else:
            problems.append(f"{field_name}: {found['msg']}")
    return HomeError("invalid agent: " + "; ".join(problems))


DEFAULT_MODELS: Final = {"openai": "gpt-4o-mini"}
"""The model a backend that needs one is written with by ``init --backend`` and :func:`add_agent` (the
README's example); config.toml's ``model`` changes it."""


def backend_of(kind: str) -> BackendSettings:
    """The backend settings of ``kind`` (with its :data:`DEFAULT_MODELS` model); HomeError when it needs
    more."""
    try:
        return BackendSettings(kind=kind, model=DEFAULT_MODELS.get(kind))
    except ValidationError as exc:
        problems = "; ".join(str(error["msg"]).removeprefix("Value error, ") for error in exc.errors())
        raise HomeError(f"backend {kind!r}: {problems}; write its settings into config.toml") from None


def add_agent(
    settings: Settings,
    slug: str,
    name: str,
    instructions: str = "",
    *,
    orchestrator: bool = False,
    backend_kind: str | None = None,
    role: str | None = None,
    source: str | None = None,
) -> KeyInfo:
    """Create ``keys/<slug>.key`` (0600) and append the agent to ``config.toml``.

    Its backend is ``backend_kind`` when given; else the one the other agents (the orchestrator
    aside) all have, copied whole (kind, model, options...); else, when they differ or there are
    none, ``offline``. Refuses a slug already configured, a second orchestrator, or an existing key
    file for the slug (it may belong to an agent removed from the config by hand).
    """
    try:
        agent = AgentSettings(
            slug=slug, name=name, instructions=instructions, orchestrator=orchestrator,
            role=role, source=source,
        )
    except ValidationError as exc:
        raise invalid_agent(exc) from None
    texts = (("name", name), ("instructions", instructions), ("role", role), ("source", source))
    for what, text in texts:  # before anything is written: config.toml is UTF-8
        if text is not None:
            require_utf8(text, f"the agent's {what}")
    if any(a.slug == slug for a in settings.agents):
        raise HomeError(f"agent {slug!r} already exists in {settings.config_path}")
    if orchestrator and any(a.orchestrator for a in settings.agents):
        raise HomeError("the project already has an orchestrator")
    _ensure_private_dir(settings.keys_dir)
    key_path = settings.agent_key_path(slug)
    if key_path.exists():
        raise HomeError(f"{key_path} already exists; remove it or choose another slug")
    config_text = settings.config_path.read_text(encoding="utf-8")
    if backend_kind is not None:
        backend = backend_of(backend_kind)
    else:
        backend = shared_backend(settings.agents) or BackendSettings()
    block = _agent_block(agent, backend)
    signer = Signer.generate(label=slug)
    write_key_file(key_path, signer)
    separator = "" if config_text.endswith("\n\n") else ("\n" if config_text.endswith("\n") else "\n\n")
    try:
        _write_atomic(settings.config_path, config_text + separator + block)
        load_settings(settings.home)  # as it will be read: with the TENEX_ variables (the dsn may be one)
    except BaseException:  # whatever went wrong, a refused add leaves the home as it was; its error is raised
        _roll_back_add(settings.config_path, config_text, key_path)
        raise
    log.info("agent_added", slug=slug, pubkey=signer.pubkey, backend=backend.kind)
    return KeyInfo.of(slug, signer.pubkey, key_path)


def _roll_back_add(config_path: Path, config_text: str, key_path: Path) -> None:
    """Undo an ``agents add`` that failed: put ``config_text`` back in ``config.toml`` when the file no
    longer holds it, and remove the new key file in any case (a key left behind would refuse the retry).
    Never raises: the add's own error is the one to report; what could not be undone is logged."""
    try:
        if config_path.read_text(encoding="utf-8") != config_text:
            _write_atomic(config_path, config_text)
    except (OSError, ValueError) as exc:  # the config unwritable (what failed the add), gone, not UTF-8
        log.warning("agent_add_config_not_restored", file=str(config_path), error=str(exc))
    try:
        key_path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("agent_add_key_not_removed", file=str(key_path), error=str(exc))


def load_public_key(path: Path, label: str) -> str:
    """Return the public key of a key file (the secret stays inside the signer)."""
    return Signer.from_file(path, label=label).pubkey


def shared_key(settings: Settings, slug: str, pubkey: str, seen: dict[str, str | None]) -> str | None:
    """Why agent ``slug``'s key file cannot be used when it holds the key of one ``seen`` before (an agent
    slug, or None: ``project.key``), in one line naming both files; None when its key is its own, and then it
    is ``seen``. Two agents with one key, or an agent with the project's, would be one Nostr identity (each
    taken for the other: ``core.agents.AgentDirectory`` refuses it, the daemon would not start)."""
    if pubkey not in seen:
        seen[pubkey] = slug
        return None
    other = seen[pubkey]
    first = settings.project_key_path if other is None else settings.agent_key_path(other)
    who = f"the project and agent {slug!r}" if other is None else f"agents {other!r} and {slug!r}"
    return (
        f"key file {settings.agent_key_path(slug)} holds the same key as {first}: {who} would be one Nostr "
        "identity; each needs a key of its own: put back the key that belongs in one of these files"
    )


def check_distinct_keys(settings: Settings, agent_keys: Mapping[str, str], project_key: str | None) -> None:
    """Raise :class:`~tenex_daemon.adapters.nostr.signer.KeyFileError` (:func:`shared_key`'s line) when two
    of the agents' keys (slug -> public key), or an agent's and the project's, are one key."""
    seen: dict[str, str | None] = {} if project_key is None else {project_key: None}
    for slug, pubkey in agent_keys.items():
        problem = shared_key(settings, slug, pubkey, seen)
        if problem is not None:
            raise KeyFileError(problem)


def _project_key_if_readable(settings: Settings) -> str | None:
    """The project's public key, None when ``project.key`` is missing or cannot be used (said elsewhere)."""
    try:
        return load_project_pubkey(settings)
    except KeyFileError:
        return None


def agent_identities(settings: Settings) -> list[tuple[AgentSettings, KeyInfo | None, str | None]]:
    """Return each configured agent with its identity, or the reason its key file cannot be used: missing,
    unreadable, or holding the key of an agent listed before it or the project's (:func:`shared_key`)."""
    result: list[tuple[AgentSettings, KeyInfo | None, str | None]] = []
    project = _project_key_if_readable(settings)
    seen: dict[str, str | None] = {} if project is None else {project: None}
    for agent in settings.agents:
        path = settings.agent_key_path(agent.slug)
        try:
            info = KeyInfo.of(agent.slug, load_public_key(path, agent.slug), path)
        except KeyFileError as exc:
            result.append((agent, None, str(exc)))
            continue
        problem = shared_key(settings, agent.slug, info.pubkey, seen)
        result.append((agent, None, problem) if problem is not None else (agent, info, None))
    return result


def load_agents(settings: Settings) -> list[Agent]:
    """Return the configured agents with the public keys of their key files.

    Raises :class:`~tenex_daemon.adapters.nostr.signer.KeyFileError` naming a missing or
    unreadable key file, or both files when two agents' keys, or an agent's and ``project.key``'s,
    are one key (:func:`check_distinct_keys`).
    """
    agents = [
        Agent(
            slug=a.slug,
            name=a.name,
            pubkey=load_public_key(settings.agent_key_path(a.slug), a.slug),
            orchestrator=a.orchestrator,
        )
        for a in settings.agents
    ]
    check_distinct_keys(settings, {a.slug: a.pubkey for a in agents}, _project_key_if_readable(settings))
    return agents


def load_project_pubkey(settings: Settings) -> str | None:
    """Return the project key's public key, or None when the home has no ``project.key``."""
    if not settings.project_key_path.exists():
        return None
    return load_public_key(settings.project_key_path, PROJECT_KEY)
