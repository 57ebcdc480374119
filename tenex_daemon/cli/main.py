"""The ``tenexd`` command line (typer, rich tables, ``--json`` on every listing).

The home is ``--home DIR``, else ``$TENEX_HOME``, else ``./.tenex``. Exit codes: 0 success,
1 not found / not running / no answer, 2 bad input or configuration.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from tenex_daemon import __version__
from tenex_daemon.adapters.nostr.signer import KeyFileError, Signer
from tenex_daemon.app.home import (
    HomeError,
    add_agent,
    agent_identities,
    init_home,
    load_agents,
)
from tenex_daemon.app.logging import configure_logging
from tenex_daemon.app.settings import (
    DEFAULT_HOME,
    Settings,
    SettingsError,
    load_settings,
    resolve_home,
)
from tenex_daemon.app.status import StatusReport, read_status
from tenex_daemon.cli.access import AccessError, normalize_event_id, open_access
from tenex_daemon.core import nip19
from tenex_daemon.core.agents import Agent
from tenex_daemon.core.errors import TenexError
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.phases import Phase

T = TypeVar("T")

EXIT_FAILURE = 1
EXIT_USAGE = 2
DEFAULT_STALE_S = 30.0

app = typer.Typer(
    help="tenexd: the conversation brain of a team of AI agents on Nostr.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
conversations_app = typer.Typer(help="List, show, search, archive, restore and export conversations.",
                                no_args_is_help=True)
agents_app = typer.Typer(help="List and add the project's agents.", no_args_is_help=True)
app.add_typer(conversations_app, name="conversations")
app.add_typer(agents_app, name="agents")

WIDE = 220
"""Console width when output is not a terminal: ids and npubs are never cut."""


def _console_width(stream: Any) -> int | None:
    try:
        return None if stream.isatty() else WIDE
    except (AttributeError, ValueError):
        return WIDE


out = Console(soft_wrap=True, width=_console_width(sys.stdout))
err = Console(stderr=True, soft_wrap=True, width=_console_width(sys.stderr))

JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


# --- shared helpers ------------------------------------------------------------------------------


def _home(ctx: typer.Context) -> Path:
    home: str | None = (ctx.obj or {}).get("home")
    return resolve_home(home)


def _fail(message: str, code: int = EXIT_FAILURE) -> NoReturn:
    err.print(Text(f"error: {message}", style="bold red"))
    raise typer.Exit(code)


def _settings(ctx: typer.Context) -> Settings:
    try:
        return load_settings(_home(ctx))
    except SettingsError as exc:
        _fail(str(exc), EXIT_USAGE)


def _run(coro: Coroutine[Any, Any, T]) -> T:
    try:
        return asyncio.run(coro)
    except AccessError as exc:
        _fail(exc.message, EXIT_USAGE if exc.status == 400 else EXIT_FAILURE)
    except (TenexError, ValueError) as exc:
        _fail(str(exc), EXIT_USAGE)


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, ensure_ascii=False, indent=2) + "\n")


def _ms_time(ms: int | float | None) -> str:
    if not ms:
        return "-"
    return datetime.fromtimestamp(float(ms) / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _s_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return datetime.fromtimestamp(float(seconds), UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _duration(seconds: float) -> str:
    total = int(seconds)
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h {minutes}m"
    if hours:
        return f"{hours}h {minutes}m"
    if minutes:
        return f"{minutes}m {secs}s"
    return f"{secs}s"


def _names(settings: Settings) -> dict[str, str]:
    """Public key -> a label for people reading history (agents by name, the project, the owner)."""
    names: dict[str, str] = {}
    for agent, info, _problem in agent_identities(settings):
        if info is not None:
            names[info.pubkey] = agent.name
    if settings.owner is not None:
        names.setdefault(settings.owner, "owner")
    return names


def _author(pubkey: str, names: dict[str, str]) -> str:
    return names.get(pubkey) or nip19.encode_npub(pubkey)[:16] + "…"


# --- version, init, run ---------------------------------------------------------------------------


@app.callback()
def main(
    ctx: typer.Context,
    home: Annotated[
        str | None,
        typer.Option("--home", help=f"Project home (default: $TENEX_HOME, else ./{DEFAULT_HOME})."),
    ] = None,
) -> None:
    """tenexd: the conversation brain of a team of AI agents on Nostr."""
    ctx.obj = {"home": home}
    configure_logging("auto", "warning")  # `run` reconfigures from the settings


@app.command()
def version() -> None:
    """Print the tenexd version."""
    typer.echo(__version__)


@app.command()
def init(
    ctx: typer.Context,
    owner: Annotated[
        str | None, typer.Option(help="Your public key (npub or hex); generated when left out.")
    ] = None,
    whitelist: Annotated[
        list[str] | None, typer.Option(help="Another public key allowed to talk to the agents (repeatable).")
    ] = None,
    relay: Annotated[list[str] | None, typer.Option(help="Relay URL to use (repeatable).")] = None,
    force: Annotated[bool, typer.Option(help="Rewrite an existing config.toml (keys are kept).")] = False,
    project: Annotated[str, typer.Option(help="Project name.")] = "demo",
    backend: Annotated[
        str, typer.Option(help="LLM backend of the demo agents: offline, or local (SmolLM2, in-process).")
    ] = "offline",
    as_json: JsonOption = False,
) -> None:
    """Create a project home: config.toml, keys/ (0700) with one key file (0600) per agent and the project."""
    home = _home(ctx)
    try:
        result = init_home(
            home, owner, whitelist or (), relay or (), force=force, project_name=project, backend=backend
        )
    except (HomeError, KeyFileError) as exc:
        _fail(str(exc), EXIT_USAGE)
    if as_json:
        _print_json(result.to_dict())
        return
    out.print(f"Initialized tenexd home [bold]{result.home}[/bold]")
    table = Table(title="Identities (public keys)")
    for column in ("who", "npub", "hex"):
        table.add_column(column, overflow="fold")
    owner_label = "owner (generated)" if result.owner_generated else "owner"
    table.add_row(owner_label, result.owner.npub, result.owner.pubkey)
    table.add_row("project", result.project.npub, result.project.pubkey)
    for info in result.agents:
        table.add_row(f"agent {info.label}", info.npub, info.pubkey)
    for key in result.whitelist:
        table.add_row("whitelisted", nip19.encode_npub(key), key)
    out.print(table)
    if result.owner_generated:
        out.print(
            f"The owner's secret key was saved in {result.owner.key_file} (mode 0600) and is not shown; "
            "`tenexd send` signs with it. Pass --owner NPUB to use your own key instead."
        )
    out.print(f"Next: tenexd --home {result.home} run --embedded-relay")


@app.command()
def run(
    ctx: typer.Context,
    relay: Annotated[
        list[str] | None, typer.Option(help="Relay URL (repeatable); replaces relays.urls of config.toml.")
    ] = None,
    embedded_relay: Annotated[
        bool, typer.Option("--embedded-relay", help="Run a relay inside the daemon on 127.0.0.1.")
    ] = False,
    log_format: Annotated[str | None, typer.Option(help="auto | json | console.")] = None,
    log_level: Annotated[str | None, typer.Option(help="debug | info | warning | error.")] = None,
) -> None:
    """Run the daemon in the foreground until SIGTERM or SIGINT (what systemd runs)."""
    settings = _settings(ctx)
    relays = settings.relays
    if relay:
        bad = [url for url in relay if not url.startswith(("ws://", "wss://"))]
        if bad:
            _fail(f"relay URL {bad[0]!r} must start with ws:// or wss://", EXIT_USAGE)
        relays = relays.model_copy(update={"urls": list(dict.fromkeys(relay))})
    if embedded_relay:
        relays = relays.model_copy(update={"embedded": True})
    daemon_settings = settings.daemon
    if log_format is not None or log_level is not None:
        daemon_settings = daemon_settings.model_copy(update={
            "log_format": log_format or daemon_settings.log_format,
            "log_level": log_level or daemon_settings.log_level,
        })
    settings = settings.model_copy(update={"relays": relays, "daemon": daemon_settings})
    if not settings.relays.urls and not settings.relays.embedded:
        _fail("no relay configured: pass --relay URL or --embedded-relay, or set relays.urls", EXIT_USAGE)
    try:
        configure_logging(settings.daemon.log_format, settings.daemon.log_level)
    except ValueError as exc:
        _fail(str(exc), EXIT_USAGE)
    from tenex_daemon.app.daemon import Daemon

    try:
        asyncio.run(Daemon(settings).run())
    except KeyboardInterrupt:
        pass
    except (TenexError, OSError) as exc:
        _fail(str(exc), EXIT_FAILURE)


# --- status ---------------------------------------------------------------------------------------


def _status_report(ctx: typer.Context) -> StatusReport:
    """Read the status file; works with a broken config (falls back to the default paths)."""
    home = _home(ctx)
    try:
        settings = load_settings(home)
    except SettingsError:
        return read_status(home / "run" / "status.json", DEFAULT_STALE_S)
    return read_status(settings.status_path, settings.daemon.stale_after_s)


@app.command()
def status(ctx: typer.Context, as_json: JsonOption = False) -> None:
    """Say whether the daemon is running; exit 0 when healthy, 1 when not running or stale."""
    report = _status_report(ctx)
    if as_json:
        _print_json(report.to_dict())
        raise typer.Exit(0 if report.healthy else EXIT_FAILURE)
    style = "green" if report.healthy else ("yellow" if report.state.value == "running" else "red")
    out.print(Text(f"tenexd: {report.reason}", style=f"bold {style}"))
    data = report.data
    if data is not None and report.state.value != "stopped":
        uptime = data.get("uptime_s")
        lines = [
            f"version {data.get('version', '?')}, pid {data.get('pid', '?')}, state {data.get('state', '?')}",
            f"up {_duration(float(uptime))}" if isinstance(uptime, int | float) else "",
            f"last event {_s_time(data.get('last_event_at'))}",
        ]
        out.print(", ".join(line for line in lines if line))
        conversations = data.get("conversations") or {}
        events = data.get("events") or {}
        out.print(
            f"conversations {conversations.get('total', 0)} {conversations.get('by_phase', {})}; "
            f"runs in flight {data.get('runs_in_flight', 0)}; replies {data.get('replies', 0)}; "
            f"events accepted {events.get('accepted', 0)}, rejected {events.get('rejected', {})}; "
            f"errors {data.get('errors', {})}"
        )
        relays = data.get("relays") or []
        if relays:
            table = Table(title="Relays")
            for column in ("url", "state", "reconnects", "last event"):
                table.add_column(column, overflow="fold")
            for relay in relays:
                table.add_row(
                    str(relay.get("url")), str(relay.get("state")), str(relay.get("reconnects", "-")),
                    _s_time(relay.get("last_event_at")),
                )
            out.print(table)
    raise typer.Exit(0 if report.healthy else EXIT_FAILURE)


# --- conversations --------------------------------------------------------------------------------


def _conversation_table(rows: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title)
    for column in ("id", "title", "phase", "events", "agents", "updated (UTC)", "archived"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(
            str(row["id"]), str(row["title"]), str(row["phase"]), str(row["event_count"]),
            str(row["agent_count"]), _ms_time(row.get("updated_at")), "yes" if row.get("archived") else "",
        )
    return table


def _search_query(
    title: str | None, phase: str | None, archived: bool | None, date_from: str | None,
    date_to: str | None, participant: str | None, limit: int | None,
) -> dict[str, str]:
    query: dict[str, str] = {}
    if title:
        query["title"] = title
    if phase:
        query["phase"] = phase
    if archived is not None:
        query["archived"] = "true" if archived else "false"
    if date_from:
        query["date_from"] = date_from
    if date_to:
        query["date_to"] = date_to
    if participant:
        query["participant"] = participant
    if limit is not None:
        query["limit"] = str(limit)
    return query


def _list_rows(ctx: typer.Context, query: dict[str, str]) -> list[dict[str, Any]]:
    settings = _settings(ctx)

    async def go() -> list[dict[str, Any]]:
        async with open_access(settings) as access:
            return await access.search(query)

    return _run(go())


PhaseOption = Annotated[
    str | None, typer.Option(help=f"Only this phase ({', '.join(p.value for p in Phase)}).")
]
LimitOption = Annotated[int | None, typer.Option(min=1, help="At most this many rows.")]


@conversations_app.command("list")
def conversations_list(
    ctx: typer.Context,
    archived: Annotated[bool, typer.Option("--archived", help="Archived conversations only.")] = False,
    all_: Annotated[bool, typer.Option("--all", help="Active and archived conversations.")] = False,
    phase: PhaseOption = None,
    limit: LimitOption = None,
    as_json: JsonOption = False,
) -> None:
    """List conversations, newest update first (active ones unless --archived or --all)."""
    which: bool | None = None if all_ else archived
    rows = _list_rows(ctx, _search_query(None, phase, which, None, None, None, limit))
    if as_json:
        _print_json(rows)
        return
    out.print(_conversation_table(rows, f"{len(rows)} conversation(s)"))


@conversations_app.command("search")
def conversations_search(
    ctx: typer.Context,
    title: Annotated[str | None, typer.Argument(help="Words of the title (fuzzy, case-insensitive).")] = None,
    phase: PhaseOption = None,
    archived: Annotated[
        bool | None, typer.Option("--archived/--active", help="Archived only / active only (default both).")
    ] = None,
    date_from: Annotated[str | None, typer.Option("--from", help="Created at/after (ISO 8601).")] = None,
    date_to: Annotated[str | None, typer.Option("--to", help="Created at/before (ISO 8601).")] = None,
    participant: Annotated[str | None, typer.Option(help="An author (npub or hex).")] = None,
    limit: LimitOption = None,
    as_json: JsonOption = False,
) -> None:
    """Search conversations by title, phase, dates, participant."""
    rows = _list_rows(ctx, _search_query(title, phase, archived, date_from, date_to, participant, limit))
    if as_json:
        _print_json(rows)
        return
    out.print(_conversation_table(rows, f"{len(rows)} match(es)"))


def _with_access(ctx: typer.Context, action: Any) -> Any:
    settings = _settings(ctx)

    async def go() -> Any:
        async with open_access(settings) as access:
            return await action(access)

    return _run(go())


def _conversation_id(value: str, what: str = "conversation id") -> str:
    try:
        return normalize_event_id(value, what)
    except AccessError as exc:
        _fail(exc.message, EXIT_USAGE)


@conversations_app.command("show")
def conversations_show(
    ctx: typer.Context,
    conversation_id: Annotated[
        str, typer.Argument(metavar="ID", help="Conversation id (hex, note1 or nevent1).")
    ],
    as_json: JsonOption = False,
) -> None:
    """Show a conversation: summary, history, agent states, phase transitions."""
    cid = _conversation_id(conversation_id)
    data: dict[str, Any] = _with_access(ctx, lambda access: access.get(cid))
    if as_json:
        _print_json(data)
        return
    names = _names(_settings(ctx))
    out.print(Text(str(data["title"]), style="bold"))
    out.print(
        f"id {data['id']}\nphase {data['phase']}, {len(data['history'])} events, "
        f"created {_ms_time(data.get('created_at'))}, updated {_ms_time(data.get('updated_at'))}, "
        f"execution {data.get('execution_seconds', 0)} s{', archived' if data.get('archived') else ''}"
    )
    tokens = data.get("tokens") or {}
    if tokens.get("by_agent"):
        out.print(f"tokens: {tokens['prompt']:,} prompt + {tokens['completion']:,} completion")
    history = Table(title="History")
    for column in ("#", "time (UTC)", "author", "kind", "content"):
        history.add_column(column, overflow="fold")
    for index, event in enumerate(data["history"]):
        history.add_row(
            str(index), _s_time(event["created_at"]), _author(event["pubkey"], names), str(event["kind"]),
            Text(event["content"]),
        )
    out.print(history)
    if data["agent_states"]:
        states = Table(title="Agent states")
        for column in ("agent", "last processed index", "session", "tokens (prompt + completion)"):
            states.add_column(column)
        for slug, state in sorted(data["agent_states"].items()):
            used = f"{state.get('prompt_tokens', 0):,} + {state.get('completion_tokens', 0):,}"
            states.add_row(
                slug, str(state["last_processed_index"]), str(state.get("session_id") or "-"), used
            )
        out.print(states)
    if data["transitions"]:
        transitions = Table(title="Phase transitions")
        for column in ("time (UTC)", "from", "to", "agent", "reason"):
            transitions.add_column(column, overflow="fold")
        for t in data["transitions"]:
            transitions.add_row(
                _ms_time(t.get("timestamp")), str(t.get("from_phase")), str(t.get("to_phase")),
                str(t.get("agent_slug")), str(t.get("reason") or t.get("message") or ""),
            )
        out.print(transitions)


@conversations_app.command("archive")
def conversations_archive(
    ctx: typer.Context, conversation_id: Annotated[str, typer.Argument(metavar="ID")]
) -> None:
    """Archive a conversation: it stays readable and becomes read-only."""
    cid = _conversation_id(conversation_id)
    _with_access(ctx, lambda access: access.archive(cid))
    out.print(f"archived {cid}")


@conversations_app.command("restore")
def conversations_restore(
    ctx: typer.Context, conversation_id: Annotated[str, typer.Argument(metavar="ID")]
) -> None:
    """Restore an archived conversation."""
    cid = _conversation_id(conversation_id)
    _with_access(ctx, lambda access: access.restore(cid))
    out.print(f"restored {cid}")


@conversations_app.command("export")
def conversations_export(
    ctx: typer.Context,
    conversation_id: Annotated[str, typer.Argument(metavar="ID")],
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write to this file (default: stdout).")
    ] = None,
) -> None:
    """Export a conversation as JSON (history as NIP-01 events, state, transitions, turns)."""
    cid = _conversation_id(conversation_id)
    data: dict[str, Any] = _with_access(ctx, lambda access: access.get(cid))
    text = json.dumps(data, ensure_ascii=False, indent=2) + "\n"
    if output is None:
        sys.stdout.write(text)
        return
    output.write_text(text, encoding="utf-8")
    err.print(f"wrote {output} ({len(data['history'])} events)")


# --- context --------------------------------------------------------------------------------------


@app.command()
def context(
    ctx: typer.Context,
    conversation_id: Annotated[str, typer.Argument(metavar="ID", help="Conversation id.")],
    agent: Annotated[str, typer.Option("--agent", help="Agent slug.")],
    trigger: Annotated[
        str | None, typer.Option(help="Event the agent responds to (default: the newest event).")
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Print exactly the messages AGENT would be sent now, without changing any state."""
    cid = _conversation_id(conversation_id)
    trigger_id = _conversation_id(trigger, "trigger event id") if trigger is not None else None
    data: dict[str, Any] = _with_access(ctx, lambda access: access.context(cid, agent, trigger_id))
    if as_json:
        _print_json(data)
        return
    for index, message in enumerate(data["messages"]):
        out.print(Text(f"--- [{index}] {message['role']} ---", style="bold cyan"))
        sys.stdout.flush()
        out.file.flush()
        sys.stdout.write(message["content"] + "\n")
        sys.stdout.flush()
    out.print(Text(
        f"--- {len(data['messages'])} message(s) for {agent}; trigger {data['trigger']}; "
        f"session {data['session_id'] or '-'} ---", style="dim",
    ))


