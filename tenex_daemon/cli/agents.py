"""The agent commands: ``agents list`` and ``agents add`` (new, or ``--from`` a kind-4199 definition)."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Final

import typer
from rich.table import Table

from tenex_daemon.cli.invocation import HomeOption, relay_urls_argument, settings_of
from tenex_daemon.cli.output import EXIT_FAILURE, EXIT_USAGE, JsonOption, fail, out, print_json
from tenex_daemon.cli.typer_app import TenexTyper
from tenex_daemon.core import nip19

if TYPE_CHECKING:
    from tenex_daemon.app.settings import Settings

agents_app = TenexTyper(help="List and add the project's agents.", no_args_is_help=True)


@agents_app.callback()
def _group_home(home: HomeOption = None) -> None:
    """Take ``--home`` between the group and its command as well (:mod:`tenex_daemon.cli.invocation`)."""


@agents_app.command("list")
def agents_list(ctx: typer.Context, as_json: JsonOption = False, home: HomeOption = None) -> None:
    """List the agents: slug, name, npub and hex public key (and, in JSON, the definition installed from).
    Exits 1 when an agent's key file cannot be used (the daemon would not start): the list is printed all
    the same, each such agent with the reason in place of its npub."""
    from tenex_daemon.app.home import agent_identities

    settings = settings_of(ctx)
    rows: list[dict[str, Any]] = []
    for agent, info, problem in agent_identities(settings):
        rows.append({
            "slug": agent.slug,
            "name": agent.name,
            "orchestrator": agent.orchestrator,
            "backend": agent.backend.kind,
            "npub": info.npub if info is not None else None,
            "pubkey": info.pubkey if info is not None else None,
            "problem": problem,
            "source": agent.source,
        })
    if as_json:
        print_json(rows)
    else:
        _print_agents(rows)
    broken = [row["slug"] for row in rows if row["problem"] is not None]
    if broken:
        names = ", ".join(broken)
        fail(f"{len(broken)} agent(s) without a usable key ({names}): `tenexd run` would not start")


def _print_agents(rows: list[dict[str, Any]]) -> None:
    table = Table(title=f"{len(rows)} agent(s)")
    for column in ("slug", "name", "npub", "hex pubkey", "role", "backend"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(
            str(row["slug"]), str(row["name"]), str(row["npub"] or row["problem"]), str(row["pubkey"] or "-"),
            "orchestrator" if row["orchestrator"] else "agent", str(row["backend"]),
        )
    out.print(table)


@agents_app.command("add")
def agents_add(
    ctx: typer.Context,
    slug: Annotated[
        str | None,
        typer.Argument(help="Stable id: lowercase letters, digits, - and _ (--from: made from the name)."),
    ] = None,
    name: Annotated[str | None, typer.Option(help="Display name (default: the slug, capitalized).")] = None,
    instructions: Annotated[str | None, typer.Option(help="Role instructions.")] = None,
    orchestrator: Annotated[bool, typer.Option("--orchestrator", help="Make it the orchestrator.")] = False,
    source: Annotated[
        str | None,
        typer.Option("--from", help="Install the kind-4199 agent definition an nevent1/naddr1 points to."),
    ] = None,
    slug_option: Annotated[
        str | None, typer.Option("--slug", help="The slug (same as the SLUG argument).")
    ] = None,
    relay: Annotated[
        list[str] | None,
        typer.Option(help="Relay to fetch the definition from (repeatable; default: the home's)."),
    ] = None,
    timeout: Annotated[
        float, typer.Option(min=0.1, help="Seconds the relays get to answer (--from).")
    ] = 10.0,
    as_json: JsonOption = False,
    home: HomeOption = None,
) -> None:
    """Add an agent: a new key file (0600) and an \\[\\[agents]] entry appended to config.toml.

    With --from, the kind-4199 definition is fetched, verified and installed (name, role,
    instructions), its reference recorded as the agent's source.
    """
    from tenex_daemon.adapters.nostr.signer import KeyFileError
    from tenex_daemon.app.home import HomeError, add_agent
    from tenex_daemon.app.settings import SettingsError

    if slug is not None and slug_option is not None and slug != slug_option:
        fail(f"two slugs given ({slug!r} and --slug {slug_option!r}); give one", EXIT_USAGE)
    slug = slug if slug is not None else slug_option
    settings = settings_of(ctx)
    if source is not None:
        if instructions is not None:
            fail("--instructions cannot go with --from: the definition gives the instructions", EXIT_USAGE)
        relays = relay_urls_argument(relay)
        _add_from(settings, source, _AddFrom(slug, name, orchestrator, relays, timeout), as_json)
        return
    if slug is None:
        fail("give the new agent's SLUG (or --from nevent1.../naddr1... to install a definition)", EXIT_USAGE)
    _check_slug(slug)
    try:
        info = add_agent(settings, slug, name or slug.replace("-", " ").title(), instructions or "",
                         orchestrator=orchestrator)
    except (HomeError, KeyFileError, SettingsError) as exc:
        fail(_plain(str(exc)), EXIT_USAGE)
    backend = _backend_of(settings, slug)
    if as_json:
        print_json({**info.to_dict(), "backend": backend})
        return
    out.print(f"added agent {slug}: {info.npub} ({info.pubkey}); restart the daemon to load it")
    out.print(f"backend: {backend}")


def _check_slug(slug: str | None) -> None:
    """Exit 2 when ``slug`` names one of the home's other key files (``owner``, ``project``, ``import``), in a
    sentence of its own: the agent's key file would be taken for theirs."""
    from tenex_daemon.app.settings import RESERVED_SLUGS

    if slug in RESERVED_SLUGS:
        fail(
            f"{slug!r} cannot be an agent's slug: keys/{slug}.key holds the home's {slug} key; choose "
            f"another slug (it may not be {', '.join(sorted(RESERVED_SLUGS))})",
            EXIT_USAGE,
        )


