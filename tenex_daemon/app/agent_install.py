"""Installing an agent from a kind-4199 definition (``tenexd agents add --from <nevent|naddr>``).

The definition is fetched once from the relays (the home's, plus the reference's hints), verified
(:func:`~tenex_daemon.adapters.nostr.agent_definition.check_definition`), and only then is anything
written: a new key (0600) and an ``[[agents]]`` entry recording the role and where it came from
(``source``), through :func:`~tenex_daemon.app.home.add_agent`, which undoes its own partial writes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import structlog
from pydantic import ValidationError

from tenex_daemon.adapters.nostr.agent_definition import (
    AgentDefinition,
    DefinitionError,
    DefinitionReference,
    DefinitionReferenceError,
    choose_definition,
    derive_slug,
)
from tenex_daemon.adapters.nostr.relay_pool import PoolSettings, RelayPool
from tenex_daemon.adapters.nostr.signer import KeyFileError, Signer
from tenex_daemon.app.home import HomeError, KeyInfo, add_agent, invalid_agent
from tenex_daemon.app.settings import RESERVED_SLUGS, AgentSettings, Settings
from tenex_daemon.core import nip19

log = structlog.get_logger(__name__)

FETCH_TIMEOUT_S: Final = 10.0
"""How long the relays are given to answer, by default."""


@dataclass(frozen=True, slots=True)
class InstalledAgent:
    """An agent installed from a definition: its slug and name, its new identity, and the definition."""

    slug: str
    name: str
    key: KeyInfo
    source: str
    definition: AgentDefinition

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data (no secret: only the key file's path)."""
        return {
            **self.key.to_dict(),
            "slug": self.slug,
            "name": self.name,
            "source": self.source,
            "definition": {
                **self.definition.to_dict(),
                "author_npub": nip19.encode_npub(self.definition.author),
            },
        }


def definition_relays(reference: DefinitionReference, relays: Sequence[str]) -> list[str]:
    """The relays to ask: ``relays`` first, then the reference's hints, each once; refuse when none."""
    urls = list(dict.fromkeys([*relays, *reference.relays]))
    if not urls:
        raise DefinitionReferenceError(
            "no relay to fetch the definition from: pass --relay URL, set relays.urls in config.toml, "
            "or give an nevent/naddr that carries a relay hint"
        )
    return urls


def check_new_slug(settings: Settings, slug: str) -> None:
    """Raise :class:`HomeError` when ``slug`` is invalid or taken (configured, or its key file exists)."""
    try:
        AgentSettings(slug=slug, name=slug)
    except ValidationError as exc:
        raise invalid_agent(exc) from None
    if any(a.slug == slug for a in settings.agents):
        raise HomeError(f"agent {slug!r} already exists in {settings.config_path}")
    if settings.agent_key_path(slug).exists():
        raise HomeError(f"{settings.agent_key_path(slug)} already exists; remove it or choose another slug")


def _auth_signer(settings: Settings) -> Signer | None:
    """The project key answers NIP-42 challenges, when the home has one."""
    try:
        return Signer.from_file(settings.project_key_path, label="project")
    except KeyFileError:
        return None


async def fetch_definition(
    reference: DefinitionReference,
    relays: Sequence[str],
    *,
    timeout_s: float = FETCH_TIMEOUT_S,
    auth_signer: Signer | None = None,
) -> AgentDefinition:
    """Ask each relay once (until its EOSE, or ``timeout_s``) and return the verified definition;
    raise :class:`DefinitionError` when no relay could be reached, none came, or none passed the checks."""
    pool = RelayPool(
        relays,
        auth_signer=auth_signer,
        settings=PoolSettings(open_timeout=min(5.0, timeout_s), backoff_base=0.2, backoff_cap=2.0),
    )
    await pool.start()
    try:
        started = time.monotonic()
        if not await pool.wait_connected(1, timeout_s):  # not "not found": nobody was asked
            raise DefinitionError(f"no relay answered within {timeout_s:g} s: {', '.join(relays)}")
        left_s = max(0.1, timeout_s - (time.monotonic() - started))
        events = await pool.fetch(reference.filters(), timeout=left_s)
        refused = pool.rejects_by_reason()
    finally:
        await pool.stop()
    try:
        return choose_definition(events, reference)
    except DefinitionError as exc:
        if events or not refused:
            raise
        counts = ", ".join(f"{reason} {count}" for reason, count in sorted(refused.items()))
        raise DefinitionError(f"{exc} (the relays sent events that failed verification: {counts})") from None


def install_definition(
    settings: Settings,
    reference: DefinitionReference,
    definition: AgentDefinition,
    *,
    slug: str | None = None,
    name: str | None = None,
    orchestrator: bool = False,
) -> InstalledAgent:
    """Create the agent ``definition`` defines: ``slug`` (else one made from its name, unique in the
    home), a new key, its persona (the role, then the instructions), ``role`` and ``source`` recorded."""
    if slug is None:
        taken = {a.slug for a in settings.agents} | RESERVED_SLUGS
        if settings.keys_dir.is_dir():
            taken |= {path.stem for path in settings.keys_dir.glob("*.key")}
        slug = derive_slug(definition.name or definition.identifier, taken)
    shown = name or definition.name or slug.replace("-", " ").title()
    key = add_agent(
        settings,
        slug,
        shown,
        definition.persona,
        orchestrator=orchestrator,
        role=definition.role,
        source=reference.text,
    )
    log.info("agent_installed", slug=slug, definition=definition.event_id, author=definition.author)
    return InstalledAgent(slug, shown, key, reference.text, definition)


async def add_agent_from(
    settings: Settings,
    reference: DefinitionReference,
    relays: Sequence[str],
    *,
    slug: str | None = None,
    name: str | None = None,
    orchestrator: bool = False,
    timeout_s: float = FETCH_TIMEOUT_S,
) -> InstalledAgent:
    """Fetch, verify and install the definition ``reference`` names (nothing is written on failure).

    A ``slug`` given is checked first, so a bad or taken one is refused before any fetch.
    """
    if slug is not None:
        check_new_slug(settings, slug)
    urls = definition_relays(reference, relays)
    signer = _auth_signer(settings)
    definition = await fetch_definition(reference, urls, timeout_s=timeout_s, auth_signer=signer)
    return install_definition(
        settings, reference, definition, slug=slug, name=name, orchestrator=orchestrator
    )