# --- agents ---------------------------------------------------------------------------------------


@agents_app.command("list")
def agents_list(ctx: typer.Context, as_json: JsonOption = False) -> None:
    """List the agents: slug, name, npub and hex public key."""
    settings = _settings(ctx)
    rows = []
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
        _print_json(rows)
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
) -> None:
    """Add an agent: a new key file (0600) and an [[agents]] entry appended to config.toml."""
    settings = _settings(ctx)
    try:
        info = add_agent(settings, slug, name or slug.replace("-", " ").title(), instructions,
                         orchestrator=orchestrator)
    except (HomeError, KeyFileError, SettingsError) as exc:
        _fail(str(exc), EXIT_USAGE)
    if as_json:
        _print_json(info.to_dict())
        return
    out.print(f"added agent {slug}: {info.npub} ({info.pubkey}); restart the daemon to load it")


# --- migrate --------------------------------------------------------------------------------------


@app.command()
def migrate(
    ctx: typer.Context,
    source: Annotated[
        Path, typer.Option("--from", help="TENEX project folder, its .tenex folder or conversations folder.")
    ] = Path("."),
    as_json: JsonOption = False,
) -> None:
    """Import TENEX's TypeScript-era conversations (.tenex/conversations/*.json) into this home's store."""
    settings = _settings(ctx)
    from tenex_daemon.adapters.storage.filesystem import StoreLockedError
    from tenex_daemon.adapters.storage.tenex_import import ImportReport, import_tenex_home
    from tenex_daemon.app.wiring import build_store

    async def go() -> ImportReport:
        store = build_store(settings)
        try:
            await store.open()
        except StoreLockedError as exc:
            raise AccessError(f"{exc} (stop the daemon before migrating)", 503) from None
        try:
            return await import_tenex_home(source, store)
        finally:
            await store.close()

    try:
        report = _run(go())
    except FileNotFoundError as exc:
        _fail(str(exc), EXIT_USAGE)
    problems = [*report.failed, *report.rejected_events, *report.notes]
    if as_json:
        _print_json({
            "imported": report.imported,
            "already_present": report.already_present,
            "events_imported": report.events_imported,
            "duplicate_events": report.duplicate_events,
            "failed": [vars(p) | {"raw": None} for p in report.failed],
            "rejected_events": [vars(p) | {"raw": None} for p in report.rejected_events],
            "notes": [vars(p) | {"raw": None} for p in report.notes],
            "clean": report.clean,
        })
    else:
        out.print(
            f"imported {len(report.imported)} conversation(s) ({report.events_imported} events), "
            f"{len(report.already_present)} already present, "
            f"{report.duplicate_events} duplicate event(s) skipped"
        )
        if problems:
            table = Table(title="Problems (source files were not changed)")
            for column in ("what", "file", "conversation", "reason"):
                table.add_column(column, overflow="fold")
            for label, items in (("failed", report.failed), ("rejected event", report.rejected_events),
                                 ("repaired", report.notes)):
                for problem in items:
                    table.add_row(label, problem.path, str(problem.conversation_id or "-"), problem.reason)
            out.print(table)
    raise typer.Exit(0 if not report.failed else EXIT_FAILURE)


