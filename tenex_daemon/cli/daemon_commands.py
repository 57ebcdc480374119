"""The commands about the daemon and its home: version, init, run, status and migrate."""

from __future__ import annotations

import asyncio
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.table import Table
from rich.text import Text

from tenex_daemon import __version__
from tenex_daemon.cli.invocation import HomeOption, home_of, relay_urls_argument, run_async, settings_of
from tenex_daemon.cli.output import (
    EXIT_FAILURE,
    EXIT_USAGE,
    JsonOption,
    duration,
    err,
    fail,
    ms_time,
    out,
    print_json,
    s_time,
)
from tenex_daemon.core import nip19
from tenex_daemon.core.errors import StoreTooNewError, TenexError
from tenex_daemon.runtime.code_id import code_id

if TYPE_CHECKING:
    from tenex_daemon.adapters.storage.smarthole_import import SmartHoleIdentities, SmartHoleImportReport
    from tenex_daemon.adapters.storage.tenex_import import ImportReport
    from tenex_daemon.app.settings import Settings
    from tenex_daemon.app.status import StatusReport
    from tenex_daemon.core.ports import Store

DEFAULT_STALE_S = 30.0
IMPORT_KEY = "import"
"""``keys/import.key``: signs imported messages of the person when the home has no owner key."""


def version(home: HomeOption = None) -> None:
    """Print the tenexd version."""
    typer.echo(__version__)


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
        str,
        typer.Option(help="LLM backend of the demo agents: offline (no model), local (SmolLM2, in-process), "
                          "or openai, anthropic, claude-code (its options set in config.toml)."),
    ] = "offline",
    as_json: JsonOption = False,
    home: HomeOption = None,
) -> None:
    """Create a project home: config.toml, keys/ (0700) with one key file (0600) per agent and the project."""
    from tenex_daemon.adapters.nostr.signer import KeyFileError
    from tenex_daemon.app.home import HomeError, init_home

    try:
        result = init_home(
            home_of(ctx), owner, whitelist or (), relay or (),
            force=force, project_name=project, backend=backend,
        )
    except (HomeError, KeyFileError) as exc:
        fail(str(exc), EXIT_USAGE)
    if as_json:
        print_json(result.to_dict())
        return
    out.print(Text.assemble("Initialized tenexd home ", (str(result.home), "bold")))
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
    # with relays given the daemon uses them; without any it needs its own (`run` refuses to start relayless)
    embedded = "" if result.relays else " --embedded-relay"
    out.print(f"Next: tenexd --home {shlex.quote(str(result.home))} run{embedded}")


def _run_settings(
    settings: Settings, relay: list[str] | None, embedded_relay: bool,
    log_format: str | None, log_level: str | None,
) -> Settings:
    """The settings with the command line's relays and logging applied; exit 2 on a bad relay URL."""
    relays = settings.relays
    if relay:
        relays = relays.model_copy(update={"urls": relay_urls_argument(relay)})
    if embedded_relay:
        relays = relays.model_copy(update={"embedded": True})
    daemon_settings = settings.daemon
    if log_format is not None or log_level is not None:
        daemon_settings = daemon_settings.model_copy(update={
            "log_format": log_format or daemon_settings.log_format,
            "log_level": log_level or daemon_settings.log_level,
        })
    return settings.model_copy(update={"relays": relays, "daemon": daemon_settings})


