"""The agent commands: ``agents list`` and ``agents add``."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from tenex_daemon.adapters.nostr.signer import KeyFileError
from tenex_daemon.app.home import HomeError, add_agent, agent_identities
from tenex_daemon.app.settings import SettingsError
from tenex_daemon.cli.invocation import HomeOption, settings_of
from tenex_daemon.cli.output import EXIT_USAGE, JsonOption, fail, out, print_json

agents_app = typer.Typer(help="List and add the project's agents.", no_args_is_help=True)


@agents_app.command("list")
def agents_list(ctx: typer.Context, as_json: JsonOption = False, home: HomeOption = None) -> None:
    """List the agents: slug, name, npub and hex public key."""
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
        })
    if as_json:
        print_json(rows)
        return
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
    slug: Annotated[str, typer.Argument(help="Stable id: lowercase letters, digits, - and _.")],
    name: Annotated[str | None, typer.Option(help="Display name (default: the slug, capitalized).")] = None,
    instructions: Annotated[str, typer.Option(help="Role instructions.")] = "",
    orchestrator: Annotated[bool, typer.Option("--orchestrator", help="Make it the orchestrator.")] = False,
    as_json: JsonOption = False,
    home: HomeOption = None,
) -> None:
    """Add an agent: a new key file (0600) and an [[agents]] entry appended to config.toml."""
    settings = settings_of(ctx)
    try:
        info = add_agent(settings, slug, name or slug.replace("-", " ").title(), instructions,
                         orchestrator=orchestrator)
    except (HomeError, KeyFileError, SettingsError) as exc:
        fail(str(exc), EXIT_USAGE)
    if as_json:
        print_json(info.to_dict())
        return
    out.print(f"added agent {slug}: {info.npub} ({info.pubkey}); restart the daemon to load it")
