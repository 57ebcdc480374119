"""The index of conversations: one entry per conversation, kept in memory, stored as a snapshot
(``.index/snapshot.json``, rewritten only on compaction) and a log of changes since it
(``.index/log.<generation>``, derived lines appended in rounds).

Records of the log: ``{"op":"put","e":<entry>}`` (an entry whole), ``{"op":"ev","id":…,"n":…,
"s":…[,"p":[…]]}`` (events appended: count, log size, new participants), ``{"op":"del","id":…}``.
"""

from __future__ import annotations

import asyncio
import bisect
import json
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from tenex_daemon.adapters.storage.atomic import Stamp, replace_file
from tenex_daemon.adapters.storage.filesystem.derived import DerivedLines
from tenex_daemon.adapters.storage.filesystem.folder import ScannedFolder
from tenex_daemon.adapters.storage.filesystem.layout import Layout
from tenex_daemon.adapters.storage.filesystem.logfile import cut_tail, encode_line, scan_log
from tenex_daemon.adapters.storage.filesystem.repairs import RecoveryAction, move_to_corrupt
from tenex_daemon.core.conversation import UNTITLED
from tenex_daemon.core.phases import Phase
from tenex_daemon.core.search import ConversationSummary, lifecycle_fields

log = structlog.get_logger(__name__)

INDEX_FORMAT = 1
COMPACT_MIN_RECORDS = 20_000
"""Index log records after which a compaction folds them into a new snapshot (at least; twice the
number of conversations when that is more)."""