def run(
    ctx: typer.Context,
    relay: Annotated[
        list[str] | None, typer.Option(help="Relay URL (repeatable); replaces relays.urls of config.toml.")
    ] = None,
    embedded_relay: Annotated[
        bool,
        typer.Option("--embedded-relay", help="Run a relay (a child process) beside the daemon."),
    ] = False,
    log_format: Annotated[str | None, typer.Option(help="auto | json | console.")] = None,
    log_level: Annotated[str | None, typer.Option(help="debug | info | warning | error | critical.")] = None,
    home: HomeOption = None,
) -> None:
    """Run the daemon in the foreground until SIGTERM or SIGINT (what systemd runs)."""
    from tenex_daemon.adapters.nostr.signer import KeyFileError
    from tenex_daemon.adapters.storage.filesystem.lock import StoreOpenError
    from tenex_daemon.app.control.errors import ControlSetupError
    from tenex_daemon.app.logging import configure_logging
    from tenex_daemon.app.settings import SettingsError
    from tenex_daemon.app.store_check import (
        EmptyStoreError,
        StoreBehindRelaysError,
        StoreOfAnotherProjectError,
    )

    settings = _run_settings(_run_settings_of(ctx, log_format), relay, embedded_relay, log_format, log_level)
    chosen = settings.daemon.log_format
    try:
        configure_logging(chosen, settings.daemon.log_level)
    except ValueError as exc:
        if chosen == "json":  # the level is wrong: the reason still goes out as the JSON asked for
            configure_logging("json")
        _fail_run(str(exc), EXIT_USAGE, chosen)
    if not settings.relays.urls and not settings.relays.embedded:
        no_relay = "no relay configured: pass --relay URL or --embedded-relay, or set relays.urls"
        _fail_run(no_relay, EXIT_USAGE, chosen)
    from tenex_daemon.app.daemon import Daemon

    try:
        asyncio.run(Daemon(settings).run())
    except KeyboardInterrupt:
        pass
    except (
        SettingsError, KeyFileError, ControlSetupError, StoreTooNewError, StoreOpenError,
        StoreBehindRelaysError, StoreOfAnotherProjectError, EmptyStoreError,
    ) as exc:
        # a backend the settings name that cannot be made (its extra not installed, its model file missing), a
        # key or control file, a path: configuration; a newer tenexd's store: not this one's to run; a store
        # this user may not read or write, one behind the relays, another project's, or one never used beside
        # the home's (exit 2: systemd's unit does not restart on it)
        _fail_run(str(exc), EXIT_USAGE, settings.daemon.log_format)
    except (TenexError, OSError) as exc:
        _fail_run(str(exc), EXIT_FAILURE, settings.daemon.log_format)
    except RuntimeError as exc:
        if "can't start new thread" not in str(exc):
            raise
        limit = (
            "the system refused the daemon a new thread: a process or thread limit (ulimit -u, "
            "systemd's TasksMax or LimitNPROC) is too low for it: raise it, then start it again (nothing "
            "accepted is lost)"
        )
        _fail_run(limit, EXIT_FAILURE, settings.daemon.log_format)


def _run_settings_of(ctx: typer.Context, log_format: str | None) -> Settings:
    """The home's settings; refused, exit 2 saying why (as a JSON line when ``--log-format json``)."""
    from tenex_daemon.app.settings import SettingsError, load_settings

    try:
        return load_settings(home_of(ctx))
    except SettingsError as exc:
        if log_format != "json":
            fail(str(exc), EXIT_USAGE)
        from tenex_daemon.app.logging import configure_logging

        configure_logging("json")
        _fail_run(str(exc), EXIT_USAGE, "json")


def _fail_run(message: str, code: int, log_format: str) -> NoReturn:
    """Exit ``code`` after saying why: with JSON logs asked for (``json``, not ``auto``), as one more JSON
    line (``daemon_failed``) on the log's stream, so a log shipper reading it sees why the daemon ended;
    otherwise as ``error:`` text (what a person reads, also from ``auto``'s JSON under systemd)."""
    if log_format != "json":
        fail(message, code)
    import structlog

    structlog.get_logger(__name__).error("daemon_failed", error=message, exit_code=code)
    raise typer.Exit(code)


