"""FileSystemStore: the conversation store on plain files (the package's doc describes the home)."""

from __future__ import annotations

import asyncio
import errno
import json
import os
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

import structlog

from tenex_daemon.adapters.storage.filesystem.committer import Committer
from tenex_daemon.adapters.storage.filesystem.derived import DerivedLines
from tenex_daemon.adapters.storage.filesystem.erasure import (
    SharedRounds,
    corrupt_copies,
    remove_leftovers,
    scan_owned_values,
    tombstone,
)
from tenex_daemon.adapters.storage.filesystem.folder import (
    delete_folder,
    keep_after_failed_delete,
    move_folder,
    scan_folder,
    state_snapshot,
)
from tenex_daemon.adapters.storage.filesystem.index import COMPACT_MIN_RECORDS, Index, IndexEntry
from tenex_daemon.adapters.storage.filesystem.journal import Journal
from tenex_daemon.adapters.storage.filesystem.journal_replay import discard
from tenex_daemon.adapters.storage.filesystem.layout import (
    LOG_NAME,
    STATE_NAME,
    Layout,
    check_event_id,
    check_id,
    meta_name,
)
from tenex_daemon.adapters.storage.filesystem.lock import StoreOpenError, lock_home, unlock_home
from tenex_daemon.adapters.storage.filesystem.logfile import encode_event
from tenex_daemon.adapters.storage.filesystem.ops import Op
from tenex_daemon.adapters.storage.filesystem.processed import DEFAULT_MAX_IDS, ProcessedIds, bucket_line
from tenex_daemon.adapters.storage.filesystem.recovery import recover
from tenex_daemon.adapters.storage.filesystem.repairs import RecoveryAction, move_to_corrupt
from tenex_daemon.adapters.storage.filesystem.store_format import check_store_format
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.erasure import value_owner
from tenex_daemon.core.errors import (
    ConversationArchivedError,
    ConversationExistsError,
    ConversationNotFoundError,
)
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.search import ConversationSummary, SearchQuery, apply_query, summary_matches

log = structlog.get_logger(__name__)

FsyncPolicy = Literal["always", "batch"]

DEFAULT_CACHE_SIZE = 256
DEFAULT_BATCH_DELAY = 0.0
DEFAULT_BUCKET_CACHE = 512
LOAD_ATTEMPTS = 5
"""Reads of a conversation folder before a load gives up on appends that keep landing."""


