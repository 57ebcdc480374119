"""Copy a filesystem store into the home's configured store (``tenexd migrate --from-store``): what an
operator needs when switching ``storage.kind`` to PostgreSQL (docs/ARCHITECTURE.md, "Scale-out"), or moving
``storage.path``, without answering again what the old store answered.

Everything is copied: each conversation (its history, its state, archived or not), every event id processed
(those of deleted conversations and refused events too: they stay answered), and every small value (the
relays' cursors, channels, delegation threads, the run journal, the outbox). In a store daemons share, the
values of one daemon's own (its run journal, its outbox and their gift wraps) go under the keys of a
daemon of the project without an instance name: the first daemon that starts on the database takes them
over as a dead daemon's (its runs are redone, its outbox published); the old daemon's watchdog value is
left out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import structlog

from tenex_daemon.adapters.nostr.private import WRAPS_KEY
from tenex_daemon.adapters.storage.filesystem import FileSystemStore
from tenex_daemon.adapters.storage.filesystem.contents import processed_ids, value_keys
from tenex_daemon.adapters.storage.filesystem.layout import Layout
from tenex_daemon.app.store_check import (
    COPIED_AWAY,
    COPIED_AWAY_KEY,
    COPY_KEY,
    COPYING,
    PROJECT_MARK_KEY,
    claim_for_project,
    copying_mark,
)
from tenex_daemon.app.watchdog import WATCHDOG_KEY
from tenex_daemon.app.wiring import instance_keys, wraps_key_for
from tenex_daemon.core.errors import ConversationExistsError, TenexError
from tenex_daemon.core.ports import Store
from tenex_daemon.core.search import SearchQuery
from tenex_daemon.services.outbox import OUTBOX_KEY
from tenex_daemon.services.runs import PENDING_RUNS_KEY

log = structlog.get_logger(__name__)


class StoreCopyError(TenexError):
    """The copy cannot be made (the target holds conversations already, the source is the target)."""


@dataclass
class CopyReport:
    """What a copy did."""

    conversations: int = 0
    archived: int = 0
    events: int = 0
    """Events of the conversations copied."""
    processed: int = 0
    """Event ids processed that no copied conversation holds (deleted conversations', refused events', events
    the source salvaged out of a damaged log)."""
    values: int = 0
    renamed: dict[str, str] = field(default_factory=dict)
    """Values of the old daemon's own, copied under another key (a store daemons share): old -> new."""
    unreadable: list[str] = field(default_factory=list)
    """Conversations the source could not read (left there; the copy goes on)."""
    present: int = 0
    """Conversations a copy cut short had copied already (taken up again: they count in ``conversations``)."""


def shared_keys(project_pubkey: str) -> dict[str, str]:
    """The keys the old daemon's own values take in a store daemons share: those of a daemon of the project
    without an instance name, which the first daemon to start takes over."""
    journal, outbox = instance_keys(project_pubkey, None)
    return {PENDING_RUNS_KEY: journal, OUTBOX_KEY: outbox, WRAPS_KEY: wraps_key_for(outbox)}


