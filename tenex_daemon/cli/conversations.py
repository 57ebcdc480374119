"""The conversation commands: ``conversations list|search|show|archive|end|stop|restore|export|rebuild``
and ``context``."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn
from rich.table import Table
from rich.text import Text

from tenex_daemon.cli.invocation import (
    HomeOption,
    event_id_argument,
    run_async,
    settings_of,
    with_access,
    with_conversation,
)
from tenex_daemon.cli.output import (
    EXIT_USAGE,
    JsonOption,
    err,
    fail,
    ms_time,
    out,
    print_json,
    printable,
    s_time,
)
from tenex_daemon.cli.references import AccessError
from tenex_daemon.cli.typer_app import TenexTyper
from tenex_daemon.core import nip19
from tenex_daemon.core.vocabulary import BUILT_IN_PHASE_NAMES

if TYPE_CHECKING:
    from tenex_daemon.app.rebuild import RebuildRequest
    from tenex_daemon.app.settings import Settings

conversations_app = TenexTyper(
    help="List, show, search, archive, end, stop, restore, export and rebuild conversations.",
    no_args_is_help=True,
)


@conversations_app.callback()
def _group_home(home: HomeOption = None) -> None:
    """Take ``--home`` between the group and its command as well (:mod:`tenex_daemon.cli.invocation`)."""

PhaseOption = Annotated[
    str | None,
    typer.Option(help=f"Only this phase ({', '.join(BUILT_IN_PHASE_NAMES)}, or one the project added)."),
]
LimitOption = Annotated[int | None, typer.Option(min=1, help="At most this many rows.")]
ID_HELP = (
    "Conversation id: hex (or its first 4 or more digits, when no other id starts with them), "
    "note1 or nevent1."
)
IdArgument = Annotated[str, typer.Argument(metavar="ID", help=ID_HELP)]


def _names(settings: Settings) -> dict[str, str]:
    """Public key -> a label for people reading history (agents by name, the project, the owner)."""
    from tenex_daemon.app.home import agent_identities

    names: dict[str, str] = {}
    for agent, info, _problem in agent_identities(settings):
        if info is not None:
            names[info.pubkey] = agent.name
    if settings.owner is not None:
        names.setdefault(settings.owner, "owner")
    return names


def _author(pubkey: str, names: dict[str, str]) -> str:
    return printable(names.get(pubkey) or nip19.encode_npub(pubkey)[:16] + "…")


SHOWN_ID_DIGITS = 12
"""How much of each id a listing shows: a short id every command takes (``--json`` has the whole id)."""
SHOWN_TITLE_CHARS = 80
"""How much of each title a listing shows (``--json`` and ``show`` have the whole title)."""


def _conversation_table(rows: list[dict[str, Any]], title: str) -> Table:
    """The listing's table; what the store holds is shown with its control characters escaped
    (:func:`~tenex_daemon.cli.output.printable`): a title is a person's or a model's."""
    from tenex_daemon.core.text import shortened

    table = Table(title=title)
    for column in ("id", "title", "phase", "events", "agents", "updated (UTC)", "status"):
        table.add_column(column, overflow="fold")
    for row in rows:
        status = "ended" if row.get("ended_at") is not None else "active"
        table.add_row(
            printable(row["id"])[:SHOWN_ID_DIGITS], shortened(printable(row["title"]), SHOWN_TITLE_CHARS),
            printable(row["phase"]), str(row["event_count"]), str(row["agent_count"]),
            ms_time(row.get("updated_at")),
            f"{status}, archived" if row.get("archived") else status,
        )
    return table


def _search_query(
    title: str | None, phase: str | None, archived: bool | None, date_from: str | None,
    date_to: str | None, participant: str | None, limit: int | None,
) -> dict[str, str]:
    """The query parameters of ``GET /api/v1/conversations`` for the options given."""
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
    return with_access(ctx, lambda access: access.search(query))


@conversations_app.command("list")
def conversations_list(
    ctx: typer.Context,
    archived: Annotated[bool, typer.Option("--archived", help="Archived conversations only.")] = False,
    all_: Annotated[bool, typer.Option("--all", help="Archived conversations and the others.")] = False,
    phase: PhaseOption = None,
    limit: LimitOption = None,
    as_json: JsonOption = False,
    home: HomeOption = None,
) -> None:
    """List conversations, newest update first: those not archived (ended ones too), unless --archived or
    --all."""
    which: bool | None = None if all_ else archived
    rows = _list_rows(ctx, _search_query(None, phase, which, None, None, None, limit))
    if as_json:
        print_json(rows)
        return
    out.print(_conversation_table(rows, f"{len(rows)} conversation(s)"))


@conversations_app.command("search")
def conversations_search(
    ctx: typer.Context,
    title: Annotated[str | None, typer.Argument(help="Words of the title (fuzzy, case-insensitive).")] = None,
    phase: PhaseOption = None,
    archived: Annotated[
        bool | None,
        typer.Option("--archived/--active", help="Archived only / not archived only (default both)."),
    ] = None,
    date_from: Annotated[str | None, typer.Option("--from", help="Created at/after (ISO 8601).")] = None,
    date_to: Annotated[
        str | None, typer.Option("--to", help="Created by (ISO 8601; a date alone: its whole UTC day).")
    ] = None,
    participant: Annotated[str | None, typer.Option(help="An author (npub or hex).")] = None,
    limit: LimitOption = None,
    as_json: JsonOption = False,
    home: HomeOption = None,
) -> None:
    """Search conversations by title, phase, dates, participant."""
    _check_dates(("--from", date_from), ("--to", date_to))
    rows = _list_rows(ctx, _search_query(title, phase, archived, date_from, date_to, participant, limit))
    if as_json:
        print_json(rows)
        return
    out.print(_conversation_table(rows, f"{len(rows)} match(es)"))


def _check_dates(*options: tuple[str, str | None]) -> None:
    """Exit 2 naming the option (``--from``, ``--to``) whose date is not one, before the search is asked
    (whose own error names the control API's parameter, ``date_from``)."""
    from tenex_daemon.app.control.errors import ApiError
    from tenex_daemon.app.control.parsing import parse_datetime

    for name, value in options:
        if value is not None:
            try:
                parse_datetime(name, value)
            except ApiError as exc:
                fail(exc.message, EXIT_USAGE)


def _print_history(history: list[dict[str, Any]], names: dict[str, str]) -> None:
    table = Table(title="History")
    for column in ("#", "time (UTC)", "author", "kind", "content"):
        table.add_column(column, overflow="fold")
    for index, event in enumerate(history):
        table.add_row(
            str(index), s_time(event["created_at"]), _author(event["pubkey"], names), str(event["kind"]),
            Text(printable(event["content"])),
        )
    out.print(table)


def _print_agent_states(agent_states: dict[str, Any]) -> None:
    table = Table(title="Agent states")
    for column in ("agent", "last processed index", "session", "tokens (prompt + completion)"):
        table.add_column(column)
    for slug, state in sorted(agent_states.items()):
        used = f"{state.get('prompt_tokens', 0):,} + {state.get('completion_tokens', 0):,}"
        session = printable(state.get("session_id") or "-")
        table.add_row(printable(slug), str(state["last_processed_index"]), session, used)
    out.print(table)


def _print_transitions(transitions: list[dict[str, Any]]) -> None:
    table = Table(title="Phase transitions")
    for column in ("time (UTC)", "from", "to", "agent", "reason"):
        table.add_column(column, overflow="fold")
    for t in transitions:
        table.add_row(
            ms_time(t.get("timestamp")), printable(t.get("from_phase")), printable(t.get("to_phase")),
            printable(t.get("agent_slug")), printable(t.get("reason") or t.get("message") or ""),
        )
    out.print(table)


@conversations_app.command("show")
def conversations_show(
    ctx: typer.Context,
    conversation_id: IdArgument,
    as_json: JsonOption = False,
    home: HomeOption = None,
) -> None:
    """Show a conversation: summary, history, agent states, phase transitions."""
    data: dict[str, Any] = with_conversation(ctx, conversation_id, lambda access, cid: access.get(cid))[1]
    if as_json:
        print_json(data)
        return
    names = _names(settings_of(ctx))
    out.print(Text(printable(data["title"]), style="bold"))
    out.print(
        f"id {printable(data['id'])}\nphase {printable(data['phase'])}, {len(data['history'])} events, "
        f"created {ms_time(data.get('created_at'))}, updated {ms_time(data.get('updated_at'))}, "
        f"execution {data.get('execution_seconds', 0)} s{', archived' if data.get('archived') else ''}"
        + (", private (NIP-17: gift-wrapped, never published in the clear)" if data.get("private") else "")
    )
    tokens = data.get("tokens") or {}
    if tokens.get("by_agent"):
        out.print(f"tokens: {tokens['prompt']:,} prompt + {tokens['completion']:,} completion")
    _print_lifecycle(data)
    _print_history(data["history"], names)
    if data["agent_states"]:
        _print_agent_states(data["agent_states"])
    if data["transitions"]:
        _print_transitions(data["transitions"])


def _print_lifecycle(data: dict[str, Any]) -> None:
    """The conversation's life: ended (when, by whom, why) or active, where its title came from, its
    summary, its task session (their control characters escaped: a reason or a summary may be a model's)."""
    if data.get("ended_at") is not None:
        why = f": {printable(data['end_reason'])}" if data.get("end_reason") else ""
        out.print(f"ended {ms_time(data['ended_at'])} by {printable(data.get('ended_by'))}{why}")
    else:
        out.print(f"active, last activity {ms_time(data.get('activity_at'))}")
    if data.get("title_source"):
        out.print(f"title source: {printable(data['title_source'])}")
    if data.get("description"):
        out.print(Text(f"summary: {printable(data['description'])}", style="italic"))
    if data.get("task_id"):
        previous = (
            f", follows session {printable(data['previous_session'])}" if data.get("previous_session") else ""
        )
        out.print(
            f"task {printable(data['task_id'])}: session expires {ms_time(data.get('expires_at'))}, "
            f"{data.get('token_count', 0):,} tokens{previous}"
        )


@conversations_app.command("archive")
def conversations_archive(ctx: typer.Context, conversation_id: IdArgument, home: HomeOption = None) -> None:
    """Archive a conversation: it stays readable and becomes read-only; one still active is ended first
    (by owner, reason archived).

    Exit 1 when it is archived already (as `end` does when it is ended already).
    """
    cid, _ = with_conversation(ctx, conversation_id, lambda access, cid: access.archive(cid))
    out.print(f"archived {cid}")


@conversations_app.command("end")
def conversations_end(
    ctx: typer.Context,
    conversation_id: IdArgument,
    reason: Annotated[str | None, typer.Option("--reason", help="Why, recorded with the end.")] = None,
    home: HomeOption = None,
) -> None:
    """End a conversation: when, by whom (owner) and why are recorded; it stays writable (a new message
    reopens it)."""
    cid, _ = with_conversation(ctx, conversation_id, lambda access, cid: access.end(cid, reason))
    out.print(f"ended {cid}")


@conversations_app.command("stop")
def conversations_stop(
    ctx: typer.Context,
    conversation_id: IdArgument,
    agent: Annotated[str | None, typer.Option("--agent", help="Stop only this agent (its slug).")] = None,
    home: HomeOption = None,
) -> None:
    """Stop the agents working on a conversation, as the owner: their running and waiting runs are
    cancelled, nothing half-written is published, and the stop is recorded (without a daemon: the runs
    a crash left journaled are not redone). An agent the home does not have exits 2, as ``context`` does."""
    if agent is not None:
        _check_agent(settings_of(ctx), agent)
    cid, result = with_conversation(ctx, conversation_id, lambda access, cid: access.stop(cid, agent))
    stopped = result.get("stopped") or []
    shown = printable(", ".join(stopped))
    out.print(f"stopped {shown} in {cid}" if stopped else f"nothing was running in {cid}")


@conversations_app.command("restore")
def conversations_restore(ctx: typer.Context, conversation_id: IdArgument, home: HomeOption = None) -> None:
    """Restore an archived conversation.

    Exit 1 when it is not archived (as `end` does when it is ended already).
    """
    cid, _ = with_conversation(ctx, conversation_id, lambda access, cid: access.restore(cid))
    out.print(f"restored {cid}")


@conversations_app.command("export")
def conversations_export(
    ctx: typer.Context,
    conversation_id: IdArgument,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write to this file (default: stdout).")
    ] = None,
    home: HomeOption = None,
) -> None:
    """Export a conversation as JSON (history as NIP-01 events, state, transitions, turns); a file is
    written with mode 0600 (it holds the conversation's text, a private one's decrypted)."""
    data: dict[str, Any] = with_conversation(ctx, conversation_id, lambda access, cid: access.get(cid))[1]
    text = json.dumps(data, ensure_ascii=False, indent=2) + "\n"
    if output is None:
        sys.stdout.write(text)
        return
    try:
        _write_private(output, text)
    except OSError as exc:
        fail(f"cannot write {output}: {exc.strerror or exc}", EXIT_USAGE)
    err.print(f"wrote {output} ({len(data['history'])} events)")