def _status_report(ctx: typer.Context) -> tuple[StatusReport, str | None]:
    """Read the status file, and say why the settings are refused when they are; works with a broken config
    (falls back to the default paths): the daemon is still reported, the settings' error beside it. A home
    missing, or with neither config.toml nor a status file, is no home: exit 2 as every command does."""
    from tenex_daemon.app.settings import CONFIG_FILE, SettingsError, load_settings
    from tenex_daemon.app.status import Health, live_report, read_status
    from tenex_daemon.cli.client import live_status

    home = home_of(ctx)
    try:
        settings = load_settings(home)
    except SettingsError as exc:
        fallback = home / "run" / "status.json"
        if not (home / CONFIG_FILE).exists() and not fallback.exists():
            fail(str(exc), EXIT_USAGE)
        return read_status(fallback, DEFAULT_STALE_S, home=home), str(exc)
    report = read_status(settings.status_path, settings.daemon.stale_after_s, home=settings.home)
    if report.state is Health.STOPPED:
        return report, None
    # its process lives: what it answers now is truer than a file whose writes may fail (a full disk)
    live = asyncio.run(live_status(settings))
    return (report if live is None else live_report(live, settings.status_path, report.age_s)), None


def _numbers(counts: object) -> dict[str, int | float]:
    """The numeric counts of a status file's mapping (anything else in it is left out, never raised on)."""
    if not isinstance(counts, dict):
        return {}
    return {
        str(name): count for name, count in counts.items()
        if isinstance(count, int | float) and not isinstance(count, bool)
    }


def _breakdown(counts: object) -> str:
    """`` (chat 2, plan 1)`` for counts by name, largest first; empty when there are none."""
    found = _numbers(counts)
    if not found:
        return ""
    ordered = sorted(found.items(), key=lambda item: (-item[1], item[0]))
    return " (" + ", ".join(f"{name} {count:g}" for name, count in ordered) + ")"


def _tally(counts: object) -> str:
    """A total and its breakdown (``3 (author_not_allowed 2, too_large 1)``), ``0`` when there are none."""
    return f"{sum(_numbers(counts).values()):g}{_breakdown(counts)}"


def _mapping(value: object) -> dict[str, Any]:
    """A status file's section as a mapping (empty when it is something else: another version's file)."""
    return value if isinstance(value, dict) else {}


