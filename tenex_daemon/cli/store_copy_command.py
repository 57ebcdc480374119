"""``tenexd migrate --from-store PATH``: a filesystem store copied into the home's configured store
(:mod:`tenex_daemon.app.store_copy`), with the daemon stopped."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from tenex_daemon.cli.invocation import run_async
from tenex_daemon.cli.output import EXIT_FAILURE, EXIT_USAGE, fail, out, print_json
from tenex_daemon.cli.references import AccessError

if TYPE_CHECKING:
    from tenex_daemon.app.settings import Settings
    from tenex_daemon.app.store_copy import CopyReport
    from tenex_daemon.core.ports import Store


def migrate_store(settings: Settings, source: Path, as_json: bool) -> None:
    """Copy the filesystem store of ``source`` (a home, or a ``storage.path``: the folder holding its
    ``conversations/``) into the store the settings name; exit 2 when there is none there or it is that
    same store, 1 when a conversation could not be read (the others are copied)."""
    from tenex_daemon.app.settings import StorageKind

    if not (source / "conversations").is_dir():
        fail(f"no filesystem store at {source} (it has no conversations/ folder)", EXIT_USAGE)
    storage = settings.storage
    target_home = Path(storage.path) if storage.path else settings.home
    if storage.kind is StorageKind.FILESYSTEM and target_home.resolve() == source.resolve():
        fail(f"{source} is the store config.toml names already: set storage.kind or storage.path first",
             EXIT_USAGE)
    if storage.kind is StorageKind.MEMORY:
        fail("storage.kind is memory: a copy into it would be lost at once", EXIT_USAGE)
    report = run_async(_copy(settings, source))
    if as_json:
        print_json(_report_json(report))
    else:
        renamed = "".join(f"; {old} now under {new}" for old, new in report.renamed.items())
        out.print(
            f"copied {report.conversations} conversation(s) ({report.archived} archived, {report.events} "
            f"events), {report.processed} other processed event id(s) and {report.values} small value(s) "
            f"from {source}{renamed}"
        )
        for conversation_id in report.unreadable:
            out.print(f"not copied (unreadable, left in {source}): {conversation_id}")
    raise typer.Exit(EXIT_FAILURE if report.unreadable else 0)


async def _copy(settings: Settings, source: Path) -> CopyReport:
    from tenex_daemon.adapters.storage.filesystem import StoreLockedError
    from tenex_daemon.app.daemon import SUBSCRIPTION_ID
    from tenex_daemon.app.home import load_project_pubkey
    from tenex_daemon.app.settings import StorageKind
    from tenex_daemon.app.store_check import (
        COPY_KEY,
        StoreOfAnotherProjectError,
        copying_mark,
        refuse_another_projects,
        used_before,
    )
    from tenex_daemon.app.store_copy import copy_store, shared_keys

    target = await open_stopped_store(settings)
    try:
        renames: dict[str, str] = {}
        project = load_project_pubkey(settings)
        if project is None:
            raise AccessError(f"this home has no project key ({settings.project_key_path})", 400)
        try:
            await refuse_another_projects(target, project)  # never into another project's store
        except StoreOfAnotherProjectError as exc:
            raise AccessError(str(exc), 400) from None
        if settings.storage.kind is StorageKind.POSTGRES:  # the old daemon's own values: for another to take
            renames = shared_keys(project)
        taking_up = await target.get_meta(COPY_KEY) == copying_mark(source)  # a copy cut short, again
        if not taking_up and await used_before(settings, target, SUBSCRIPTION_ID):
            raise AccessError(
                "the store config.toml names was used already (it holds conversations or relay cursors): "
                "a copy goes into an unused store only", 400,
            )
        try:
            return await copy_store(
                source, target, renames=renames, target_name=_named(settings), project=project
            )
        except StoreLockedError as exc:
            raise AccessError(f"{exc} (stop the daemon running on {source} first)", 503) from None
    finally:
        await target.close()


def reopen_store(settings: Settings, as_json: bool = False) -> None:
    """Let a daemon of this home start on the store the settings name: lift the mark ``--from-store`` left
    on it when it copied it into another, and make it this home's project key's when another key's mark
    is on it (the project key made anew); exit 2 when there is neither."""
    from tenex_daemon.app.home import load_project_pubkey
    from tenex_daemon.app.store_check import COPIED_AWAY, COPIED_AWAY_KEY, PROJECT_MARK_KEY, reopened
    project = load_project_pubkey(settings)

    async def go() -> tuple[str | None, str | None]:
        store = await open_stopped_store(settings)
        try:
            mark = await store.get_meta(COPIED_AWAY_KEY)
            copied = mark if mark is not None and mark.startswith(COPIED_AWAY) else None
            owner = await store.get_meta(PROJECT_MARK_KEY)
            other = owner if project is not None and owner is not None and owner != project else None
            if other is not None and await _served_now(store, other):
                raise AccessError(  # refused before anything is written: the store stays as it was
                    f"daemons of the project {other[:16]}… run on this store now: it is theirs, not a key "
                    "of this home made anew (give this project a database of its own)", 409,
                )
            if copied is not None:
                await store.set_meta(COPIED_AWAY_KEY, reopened(copied))
            if other is not None and project is not None:  # a project key made anew: the store is its now
                await store.set_meta(PROJECT_MARK_KEY, project)
            return copied, other
        finally:
            await store.close()

    copied, other = run_async(go())
    if copied is None and other is None:
        fail("the store config.toml names was neither copied into another nor another project key's: "
             "nothing to reopen", EXIT_USAGE)
    if as_json:
        print_json({"reopened": True, "copied": copied, "previous_project": other})
    else:
        if copied is not None:
            out.print(f"reopened: a daemon starts on this store again (it was copied {copied}; what the "
                      "copy gained since is not in it)")
        if other is not None:
            out.print(f"reopened: the store is this home's project key's now (it was {other[:16]}…'s)")
    raise typer.Exit(0)


async def open_stopped_store(settings: Settings) -> Store:
    """The store the settings name, open, for a migration: refused (503) while the home's daemon runs, on a
    database it shares too (no lock tells it there: its control API does)."""
    from tenex_daemon.adapters.storage.filesystem import StoreLockedError
    from tenex_daemon.app.wiring import build_store
    from tenex_daemon.cli.client import live_status

    if await live_status(settings) is not None:
        raise AccessError("the daemon is running (stop the daemon before migrating)", 503)
    store = build_store(settings)
    try:
        await store.open()
    except StoreLockedError as exc:
        raise AccessError(f"{exc} (stop the daemon before migrating)", 503) from None
    return store


async def _served_now(store: Store, project: str) -> bool:
    """Whether daemons of ``project`` run on ``store`` now (a database they share: they hear its stops)."""
    from tenex_daemon.core.ports import PeerMessages
    from tenex_daemon.services.stopping import stop_channel

    return isinstance(store, PeerMessages) and await store.hearers(stop_channel(project)) > 0


def _named(settings: Settings) -> str:
    """The store the settings name, as the old store's mark says it (a database by its kind only: its DSN
    may hold a password)."""
    from tenex_daemon.app.settings import StorageKind

    storage = settings.storage
    if storage.kind is StorageKind.POSTGRES:
        return "a PostgreSQL database (storage.kind = postgres)"
    return f"the filesystem store at {Path(storage.path).resolve() if storage.path else settings.home}"


def _report_json(report: CopyReport) -> dict[str, Any]:
    return {
        "conversations": report.conversations, "archived": report.archived, "events": report.events,
        "processed": report.processed, "values": report.values, "renamed": dict(report.renamed),
        "unreadable": list(report.unreadable),
    }
