"""The durable outbox: every event tenexd signs for a conversation reaches a relay, however long it takes.

An event is added once it is saved in its conversation (an agent's reply, a delegation request or
answer). Delivery starts at once; the entry is recorded durably in the store's small values (the
key :data:`OUTBOX_KEY`, or a key per daemon when several share a database) before :meth:`Outbox.add`
returns (a failed write is tried again until it succeeds: the run that saved the event does not end
before). A publish that no relay accepts is tried again with a capped backoff (``backoff_start_s``, 1 s,
doubling up to ``backoff_cap_s``), at once whenever a relay (re)connects (:meth:`Outbox.wake`), and after a
restart (:meth:`Outbox.recover`); an entry is never dropped for its age, only logged
(``outbox_entry_old``) once it is older than ``warn_after_s``. A relay's ``OK true`` (a
``duplicate:`` answer counts as one) ends it; the store forgets it with the next write (coalesced).
Only an event every relay refused for good (:class:`~tenex_daemon.core.errors.EventRefusedError`: NIP-01
``blocked:`` or ``invalid:`` for its size, or a rumor too long to gift-wrap) leaves unpublished, logged
(``outbox_entry_refused``) and counted (:attr:`Outbox.refused`); it stays saved in its conversation, and
``on_refused`` may give a notice that tells the person (added like any event).

Until the entry is durable the run journal covers the event (a run whose reply is saved is
redone after a crash by publishing that reply again), so nothing signed is ever lost on its way out.
An event no run covers (a stop's notice) goes through :meth:`Outbox.add_saving`: its entry, holding the
event itself, is stored before the event is saved, and :meth:`Outbox.recover` saves such an event its
conversation lacks before delivering it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from tenex_daemon.core.errors import EventRefusedError
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.ports import Peers, Publisher, SmallValues
from tenex_daemon.runtime.background import BackgroundTasks

log = structlog.get_logger(__name__)

OUTBOX_KEY = "outbox.pending"
DEFAULT_WARN_AFTER_S = 300.0
DEFAULT_BACKOFF_CAP_S = 60.0
FORGET_FLUSH_S = 1.0
"""A delivered entry leaves the stored outbox within this long (with any write sooner)."""


def outbox_key_for(daemon_id: str) -> str:
    """The outbox's key of one daemon (its project key) in a store daemons share (PostgreSQL)."""
    return f"{OUTBOX_KEY}.{daemon_id}"


async def conversations_in_outboxes(store: SmallValues, peers: Peers, prefix: str) -> set[str]:
    """The conversations with an entry in any stored outbox whose key starts with ``prefix`` (those of every
    daemon of a project sharing a database: another's replies still on their way keep their conversations
    from retention here too). Raises ValueError for an outbox that cannot be read."""
    held: set[str] = set()
    for key in await peers.keys_with_prefix(prefix):
        raw = await store.get_meta(key)
        try:
            held.update(str(record["c"]) for record in json.loads(raw or "[]"))
        except (TypeError, KeyError) as exc:
            raise ValueError(f"the outbox under {key!r} cannot be read") from exc
    return held


def every_outbox(
    store: SmallValues, peers: Peers | None, project: str
) -> Callable[[], Awaitable[set[str]]] | None:
    """What :func:`conversations_in_outboxes` reads for a project's daemons sharing a database; None for a
    daemon alone (its own outbox is all there is)."""
    if peers is None:
        return None
    return functools.partial(conversations_in_outboxes, store, peers, outbox_key_for(project))


@dataclass(slots=True)
class OutboxEntry:
    """One event waiting for a relay's ``OK true``."""

    event: NostrEvent
    conversation_id: str
    agent_slug: str
    trigger_id: str | None
    first_at: float
    """When it was first added (epoch seconds; kept across restarts)."""
    attempts: int = 0
    last_error: str | None = None
    warned: bool = False
    unsaved: bool = False
    """Stored before its event is saved in its conversation (:meth:`Outbox.add_saving`): the stored form
    holds the event, and it is delivered only once saved."""
    held_since: float = field(init=False)
    """:attr:`first_at` on the monotonic clock (one recovered: its age then taken back from that clock's
    reading), so its age in this process is what no step of the wall clock moves."""

    def __post_init__(self) -> None:
        self.held_since = time.monotonic() - max(0.0, time.time() - self.first_at)

    def age_s(self) -> float:
        """Seconds since it was first added (across restarts; steps of the wall clock in this process
        left out)."""
        return max(0.0, time.monotonic() - self.held_since)

    def record(self) -> dict[str, object]:
        """The stored form (the event itself is in its conversation, or in ``e`` until it is saved there)."""
        stored: dict[str, object] = {
            "id": self.event.id, "c": self.conversation_id, "a": self.agent_slug,
            "t": self.trigger_id, "at": self.first_at,
        }
        if self.unsaved:
            stored["e"] = self.event.to_dict()
        return stored


