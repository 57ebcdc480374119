"""The retention sweeper: ends idle conversations, archives old ones and deletes the oldest ended ones
(docs/ARCHITECTURE.md, "Conversation lifecycle").

The daemon runs :meth:`Sweeper.run_forever` (a sweep at start, then every
``conversations.sweep_interval_min``). One sweep, with the time of the manager's clock:

1. **Idle.** Every conversation not ended whose last activity is older than the idle timeout is ended
   by ``idle`` (reason ``idle_timeout``). The manager checks the last activity again under the
   conversation's lock, so a message that arrived meanwhile wins and it stays open. Conversations
   archived by hand without being ended are ended this way too, so they count as ended below.
2. **Archive.** Every conversation not archived whose last activity is older than
   ``archive_after_days`` is archived. One still active is ended first (by ``idle``, with the same
   check), so an archived conversation is always an ended one for the retention below; one that
   turns out to have new activity is left alone.
3. **Delete.** Only ended conversations (archived or not) are deleted, never an active one: those
   whose last activity is older than ``delete_after_days`` (when set), then, while more than
   ``max_retained`` conversations are kept (active ones count, but are never deleted), the oldest
   ended ones (by when they ended, then last activity). Each is loaded again just before its
   deletion and skipped if it was reopened or had activity since the sweep looked. Deleting erases
   the conversation on every store (its events, state, title and summary, index rows, delegation
   threads); its event ids stay processed, so relays cannot bring it back.

A conversation with a run scheduled or under way (``busy``) is left alone by every step: its last
message may be old (a slow run, a backlog, a run recovered after downtime), and its reply is still to
come. The archive is checked again in one step under the conversation's lock (still ended, no activity
since), and a deletion likewise (still ended, its last activity the one the sweep chose it by: a reply
saved since does not reopen a conversation, but keeps it).

An error on one conversation is logged and counted and the sweep goes on with the next. Each sweep
is logged (``retention_sweep``, with its counts) and reported to ``on_sweep`` (the daemon's metrics).

A wall clock that jumped forward (set a year ahead by mistake and fixed minutes later) is not time that
passed: a sweep would end, archive and delete by it, and a deletion is for good. So the sweeps hold off
(``retention_held``, nothing done) for :data:`STEP_HOLD_S` after the wall clock moved ahead of the time the
machine counted since the sweep before (:class:`WallClockSteps`; the boot clock counts a suspended machine's
sleep too, so waking after hours is time that passed, and a sweep acts on it). A boot's first sweep has no
sweep of its own to compare with, and a machine may boot with its wall clock wrong until NTP sets it: when the
wall clock is over :data:`STEP_HOLD_S` past the last sweep any boot recorded, the sweeps hold off as after a
step (a long downtime delays retention by that hour; a clock booted a year ahead deletes nothing).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import structlog

from tenex_daemon.core.errors import ConversationNotFoundError
from tenex_daemon.core.ports import SmallValues
from tenex_daemon.core.search import ConversationSummary, SearchQuery
from tenex_daemon.runtime.boot import boot_id, boot_seconds
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.services.lifecycle import IDLE, IDLE_TIMEOUT
from tenex_daemon.services.threads import ThreadManager

log = structlog.get_logger(__name__)

MS_PER_MINUTE = 60_000
MS_PER_DAY = 24 * 60 * MS_PER_MINUTE
DELETE_BATCH = 16
"""Conversations deleted at once (the filesystem store rewrites its index once for them)."""


STEP_SLACK_S = 60.0
"""How far the wall clock may move ahead of the boot clock between two sweeps before it counts as a step."""
STEP_KEY = "retention.clock"
"""The small value holding each boot's record (by boot id; :class:`WallClockSteps`): the wall clock less the
boot clock at its last sweep, the hold under way, and when (wall clock) it was saved. A boot that stopped
sweeping has its record dropped (:data:`STEP_RECORD_KEEP_S`): a value per boot, never removed, was one more
for good at every boot. A record per boot, not one in all: machines sharing a database each keep theirs."""
STEP_KEY_PREFIX = "retention.clock."
"""Where a daemon before :data:`STEP_KEY` kept a boot's record (``retention.clock.<boot id>``): read when
:data:`STEP_KEY` has none for this boot (a daemon upgraded on the same boot). Such values are left, as
small values cannot be removed; none is written any more."""
STEP_RECORD_KEEP_S = 7 * 86_400.0
"""How long (wall clock) another boot's record is kept after its last sweep: past it that boot is gone (or
its daemon stopped for a week, which then compares nothing at its first sweep, as on a new boot). None is
dropped while this boot's sweeps hold off: a wall clock set ahead tells no boot gone."""
STEP_HOLD_S = 3_600.0
"""How long (boot clock) the sweeps hold off after a forward step: time for NTP or a person to fix it."""