def _print_status_data(data: dict[str, Any]) -> None:
    """Print a running (or stale) daemon's status data: process, counters and relays."""
    uptime = data.get("uptime_s")
    lines = [
        f"version {data.get('version', '?')}, pid {data.get('pid', '?')}, state {data.get('state', '?')}",
        f"up {duration(uptime)}" if isinstance(uptime, int | float) else "",
        f"last event {s_time(data.get('last_event_at'))}",
    ]
    out.print(", ".join(line for line in lines if line))
    code = data.get("code")
    if isinstance(code, str) and code != code_id() and data.get("state") in ("starting", "running"):
        out.print(f"code {code}: the daemon runs other code than this tenexd ({code_id()}), installed since "
                  "it started: restart it to run the version installed, e.g. `systemctl restart tenexd`")
    conversations, events = _mapping(data.get("conversations")), _mapping(data.get("events"))
    runs = _mapping(data.get("runs"))
    out.print(
        f"conversations {conversations.get('total', 0)}{_breakdown(conversations.get('by_phase'))}; "
        f"runs in flight {data.get('runs_in_flight', 0)}; replies {data.get('replies', 0)}; "
        f"events accepted {events.get('accepted', 0)}, rejected {_tally(events.get('rejected'))}; "
        f"errors {_tally(data.get('errors'))}"
    )
    # a backend failing answers each run with an error reply: said here, not only in /metrics
    out.print(
        f"runs completed {runs.get('completed', 0)}, answered with an error "
        f"{_tally(runs.get('with_error'))}; tries failed {runs.get('failed', 0)} (each tried again), "
        f"runs given up {runs.get('dropped', 0)}"
    )
    parked = _numbers(runs.get("parked"))
    if parked:  # messages unanswered until their agent is configured again
        out.print(f"runs kept for agents not configured {_tally(parked)}: run once they are configured again")
    fallbacks = _numbers(data.get("routing_fallbacks"))
    if fallbacks:  # the orchestrator's model did not decide: routed by the rules or to the default agent
        out.print(f"routing without the model's decision {_tally(fallbacks)}")
    outbox = _mapping(data.get("outbox"))
    if outbox:
        oldest = outbox.get("oldest_age_s")
        waiting = f" (oldest {duration(oldest)})" if isinstance(oldest, int | float) else ""
        out.print(
            f"outbox: {outbox.get('depth', 0)} waiting for a relay{waiting}; "
            f"{outbox.get('delivered', 0)} delivered, {outbox.get('retries', 0)} retries since start"
            + (f", {outbox['refused']} refused for good by every relay" if outbox.get("refused") else "")
        )
    described = _mapping(data.get("descriptions"))
    if described:
        out.print(
            f"descriptions: {described.get('queued', 0)} queued, {described.get('described', 0)} made "
            f"({described.get('fallbacks', 0)} fallback), {described.get('unpublished', 0)} unpublished"
        )
    retention = _mapping(data.get("retention"))
    if retention:
        totals = _mapping(retention.get("totals"))
        out.print(
            f"retention: {retention.get('sweeps', 0)} sweeps, last {s_time(retention.get('last_sweep_at'))}; "
            f"since start ended idle {totals.get('ended_idle', 0)}, archived {totals.get('archived', 0)}, "
            f"deleted {totals.get('deleted', 0)}, errors {totals.get('errors', 0)}"
        )
    _print_embedded_relay(data)
    listed = data.get("relays")
    relays = [relay for relay in listed if isinstance(relay, dict)] if isinstance(listed, list) else []
    if relays:
        table = Table(title="Relays")
        for column in ("url", "state", "reconnects", "last event", "subscriptions refused"):
            table.add_column(column, overflow="fold")
        for relay in relays:
            unserved = _mapping(relay.get("unserved"))
            table.add_row(
                str(relay.get("url")), str(relay.get("state")), str(relay.get("reconnects", "-")),
                s_time(relay.get("last_event_at")),
                ", ".join(f"{sub} ({_mapping(why).get('message')})" for sub, why in unserved.items()) or "-",
            )
        out.print(table)


def _print_embedded_relay(data: dict[str, Any]) -> None:
    """Print the embedded relay's line when it runs: its URL, pid, and how often it was started again since
    the daemon started (with the last time's reason, exited or unresponsive, when the status names it)."""
    url = data.get("embedded_relay")
    if not isinstance(url, str) or not url:
        return
    restarts = data.get("embedded_relay_restarts")
    last = data.get("embedded_relay_last_restart_reason")
    why = f" (last: {last})" if isinstance(last, str) and last and restarts else ""
    out.print(
        f"embedded relay: {url}, pid {data.get('embedded_relay_pid') or '-'}; "
        f"{restarts if isinstance(restarts, int) else 0} restarts since start{why}"
    )


def status(ctx: typer.Context, as_json: JsonOption = False, home: HomeOption = None) -> None:
    """Say whether the daemon is running: exit 0 when running and fresh, 1 when stopped, stale or degraded
    (the reason is shown), 2 when the home does not exist or has no config.toml (and no status file).

    Settings the other commands refuse (exit 2) do not stop it: the daemon is reported all the same, and the
    settings' error is a warning line on stderr (``settings_error`` in --json, null when they load).
    """
    report, settings_error = _status_report(ctx)
    if settings_error is not None:
        err.print(Text(
            f"warning: {settings_error} (other commands refuse these settings, and `tenexd run` would not "
            "start with them)",
            style="yellow",
        ))
    if as_json:
        print_json({**report.to_dict(), "settings_error": settings_error})
        raise typer.Exit(0 if report.healthy else EXIT_FAILURE)
    style = "green" if report.healthy else ("yellow" if report.state.value == "running" else "red")
    out.print(Text(f"tenexd: {report.reason}", style=f"bold {style}"))
    if report.data is not None and report.state.value != "stopped":
        _print_status_data(report.data)
    raise typer.Exit(0 if report.healthy else EXIT_FAILURE)