class DeliveryObserver(Protocol):
    """Told when an agent's reply reached a relay (the run observer: reply latency, metrics)."""

    def reply_published(self, agent_slug: str, trigger_id: str, sent_at: float) -> None:
        """A reply to ``trigger_id`` reached a relay; ``sent_at``: when that publish was sent (epoch s)."""


FindEvent = Callable[[str], Awaitable[tuple[str, NostrEvent] | None]]
SaveEvent = Callable[[str, NostrEvent], Awaitable[bool]]
"""Saves an event in a conversation; False when the conversation cannot take it (gone, archived)."""
OnRefused = Callable[[OutboxEntry, EventRefusedError], Awaitable[NostrEvent | None]]
"""Told of an event every relay refused for good; may return a notice saved in its conversation, to send."""


@dataclass
class _Wakeup:
    event: asyncio.Event = field(default_factory=asyncio.Event)


class Outbox:
    """Keeps every signed conversation event until a relay accepted it (see the module docstring)."""

    def __init__(
        self,
        store: SmallValues,
        publisher: Publisher,
        *,
        key: str = OUTBOX_KEY,
        warn_after_s: float = DEFAULT_WARN_AFTER_S,
        backoff_cap_s: float = DEFAULT_BACKOFF_CAP_S,
        backoff_start_s: float = 1.0,
        observer: DeliveryObserver | None = None,
        on_refused: OnRefused | None = None,
        save_missing: SaveEvent | None = None,
    ) -> None:
        """``save_missing``: how :meth:`recover` saves an event an entry holds that its conversation lacks
        (:meth:`add_saving`'s, its process ended before it was saved)."""
        self.key = key
        self._on_refused = on_refused
        self._save_missing = save_missing
        self._store = store
        self._publisher = publisher
        self._warn_after = warn_after_s
        self._backoff_cap = backoff_cap_s
        self._backoff_start = backoff_start_s
        self._observer = observer
        self._entries: dict[str, OutboxEntry] = {}
        self._deliveries = BackgroundTasks("outbox")
        self._writes = BackgroundTasks("outbox store")
        self._write_lock = asyncio.Lock()
        self._version = 0
        self._written = 0
        self._flush: asyncio.Task[None] | None = None
        self._wakeup: _Wakeup | None = None
        self.delivered = 0
        self.retries = 0
        self.refused = 0
        """Events every relay refused for good, left unpublished."""

    # --- what status and metrics read ---------------------------------------------------------

    def holds(self, conversation_id: str) -> bool:
        """Whether an event of this conversation still waits for a relay (retention keeps it)."""
        return any(entry.conversation_id == conversation_id for entry in self._entries.values())

    def event_ids(self) -> frozenset[str]:
        """The ids of the events waiting for a relay."""
        return frozenset(self._entries)

    @property
    def depth(self) -> int:
        """Events waiting for a relay."""
        return len(self._entries)

    def oldest_age_s(self) -> float | None:
        """Seconds since the oldest waiting event was added (:meth:`OutboxEntry.age_s`), or None when none
        waits."""
        if not self._entries:
            return None
        return max(entry.age_s() for entry in self._entries.values())

    # --- adding and delivering ------------------------------------------------------------------

    async def add(
        self, conversation_id: str, event: NostrEvent, *, agent_slug: str, trigger_id: str | None = None
    ) -> None:
        """Deliver ``event`` (saved in ``conversation_id``) until a relay accepts it; on return the
        entry is durable (delivery has started already). Adding an event already waiting does nothing."""
        if event.id in self._entries:
            return
        entry = OutboxEntry(event, conversation_id, agent_slug, trigger_id, time.time())
        self._entries[event.id] = entry
        self._version += 1
        self._deliveries.spawn(self._deliver(entry), f"deliver {event.id[:12]}")
        await self._stored(entry)  # the run that saved the event ends only once its entry is stored

    async def add_saving(
        self,
        conversation_id: str,
        event: NostrEvent,
        save: Callable[[], Awaitable[bool]],
        *,
        agent_slug: str,
        trigger_id: str | None = None,
    ) -> bool:
        """Save ``event`` with ``save`` and deliver it, an event no run journal covers (a stop's notice): its
        entry, holding the event, is stored first, then it is saved, then delivered, so a crash at any
        instant loses neither (:meth:`recover` saves it when its conversation lacks it). Return whether it
        was saved; when ``save`` answers False (the conversation cannot take it) or raises, the entry goes."""
        if event.id in self._entries:
            return True
        entry = OutboxEntry(event, conversation_id, agent_slug, trigger_id, time.time(), unsaved=True)
        self._entries[event.id] = entry
        self._version += 1
        await self._stored(entry)
        try:
            saved = await save()
        except BaseException:
            self._forget(event.id)
            raise
        if not saved:
            self._forget(event.id)
            return False
        entry.unsaved = False  # the next write stores it without the event
        self._version += 1
        self._deliveries.spawn(self._deliver(entry), f"deliver {event.id[:12]}")
        return True

    def _forget(self, event_id: str) -> None:
        """The entry leaves the outbox; the store forgets it with the next write (within FORGET_FLUSH_S)."""
        self._entries.pop(event_id, None)
        self._version += 1
        self._write_soon()

    def _write_soon(self) -> None:
        if self._flush is None:
            self._flush = asyncio.create_task(self._forget_soon(), name="outbox forget")

    async def _stored(self, entry: OutboxEntry) -> None:
        """Write the outbox until ``entry`` is stored (a failed write is logged and tried again)."""
        delay = 0.1
        while True:
            try:
                await self._write(self._version)
                return
            except Exception:
                log.exception(
                    "outbox_write_failed", event_id=entry.event.id, conversation_id=entry.conversation_id,
                    retry_in=delay,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._backoff_cap)

    def wake(self) -> None:
        """A relay (re)connected: every waiting event is tried again now."""
        wakeup = self._wakeup
        self._wakeup = None
        if wakeup is not None:
            wakeup.event.set()

    async def _deliver(self, entry: OutboxEntry) -> None:
        delay = self._backoff_start
        while True:
            sent_at = time.time()
            try:
                await self._publisher.publish(entry.event)
                break
            except EventRefusedError as exc:
                failed = await self._refused(entry, exc)
                if failed is None:
                    return
                problem: Exception = failed  # its notice could not be saved: refused again, told again
            except Exception as exc:
                problem = exc
            entry.attempts += 1
            entry.last_error = str(problem) or type(problem).__name__
            self.retries += 1
            self._warn_if_old(entry)
            log.info(
                "outbox_retry",
                event_id=entry.event.id,
                conversation_id=entry.conversation_id,
                attempt=entry.attempts,
                retry_in=delay,
                error=entry.last_error,
            )
            await self._sleep(delay)
            delay = min(delay * 2, self._backoff_cap)
        self._forget(entry.event.id)
        self.delivered += 1
        if entry.attempts:
            log.info("outbox_delivered", event_id=entry.event.id, attempts=entry.attempts + 1)
        if self._observer is not None and entry.trigger_id is not None:
            self._observer.reply_published(entry.agent_slug, entry.trigger_id, sent_at)

    async def _refused(self, entry: OutboxEntry, refusal: EventRefusedError) -> Exception | None:
        """Every relay refused the entry's event for good: it leaves the outbox (trying again cannot help),
        and the person is told when ``on_refused`` gives a notice. The notice is saved first, and one write
        of the outbox then holds its entry and no longer the refused one, so a crash between loses neither
        (it could only refuse the event again and save a second notice). A notice that cannot be made (its
        agent no longer configured: a ``LookupError``; a ``ValueError`` or ``TypeError``) would fail at every
        try, and the entry leaves without it; any other failure (the store's: a full disk, a database
        restarting, a deadlock) keeps the entry: returned is that error, and the caller tries the event,
        then the notice, again after a wait."""
        notice = None
        if self._on_refused is not None:
            try:
                notice = await self._on_refused(entry, refusal)
            except (LookupError, ValueError, TypeError):
                log.exception(
                    "refusal_notice_failed", event_id=entry.event.id, conversation_id=entry.conversation_id,
                    action="dropped: the notice cannot be made",
                )
            except Exception as exc:
                log.exception(
                    "refusal_notice_failed", event_id=entry.event.id, conversation_id=entry.conversation_id,
                    action="kept; the event and its notice are tried again after a wait",
                )
                return exc
        log.error(
            "outbox_entry_refused",
            event_id=entry.event.id,
            conversation_id=entry.conversation_id,
            agent=entry.agent_slug,
            error=str(refusal),
            action="not sent again: every relay refused it for good; it stays saved in the conversation",
        )
        self._entries.pop(entry.event.id, None)
        self.refused += 1
        self._version += 1
        if notice is not None:  # its write covers the removal too; without a trigger it is no reply published
            await self.add(entry.conversation_id, notice, agent_slug=entry.agent_slug)
        else:
            self._write_soon()
        return None

    def _warn_if_old(self, entry: OutboxEntry) -> None:
        if entry.warned or entry.age_s() < self._warn_after:
            return
        entry.warned = True
        log.warning(
            "outbox_entry_old",
            event_id=entry.event.id,
            conversation_id=entry.conversation_id,
            age_s=round(entry.age_s(), 1),
            attempts=entry.attempts,
            error=entry.last_error,
            action="kept; tried again with backoff and on every relay (re)connect",
        )

    async def _sleep(self, delay: float) -> None:
        """Wait ``delay`` seconds, or less when a relay (re)connects meanwhile."""
        if self._wakeup is None:
            self._wakeup = _Wakeup()
        wakeup = self._wakeup
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wakeup.event.wait(), delay)

    # --- the stored form --------------------------------------------------------------------------

    async def _forget_soon(self) -> None:
        await asyncio.sleep(FORGET_FLUSH_S)
        self._flush = None
        self._writes.spawn(self._write(self._version), "forget delivered")

    async def _write(self, wanted: int) -> None:
        """Store the outbox as it is now, unless a write since ``wanted`` was made already covers it."""
        async with self._write_lock:
            if self._written >= wanted:
                return
            version = self._version
            payload = json.dumps([e.record() for e in self._entries.values()], separators=(",", ":"))
            await self._store.set_meta(self.key, payload)
            self._written = version

    async def recover(self, find_event: FindEvent, *, key: str | None = None) -> int:
        """Deliver what a previous process left in the stored outbox; return how many entries.

        Each entry's event is read back from its conversation; one whose conversation is gone
        (deleted) is dropped and logged. An entry that holds its event (:meth:`add_saving`: the process
        ended before or just after saving it) has it saved (the constructor's ``save_missing``) when its
        conversation lacks it. With ``key``, the outbox another daemon left (it died) is taken over: its
        entries are in this outbox's stored form when this returns, so the caller may then forget ``key``.
        """
        source = self.key if key is None else key
        raw = await self._store.get_meta(source)
        try:
            records = json.loads(raw) if raw else []
            pending = [
                (str(r["id"]), str(r["c"]), str(r["a"]), r.get("t"), float(r["at"]), r.get("e"))
                for r in records
            ]
        except (ValueError, TypeError, KeyError, AttributeError):
            log.error("outbox_unreadable", key=source)
            return 0
        restored = 0
        for event_id, conversation_id, agent_slug, trigger_id, first_at, held in pending:
            found = await find_event(event_id)
            if found is None and held is not None and self._save_missing is not None:
                found = await self._save_held(conversation_id, event_id, held, self._save_missing)
            if found is None:
                log.warning("outbox_entry_dropped", event_id=event_id, reason="event no longer stored")
                self._version += 1
                continue
            entry = OutboxEntry(found[1], conversation_id, agent_slug, trigger_id, first_at)
            if event_id not in self._entries:
                self._entries[event_id] = entry
                self._deliveries.spawn(self._deliver(entry), f"deliver {event_id[:12]}")
                restored += 1
        if restored:
            log.info("outbox_recovered", count=restored, key=source)
        self._version += 1
        await self._write(self._version)  # what was added meanwhile is stored with what was restored
        return restored

    @staticmethod
    async def _save_held(
        conversation_id: str, event_id: str, held: object, save_missing: SaveEvent
    ) -> tuple[str, NostrEvent] | None:
        """Save the event an entry holds (its process ended before saving it); None when it cannot be."""
        try:
            event = NostrEvent.model_validate(held)
        except ValueError:
            log.error("outbox_entry_unreadable", event_id=event_id, conversation_id=conversation_id)
            return None
        if event.id != event_id or not await save_missing(conversation_id, event):
            return None
        log.info("outbox_event_saved", event_id=event_id, conversation_id=conversation_id)
        return conversation_id, event

    async def flush(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for the deliveries under way; return how many events still wait."""
        await self._deliveries.wait(timeout_s)
        return self.depth

    async def close(self) -> None:
        """Stop delivering (what waits stays stored for the next start) and store the outbox as it is."""
        await self._deliveries.cancel_all()
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        await self._writes.gather()
        await self._write(self._version)