class WallClockSteps:
    """Tells a forward step of the wall clock from time that passed, at each sweep: see the module
    docstring. The wall clock less the boot clock stays the same while nobody steps it; kept in ``values``
    (under this boot's id in :data:`STEP_KEY`, when it has one), so a daemon restarted on the same boot still
    compares its first sweep with the sweep before, and a hold under way goes on."""

    def __init__(
        self,
        values: SmallValues | None = None,
        boot: Callable[[], float] = boot_seconds,
        read_boot_id: Callable[[], str | None] = boot_id,
    ) -> None:
        self._values = values
        self._boot = boot
        self._boot_id = None if values is None else read_boot_id()
        self._loaded = False
        self._offset: float | None = None
        """The wall clock less the boot clock at the sweep before (seconds)."""
        self._held_until: float | None = None

    async def holding(self, wall_ms: int) -> bool:
        """Whether the sweep at wall time ``wall_ms`` holds off (a forward step in the last
        :data:`STEP_HOLD_S`)."""
        boot = self._boot()
        offset = wall_ms / 1000 - boot
        if not self._loaded:
            self._loaded = True
            last_sweep = await self._load()
            if self._offset is None and last_sweep is not None and wall_ms / 1000 - last_sweep > STEP_HOLD_S:
                self._held_until = boot + STEP_HOLD_S
                since_s = round(wall_ms / 1000 - last_sweep)
                log.warning(
                    "wall_clock_unchecked", since_last_sweep_s=since_s, retention_held_for_s=STEP_HOLD_S
                )
        if self._offset is not None and offset - self._offset > STEP_SLACK_S:
            self._held_until = boot + STEP_HOLD_S
            ahead_s = round(offset - self._offset)
            log.warning("wall_clock_step", ahead_s=ahead_s, retention_held_for_s=STEP_HOLD_S)
        self._offset = offset
        held = self._held_until is not None and boot < self._held_until
        await self._save(wall_ms / 1000, drop_gone=not held)
        return held

    async def _load(self) -> float | None:
        """Take in this boot's record; return when (wall clock) any boot's record was last saved (None: no
        record, or none readable)."""
        if self._values is None or self._boot_id is None:
            return None
        try:
            records = await _step_records(self._values)
            stored = records.get(self._boot_id)
            if stored is None:  # kept the old way, by a daemon before this one on this boot
                stored = json.loads(await self._values.get_meta(f"{STEP_KEY_PREFIX}{self._boot_id}") or "{}")
            self._offset = float(stored["offset"]) if "offset" in stored else None
            held = stored.get("held_until")
            self._held_until = float(held) if held is not None else None
        except (OSError, ValueError, TypeError, AttributeError) as error:
            log.warning("wall_clock_record_unreadable", key=STEP_KEY, error=str(error))
            return None
        saved = (record.get("saved") for record in records.values() if isinstance(record, dict))
        return max((at for at in saved if isinstance(at, int | float)), default=None)

    async def _save(self, wall_s: float, *, drop_gone: bool) -> None:
        if self._values is None or self._boot_id is None:
            return
        try:
            try:  # read again: other machines sharing the store keep their records in it too
                records = await _step_records(self._values)
            except ValueError as error:  # written again with this boot's record alone
                log.warning("wall_clock_record_unreadable", key=STEP_KEY, error=str(error))
                records = {}
            kept = {
                other: record
                for other, record in records.items()
                if other != self._boot_id and not (drop_gone and _gone(record, wall_s))
            }
            kept[self._boot_id] = {"offset": self._offset, "held_until": self._held_until, "saved": wall_s}
            await self._values.set_meta(STEP_KEY, json.dumps(kept))
        except Exception as error:  # the sweep goes on; the next one writes it again
            log.warning("wall_clock_record_not_saved", key=STEP_KEY, error=str(error))