def migrate(
    ctx: typer.Context,
    source: Annotated[
        Path | None,
        typer.Option(
            "--from", help="TENEX project folder, its .tenex folder or conversations folder (default: .)."
        ),
    ] = None,
    smarthole: Annotated[
        Path | None,
        typer.Option(
            "--from-smarthole", help="A SmartHole plugin's data.json: its conversations and legacy history."
        ),
    ] = None,
    agent: Annotated[
        str | None,
        typer.Option(help="With --from-smarthole: the agent the assistant's messages are attributed to "
                          "(default: the home's default agent)."),
    ] = None,
    from_store: Annotated[
        Path | None,
        typer.Option(
            "--from-store",
            help="A filesystem store to copy whole into the store config.toml names (an unused one): the "
                 "folder holding its conversations/ (the home itself after switching storage.kind).",
        ),
    ] = None,
    reopen: Annotated[
        bool,
        typer.Option(
            "--reopen",
            help="Let a daemon start again on the store config.toml names though --from-store copied it into "
                 "another (what the copy gained since is not in it).",
        ),
    ] = False,
    as_json: JsonOption = False,
    home: HomeOption = None,
) -> None:
    """Import TENEX's TypeScript-era conversations (.tenex/conversations/*.json), or with --from-smarthole a
    SmartHole data.json, into this home's store; or with --from-store copy a filesystem store into it
    whole (the old store is marked: a daemon refuses it until --reopen). The daemon must be stopped. Exit 1
    when a conversation could not be imported."""
    settings = settings_of(ctx)
    if sum(given is not None for given in (source, smarthole, from_store)) + reopen > 1:
        fail("give one of --from, --from-smarthole, --from-store and --reopen", EXIT_USAGE)
    if agent is not None and smarthole is None:
        fail("--agent goes with --from-smarthole", EXIT_USAGE)
    if reopen:
        from tenex_daemon.cli.store_copy_command import reopen_store

        reopen_store(settings, as_json)
    if from_store is not None:
        from tenex_daemon.cli.store_copy_command import migrate_store

        migrate_store(settings, from_store, as_json)
    from tenex_daemon.adapters.storage.tenex_import import import_tenex_home
    from tenex_daemon.app.home import load_project_pubkey
    from tenex_daemon.app.store_check import serves_this_project
    from tenex_daemon.cli.store_copy_command import open_stopped_store

    async def go() -> ImportReport:
        store = await open_stopped_store(settings)
        try:
            await serves_this_project(settings, store, load_project_pubkey(settings))
            if smarthole is not None:  # its signers only once the import may go ahead
                identities = _smarthole_identities(settings, agent)
                return await _import_smarthole(smarthole, store, identities, settings)
            idle_ms = round(settings.conversations.idle_timeout_min * 60_000)  # the home's, as the daemon's
            folder = source if source is not None else Path(".")
            return await import_tenex_home(folder, store, idle_timeout_ms=idle_ms)
        finally:
            await store.close()

    try:
        report = run_async(go())
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as exc:
        fail(str(exc), EXIT_USAGE)  # a source missing, a folder given for a file, one not this user's to read
    if as_json:
        print_json(_import_report_json(report))
    else:
        _print_import_report(report)
    raise typer.Exit(0 if not report.failed else EXIT_FAILURE)


