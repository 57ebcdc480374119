"""What open does before the store serves anything: finish what a crash interrupted, replay the
commit journal, read the index and check it against the folders on disk (by size, with ``stat``: a
log whose size disagrees is rescanned, its torn tail cut, its entry repaired). A log grown since the
index snapshot is read from the size the snapshot counted whatever the index log says, its event ids
filed again (``_Recovery.check_entry``); after a clean close there is none. Blocking file work: runs in
a worker thread.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import structlog

from tenex_daemon.adapters.storage.atomic import Stamp, temp_of
from tenex_daemon.adapters.storage.filesystem.folder import scan_folder
from tenex_daemon.adapters.storage.filesystem.index import IndexEntry, IndexRead, read_index
from tenex_daemon.adapters.storage.filesystem.journal_replay import Replayed, replay
from tenex_daemon.adapters.storage.filesystem.layout import (
    ARCHIVE_DIR,
    DELETED_FOLDER_PREFIX,
    LOG_NAME,
    STATE_NAME,
    TEMP_FOLDER_PREFIX,
    Layout,
)
from tenex_daemon.adapters.storage.filesystem.logfile import ends_a_line
from tenex_daemon.adapters.storage.filesystem.processed import absent_buckets
from tenex_daemon.adapters.storage.filesystem.repairs import RecoveryAction, move_to_corrupt

log = structlog.get_logger(__name__)


@dataclass
class Recovered:
    """What open found, once repaired."""

    index: IndexRead
    """The index, checked against the folders."""
    actions: list[RecoveryAction]
    rebuilt_ids: dict[str, list[str]]
    """Event ids of the logs rescanned, by conversation: their bucket lines are queued again."""
    absent_buckets: set[str]
    """Event-id buckets with no file yet: known empty without reading anything."""
    journal: Replayed
    """What replaying a journal left behind did (its files are deleted after open's compaction)."""
    has_snapshot: bool
    """Whether the index has a snapshot (a new home gets one at once, so that a crash before
    the first derived write still finds an index)."""


def _stamp_of(path: Path) -> Stamp:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return (-1, -1)
    return (st.st_size, st.st_mtime_ns)


class _Recovery:
    """One open's checks of the index against the folders, and what they repaired."""

    def __init__(
        self, layout: Layout, actions: list[RecoveryAction], touched: set[str],
        synced: dict[str, tuple[int, int]],
    ) -> None:
        self.layout = layout
        self.actions = actions
        self.touched = touched
        """Conversations the journal replay appended to: rescanned whole."""
        self.synced = synced
        """What the index snapshot counted of each log (:attr:`IndexRead.synced`)."""
        self.rebuilt: dict[str, list[str]] = {}
        self.rescanned = 0
        """Logs grown since the index snapshot, in agreement with the index log, read again all the same."""

    def drop_missing(self, entries: dict[str, IndexEntry], on_disk: dict[str, bool]) -> None:
        """Entries whose folder is gone are removed."""
        for conversation_id in [cid for cid in entries if cid not in on_disk]:
            del entries[conversation_id]
            self.actions.append(RecoveryAction(
                "index_entry_removed", conversation_id, "indexed conversation has no files"
            ))
            log.warning("index_entry_removed", conversation_id=conversation_id)

    def add_entry(self, conversation_id: str, archived: bool, *, index_ok: bool) -> IndexEntry:
        """A folder the index lacks is scanned whole into a new entry."""
        folder = self.layout.folder(conversation_id, archived)
        scanned = scan_folder(folder, conversation_id, self.layout.corrupt_dir, parse_events=False)
        entry = IndexEntry(id=conversation_id)
        entry.absorb(scanned, archived, full=True)
        self.rebuilt[conversation_id] = scanned.event_ids
        self.actions.extend(scanned.actions)
        if index_ok:
            self.actions.append(RecoveryAction(
                "index_entry_added", conversation_id, "conversation missing from the index"
            ))
            log.warning("index_entry_added", conversation_id=conversation_id)
        return entry

    def check_entry(self, entry: IndexEntry, archived: bool) -> None:
        """An entry whose files disagree with it (or that the journal appended to) is rescanned and
        repaired. So is, quietly, a log grown since the index snapshot whose size agrees with the index
        log's records: those records, like the bucket lines of the events they count, were written and
        never fsynced, and a power loss may have kept a record but lost its event's bucket line (the
        event would not be known as processed, and a relay's copy of it would be stored again). The
        rescan reads the log past the size the snapshot counted (whose bucket lines were fsynced before
        it) when a line ends there, else whole; the ids it finds are queued for their buckets again."""
        conversation_id = entry.id
        folder = self.layout.folder(conversation_id, archived)
        log_size = _stamp_of(folder / LOG_NAME)[0]
        state_stamp = _stamp_of(folder / STATE_NAME)
        replayed = conversation_id in self.touched
        agrees = (
            log_size == entry.log_size and state_stamp == entry.state_stamp and entry.archived == archived
            and not replayed
        )
        synced_size, synced_count = self.synced.get(conversation_id, (0, 0))
        if agrees and log_size == synced_size:
            return
        partial = (
            not replayed  # its older bucket lines may be lost too
            and 0 < synced_size < log_size
            and ends_a_line(folder / LOG_NAME, synced_size)
        )
        scanned = scan_folder(
            folder, conversation_id, self.layout.corrupt_dir, parse_events=False,
            start=synced_size if partial else 0,
        )
        indexed = entry.log_size
        if scanned.start > 0:
            entry.event_count = synced_count  # the scanned tail's events are counted on top
        entry.absorb(scanned, archived, full=scanned.start == 0)
        self.rebuilt[conversation_id] = scanned.event_ids
        self.actions.extend(scanned.actions)
        if agrees:
            self.rescanned += 1  # not a repair: nothing disagreed
            return
        detail = f"log {log_size} bytes (indexed {indexed}), state {state_stamp}"
        self.actions.append(RecoveryAction("index_entry_repaired", conversation_id, detail))
        if log_size < 0:  # every folder is made with its log: its history is gone, not something a crash does
            missing = f"{folder / LOG_NAME} is missing: the conversation's history is lost"
            self.actions.append(RecoveryAction("event_log_missing", conversation_id, missing))
            log.error("event_log_missing", conversation_id=conversation_id, detail=missing)
        else:
            level = log.warning if log_size < indexed else log.info  # shorter: something was cut
            level("index_entry_repaired", conversation_id=conversation_id, detail=detail)


def _sweep_leftovers(layout: Layout, actions: list[RecoveryAction]) -> None:
    """Half-made creations go to corrupt/; half-finished deletions are finished; a small value's temp
    file that was never renamed (a kill while it was written) is removed: the value it held is in
    its file or in the journal replayed next."""
    for temp in layout.meta_dir.glob("*.tmp"):
        temp.unlink(missing_ok=True)
    for parent in (layout.root, layout.root / ARCHIVE_DIR):
        for item in os.scandir(parent):
            if item.name.startswith(TEMP_FOLDER_PREFIX):
                moved = move_to_corrupt(layout.corrupt_dir, Path(item.path), item.name.lstrip("."))
                actions.append(RecoveryAction(
                    "moved_to_corrupt", None, f"unfinished creation moved to {moved.name}"
                ))
            elif item.name.startswith(DELETED_FOLDER_PREFIX):
                shutil.rmtree(item.path, ignore_errors=True)


def _remove_staged_state(folder: Path) -> None:
    """Remove a state snapshot's temp file that was never renamed (a kill while it was written): the
    snapshot it held is in the folder's state file or in the journal replayed before this."""
    with contextlib.suppress(OSError):  # none, or a folder that cannot be read: the scan says which
        os.unlink(temp_of(folder / STATE_NAME))


def recover(layout: Layout) -> Recovered:
    """Repair the home and return its index (the caller holds the home's lock)."""
    layout.make_folders()
    actions: list[RecoveryAction] = []
    _sweep_leftovers(layout, actions)
    # batch's journal first: the logs it completes are then checked like any other
    replayed = replay(layout.root, layout.corrupt_dir)
    actions.extend(replayed.actions)
    index = read_index(layout, actions)
    on_disk = layout.list_folders()
    index_ok = index.readable
    if not index_ok and not on_disk and not actions:
        index_ok = True  # a new, empty home
    elif not index_ok:
        actions.append(RecoveryAction("index_rebuilt", None, "index missing or unreadable"))
        log.warning("index_rebuilding", path=str(layout.root), conversations=len(on_disk))
    recovery = _Recovery(layout, actions, replayed.touched, index.synced)
    recovery.drop_missing(index.entries, on_disk)
    for conversation_id, archived in on_disk.items():
        _remove_staged_state(layout.folder(conversation_id, archived))
        entry = index.entries.get(conversation_id)
        if entry is None:
            index.entries[conversation_id] = recovery.add_entry(conversation_id, archived, index_ok=index_ok)
        else:
            recovery.check_entry(entry, archived)
    if recovery.rescanned:
        log.info("index_logs_rescanned", conversations=recovery.rescanned, why="grown since the snapshot")
    return Recovered(
        index, actions, recovery.rebuilt, absent_buckets(layout.events_dir), replayed,
        layout.snapshot.exists(),
    )