EXPORT_MODE = 0o600
"""An export file's mode: its owner's only (it holds a conversation's text)."""


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, created with mode 0600; an existing file readable by others is made 0600
    before anything is written to it (a device such as /dev/null is written as it is)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, EXPORT_MODE)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        found = os.fstat(fd)
        if stat.S_ISREG(found.st_mode) and stat.S_IMODE(found.st_mode) & ~EXPORT_MODE:
            os.fchmod(fd, EXPORT_MODE)
        file.write(text)


def _rebuild_body(request: RebuildRequest) -> dict[str, Any]:
    """The body of ``POST /api/v1/conversations/rebuild`` for ``request``."""
    body: dict[str, Any] = {"id": request.conversation_id} if request.conversation_id else {"all": True}
    if request.since is not None:
        body["since"] = request.since
    return body


async def _rebuild(settings: Settings, request: RebuildRequest, progress: Progress | None) -> dict[str, Any]:
    """Rebuild through the daemon's control API when it runs, else with the store and relays opened here."""
    from tenex_daemon.app.rebuild import NoRelayConfiguredError, RebuildError, rebuild_from_relays
    from tenex_daemon.cli.access import LocalAccess, open_access
    from tenex_daemon.cli.client import ApiAccess
    from tenex_daemon.core.errors import ConversationNotFoundError

    task = progress.add_task("fetching from the relays", total=None) if progress is not None else None

    def merged(done: int, total: int) -> None:
        if progress is not None and task is not None:
            progress.update(task, description="merging conversations", completed=done, total=total)

    async with open_access(settings, create=True) as access:
        if isinstance(access, ApiAccess):
            return await access.rebuild(_rebuild_body(request))
        assert isinstance(access, LocalAccess)
        try:
            report = await rebuild_from_relays(settings, access.manager, request, merged)
        except ConversationNotFoundError:
            raise AccessError(f"no relay has conversation {request.conversation_id}", 404) from None
        except NoRelayConfiguredError as exc:  # configuration: exit 2
            raise AccessError(str(exc), 400) from None
        except RebuildError as exc:
            raise AccessError(str(exc), 503) from None
        return report.to_dict()