@dataclass(slots=True)
class IndexEntry:
    """One conversation in the index: its summary fields and what its files looked like."""

    id: str
    title: str = UNTITLED
    phase: str = Phase.CHAT.value
    created_at: int = 0
    updated_at: int = 0
    event_count: int = 0
    agent_count: int = 0
    archived: bool = False
    participants: set[str] = field(default_factory=set)
    lifecycle: dict[str, Any] = field(default_factory=dict)
    """The row's lifecycle fields (:func:`~tenex_daemon.core.search.lifecycle_fields`)."""
    log_size: int = 0
    state_stamp: Stamp = (0, 0)
    """(size, mtime_ns) of state.json when the entry was last made to agree with it."""

    def to_json(self) -> dict[str, Any]:
        """Return the entry as a compact JSON object."""
        return {
            "id": self.id, "t": self.title, "ph": self.phase, "ca": self.created_at,
            "ua": self.updated_at, "n": self.event_count, "ac": self.agent_count,
            "ar": self.archived, "p": sorted(self.participants), "s": self.log_size,
            "ss": list(self.state_stamp), "lc": self.lifecycle,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> IndexEntry:
        """Rebuild an entry from :meth:`to_json` output."""
        size, mtime = data.get("ss", (0, 0))
        return cls(
            id=str(data["id"]), title=str(data["t"]), phase=str(data["ph"]),
            created_at=int(data["ca"]), updated_at=int(data["ua"]), event_count=int(data["n"]),
            agent_count=int(data["ac"]), archived=bool(data["ar"]), participants=set(data["p"]),
            log_size=int(data["s"]), state_stamp=(int(size), int(mtime)),
            lifecycle=lifecycle_fields(data.get("lc") or {}),
        )

    def apply_state(self, state: dict[str, Any], archived: bool) -> None:
        """Copy the summary fields of a state snapshot."""
        self.title = str(state.get("title", UNTITLED))
        self.phase = str(state.get("phase", Phase.CHAT.value))
        self.created_at = int(state.get("created_at", 0))
        self.updated_at = int(state.get("updated_at", 0))
        self.agent_count = len(state.get("agent_states") or {})
        self.archived = archived
        self.lifecycle = lifecycle_fields(state)

    def absorb(self, scanned: ScannedFolder, archived: bool, *, full: bool) -> None:
        """Agree with a folder just read: whole (``full``), or adding a log's scanned tail."""
        self.apply_state(scanned.state, archived)
        if full:
            self.event_count = len(scanned.event_ids)
            self.participants = set(scanned.participants)
        else:
            self.event_count += len(scanned.event_ids)
            self.participants |= scanned.participants
        self.log_size = scanned.log_size
        self.state_stamp = scanned.state_stamp

    def summary(self) -> ConversationSummary:
        """Return the search row."""
        return ConversationSummary(
            id=self.id, title=self.title, phase=Phase(self.phase), created_at=self.created_at,
            updated_at=self.updated_at, event_count=self.event_count, agent_count=self.agent_count,
            archived=self.archived, participants=sorted(self.participants),
            **(self.lifecycle or lifecycle_fields({})),
        )


def _end_time(entry: IndexEntry) -> int | None:
    """The entry's end time as a number (ms), None when not ended (or not a number: such an entry is
    found by a search that reads entries, never by the walk in end-time order)."""
    value = entry.lifecycle.get("ended_at")
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


# --- reading the index on open -------------------------------------------------------------------


@dataclass
class IndexRead:
    """The index as open found it."""

    entries: dict[str, IndexEntry]
    generation: int
    records: int
    """Log records replayed over the snapshot."""
    readable: bool
    """False when the index was missing or unreadable (open rebuilds it from the folders)."""
    synced: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Conversation id -> (log size, event count) the snapshot counted: the bucket lines of those
    events were fsynced before it was written. The log's records after it were not, nor the bucket
    lines of the events they count: a power loss may keep a record and lose its event's bucket line,
    so open rescans a log past this size even when its size agrees with the records (``recovery.py``).
    A conversation deleted (or its log cut) since the snapshot has none."""


def apply_record(entries: dict[str, IndexEntry], record: dict[str, Any]) -> None:
    """Apply one index log record to ``entries``."""
    op = record.get("op")
    if op == "put":
        entry = IndexEntry.from_json(record["e"])
        entries[entry.id] = entry
    elif op == "ev":
        found = entries.get(record["id"])
        if found is not None:
            found.event_count = int(record["n"])
            found.log_size = int(record["s"])
            found.participants.update(record.get("p", ()))
    elif op == "del":
        entries.pop(record["id"], None)


def _read_snapshot(path: Path) -> tuple[dict[str, IndexEntry], int]:
    """The snapshot's entries and generation; ValueError, KeyError or TypeError when unreadable."""
    snapshot = json.loads(path.read_bytes())
    if snapshot.get("format") != INDEX_FORMAT:
        raise ValueError("unknown index format")
    entries: dict[str, IndexEntry] = {}
    for row in snapshot["entries"]:
        entry = IndexEntry.from_json(row)
        entries[entry.id] = entry
    return entries, int(snapshot["generation"])


def read_index(layout: Layout, actions: list[RecoveryAction]) -> IndexRead:
    """Read the snapshot and replay the logs after it (cutting their torn tails)."""
    logs = sorted(
        (int(p.name.split(".", 1)[1]), p) for p in layout.index_dir.glob("log.*")
        if p.name.split(".", 1)[1].isdigit()
    )
    entries: dict[str, IndexEntry] = {}
    generation = 0
    if layout.snapshot.exists():
        try:
            entries, generation = _read_snapshot(layout.snapshot)
        except (ValueError, KeyError, TypeError):
            moved = move_to_corrupt(layout.corrupt_dir, layout.snapshot, "index.snapshot.json")
            actions.append(RecoveryAction("moved_to_corrupt", None, f"index snapshot -> {moved.name}"))
            return IndexRead({}, max((g for g, _ in logs), default=0) + 1, 0, False)
    elif not logs:
        return IndexRead({}, 0, 0, False)
    synced = {cid: (entry.log_size, entry.event_count) for cid, entry in entries.items()}
    records = 0
    for gen, path in logs:
        if gen < generation:
            path.unlink(missing_ok=True)
            continue
        scan = scan_log(path.read_bytes())
        if scan.torn or scan.bad_lines:
            cut_tail(path, scan.good_end, durable=False)
        for payload in scan.payloads:
            record = json.loads(payload)
            apply_record(entries, record)
            _forget_synced(synced, record)
            records += 1
        generation = max(generation, gen)
    return IndexRead(entries, generation, records, True, synced)


def _forget_synced(synced: dict[str, tuple[int, int]], record: dict[str, Any]) -> None:
    """A conversation deleted since the snapshot (a new one may take its id), or whose log a record
    says is shorter than the snapshot counted (cut, or salvaged: its lines moved), keeps no synced size."""
    op = record.get("op")
    row = record.get("e") if op == "put" else record
    if not isinstance(row, dict):
        return
    conversation_id, size = row.get("id"), row.get("s")
    if not isinstance(conversation_id, str) or conversation_id not in synced:
        return
    if op == "del" or (isinstance(size, int) and size < synced[conversation_id][0]):
        del synced[conversation_id]


def _write_snapshot(layout: Layout, rows: list[dict[str, Any]], generation: int) -> None:
    """Replace the snapshot, then remove every log older than it (a deleted conversation's title
    and summary are in no index file once this returns). Run in a thread: encoding a large home's rows
    took the event loop for about as long as building them."""
    data = json.dumps(
        {"format": INDEX_FORMAT, "generation": generation, "entries": rows},
        separators=(",", ":"), ensure_ascii=False,
    ).encode("utf-8")
    replace_file(layout.snapshot, data)
    for path in layout.index_dir.glob("log.*"):
        suffix = path.name.split(".", 1)[1]
        if suffix.isdigit() and int(suffix) < generation:
            path.unlink(missing_ok=True)


# --- the live index ------------------------------------------------------------------------------


class Index:
    """The entries in memory; each change queued as a derived line of the index log."""

    def __init__(self, layout: Layout, derived: DerivedLines) -> None:
        self.layout = layout
        self.entries: dict[str, IndexEntry] = {}
        self._by_participant: dict[str, set[str]] = {}
        """Pubkey -> ids of the conversations it wrote in: a superset (a deleted conversation's id stays
        until the next compaction), so :meth:`candidates` checks each entry it finds."""
        self._ended: dict[str, int] = {}
        """Ended conversations: id -> end time (kept by :meth:`put`; a deleted one's id may stay, as
        above). A search for ended conversations starts from them when they are fewer."""
        self._by_end: list[tuple[int, str]] = []
        """``_ended`` as (end time, id), ascending: :meth:`newest_ended` walks it from the end."""
        self._derived = derived
        self._generation = 0
        self._log: Path | None = None
        self._records = 0
        self._compacting: asyncio.Task[None] | None = None

    def reset(self, read: IndexRead) -> None:
        """Take the entries open found (and rebuilt)."""
        self.entries = read.entries
        self._generation = read.generation
        self._log = None
        self._records = read.records
        self._map_entries()

    def _map_entries(self) -> None:
        self._by_participant = {}
        self._ended = {}
        for entry in self.entries.values():
            self.note_participants(entry.id, entry.participants)
            ended_at = _end_time(entry)
            if ended_at is not None:
                self._ended[entry.id] = ended_at
        self._by_end = sorted((ended_at, cid) for cid, ended_at in self._ended.items())

    def _note_ended(self, entry: IndexEntry) -> None:
        new = _end_time(entry)
        old = self._ended.get(entry.id)
        if new == old:
            return
        if old is not None:
            at = bisect.bisect_left(self._by_end, (old, entry.id))
            if at < len(self._by_end) and self._by_end[at] == (old, entry.id):
                del self._by_end[at]
            del self._ended[entry.id]
        if new is not None:
            bisect.insort(self._by_end, (new, entry.id))
            self._ended[entry.id] = new

    def note_participants(self, conversation_id: str, pubkeys: Iterable[str]) -> None:
        """Remember that ``pubkeys`` wrote in the conversation (every change that adds a participant
        to an entry calls this, or :meth:`put`)."""
        for pubkey in pubkeys:
            self._by_participant.setdefault(pubkey, set()).add(conversation_id)

    def candidates(self, pubkeys: Iterable[str], *, ended_only: bool = False) -> Iterable[IndexEntry]:
        """The entries in which every one of ``pubkeys`` wrote, found through the participant map
        (and, ``ended_only``, the ended set) rather than by reading every entry: the smallest of
        those sets is read. Some of them may not be ended (the caller checks); none is left out.
        No pubkey: every ended entry (``ended_only``) or every entry."""
        wanted = set(pubkeys)
        found: list[Collection[str]] = [self._by_participant.get(pubkey, set()) for pubkey in wanted]
        if ended_only:
            found.append(self._ended.keys())
        if not found:
            return self.entries.values()
        entries = []
        for conversation_id in min(found, key=len):
            entry = self.entries.get(conversation_id)
            if entry is not None and entry.participants.issuperset(wanted):
                entries.append(entry)
        return entries

    def smallest_set(self, pubkeys: Iterable[str]) -> int:
        """How many conversations the one of ``pubkeys`` that wrote in the fewest wrote in (a bound on
        what :meth:`candidates` reads for them); the number of entries when no pubkey is given."""
        sizes = [len(self._by_participant.get(pubkey, ())) for pubkey in pubkeys]
        return min(sizes) if sizes else len(self.entries)

    @property
    def ended_count(self) -> int:
        """How many conversations are ended (an upper bound: a deleted one may count)."""
        return len(self._ended)

    def newest_ended(self) -> Iterator[IndexEntry]:
        """The ended entries, newest end first (ties: highest id first)."""
        for ended_at, conversation_id in reversed(self._by_end):
            entry = self.entries.get(conversation_id)
            if entry is not None and _end_time(entry) == ended_at:
                yield entry

    def put(self, entry: IndexEntry) -> None:
        """Record an entry whole."""
        self.note_participants(entry.id, entry.participants)
        self._note_ended(entry)
        self.record({"op": "put", "e": entry.to_json()})

    def record(self, record: dict[str, Any]) -> None:
        """Queue one record of the index log."""
        self._payload(json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))

    def counted(self, conversation_id: str, entry: IndexEntry, new_participant: str | None) -> None:
        """Record one event appended (the entry's count and log size, a new participant)."""
        # the record {"op":"ev","id":…,"n":…,"s":…[,"p":[…]]}, formatted by hand: ids are plain
        # (checked by create), and this runs once per event
        extra = ""
        if new_participant is not None:
            self.note_participants(conversation_id, (new_participant,))
            extra = f',"p":[{json.dumps(new_participant)}]'
        self._payload(
            f'{{"op":"ev","id":"{conversation_id}","n":{entry.event_count},"s":{entry.log_size}{extra}}}'
            .encode()
        )

    def _payload(self, payload: bytes) -> None:
        if self._log is None:
            self._log = self.layout.index_log(self._generation)
        self._derived.add(self._log, encode_line(payload))
        self._records += 1
        threshold = max(COMPACT_MIN_RECORDS, 2 * len(self.entries))
        if self._records > threshold and (self._compacting is None or self._compacting.done()):
            self._compacting = asyncio.create_task(self.compact(), name="fs-store-compact")

    async def compact(self) -> None:
        """Write the whole index as a new snapshot and start a new index log (amortized O(1))."""
        async with self._derived.lock:
            # rows are taken and the generation switched before the flush: every event the
            # snapshot counts has its bucket line queued already, so this flush writes it
            generation = self._generation + 1
            rows = [entry.to_json() for entry in self.entries.values()]
            self._map_entries()  # drops the ids of conversations deleted since the last one
            self._generation = generation
            self._log = None
            self._records = 0
            await self._derived.flush_locked()
            if self._derived.unwritten:
                # bucket lines of events it would count are not on disk (a full disk): no snapshot, so
                # the logs of both generations are read at open, and the next compaction tries again
                log.warning("index_snapshot_deferred", generation=generation)
                return
            # the snapshot lets open skip a log whose size matches: the bucket lines of every
            # event it counts must be on disk first, not only in the page cache
            if self._derived.poisoned:
                why = "an fsync of derived files failed"
                log.warning("index_snapshot_withheld", generation=generation, why=why)
                return
            await self._derived.sync_written()
            await asyncio.to_thread(_write_snapshot, self.layout, rows, generation)

    async def wait_compacted(self) -> None:
        """Wait for a compaction started by the log's growth, if one runs."""
        if self._compacting is not None:
            await self._compacting