# --- send -----------------------------------------------------------------------------------------


@app.command()
def send(
    ctx: typer.Context,
    text: Annotated[str, typer.Argument(help="What to say.")],
    to: Annotated[str | None, typer.Option(help="Agent slug to address (default: the orchestrator).")] = None,
    reply_to: Annotated[
        str | None, typer.Option(help="Event id to reply to (a kind-1111 reply in its conversation).")
    ] = None,
    timeout: Annotated[float, typer.Option(min=0.1, help="Seconds to wait for replies.")] = 30.0,
    relay: Annotated[list[str] | None, typer.Option(help="Relay URL (repeatable).")] = None,
    title: Annotated[str | None, typer.Option(help="Title of a new conversation.")] = None,
    as_json: JsonOption = False,
) -> None:
    """Publish TEXT as the owner (keys/owner.key) and print the agents' replies as they arrive.

    Ends at the addressed agent's reply (exit 0) or at the timeout (exit 1).
    """
    from tenex_daemon.cli.send import SendError, send_message

    settings = _settings(ctx)
    if not settings.owner_key_path.exists():
        _fail(
            f"this home has no owner secret ({settings.owner_key_path}): the owner was given by public key "
            "at init, so publish from your own Nostr client (p-tag an agent), or re-run init without --owner",
            EXIT_USAGE,
        )
    try:
        owner = Signer.from_file(settings.owner_key_path, label="owner")
        agents = load_agents(settings)
    except KeyFileError as exc:
        _fail(str(exc), EXIT_USAGE)
    parent_id = _conversation_id(reply_to, "reply-to event id") if reply_to is not None else None
    names = {a.pubkey: a.name for a in agents}

    def show(agent: Agent, event: NostrEvent) -> None:
        if as_json:
            line = json.dumps({"reply": event.to_dict(), "agent": agent.slug}, ensure_ascii=False)
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
            return
        out.print(Text(f"[{names.get(event.pubkey, agent.slug)}] ", style="bold green"), end="")
        out.print(Text(event.content))

    async def find_local(event_id: str) -> NostrEvent | None:
        try:
            async with open_access(settings) as access:
                data = await access.conversation_of_event(event_id)
        except TenexError:
            return None
        for raw in data.get("history", []):
            if raw.get("id") == event_id:
                return NostrEvent.model_validate(raw)
        return None

    async def go() -> Any:
        return await send_message(
            settings, owner, agents, text, to=to, reply_to=parent_id, relays=relay or (),
            timeout=timeout, title=title, on_reply=show,
            find_event=find_local,
        )

    try:
        result = asyncio.run(go())
    except SendError as exc:
        _fail(str(exc), EXIT_FAILURE)
    except (TenexError, ValueError) as exc:
        _fail(str(exc), EXIT_USAGE)
    if as_json:
        sys.stdout.write(json.dumps({
            "sent": result.event.to_dict(), "conversation_id": result.conversation_id,
            "addressed": result.addressed.slug, "relays": result.relays, "answered": result.answered,
            "replies": len(result.replies),
        }, ensure_ascii=False) + "\n")
    else:
        err.print(
            f"sent {result.event.id} (conversation {result.conversation_id}) to {result.addressed.slug} "
            f"via {', '.join(result.relays)}"
        )
        if not result.answered:
            err.print(f"no reply from {result.addressed.slug if to else 'the agents'} within {timeout:g} s")
    raise typer.Exit(0 if result.answered else EXIT_FAILURE)


if __name__ == "__main__":
    app()