def _progress_bar() -> Progress | None:
    """A progress bar on stdout when it is a terminal, else None."""
    if not out.is_terminal:
        return None
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    return Progress(*columns, console=out, transient=True)


@conversations_app.command("rebuild")
def conversations_rebuild(
    ctx: typer.Context,
    conversation_id: Annotated[
        str | None, typer.Argument(metavar="ID", help="Conversation id (hex, note1 or nevent1).")
    ] = None,
    all_: Annotated[
        bool, typer.Option("--all", help="Every conversation the project's agents took part in.")
    ] = False,
    since: Annotated[
        str | None, typer.Option("--since", help="Only events created at/after (ISO 8601 or Unix seconds).")
    ] = None,
    as_json: JsonOption = False,
    home: HomeOption = None,
) -> None:
    """Fetch conversations back from the relays, verify every event and merge what the store lacks.

    Through the daemon when it runs, else with the store and the relays of config.toml. Nothing
    already stored is added twice and no agent is run.
    """
    from tenex_daemon.app.control.errors import ApiError
    from tenex_daemon.app.control.parsing import parse_datetime
    from tenex_daemon.app.rebuild import RebuildRequest, report_rows

    if (conversation_id is None) == (not all_):
        fail("name one conversation ID or pass --all", EXIT_USAGE)
    cid = event_id_argument(conversation_id) if conversation_id is not None else None
    since_s: int | None = None
    if since is not None:
        try:
            since_s = int(parse_datetime("--since", since).timestamp())
        except ApiError as exc:
            fail(exc.message, EXIT_USAGE)
    request = RebuildRequest(conversation_id=cid, all_=all_, since=since_s)
    settings = settings_of(ctx)
    progress = None if as_json else _progress_bar()
    if progress is None:
        report = run_async(_rebuild(settings, request, None))
    else:
        with progress:
            report = run_async(_rebuild(settings, request, progress))
    if as_json:
        print_json(report)
        return
    table = Table(title="Rebuilt from the relays")
    table.add_column("what")
    table.add_column("count", justify="right")
    for label, count in report_rows(report):
        table.add_row(label, str(count))
    out.print(table)