async def copy_store(
    source_home: Path,
    target: Store,
    *,
    renames: dict[str, str] | None = None,
    progress: Callable[[int, int], None] | None = None,
    target_name: str = "another store",
    project: str | None = None,
) -> CopyReport:
    """Copy the filesystem store of ``source_home`` (the folder holding its ``conversations/``) into
    ``target`` (open, holding no conversation). ``renames``: keys whose values go under another key
    (:func:`shared_keys` for a store daemons share). ``progress(done, total)`` is told after each
    conversation. The source is opened (its lock taken: no daemon may run on it) and closed once first,
    so its files say everything (:mod:`~tenex_daemon.adapters.storage.filesystem.contents`). Once the copy
    is whole, the source is marked copied away (:data:`COPIED_AWAY_KEY`, into ``target_name``). Given
    ``project`` (this home's project key), a source another project marked (:data:`PROJECT_MARK_KEY`, a
    ``storage.path`` of its) is refused, and the target is marked this project's once every check passed."""
    copying = copying_mark(source_home)
    mark = await target.get_meta(COPY_KEY)
    resuming = mark == copying
    if mark is not None and not resuming:
        raise StoreCopyError(f"the store config.toml names was made by a copy already ({mark})")
    if not resuming and await target.search(SearchQuery(limit=1)):
        raise StoreCopyError(
            "the store config.toml names holds conversations already: a copy goes into an unused store only"
        )
    source = FileSystemStore(source_home, fsync="batch")
    # first, before the target is marked: a source refused (a daemon on it, a newer tenexd's) leaves the
    # target as it was, unmarked; opening replays a journal a crash left
    await source.open()
    try:
        away = await source.get_meta(COPIED_AWAY_KEY)
        owner = await source.get_meta(PROJECT_MARK_KEY)
    finally:
        await source.close()
    if project is not None and owner is not None and owner != project and not resuming:
        raise StoreCopyError(
            f"{source_home} serves another project (project key {owner[:16]}…, this home's is "
            f"{project[:16]}…): its conversations are not this project's to copy"
        )
    if away is not None and away.startswith(COPIED_AWAY) and not resuming:
        raise StoreCopyError(
            f"{source_home} was copied {away} already: the daemon has run on that copy since, and a copy of "
            "this old store would lack all it gained. Copy from that copy's folder instead, or run `tenexd "
            "migrate --reopen` with config.toml naming this old store first, to copy it as it is"
        )
    if project is not None:  # every check passed: the target is this project's now
        await claim_for_project(target, project)
    await target.set_meta(COPY_KEY, copying)
    layout = Layout(Path(source_home) / "conversations")
    report = CopyReport()
    copied: set[str] = set()
    """The ids of the events copied with their conversations."""
    await source.open()
    try:
        summaries = await source.search(SearchQuery())
        for done, summary in enumerate(summaries, start=1):
            conversation = await source.load(summary.id)
            if conversation is None:
                report.unreadable.append(summary.id)
                log.warning("store_copy_unreadable", conversation_id=summary.id)
            else:
                if conversation.upgraded:  # stored by an earlier tenexd: its end, recorded then, kept so
                    conversation.upgrade_saved()  # (the target's rows look up to date: no later pass would)
                try:
                    await target.create(conversation)
                except ConversationExistsError:
                    if not resuming:
                        raise
                    report.present += 1  # copied (whole: a create is one write) before the copy was cut short
                if conversation.archived:
                    await target.set_archived(conversation.id, True)
                    report.archived += 1
                copied.update(event.id for event in conversation.history)
                report.conversations += 1
                report.events += len(conversation.history)
            if progress is not None:
                progress(done, len(summaries))
        await _copy_values(source, target, layout, renames or {}, report)
    finally:
        await source.close()
    for event_id, _ in processed_ids(layout):
        # a copied event is processed with its conversation; every other id still counts, one of a copied
        # conversation too: an event the source salvaged out of a damaged log is answered there already
        if event_id not in copied:
            await target.mark_processed(event_id)
            report.processed += 1
    # the old store says so first: a daemon started on it again (settings switched back) would lack all
    # since; a crash before the target is marked copied leaves a copy cut short, finished by the command again
    source = FileSystemStore(source_home, fsync="batch")
    await source.open()
    try:
        when = datetime.now(UTC).isoformat(timespec="seconds")
        await source.set_meta(COPIED_AWAY_KEY, f"{COPIED_AWAY}{target_name}, {when}")
    finally:
        await source.close()
    await target.set_meta(COPY_KEY, "copied " + copying.removeprefix(COPYING))
    log.info(
        "store_copied", source=str(source_home), conversations=report.conversations, events=report.events,
        processed=report.processed, values=report.values, unreadable=len(report.unreadable),
    )
    return report


async def _copy_values(
    source: FileSystemStore, target: Store, layout: Layout, renames: dict[str, str], report: CopyReport
) -> None:
    """Copy every small value, under its own key unless ``renames`` names another; the old daemon's
    watchdog value is its own liveness probe, nothing to keep, and the marks of a copy that made the source,
    or of one made from it before, are not this copy's."""
    for key in value_keys(layout):
        if key in (WATCHDOG_KEY, COPY_KEY, COPIED_AWAY_KEY, PROJECT_MARK_KEY):
            continue
        value = await source.get_meta(key)
        if value is None:
            continue
        new_key = renames.get(key, key)
        if new_key != key:
            report.renamed[key] = new_key
        await target.set_meta(new_key, value)
        report.values += 1
    journal = renames.get(PENDING_RUNS_KEY)
    if report.renamed and journal is not None and PENDING_RUNS_KEY not in report.renamed:
        await target.set_meta(journal, "[]")  # daemons look for a dead one's run journal, then its outbox