_VALIDATION_PREFIX: Final = re.compile(r"\b[\w.]+: (?:Value|Assertion) error, ")
"""How pydantic words a validator's refusal (``slug: Value error, ...``): the field and the error's class."""


def _plain(message: str) -> str:
    """An agent's refusal as a sentence: what pydantic prefixes to a validator's own words left out."""
    return _VALIDATION_PREFIX.sub("", message)


def _backend_of(settings: Settings, slug: str) -> str:
    """The backend an agent just added was given (the other agents', else ``offline``), as config.toml
    now says: its kind, and its model when it names one."""
    from tenex_daemon.app.settings import load_settings

    added = next(a for a in load_settings(settings.home).agents if a.slug == slug)
    model = added.backend.model
    return added.backend.kind if model is None else f"{added.backend.kind} ({model})"


@dataclass(frozen=True, slots=True)
class _AddFrom:
    """The options of ``agents add --from`` besides the reference."""

    slug: str | None
    name: str | None
    orchestrator: bool
    relays: list[str]
    timeout_s: float


def _add_from(settings: Settings, text: str, options: _AddFrom, as_json: bool) -> None:
    """Install the definition ``text`` names; exit 2 on a usage error, 1 when it is not found or invalid."""
    from tenex_daemon.adapters.nostr.agent_definition import (
        DefinitionError,
        DefinitionReferenceError,
        parse_reference,
    )
    from tenex_daemon.adapters.nostr.signer import KeyFileError
    from tenex_daemon.app.agent_install import add_agent_from
    from tenex_daemon.app.home import HomeError
    from tenex_daemon.app.settings import SettingsError
    from tenex_daemon.cli.send import send_relays

    _check_slug(options.slug)
    try:
        reference = parse_reference(text)
        installed = asyncio.run(add_agent_from(
            settings, reference, send_relays(settings, options.relays),
            slug=options.slug, name=options.name, orchestrator=options.orchestrator,
            timeout_s=options.timeout_s,
        ))
    except DefinitionError as exc:
        fail(str(exc), EXIT_FAILURE)
    except (DefinitionReferenceError, HomeError, KeyFileError, SettingsError) as exc:
        fail(_plain(str(exc)), EXIT_USAGE)
    backend = _backend_of(settings, installed.slug)
    if as_json:
        print_json({**installed.to_dict(), "backend": backend})
        return
    definition = installed.definition
    out.print(
        f"installed agent {installed.slug} ({installed.name}) from agent definition {definition.event_id} "
        f"by {nip19.encode_npub(definition.author)}"
    )
    if definition.role:
        out.print(f"role: {definition.role}")
    out.print(f"key: {installed.key.npub} ({installed.key.pubkey}); restart the daemon to load it")
    out.print(f"backend: {backend}")