def _log_failed_deletion(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("delete_failed", error=str(task.exception()))


class FileSystemStore:
    """A :class:`~tenex_daemon.core.ports.Store` on plain files (see the package doc).

    ``path`` is the home folder; data lives in ``path/conversations``. ``fsync`` is ``"always"``
    (every file written is fsynced, with its folder, before the write returns) or ``"batch"``
    (group commit through the commit journal: the writes waiting while a commit is in flight, plus
    up to ``batch_delay`` seconds, share one fsync of the journal; the daemon's default).
    ``cache_size`` bounds the conversations kept loaded in memory; ``bucket_cache_size`` and
    ``max_loaded_ids`` the processed set's buckets and ids kept loaded (``processed.py``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fsync: FsyncPolicy = "always",
        batch_delay: float = DEFAULT_BATCH_DELAY,
        cache_size: int = DEFAULT_CACHE_SIZE,
        bucket_cache_size: int = DEFAULT_BUCKET_CACHE,
        max_loaded_ids: int = DEFAULT_MAX_IDS,
    ) -> None:
        if fsync not in ("always", "batch"):
            raise ValueError(f"fsync policy must be 'always' or 'batch', not {fsync!r}")
        if cache_size < 1:
            raise ValueError("cache_size must be at least 1")
        self.home = Path(path)
        self.root = self.home / "conversations"
        self.fsync: FsyncPolicy = fsync
        self.batch_delay = batch_delay
        self.cache_size = cache_size
        self.bucket_cache_size = bucket_cache_size
        self.recovery: list[RecoveryAction] = []
        """What the last :meth:`open` (and later loads) repaired on their own."""
        self._layout = Layout(self.root)
        self._derived = DerivedLines()
        self._index = Index(self._layout, self._derived)
        self._processed = ProcessedIds(
            self._layout.events_dir, self._derived, bucket_cache_size, max_loaded_ids
        )
        self._committer = Committer(batched=fsync == "batch", batch_delay=batch_delay)
        self._cache: OrderedDict[str, Conversation] = OrderedDict()
        self._live_paths: dict[str, tuple[Path, Path]] = {}
        self._meta_paths: dict[str, Path] = {}
        self._meta_files: set[str] = set()
        """The names of the small values' files that may exist or be held (listed at open, added to by each
        save): a value never saved is answered without the disk (every new root asks for one)."""
        self._owned_values: dict[str, set[str]] = {}
        """Conversation id -> keys of the small values that belong to it (its delegation threads):
        those set since open, and (once a deletion needed them) those found on disk."""
        self._owned_values_scanned = False
        self._erasure = SharedRounds(self._rewrite_after_deletions)
        self._lock_fd: int | None = None
        self._opened = False

    @property
    def corrupt_dir(self) -> Path:
        """Where unreadable files are moved (never deleted)."""
        return self._layout.corrupt_dir

    def _paths(self, conversation_id: str) -> tuple[Path, Path]:
        """The live (not archived) log's and snapshot's paths, remembered: appends never build
        paths anew (and the commit finds them by their cached hashes)."""
        paths = self._live_paths.get(conversation_id)
        if paths is None:
            if len(self._live_paths) >= 4 * self.cache_size:
                self._live_paths.clear()
            folder = self._layout.folder(conversation_id, False)
            paths = self._live_paths[conversation_id] = (folder / LOG_NAME, folder / STATE_NAME)
        return paths

    def _meta_path(self, key: str) -> Path:
        """A meta value's path, remembered (the run journal's key is written at every reply)."""
        path = self._meta_paths.get(key)
        if path is None:
            if len(self._meta_paths) >= 1024:
                self._meta_paths.clear()
            path = self._meta_paths[key] = self._layout.meta_path(key)
        return path

    # --- open / close --------------------------------------------------------------------------

    def _not_this_users(self, exc: PermissionError) -> StoreOpenError:
        where = exc.filename if exc.filename else self.root
        return StoreOpenError(
            f"cannot open the conversation store in {self.root}: {where} cannot be read or written by this "
            "user (check its owner and mode)"
        )

    async def open(self) -> None:
        """Take the home's lock, read the index (never the logs), check it and repair it."""
        if self._opened:
            return
        try:
            self._lock_fd = await asyncio.to_thread(lock_home, self.root)
        except PermissionError as exc:  # its lock file (a home restored as another user's, say)
            raise self._not_this_users(exc) from exc
        except (NotADirectoryError, FileExistsError) as exc:  # storage.path naming a file, or a file in it
            raise StoreOpenError(
                f"cannot open the conversation store in {self.root}: that folder, or one above it, is a file "
                "(check storage.path)"
            ) from exc
        try:
            await asyncio.to_thread(check_store_format, self.root)  # a newer tenexd's store is not recovered
            result = await asyncio.to_thread(recover, self._layout)
        except PermissionError as exc:  # a file or folder of the home this process may not read
            await asyncio.to_thread(self._unlock)
            raise self._not_this_users(exc) from exc
        except BaseException:
            await asyncio.to_thread(self._unlock)
            raise
        self._index.reset(result.index)
        self._meta_files = set(await asyncio.to_thread(os.listdir, self._layout.meta_dir))
        self._owned_values.clear()  # another process may have written small values while closed
        self._owned_values_scanned = False
        self.recovery = result.actions
        self._processed.reset(result.absent_buckets)
        for conversation_id, ids in result.rebuilt_ids.items():
            for event_id in ids:
                self._processed.add(event_id, conversation_id)
        self._derived.closing = False
        self._committer.reset()
        self._opened = True
        if self.fsync == "batch":
            journal = Journal(self.root)
            journal.generation = result.journal.next_generation
            await self._committer.start(journal)
        if (
            result.actions or result.index.records > COMPACT_MIN_RECORDS or not result.has_snapshot
            or result.journal.files or result.rebuilt_ids
        ):
            await self._index.compact()  # fsyncs the rescans' derived data before the replayed journal goes
        if result.journal.files:
            await asyncio.to_thread(discard, result.journal.files)
        log.info(
            "store_opened", path=str(self.root), conversations=len(self._index.entries),
            repairs=len(result.actions),
        )

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            unlock_home(self._lock_fd)
            self._lock_fd = None

    async def close(self) -> None:
        """Finish pending commits, write the index snapshot, release the lock. Safe to call twice."""
        if not self._opened:
            return
        self._derived.closing = True
        await self._committer.stop()
        await self._index.wait_compacted()
        await self._index.compact()
        await self._derived.stop()
        await asyncio.to_thread(self._unlock)
        self._cache.clear()
        self._processed.clear()
        self._opened = False
        log.info("store_closed", path=str(self.root))

    # --- conversations -------------------------------------------------------------------------

    def _require_open(self) -> None:
        if not self._opened:
            raise RuntimeError("FileSystemStore is not open; call open() first")

    def _cache_put(self, conversation: Conversation) -> None:
        self._cache[conversation.id] = conversation
        self._cache.move_to_end(conversation.id)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    async def create(self, conversation: Conversation) -> None:
        """Store a new conversation: both files are written in a temp folder renamed into place."""
        self._require_open()
        check_id(conversation.id)
        if conversation.id in self._index.entries:
            raise ConversationExistsError(conversation.id)
        log_data = b"".join(encode_event(event) for event in conversation.history)
        data, state = state_snapshot(conversation, conversation.archived)
        op = Op("create", self._layout.folder(conversation.id, conversation.archived), log_data, extra=data)
        await self._committer.commit([op])
        assert op.result is not None
        entry = IndexEntry(id=conversation.id)
        entry.apply_state(state, conversation.archived)
        entry.event_count = len(conversation.history)
        entry.participants = conversation.participants()
        entry.log_size = len(log_data)
        entry.state_stamp = op.result
        self._index.entries[conversation.id] = entry
        self._index.put(entry)
        for event in conversation.history:
            self._processed.add(event.id, conversation.id)
        self._cache_put(conversation)

    async def load(self, conversation_id: str) -> Conversation | None:
        """Return the conversation (the cached live object when loaded), or None.

        A first load reads the snapshot and the log, moving unreadable files to ``corrupt/``. The log
        is read up to its last complete line: a tail without its newline may be a line being appended
        that moment (never cut here: open cuts the torn tails a crash left).
        """
        self._require_open()
        cached = self._cache.get(conversation_id)
        if cached is not None:
            self._cache.move_to_end(conversation_id)
            return cached
        entry = self._index.entries.get(conversation_id)
        if entry is None:
            return None
        await self._committer.write_unwritten(conversation_id)  # its log must hold every line counted
        for _ in range(LOAD_ATTEMPTS):
            folder = self._layout.folder(conversation_id, entry.archived)
            try:
                scanned = await asyncio.to_thread(
                    scan_folder, folder, conversation_id, self.corrupt_dir, parse_events=True, live=True
                )
            except FileNotFoundError:
                log.error("conversation_files_missing", conversation_id=conversation_id)
                return None
            # a racing load may have filled the cache while this one read the disk
            cached = self._cache.get(conversation_id)
            if cached is not None:
                return cached
            if scanned.actions or scanned.log_size >= entry.log_size:
                break
            # an append was acknowledged after its line was read past: read the folder again
        else:
            raise OSError(errno.EAGAIN, f"conversation {conversation_id} kept changing while it was read")
        self.recovery.extend(scanned.actions)
        conversation = Conversation.from_state(scanned.state, scanned.events)
        conversation.archived = entry.archived
        if scanned.actions:
            entry.absorb(scanned, entry.archived, full=True)
            self._index.put(entry)
            for event in scanned.events:
                self._processed.add(event.id, conversation_id)
        self._cache_put(conversation)
        return conversation

    def _entry_required(self, conversation_id: str) -> IndexEntry:
        self._require_open()
        entry = self._index.entries.get(conversation_id)
        if entry is None:
            raise ConversationNotFoundError(conversation_id)
        return entry

    def _writable_entry(self, conversation_id: str) -> IndexEntry:
        entry = self._entry_required(conversation_id)
        if entry.archived:
            raise ConversationArchivedError(conversation_id)
        return entry

    async def append_event(
        self, conversation_id: str, event: NostrEvent, *, state: Conversation | None = None
    ) -> bool:
        """Append one event line to the conversation's log; durable when this returns True.

        With ``state``, the conversation's snapshot is replaced in the same commit (one group
        commit with ``batch``; with ``always`` the log line is made durable first, then the
        snapshot). A duplicate event id changes nothing (False). An archived conversation is read-only.
        A line made durable whose snapshot could not be (a full disk) counts all the same (True, logged):
        raising would have the caller store the event again. So does, with ``batch``, a line journaled
        whose log could not take it (a full disk): it waits in the journal for room (``group_commit.py``).
        """
        entry = self._writable_entry(conversation_id)
        if await self._processed.contains(event.id):
            return False
        line = encode_event(event)
        if self._index.entries.get(conversation_id) is not entry:  # deleted while the bucket was read
            raise ConversationNotFoundError(conversation_id)
        log_path, state_path = self._paths(conversation_id)  # live ones: archived is refused above
        ops = [Op("append", log_path, line)]
        snapshot: dict[str, Any] = {}
        if state is not None:
            data, snapshot = state_snapshot(state, entry.archived, event)
            ops.append(Op("replace", state_path, data, after=ops[0]))
        state_saved = state is not None
        try:
            await self._committer.commit(ops)
        except BaseException as exc:
            if state is not None:
                self._cache.pop(conversation_id, None)
            if state is None or exc is not ops[1].error or ops[0].error is not None:
                raise
            # the line is durable, its state is not (a full disk): the event counts, or a retry would
            # store it a second time; the snapshot on disk stays the one before (its next save catches up)
            log.error("state_not_saved_with_event", conversation_id=conversation_id, event_id=event.id,
                      error=str(exc))
            state_saved = False
        entry.event_count += 1
        entry.log_size += len(line)
        new_participant = event.pubkey not in entry.participants
        entry.participants.add(event.pubkey)
        self._processed.add(event.id, conversation_id)
        self._index.counted(conversation_id, entry, event.pubkey if new_participant else None)
        if state is not None:
            if state_saved:
                self._state_saved(state, snapshot, entry, ops[1])
            state.append(event)
        cached = self._cache.get(conversation_id)
        if cached is not None:
            cached.append(event)
        return True

    async def append_events(self, conversation_id: str, events: Iterable[NostrEvent]) -> None:
        """Append several events with one durable write (imports, bulk loads)."""
        entry = self._writable_entry(conversation_id)
        fresh: list[NostrEvent] = []
        seen: set[str] = set()
        for event in events:
            if event.id not in seen and not await self._processed.contains(event.id):
                fresh.append(event)
                seen.add(event.id)
        if not fresh:
            return
        data = b"".join(encode_event(event) for event in fresh)
        if self._index.entries.get(conversation_id) is not entry:  # deleted while buckets were read
            raise ConversationNotFoundError(conversation_id)
        await self._committer.commit([Op("append", self._paths(conversation_id)[0], data)])
        entry.event_count += len(fresh)
        entry.log_size += len(data)
        added = {e.pubkey for e in fresh} - entry.participants
        entry.participants |= added
        self._index.note_participants(conversation_id, added)
        cached = self._cache.get(conversation_id)
        for event in fresh:
            self._processed.add(event.id, conversation_id)
            if cached is not None:
                cached.append(event)
        self._index.record({
            "op": "ev", "id": conversation_id, "n": entry.event_count, "s": entry.log_size,
            "p": sorted(added),
        })

    async def save_state(self, conversation: Conversation) -> None:
        """Atomically replace the conversation's snapshot (temp file, fsync, rename, fsync folder)."""
        entry = self._entry_required(conversation.id)
        data, state = state_snapshot(conversation, entry.archived)
        op = Op("replace", self._layout.folder(conversation.id, entry.archived) / STATE_NAME, data)
        try:
            await self._committer.commit([op])
        except BaseException:
            self._cache.pop(conversation.id, None)
            raise
        self._state_saved(conversation, state, entry, op)

    def _state_saved(
        self, conversation: Conversation, state: dict[str, Any], entry: IndexEntry, op: Op
    ) -> None:
        """Bookkeeping once a snapshot replacement is durable: index row (from ``state``, the snapshot
        written), stamp, cache."""
        entry.apply_state(state, entry.archived)
        assert op.result is not None
        entry.state_stamp = op.result
        self._index.put(entry)
        conversation.archived = entry.archived
        self._cache_put(conversation)

    async def set_archived(self, conversation_id: str, archived: bool) -> None:
        """Move the conversation's folder into ``archive/`` (or back); rename is atomic."""
        entry = self._entry_required(conversation_id)
        if entry.archived != archived:
            source = self._layout.folder(conversation_id, entry.archived)
            target = self._layout.folder(conversation_id, archived)
            await asyncio.to_thread(move_folder, source, target)
            entry.archived = archived
            self._index.put(entry)
        cached = self._cache.get(conversation_id)
        if cached is not None:
            cached.archived = archived

    async def delete(self, conversation_id: str) -> bool:
        """Remove a conversation's files and erase everything else of it in the home: the small values
        that belong to it (:mod:`~tenex_daemon.core.erasure`), its copies in ``corrupt/``, its index
        rows (a compaction rewrites the index) and, with ``batch``, the journal that recorded its
        writes (a checkpoint renews it). Its event ids stay processed (the buckets hold ids only)."""
        self._require_open()
        entry = self._index.entries.get(conversation_id)
        if entry is None:
            return False
        folder = self._layout.folder(conversation_id, entry.archived)
        del self._index.entries[conversation_id]  # from now on appends to it are refused
        try:
            values = await self._values_of(conversation_id)
        except BaseException:
            self._index.entries[conversation_id] = entry
            raise
        # shielded: once the forget frame is queued, the deletion must finish even if the caller
        # is cancelled (a committed forget over a kept folder would drop its journaled appends)
        deletion = asyncio.ensure_future(self._delete_files(conversation_id, folder, values))
        deletion.add_done_callback(_log_failed_deletion)
        try:
            await asyncio.shield(deletion)
        except asyncio.CancelledError:
            raise  # the deletion goes on; a folder it leaves behind is re-indexed on open
        except BaseException:
            if await asyncio.to_thread(keep_after_failed_delete, folder):
                self._index.entries[conversation_id] = entry
                self._owned_values.setdefault(conversation_id, set()).update(values)
            raise
        self._cache.pop(conversation_id, None)
        self._index.record({"op": "del", "id": conversation_id})
        # shielded too: the traces are erased even when the caller stops waiting
        await asyncio.shield(asyncio.ensure_future(self._erase_traces(conversation_id, values)))
        return True

    async def _values_of(self, conversation_id: str) -> set[str]:
        """The keys of the small values that belong to the conversation (forgotten here: it is being
        deleted). The first call reads every small value's key once."""
        if not self._owned_values_scanned:
            found = await asyncio.to_thread(scan_owned_values, self._layout.meta_dir)
            for owner, keys in found.items():
                self._owned_values.setdefault(owner, set()).update(keys)
            self._owned_values_scanned = True
        return self._owned_values.pop(conversation_id, set())

    async def _delete_files(self, conversation_id: str, folder: Path, values: set[str]) -> None:
        ops = [Op("replace", self._meta_path(key), tombstone(key), erases=True) for key in sorted(values)]
        if self._committer.journal is not None:
            # batch: the journal must never replay this conversation's appends into a new one
            ops.append(Op("forget", folder, conversation_id.encode("utf-8")))
        if ops:
            await self._committer.commit(ops)
        await asyncio.to_thread(delete_folder, folder)

    async def _erase_traces(self, conversation_id: str, values: set[str]) -> None:
        """After a deletion: remove the tombstoned small values and the copies in ``corrupt/``, rewrite
        the index and checkpoint the journal (one rewrite and checkpoint for deletions made together).
        A failure is logged: the deletion stands, and the next compaction and checkpoint (at the latest
        the store's close) erase what is left."""
        try:
            erased = [self._meta_path(key) for key in values]
            leftovers = erased + await asyncio.to_thread(corrupt_copies, self.corrupt_dir, conversation_id)
            await asyncio.to_thread(remove_leftovers, leftovers)
            # and their names, each held in memory until a restart (unless saved again since)
            self._meta_files.difference_update(path.name for path in erased if not path.exists())
            await self._erasure.request()
        except Exception:
            log.exception("delete_traces_left", conversation_id=conversation_id)

    async def _rewrite_after_deletions(self) -> None:
        """A new index snapshot without the deleted conversations (every older index file removed), then
        a journal checkpoint (the journal file that recorded their writes is deleted)."""
        await self._index.compact()
        await self._committer.checkpoint()

    async def search(self, query: SearchQuery) -> list[ConversationSummary]:
        """Filter the in-memory index (no log is read), in the query's order.

        The entries read are the fewest of: the conversations of the participant who wrote in the
        fewest, and the ended ones (a search for ended conversations). The persona's search (the
        newest ended conversations, cut at a count) walks the ended ones newest first and stops at
        the count when they are the fewer: a home with one owner has the owner in every conversation.
        """
        self._require_open()
        wanted = (*query.participants, *([query.participant] if query.participant is not None else []))
        ended_only = query.ended is True
        if (
            ended_only and query.order == "ended" and query.limit is not None and query.limit >= 0
            and self._index.ended_count <= self._index.smallest_set(wanted)
        ):
            return self._newest_ended(query)
        entries = self._index.candidates(wanted, ended_only=ended_only)
        return apply_query([entry.summary() for entry in _matching(entries, query)], query)

    def _newest_ended(self, query: SearchQuery) -> list[ConversationSummary]:
        """The first ``query.limit`` rows of ended conversations matching it, newest end first."""
        rows: list[ConversationSummary] = []
        limit = query.limit or 0
        if limit < 1:
            return rows
        for entry in _matching(self._index.newest_ended(), query):
            row = entry.summary()
            if summary_matches(row, query):
                rows.append(row)
                if len(rows) >= limit:
                    break
        return rows

    async def phase_counts(self) -> dict[tuple[str, bool], int]:
        """Count conversations by (phase, archived) from the in-memory index."""
        self._require_open()
        return dict(Counter((entry.phase, entry.archived) for entry in self._index.entries.values()))

    async def find_event(self, event_id: str) -> tuple[str, NostrEvent] | None:
        """Return (conversation id, event) for a stored event id."""
        self._require_open()
        conversation_id = (await self._processed.table(event_id)).get(event_id)
        if not conversation_id:
            return None
        conversation = await self.load(conversation_id)
        if conversation is None:
            return None
        for event in conversation.history:
            if event.id == event_id:
                return conversation_id, event
        return None

    def __len__(self) -> int:
        return len(self._index.entries)

    # --- the processed set ---------------------------------------------------------------------

    async def is_processed(self, event_id: str) -> bool:
        """Return whether this event id was ever accepted or marked processed."""
        return await self._processed.contains(event_id)

    async def mark_processed(self, event_id: str) -> None:
        """Durably remember an event id handled without joining a conversation."""
        check_event_id(event_id)
        bucket = await self._processed.table(event_id)
        if event_id in bucket:
            return
        path = self._processed.path_of(event_id)
        await self._committer.commit([Op("append", path, bucket_line(event_id, ""), create=True)])
        self._processed.marked(event_id)

    # --- small values --------------------------------------------------------------------------

    async def get_meta(self, key: str) -> str | None:
        """Return the value stored under ``key``, if any."""
        self._require_open()
        if meta_name(key) not in self._meta_files:
            return None  # never saved (a saved one's name is there before it is held or written)
        path = self._meta_path(key)
        held = self._committer.held_value(path)
        if held is None:
            return None  # erased; its file goes at the journal's checkpoint
        if isinstance(held, bytes):
            data = held  # newer than the file: written at the journal's checkpoint
        else:
            try:
                data = await asyncio.to_thread(path.read_bytes)
            except FileNotFoundError:
                return None
        try:
            record = json.loads(data)
        except ValueError:
            await asyncio.to_thread(move_to_corrupt, self.corrupt_dir, path, f"meta.{path.name}")
            self.recovery.append(RecoveryAction("moved_to_corrupt", None, f"meta value {key!r}"))
            return None
        if record.get("key") != key or record.get("value") is None:
            return None  # another key's file (a hash collision), or an erased value's tombstone
        return str(record["value"])

    async def set_meta(self, key: str, value: str) -> None:
        """Durably store ``value`` under ``key`` (one small file, replaced atomically)."""
        self._require_open()
        data = json.dumps({"key": key, "value": value}, ensure_ascii=False).encode("utf-8")
        path = self._meta_path(key)
        self._meta_files.add(path.name)
        await self._committer.commit([Op("replace", path, data)])
        owner = value_owner(key)
        if owner is not None:
            self._owned_values.setdefault(owner, set()).add(key)

    @asynccontextmanager
    async def lease(self, conversation_id: str) -> AsyncIterator[None]:
        """One process owns a home (its lock), so the lease is always granted."""
        yield

    @property
    def commits_in_order(self) -> bool:
        """With ``batch`` yes: writes join the group-commit queue in call order, and a group is
        durable (journal fsync) before the next is written; while closing, on one thread, in
        order too. With ``always`` each write fsyncs on a thread of its own: in order only among
        the writes of one file."""
        return self.fsync == "batch"


def _matching(entries: Iterable[IndexEntry], query: SearchQuery) -> Iterator[IndexEntry]:
    """The entries that pass the filters an index entry answers without building its row
    (``apply_query`` and ``summary_matches`` check them all)."""
    phase = query.phase.value if query.phase is not None else None
    for entry in entries:
        if query.id_prefix is not None and not entry.id.startswith(query.id_prefix):
            continue
        if query.archived is not None and entry.archived != query.archived:
            continue
        if phase is not None and entry.phase != phase:
            continue
        if query.participant is not None and query.participant not in entry.participants:
            continue
        if query.participants and not entry.participants.issuperset(query.participants):
            continue
        if query.ended is not None and (entry.lifecycle.get("ended_at") is not None) != query.ended:
            continue
        yield entry