async def _step_records(values: SmallValues) -> dict[str, Any]:
    """Every boot's record in :data:`STEP_KEY` (none yet: empty)."""
    records = json.loads(await values.get_meta(STEP_KEY) or "{}")
    if not isinstance(records, dict):
        raise ValueError(f"{STEP_KEY} holds no JSON object")
    return records


def _gone(record: object, wall_s: float) -> bool:
    """Whether a boot's record was last saved over :data:`STEP_RECORD_KEEP_S` before ``wall_s`` (or is not
    one). One saved later than ``wall_s`` is kept: the wall clock behind tells no boot gone."""
    saved = record.get("saved") if isinstance(record, dict) else None
    return not isinstance(saved, int | float) or wall_s - saved > STEP_RECORD_KEEP_S


class RetentionSettings(Protocol):
    """The ``[conversations]`` values a :class:`RetentionPolicy` is made of."""

    @property
    def idle_timeout_min(self) -> float: ...

    @property
    def archive_after_days(self) -> float | None: ...

    @property
    def max_retained(self) -> int: ...

    @property
    def delete_after_days(self) -> float | None: ...


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    """When conversations are ended, archived and deleted (the ``[conversations]`` settings)."""

    idle_timeout_min: float = 30.0
    """An active conversation idle this long is ended (by ``idle``)."""
    archive_after_days: float | None = 30.0
    """Archive conversations inactive this long; None: never."""
    max_retained: int = 1000
    """Delete the oldest ended conversations while more than this many are kept."""
    delete_after_days: float | None = None
    """Also delete ended conversations inactive this long; None: only ``max_retained`` deletes."""

    def __post_init__(self) -> None:
        if self.idle_timeout_min <= 0:
            raise ValueError("idle_timeout_min must be positive")
        if self.max_retained < 1:
            raise ValueError("max_retained must be at least 1")
        for name in ("archive_after_days", "delete_after_days"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive (or unset)")

    @classmethod
    def of(cls, settings: RetentionSettings) -> RetentionPolicy:
        """The policy of a ``[conversations]`` settings section."""
        return cls(
            idle_timeout_min=settings.idle_timeout_min,
            archive_after_days=settings.archive_after_days,
            max_retained=settings.max_retained,
            delete_after_days=settings.delete_after_days,
        )

    @property
    def idle_ms(self) -> int:
        """The idle timeout in milliseconds."""
        return round(self.idle_timeout_min * MS_PER_MINUTE)

    @property
    def archive_after_ms(self) -> int | None:
        """``archive_after_days`` in milliseconds (None: never)."""
        return None if self.archive_after_days is None else round(self.archive_after_days * MS_PER_DAY)

    @property
    def delete_after_ms(self) -> int | None:
        """``delete_after_days`` in milliseconds (None: not by age)."""
        return None if self.delete_after_days is None else round(self.delete_after_days * MS_PER_DAY)


@dataclass(frozen=True, slots=True)
class SweepReport:
    """What one sweep did."""

    started_at: int
    """When it started (ms since the epoch, the manager's clock)."""
    ended_idle: int = 0
    archived: int = 0
    deleted: int = 0
    errors: int = 0
    """Conversations (or steps) that failed; the sweep went on."""
    duration_s: float = 0.0


@dataclass(slots=True)
class SweepTotals:
    """Every sweep's counts added up since the sweeper was made."""

    sweeps: int = 0
    ended_idle: int = 0
    archived: int = 0
    deleted: int = 0
    errors: int = 0

    def add(self, report: SweepReport) -> None:
        """Count one sweep."""
        self.sweeps += 1
        self.ended_idle += report.ended_idle
        self.archived += report.archived
        self.deleted += report.deleted
        self.errors += report.errors


@dataclass(slots=True)
class _Counts:
    ended_idle: int = 0
    archived: int = 0
    deleted: int = 0
    errors: int = 0
    deleted_ids: set[str] = field(default_factory=set)
    held_elsewhere: set[str] = field(default_factory=set)
    """Conversations with an event waiting in another daemon's outbox (read once per sweep)."""


class Deletion(StrEnum):
    """What became of a conversation the delete step chose."""

    DELETED = "deleted"
    GONE = "gone"
    """Deleted by someone else meanwhile (another daemon sharing the database, the owner)."""
    KEPT = "kept"
    """Still there: reopened, changed since the search, or its deletion failed."""


def _deletion_order(row: ConversationSummary) -> tuple[int, int, str]:
    """Oldest first: by last activity, then by when it ended. Not by the end first: a sweep ends every idle
    conversation at once (after an import, or a downtime), newest first as the search lists them, so their
    end times would put the newest first in line."""
    return (row.last_activity, row.ended_at or 0, row.id)


class Sweeper:
    """Applies a :class:`RetentionPolicy` to the conversations of ``manager``'s store.

    ``threads``: the delegation threads, whose cached copies of a deleted conversation are dropped
    (the store's ``delete`` erases the stored ones). ``on_sweep``: called with each sweep's report
    (it must not block).
    """

    def __init__(
        self,
        manager: ConversationManager,
        policy: RetentionPolicy,
        *,
        threads: ThreadManager | None = None,
        on_sweep: Callable[[SweepReport], None] | None = None,
        undelivered: Callable[[str], bool] | None = None,
        busy: Callable[[str], bool] | None = None,
        held_elsewhere: Callable[[], Awaitable[set[str]]] | None = None,
        clock_steps: WallClockSteps | None = None,
    ) -> None:
        """``undelivered(conversation_id)``: whether an event of it still waits for a relay (the outbox);
        such a conversation is not deleted yet (a reply is never lost to retention).
        ``busy(conversation_id)``: whether a run in it is scheduled or under way (the run scheduler); such
        a conversation is not ended, archived or deleted by this sweep, however long ago its last message
        came (a slow run, a backlog, a run recovered after a long downtime). ``held_elsewhere()``: the
        conversations with an event waiting in another daemon's outbox (daemons sharing a database), read
        once per sweep before deleting; none is deleted when it fails."""
        self._manager = manager
        self._undelivered = undelivered
        self._busy = busy
        self._held_elsewhere = held_elsewhere
        self.policy = policy
        self._threads = threads
        self._on_sweep = on_sweep
        self._clock_steps = clock_steps
        """The daemon's: sweeps hold off after a forward step of the wall clock (None: never, as when the
        manager's clock is a test's, moved on by hand)."""
        self.last: SweepReport | None = None
        """The newest sweep's report (None before the first)."""
        self.totals = SweepTotals()

    async def run_forever(self, interval_s: float) -> None:
        """Sweep now, then every ``interval_s`` seconds, until cancelled."""
        if interval_s <= 0:
            raise ValueError("the sweep interval must be positive")
        while True:
            try:
                await self.sweep_once()
            except Exception:  # a bug in a sweep: logged, and the next sweep comes anyway
                log.exception("retention_sweep_failed")
            await asyncio.sleep(interval_s)

    async def sweep_once(self) -> SweepReport:
        """End idle conversations, archive old ones, delete beyond the limits; return the counts."""
        started = time.monotonic()
        now = self._manager.now_ms()
        counts = _Counts()
        if self._clock_steps is not None and await self._clock_steps.holding(now):
            log.warning("retention_held", reason="wall_clock_step", action="nothing ended, archived, deleted")
        else:
            await self._end_idle(now, counts)
            await self._archive(now, counts)
            await self._delete(now, counts)
        report = SweepReport(
            started_at=now,
            ended_idle=counts.ended_idle,
            archived=counts.archived,
            deleted=counts.deleted,
            errors=counts.errors,
            duration_s=round(time.monotonic() - started, 6),
        )
        self.last = report
        self.totals.add(report)
        did = report.ended_idle or report.archived or report.deleted or report.errors
        (log.info if did else log.debug)(  # a sweep that did nothing: not a line every 5 minutes for months
            "retention_sweep",
            ended_idle=report.ended_idle,
            archived=report.archived,
            deleted=report.deleted,
            errors=report.errors,
            duration_s=report.duration_s,
        )
        if self._on_sweep is not None:
            self._on_sweep(report)
        return report

    async def _search(self, query: SearchQuery, counts: _Counts, step: str) -> list[ConversationSummary]:
        """Search the store; a failure is logged and counted, and the step finds nothing."""
        try:
            return await self._manager.store.search(query)
        except Exception:
            counts.errors += 1
            log.exception("retention_search_failed", step=step)
            return []

    async def _end_idle(self, now: int, counts: _Counts) -> None:
        idle_before = now - self.policy.idle_ms
        for row in await self._search(SearchQuery(ended=False, inactive_before=idle_before), counts, "idle"):
            if self._is_busy(row.id):
                continue
            try:
                if await self._manager.end_conversation(
                    row.id, by=IDLE, reason=IDLE_TIMEOUT, idle_before=idle_before
                ):
                    counts.ended_idle += 1
            except Exception:
                counts.errors += 1
                log.exception("retention_failed", conversation_id=row.id, action="end_idle")

    async def _archive(self, now: int, counts: _Counts) -> None:
        after_ms = self.policy.archive_after_ms
        if after_ms is None:
            return
        inactive_before = now - after_ms
        query = SearchQuery(archived=False, inactive_before=inactive_before)
        for row in await self._search(query, counts, "archive"):
            if self._is_busy(row.id):
                continue
            try:
                ended_now = row.ended_at is None and await self._manager.end_conversation(
                    row.id, by=IDLE, reason=IDLE_TIMEOUT, idle_before=inactive_before
                )
                if ended_now:
                    counts.ended_idle += 1
                # False: a message came meanwhile (it stays open), or archived meanwhile
                if await self._manager.archive_conversation(row.id, ended_before=inactive_before):
                    counts.archived += 1
            except ConversationNotFoundError:
                continue  # deleted meanwhile
            except Exception:
                counts.errors += 1
                log.exception("retention_failed", conversation_id=row.id, action="archive")

    def _is_busy(self, conversation_id: str) -> bool:
        return self._busy is not None and self._busy(conversation_id)

    async def _delete(self, now: int, counts: _Counts) -> None:
        ended = await self._search(SearchQuery(ended=True), counts, "delete")
        if not ended:
            return
        if self._held_elsewhere is not None:
            try:
                counts.held_elsewhere = await self._held_elsewhere()
            except Exception:
                counts.errors += 1
                log.exception("retention_outboxes_unread")
                return
        ended.sort(key=_deletion_order)
        delete_after_ms = self.policy.delete_after_ms
        if delete_after_ms is not None:
            too_old = now - delete_after_ms
            old = [row for row in ended if row.last_activity < too_old]
            for start in range(0, len(old), DELETE_BATCH):
                await self._delete_batch(old[start:start + DELETE_BATCH], counts)
        try:
            kept = sum((await self._manager.store.phase_counts()).values())
        except Exception:
            counts.errors += 1
            log.exception("retention_count_failed")
            return
        candidates = [row for row in ended if row.id not in counts.deleted_ids]
        while kept > self.policy.max_retained and candidates:
            batch = candidates[:min(kept - self.policy.max_retained, DELETE_BATCH)]
            candidates = candidates[len(batch):]
            outcomes = await self._delete_batch(batch, counts)
            # deleted, or gone already (another daemon sharing the database deleted it)
            kept -= sum(1 for outcome in outcomes if outcome is not Deletion.KEPT)

    async def _delete_batch(self, rows: list[ConversationSummary], counts: _Counts) -> list[Deletion]:
        """Delete several conversations at once (a store shares its work between deletions made together)."""
        return list(await asyncio.gather(*(self._delete_one(row, counts) for row in rows)))

    async def _delete_one(self, row: ConversationSummary, counts: _Counts) -> Deletion:
        """Delete one ended conversation if it still is (unchanged since the search)."""
        try:
            conversation = await self._manager.get_conversation(row.id)
            if conversation is None:
                return Deletion.GONE
            if not conversation.is_ended or conversation.last_activity != row.last_activity:
                return Deletion.KEPT  # reopened, or changed since the search: the next sweep decides
            waiting = self._undelivered is not None and self._undelivered(row.id)
            if waiting or row.id in counts.held_elsewhere:
                return Deletion.KEPT  # an event of it still waits for a relay (in this outbox or another's)
            if self._is_busy(row.id):
                return Deletion.KEPT  # a run in it is under way: its reply is saved into it
            activity = row.last_activity
            if not await self._manager.delete_conversation(row.id, only_ended=True, activity=activity):
                # changed under the lock (a reply or a message came meanwhile), or gone
                return Deletion.KEPT if await self._manager.get_conversation(row.id) else Deletion.GONE
            if self._threads is not None:
                self._threads.forget_conversation(row.id)
        except Exception:
            counts.errors += 1
            log.exception("retention_failed", conversation_id=row.id, action="delete")
            return Deletion.KEPT
        counts.deleted += 1
        counts.deleted_ids.add(row.id)
        return Deletion.DELETED