def _smarthole_identities(settings: Settings, agent: str | None) -> SmartHoleIdentities:
    """Who signs a SmartHole import: the agent's key, and the owner's key if the home has it, else
    ``keys/import.key`` (made on first use, 0600); exit 2 on an unknown agent or a bad key file."""
    from tenex_daemon.adapters.nostr.signer import KeyFileError, Signer, write_key_file
    from tenex_daemon.adapters.storage.smarthole_import import SmartHoleIdentities

    slug = agent or settings.default_agent_slug
    if slug is None or all(a.slug != slug for a in settings.agents):
        known = ", ".join(a.slug for a in settings.agents) or "none"
        fail(f"no agent {slug!r} to attribute the assistant's messages to (agents: {known})", EXIT_USAGE)
    try:
        agent_signer = Signer.from_file(settings.agent_key_path(slug), label=slug)
        if settings.owner_key_path.exists():
            user = Signer.from_file(settings.owner_key_path, label="owner")
        elif (settings.keys_dir / f"{IMPORT_KEY}.key").exists():
            user = Signer.from_file(settings.keys_dir / f"{IMPORT_KEY}.key", label=IMPORT_KEY)
        else:
            user = Signer.generate(label=IMPORT_KEY)
            settings.keys_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            write_key_file(settings.keys_dir / f"{IMPORT_KEY}.key", user)
    except (KeyFileError, OSError) as exc:
        fail(str(exc), EXIT_USAGE)
    project = (settings.owner, settings.project.d_tag) if settings.owner else None
    return SmartHoleIdentities(user=user, agent=agent_signer, agent_slug=slug, project=project)


async def _import_smarthole(
    path: Path, store: Store, identities: SmartHoleIdentities, settings: Settings
) -> SmartHoleImportReport:
    """Run the SmartHole import with the home's idle timeout and the system clock."""
    from tenex_daemon.adapters.storage.smarthole_import import import_smarthole_file
    from tenex_daemon.core.ports import SystemClock

    idle_ms = round(settings.conversations.idle_timeout_min * 60_000)
    return await import_smarthole_file(path, store, identities, clock=SystemClock(), idle_timeout_ms=idle_ms)


def _import_report_json(report: ImportReport) -> dict[str, Any]:
    """An import report as JSON (the raw source data of each problem left out)."""
    from tenex_daemon.adapters.storage.smarthole_import import SmartHoleImportReport

    data: dict[str, Any] = {
        "imported": report.imported,
        "already_present": report.already_present,
        "events_imported": report.events_imported,
        "duplicate_events": report.duplicate_events,
        "failed": [vars(p) | {"raw": None} for p in report.failed],
        "rejected_events": [vars(p) | {"raw": None} for p in report.rejected_events],
        "notes": [vars(p) | {"raw": None} for p in report.notes],
        "clean": report.clean,
    }
    if isinstance(report, SmartHoleImportReport):
        data |= {
            "source": report.source, "sha256": report.sha256, "already_imported": report.already_imported,
        }
    return data


def _print_import_report(report: ImportReport) -> None:
    """Print an import report: the counts, then a table of its problems if any."""
    from tenex_daemon.adapters.storage.smarthole_import import SmartHoleImportReport

    if isinstance(report, SmartHoleImportReport) and report.already_imported is not None:
        record = report.already_imported
        out.print(
            f"{report.source} was already imported at {ms_time(record.get('at'))} "
            f"({record.get('imported', 0)} conversation(s), {record.get('events', 0)} events); "
            "nothing changed"
        )
        return
    out.print(
        f"imported {len(report.imported)} conversation(s) ({report.events_imported} events), "
        f"{len(report.already_present)} already present, "
        f"{report.duplicate_events} duplicate event(s) skipped"
    )
    if not [*report.failed, *report.rejected_events, *report.notes]:
        return
    table = Table(title="Problems (source files were not changed)")
    for column in ("what", "file", "conversation", "reason"):
        table.add_column(column, overflow="fold")
    for label, items in (("failed", report.failed), ("rejected event", report.rejected_events),
                         ("repaired", report.notes)):
        for problem in items:
            table.add_row(label, problem.path, str(problem.conversation_id or "-"), problem.reason)
    out.print(table)