def context(
    ctx: typer.Context,
    conversation_id: IdArgument,
    agent: Annotated[str, typer.Option("--agent", help="Agent slug.")],
    trigger: Annotated[
        str | None,
        typer.Option(help="Event the agent responds to (default: the newest event it did not write)."),
    ] = None,
    as_json: JsonOption = False,
    home: HomeOption = None,
) -> None:
    """Print exactly what the agent named by --agent would be sent now: its persona (the system message sent
    first), then the messages; no state changes."""
    trigger_id = event_id_argument(trigger, "trigger event id") if trigger is not None else None
    _check_agent(settings_of(ctx), agent)
    data: dict[str, Any] = with_conversation(
        ctx, conversation_id, lambda access, cid: access.context(cid, agent, trigger_id)
    )[1]
    if as_json:
        print_json(data)
        return
    _print_message("--- [persona] system ---", data["persona"])
    for index, message in enumerate(data["messages"]):
        _print_message(f"--- [{index}] {printable(message['role'])} ---", message["content"])
    out.print(Text(
        f"--- {len(data['messages'])} message(s) for {agent}; trigger {printable(data['trigger'])}; "
        f"session {printable(data['session_id'] or '-')} ---", style="dim",
    ))
    budget = data.get("budget")
    if budget:
        line = (
            f"--- budget {budget['limit']} tokens ({budget['strategy']}): {budget['tokens']} before cuts, "
            f"{budget['dropped']} message(s) left out"
        )
        if budget["to_summarize"]:
            line += f"; the run first adds {budget['to_summarize']} of them to the summary (shown truncated)"
        out.print(Text(line + " ---", style="dim"))


def _check_agent(settings: Settings, slug: str) -> None:
    """Exit 2 (bad input, as ``send --to`` does) when the home has no agent ``slug``, or when its running
    daemon does not serve it (it was added after the daemon started), before any conversation is looked up."""
    import asyncio

    from tenex_daemon.cli.client import live_status, unserved_reason

    slugs = [a.slug for a in settings.agents]
    if slug not in slugs:
        fail(f"unknown agent {slug!r} (agents: {', '.join(slugs) or 'none'})", EXIT_USAGE)
    reason = unserved_reason(asyncio.run(live_status(settings)), slug)
    if reason is not None:
        fail(reason, EXIT_USAGE)


def _print_message(heading: str, content: str) -> None:
    """Print a heading, then the content as it is (no markup, no wrapping, its control characters but line
    feed and tab escaped: a person's or a model's words) and a line break."""
    out.print(Text(heading, style="bold cyan"))
    sys.stdout.flush()
    out.file.flush()
    sys.stdout.write(printable(content) + "\n")
    sys.stdout.flush()
