"""Scheduling agent runs: one at a time per conversation, a global cap, no orphan tasks,
and a durable journal so that an event accepted before a crash is dispatched, and a run
scheduled before it is carried out, after the restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any, Protocol

import structlog

from tenex_daemon.core.errors import ConversationArchivedError, ConversationNotFoundError
from tenex_daemon.core.ports import Peers, SmallValues
from tenex_daemon.runtime.background import BackgroundTasks
from tenex_daemon.runtime.failures import log_failure
from tenex_daemon.runtime.fair_slots import FairSlots
from tenex_daemon.services.locks import KeyedLock
from tenex_daemon.services.run_journal import (
    PENDING_RUNS_KEY,
    RunRequest,
    forget_journaled,
    journal_key_for,
    journaled_request,
)
from tenex_daemon.services.run_lease import LeaseLoss, RunLeaseLostError

log = structlog.get_logger(__name__)

__all__ = [
    "PENDING_RUNS_KEY", "RUN_LEASE_PREFIX", "RunRequest", "RunScheduler", "forget_journaled",
    "journal_key_for",
]

RUN_LEASE_PREFIX = "run:"
"""The lease a run holds on its conversation across daemons (the manager's steps use the bare id)."""

RunFunction = Callable[[RunRequest], Awaitable[None]]

RUN_RETRY_S = (1.0, 2.0, 5.0, 10.0, 30.0, *(60.0,) * 25)
"""Waits before each new try of a run that failed with an error (about 26 minutes in all)."""
SAVING_WAIT_S = 10.0
"""How long a stop waits for the replies of the runs it let finish (already saving) to be saved, and such a
run for the stop to count its reply before routing it."""
FINISHED_FLUSH_S = 1.0
"""A finished run is dropped from the stored journal within this long (with any write sooner)."""


class RunListener(Protocol):
    """Told when a run starts and ends (the live status, kind 24133); must return at once and never raise."""

    def run_started(self, request: RunRequest) -> None:
        """``request``'s agent starts working (it held its conversation's slot)."""

    def run_ended(self, request: RunRequest) -> None:
        """``request``'s run is over (answered, dropped after its last try, stopped or cancelled; a try that
        failed and waits to try again still works on the answer)."""


@dataclass(slots=True)
class _Accepts:
    """The :meth:`RunScheduler.accept` calls of one event under way."""

    fresh: bool
    """The event was not being dispatched when the first of them came."""
    in_flight: int = 0
    accepted: bool = False
    """One of them was journaled."""


@dataclass(slots=True)
class _Running:
    """A run being carried out, as :meth:`RunScheduler.cancel` sees it."""

    covers: list[str] = field(default_factory=list)
    """The keys of the burst it answers too."""
    saving: bool = False
    """Its answer is in and its reply is being saved: a stop lets it finish."""
    saved: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once its reply is in history (:func:`reply_saved`), or the run is over."""
    routed: list[str] = field(default_factory=list)
    """The replies it journaled as being dispatched before saving (:meth:`RunScheduler.reply_journaled`)."""
    reply_in: bool = False
    """Its reply is in history (:func:`reply_saved`): a try that fails after it leaves a reply to publish."""
    reply_id: str | None = None
    """The id of its reply, once in history (:func:`reply_saved`)."""
    recorded: asyncio.Event | None = None
    """A stop that let it finish and waits for its reply: set once the stop has counted that reply in its
    record; the run routes its reply only then (:func:`stops_recorded`)."""


_CURRENT_RUN: ContextVar[_Running | None] = ContextVar("tenexd_current_run", default=None)


def saving_reply() -> None:
    """Tell the scheduler that the calling run's answer is in and its reply is being saved: a stop
    (:meth:`RunScheduler.cancel`) then lets it finish, so a reply is never left half-saved."""
    running = _CURRENT_RUN.get()
    if running is not None:
        running.saving = True


def reply_saved(reply_id: str) -> None:
    """Tell the scheduler that the calling run's reply (``reply_id``) is in history (a stop that let it finish
    waits for this: :meth:`RunScheduler.replies_being_saved`)."""
    running = _CURRENT_RUN.get()
    if running is not None:
        running.reply_in = True
        running.reply_id = reply_id
        running.saved.set()


@dataclass(frozen=True, slots=True)
class ReplyBeingSaved:
    """A run's reply being saved as a stop came (:meth:`RunScheduler.replies_being_saved`)."""

    saved: asyncio.Event
    """Set once the reply is in history, or the run is over."""
    recorded: asyncio.Event
    """Set by the stop once it has counted the reply in its record (the run routes it only then)."""
    _running: _Running

    @property
    def reply_id(self) -> str | None:
        """The reply's id once it is in history (None: not saved, or not yet)."""
        return self._running.reply_id


async def stops_recorded(within: float) -> None:
    """Before the calling run routes its saved reply: wait (at most ``within``) for a stop that let it finish
    to count that reply in its record, so the agents it would be routed to read the stop."""
    running = _CURRENT_RUN.get()
    if running is not None and running.recorded is not None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(running.recorded.wait(), within)


class RunScheduler:
    """Runs agents concurrently across conversations and serially within one.

    The journal in the store (``runs.pending``) holds two kinds of entries. An event being
    dispatched (:meth:`accept`) is journaled no later than the event itself is stored, and
    leaves once its dispatch is over (:meth:`dispatched`): a crash in between, while the
    orchestrator decides for example, leaves it to :meth:`dispatches_to_redo`. Every run
    request is journaled as it is scheduled, so :meth:`recover` can redo what a crash
    interrupted. A finished run leaves
    the journal with the next write, at the latest ``FINISHED_FLUSH_S`` later (or at
    :meth:`drain`): it needs no write of its own, because a recovered run whose agent
    already replied to its trigger is skipped. Journal writes are coalesced: a change waits
    for the write in flight, then one write covers every change made meanwhile. At most
    ``max_concurrent`` runs execute at once; a place that comes free goes to a waiting run of the person
    holding the fewest (:class:`~tenex_daemon.runtime.fair_slots.FairSlots`), first come first served
    among equals.

    ``journal_key`` names the journal: daemons sharing one store (PostgreSQL) each need their
    own (:func:`journal_key_for`).
    """

    def __init__(
        self,
        store: SmallValues,
        run: RunFunction,
        max_concurrent: int = 8,
        *,
        journal_key: str = PENDING_RUNS_KEY,
        peers: Peers | None = None,
        listener: RunListener | None = None,
        agents: Collection[str] | None = None,
    ) -> None:
        self._store = store
        self._agents = None if agents is None else frozenset(agents)
        """The agents configured (None: any): a journaled run of another waits in the journal (parked)."""
        self._parked: dict[str, dict[str, Any]] = {}
        """Journaled runs of agents the configuration no longer has, by key: kept in every journal write, so
        a start with the agent configured again runs them (``run_parked``)."""
        self._listener = listener
        self.journal_key = journal_key
        self._peers = peers
        self._run = run
        self._slots = FairSlots(max_concurrent)
        """The runs' places, shared fairly between the people they answer (a flood waits behind others)."""
        self._conversation_locks = KeyedLock()
        self._tasks = BackgroundTasks("run scheduler")
        """The runs scheduled and not finished (each logs its own failure)."""
        self._pending: dict[str, RunRequest] = {}
        self._covered: set[str] = set()
        """Requests taken into a burst run: their own turn finds them answered."""
        self._answered: set[str] = set()
        """Covered requests whose burst run saved its reply: out of the stored journal (a crash does not
        redo them alone: the burst's reply names only its newest trigger), waiting for their own turn."""
        self._unsaved: dict[str, list[str]] = {}
        """Per run, the replies its failed tries journaled as being dispatched: once a later try answers,
        those still journaled were never saved (a saved one is found and routed by that try) and leave."""
        self._saved_then_failed: set[str] = set()
        """Requests whose failed try had its reply saved (or being saved), waiting to try again: a stop lets
        them finish (their retry publishes that reply, it does not make another)."""
        self._task_of: dict[str, asyncio.Task[None]] = {}
        self._running: dict[str, _Running] = {}
        """The requests whose run is being carried out now, by key."""
        self._shown: dict[str, RunRequest] = {}
        """Key -> the run the listener was told started and not yet ended: from a run's first try until
        its last (a try that failed and waits to try again still works on the answer), or until a burst
        takes it."""
        self._stopping: set[str] = set()
        """Requests :meth:`cancel` is stopping."""
        self._dispatching: dict[str, None] = {}
        self._accepts: dict[str, _Accepts] = {}
        """Event ids accepted and not yet dispatched (insertion order)."""
        self._redo: list[str] = []
        """Event ids a previous process accepted and did not finish dispatching."""
        self._redoing_in: dict[str, str] = {}
        """Of those, each stored one's conversation (:meth:`redoing`), until its dispatch is over."""
        self._journal_lock = asyncio.Lock()
        self._journal_version = 0
        """Bumped by every change to ``_pending`` or ``_dispatching``."""
        self._journal_written = 0
        """The version the stored journal holds."""
        self._start_waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._accepting = True
        self._flush_task: asyncio.Task[None] | None = None
        self._writes = BackgroundTasks("run journal")
        self.running = 0
        self.completed = 0
        self.failed = 0
        self.dropped = 0
        """Runs given up after their last try (``run_dropped``): a person left unanswered."""

    @staticmethod
    def _key(request: RunRequest) -> str:
        return f"{request.conversation_id}:{request.trigger_id}:{request.agent_slug}"

    @property
    def in_flight(self) -> int:
        """Runs scheduled and not finished (waiting or running)."""
        return len(self._tasks)

    def has_runs(self, conversation_id: str) -> bool:
        """Whether a run in the conversation is scheduled or under way here (recovered ones included), or
        may be soon: an event of it a previous process left to dispatch is being dispatched again."""
        return any(request.conversation_id == conversation_id for request in self._pending.values()) or (
            conversation_id in self._redoing_in.values()
        )

    def holds(self, conversation_id: str) -> bool:
        """Whether a run of the conversation is to come: :meth:`has_runs`, or one parked until its agent is
        configured again. Retention leaves such a conversation alone (it would end, archive or delete
        what that run is to answer); joining a channel's or task's open conversation does not wait for it."""
        return self.has_runs(conversation_id) or any(
            entry["conversation_id"] == conversation_id for entry in self._parked.values()
        )

    @property
    def parked(self) -> dict[str, int]:
        """The runs kept in the journal because their agent is not configured, by agent slug."""
        return dict(Counter(str(entry["agent_slug"]) for entry in self._parked.values()))

    def redoing(self, event_id: str, conversation_id: str) -> None:
        """A dispatch a previous process left (:meth:`dispatches_to_redo`) is of a stored event of
        ``conversation_id``: the conversation counts as busy (:meth:`has_runs`) until the dispatch is over,
        so a sweep after a long downtime does not end it while the orchestrator decides again."""
        if event_id in self._dispatching:
            self._redoing_in[event_id] = conversation_id

    async def _write_journal(self, wanted: int) -> None:
        async with self._journal_lock:
            if self._journal_written >= wanted:
                return  # a write that started after this change already covered it
            version = self._journal_version
            entries: list[dict[str, object]] = [{"dispatch": event_id} for event_id in self._dispatching]
            entries.extend(asdict(r) for k, r in self._pending.items() if k not in self._answered)
            entries.extend(entry for key, entry in self._parked.items() if key not in self._pending)
            payload = json.dumps(entries, separators=(",", ":"))
            waiters, self._start_waiters = self._start_waiters, []
            for at, future in waiters:
                if at > version:
                    self._start_waiters.append((at, future))
                elif not future.done():
                    future.set_result(None)
            # the store takes the write in before this task yields: the waiters just woken
            # run after it, so what they store next is ordered behind it
            await self._store.set_meta(self.journal_key, payload)
            self._journal_written = version

    async def _write_journal_logged(self, wanted: int) -> None:
        try:
            await self._write_journal(wanted)
        except Exception as exc:
            log_failure(log, "run_journal_write_failed", exc)
            raise

    async def accept(self, event_id: str) -> None:
        """Journal ``event_id`` as being dispatched; on return, anything the caller stores next
        is durable no sooner than that entry (so a crash never leaves the event stored and the
        entry lost).

        With a store that commits in order (``commits_in_order``) this waits only until the
        journal write is handed to the store (a write that fails later fails its group, or is
        logged); otherwise until it is durable, and raises when it fails (the event is then not
        to be stored: the relays deliver it again).
        """
        accepting = self._accepts.setdefault(event_id, _Accepts(fresh=event_id not in self._dispatching))
        accepting.in_flight += 1
        self._dispatching[event_id] = None
        self._journal_version += 1
        wanted = self._journal_version
        try:
            if not self._store.commits_in_order:
                await self._write_journal(wanted)
            else:
                started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                self._start_waiters.append((wanted, started))
                write = self._start_write(wanted)
                write.add_done_callback(lambda done: _fail_waiter(done, started))
                await started
            accepting.accepted = True
        finally:
            accepting.in_flight -= 1
            if not accepting.in_flight:
                # none accepted it (the same event may be accepted twice at once: one rumor in two wraps):
                # a later write must not journal it, or a restart would redo it
                del self._accepts[event_id]
                if accepting.fresh and not accepting.accepted:
                    self._dispatching.pop(event_id, None)

    @staticmethod
    def reply_journaled(reply_id: str) -> None:
        """The calling run journaled its reply as being dispatched (:meth:`accept`) before saving it: should
        this try fail, and a later one answer, the reply (never saved) leaves the journal then."""
        running = _CURRENT_RUN.get()
        if running is not None:
            running.routed.append(reply_id)

    def dispatched(self, event_id: str, *, at_once: bool = False) -> None:
        """The dispatch of ``event_id`` is over (its runs, if any, are scheduled): its entry
        leaves the journal with the next write, or at once with ``at_once``. While shutting down
        it stays (a run it asked for was refused): the next start dispatches it again."""
        self._redoing_in.pop(event_id, None)
        if event_id not in self._dispatching or not self._accepting:
            return
        del self._dispatching[event_id]
        if at_once:
            self._write_journal_soon()
        elif self._flush_task is None:
            self._flush_task = asyncio.create_task(self._flush_finished(), name="run journal flush")

    def dispatches_to_redo(self) -> list[str]:
        """The event ids a previous process accepted and did not finish dispatching (read by
        :meth:`recover`), oldest first; each stays journaled until :meth:`dispatched`."""
        return list(self._redo)

    async def submit(self, request: RunRequest) -> bool:
        """Schedule a run and start its journal write; False when shutting down or already scheduled."""
        if not self._accepting:
            return False
        key = self._key(request)
        if key in self._pending:
            return False
        self._pending[key] = request
        self._spawn(request)
        if request.trigger_id in self._dispatching:
            # Its trigger's entry is journaled and stays until this request is (any write that
            # drops the entry holds every request made meanwhile): no write of its own.
            return True
        # The run starts at once and the journal write goes on beside it: the run's first store
        # write (the agent's state) then shares a group commit with it instead of queueing behind
        # it, and the caller is free again. A failed write is logged and the run goes on.
        self._write_journal_soon()
        return True

    def _write_journal_soon(self) -> None:
        """Start a write covering every change made so far (tracked: :meth:`journaled` waits for it)."""
        self._journal_version += 1
        self._start_write(self._journal_version)

    def _start_write(self, wanted: int) -> asyncio.Task[None]:
        return self._writes.spawn(self._write_journal_logged(wanted), "write", log_failure=False)

    async def journaled(self) -> None:
        """Return once every run submitted so far is in the stored journal (or its write failed)."""
        await self._writes.gather()  # failures were logged

    def _spawn(self, request: RunRequest) -> None:
        name = f"run {request.agent_slug} {request.conversation_id[:8]}"
        key = self._key(request)
        task = self._tasks.spawn(self._execute(request), name, log_failure=False)
        self._task_of[key] = task
        task.add_done_callback(lambda done: self._forget_task(key, done))

    def _forget_task(self, key: str, task: asyncio.Task[None]) -> None:
        if self._task_of.get(key) is task:
            del self._task_of[key]

    async def _execute(self, request: RunRequest) -> None:
        """Run ``request``; a run that fails with an error (a store that went away: a database restart,
        a full disk) is tried again after each of ``RUN_RETRY_S``, as recovered (a reply it saved is
        published, not made again), and dropped after the last (``run_dropped``)."""
        key = self._key(request)
        try:
            for attempt, wait_s in enumerate((*RUN_RETRY_S, None), start=1):
                if await self._attempt(request, attempt):
                    break
                log_ctx = log.bind(
                    conversation_id=request.conversation_id,
                    event_id=request.trigger_id,
                    agent=request.agent_slug,
                )
                if wait_s is None:
                    self.dropped += 1
                    log_ctx.error("run_dropped", attempts=attempt)
                    break
                # recovered from now on, where a burst taken meanwhile reads it too (its failed try may have
                # saved a reply: that goes out, none is made again)
                request = self._recovered(key) or replace(request, recovered=True)
                log_ctx.warning("run_retry", attempt=attempt, retry_in_s=wait_s)
                await asyncio.sleep(wait_s)
        finally:  # answered, dropped, stopped or cancelled: the agent no longer works on it
            self._show(key, None)
        self._pending.pop(key, None)
        self._unsaved.pop(key, None)  # dropped or cancelled: the next start sorts out what it journaled
        self._answered.discard(key)
        self._saved_then_failed.discard(key)
        if self._flush_task is None:
            self._flush_task = asyncio.create_task(self._flush_finished(), name="run journal flush")

    async def _attempt(self, request: RunRequest, attempt: int) -> bool:
        """One try of a run: True when it ended (answered, or answered in a burst), False when it
        failed with an error (logged ``run_failed``, counted)."""
        log_ctx = log.bind(
            conversation_id=request.conversation_id, event_id=request.trigger_id, agent=request.agent_slug
        )
        try:
            async with self._conversation_locks.hold(request.conversation_id), self._run_slot(request):
                if self._key(request) in self._covered:
                    self._covered.discard(self._key(request))
                    log_ctx.info("run_answered_in_burst")
                else:
                    self.running += 1
                    run, covered = self._take_burst(request)
                    running = self._running[self._key(request)] = _Running(covered)
                    token = _CURRENT_RUN.set(running)
                    self._show(self._key(request), run)
                    for other in covered:  # shown from now on by this run, until its end
                        self._show(other, None)
                    try:
                        await self._run(run)
                        self.completed += 1
                        for reply_id in self._unsaved.pop(self._key(request), ()):
                            self.dispatched(reply_id)  # no-op for one a try found saved and routed
                        if covered:  # answered: out of the stored journal now, not when each turn comes,
                            # but for the one the reply names (a run redone for it finds the reply)
                            named = self._key(run)
                            self._answered.update(k for k in (self._key(request), *covered) if k != named)
                            self._write_journal_soon()
                    except BaseException:
                        self._covered.difference_update(covered)  # no reply: each gets its own turn
                        for other in covered:  # a reply the burst saved goes out again, none is made again
                            self._recovered(other)
                        if running.reply_in:
                            self._saved_then_failed.update((self._key(request), *covered))
                        if not running.reply_in:  # one in history is routed by the try that finds it
                            self._unsaved.setdefault(self._key(request), []).extend(running.routed)
                        raise
                    finally:
                        self.running -= 1
                        _CURRENT_RUN.reset(token)
                        self._running.pop(self._key(request), None)
                        running.saved.set()  # over: nobody waits for a reply that will not come
        except asyncio.CancelledError:
            if self._key(request) in self._stopping:
                log_ctx.info("run_stopped")
            else:
                log_ctx.warning("run_cancelled", reason="shutdown")
            raise
        except RunLeaseLostError as error:  # expected after a database restart: no traceback
            self.failed += 1
            log_ctx.warning("run_failed", attempt=attempt, error=str(error))
            return False
        except (ConversationNotFoundError, ConversationArchivedError) as gone:
            # deleted or archived meanwhile (the owner's doing, or retention's): no try could save an answer;
            # what the run journaled as being dispatched goes too
            log_ctx.info("run_abandoned", reason=str(gone))
            for reply_id in self._unsaved.pop(self._key(request), ()):
                self.dispatched(reply_id)
            return True
        except Exception:
            self.failed += 1
            log_ctx.exception("run_failed", attempt=attempt)
            return False
        return True

    def _recovered(self, key: str) -> RunRequest | None:
        """Mark the waiting request ``key`` recovered (a try that failed may have saved its reply); return it,
        or None when it no longer waits."""
        waiting = self._pending.get(key)
        if waiting is None:
            return None
        if not waiting.recovered:
            waiting = self._pending[key] = replace(waiting, recovered=True)
        return waiting

    def _show(self, key: str, run: RunRequest | None) -> None:
        """Tell the listener that ``key``'s ``run`` started, unless it was told already; with None, that the
        run shown for ``key`` ended, if one is."""
        if run is None:
            shown = self._shown.pop(key, None)
            if shown is not None:
                self._tell(shown, started=False)
        elif key not in self._shown:
            self._shown[key] = run
            self._tell(run, started=True)

    def _tell(self, run: RunRequest, *, started: bool) -> None:
        """Tell the listener (best effort: a listener's failure never touches the run)."""
        if self._listener is None:
            return
        try:
            if started:
                self._listener.run_started(run)
            else:
                self._listener.run_ended(run)
        except Exception:
            log.exception("run_listener_failed", conversation_id=run.conversation_id, agent=run.agent_slug)

    def replies_being_saved(self, conversation_id: str) -> list[ReplyBeingSaved]:
        """The replies of the conversation's runs that are being saved (a stop lets them finish): each with
        the event set once it is in history or the run is over, and the one the caller (a stop) sets once it
        has counted the reply in its record, which the run waits for before routing the reply."""
        held = []
        for key, running in self._running.items():
            if running.saving and not running.saved.is_set() and key.startswith(f"{conversation_id}:"):
                if running.recorded is None:
                    running.recorded = asyncio.Event()
                held.append(ReplyBeingSaved(running.saved, running.recorded, running))
        return held

    async def cancel(self, conversation_id: str, agent_slug: str | None = None) -> list[RunRequest]:
        """Stop the runs of ``conversation_id`` (only ``agent_slug``'s when given): running ones are
        cancelled, waiting ones dropped; when this returns they have ended and the stored journal no
        longer holds them (a restart does not redo them). A run whose reply is already being saved
        (:func:`saving_reply`), and the burst it answers, are let finish: a stop never leaves a reply
        half-saved. Returns the requests stopped, oldest first."""
        finishing: set[str] = set()
        in_bursts: set[str] = set()
        for key, running in self._running.items():
            in_bursts.update(running.covers)
            if running.saving:
                finishing.update((key, *running.covers))
        finishing.update(self._covered - in_bursts)  # answered by a burst run that is over
        finishing.update(self._saved_then_failed)  # their retry publishes the reply they saved
        chosen = [
            (key, request)
            for key, request in self._pending.items()
            if request.conversation_id == conversation_id
            and (agent_slug is None or request.agent_slug == agent_slug)
            and key not in finishing
        ]
        parked = [  # a stop covers the parked runs too: they leave the journal
            key for key, entry in self._parked.items() if entry["conversation_id"] == conversation_id
            and (agent_slug is None or entry["agent_slug"] == agent_slug)
        ]
        for key in parked:
            del self._parked[key]
        tasks = []
        for key, _ in chosen:
            del self._pending[key]
            self._covered.discard(key)
            self._stopping.add(key)
            task = self._task_of.get(key)
            if task is not None:
                task.cancel()
                tasks.append(task)
        try:
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self._stopping.difference_update(key for key, _ in chosen)
            for key, _ in chosen:  # a stopped run's reply is never saved: what it journaled goes
                for reply_id in self._unsaved.pop(key, ()):
                    self.dispatched(reply_id)
                self._answered.discard(key)
        if chosen or parked:
            self._write_journal_soon()
            await self.journaled()
        return [request for _, request in chosen]

    @contextlib.asynccontextmanager
    async def _run_slot(self, request: RunRequest) -> AsyncIterator[None]:
        """A place among the ``max_concurrent`` runs and, with daemons sharing a database (``peers``),
        the conversation's run lease, held for the whole run and the routing of its reply, so two daemons
        never run one conversation's agents at once. The place comes first, so at most ``max_concurrent``
        runs hold a lease's connection; while another daemon holds the lease, the run gives its place back
        and tries again (every 50 ms to 1 s), holding neither. Steps of the run take their own short lease
        (the manager's), which intake takes too, so intake never waits for a run.

        A database restart drops the lease with its connection: it is taken again once the database
        answers. If another daemon took it first, the run is cancelled (unless its reply is being saved:
        that finishes) and fails with :class:`RunLeaseLostError`, so it is tried again, as recovered,
        once the lease is free; a stop or a shutdown cancelling it at the same time still wins."""
        if self._peers is None:
            async with self._slots.hold(request.person):
                yield
            return
        delay = 0.05
        while True:
            loss = LeaseLoss()
            name = f"{RUN_LEASE_PREFIX}{request.conversation_id}"
            lease = self._peers.try_take(name, on_lost=partial(self._lease_lost, request, loss))
            async with self._slots.hold(request.person), lease as taken:
                if taken:
                    try:
                        yield
                    except asyncio.CancelledError:
                        if loss.only_cancellation():  # no stop or shutdown cancels the run too
                            raise RunLeaseLostError(request.conversation_id) from None
                        raise
                    except BaseException:
                        loss.only_cancellation()  # the run made the cancellation an error of its own
                        raise
                    return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _lease_lost(self, request: RunRequest, loss: LeaseLoss) -> None:
        """Another daemon took the running ``request``'s lease: cancel the run, to be tried again, unless
        its reply is being saved (it finishes) or a stop cancels it already."""
        key = self._key(request)
        running = self._running.get(key)
        cid = request.conversation_id
        if running is not None and running.saving:
            log.warning("run_lease_lost", conversation_id=cid, action="finish", reason="saving its reply")
        elif key not in self._stopping:
            log.warning("run_lease_lost", conversation_id=cid, action="retry")
            loss.cancel_run()

    def _take_burst(self, request: RunRequest) -> tuple[RunRequest, list[str]]:
        """The request to run now: when more messages to the same agent in the conversation wait, the
        newest of them, answering the others too (docs/CONTEXT.md, "Bursts"); their own turns then find
        them answered. Direct requests are taken with direct ones and routed ones with routed ones: each
        message the orchestrator routes starts a turn that ends the one before, so a routed burst's run
        answers the open turn (its newest), while a direct reply would leave a routed turn waiting.
        Returns the request to run and the keys it covers. Recovered when any of them is (its saved
        answers go out again)."""
        key = self._key(request)
        group = [
            (k, r)
            for k, r in self._pending.items()
            if k == key
            or (
                k not in self._covered
                and r.conversation_id == request.conversation_id
                and r.agent_slug == request.agent_slug
                and r.via_orchestrator == request.via_orchestrator
            )
        ]
        if key not in self._pending:
            group.insert(0, (key, request))
        if len(group) < 2:
            return request, []
        # in the order they came: a request tried again after a failure may be older than others waiting
        covered = [k for k, _ in group if k != key]
        self._covered.update(covered)
        newest = group[-1][1] if group[-1][0] != key else request
        earlier = tuple(r.trigger_id for _, r in group[:-1])
        log.info(
            "run_burst",
            conversation_id=request.conversation_id,
            agent=request.agent_slug,
            trigger=newest.trigger_id,
            answers_too=list(earlier),
        )
        recovered = request.recovered or any(r.recovered for _, r in group)
        return replace(newest, burst=earlier, recovered=recovered), covered

    async def _flush_finished(self) -> None:
        """Write the journal without the runs finished lately (they need no write of their own)."""
        await asyncio.sleep(FINISHED_FLUSH_S)
        self._flush_task = None
        self._write_journal_soon()  # tracked, so drain() waits for it

    async def recover(self) -> list[RunRequest]:
        """Schedule the runs a previous process journaled but did not finish; return them."""
        redo, requests = await self._take_in(self.journal_key)
        self._redo = redo
        if requests:
            log.info("runs_recovered", count=len(requests))
        if redo:
            log.info("dispatches_recovered", count=len(redo))
        return requests

    async def adopt(self, key: str) -> list[str]:
        """Take over the journal another daemon left under ``key`` (it died): its runs are scheduled
        here (as recovered) and, with its dispatches, are in this daemon's own journal when this
        returns; the caller may then forget ``key``. Returns the event ids whose dispatch to finish."""
        # taken over while draining: journaled here, started at the next start (the drain counted its runs)
        redo, requests = await self._take_in(key, start=self._accepting)
        self._journal_version += 1
        await self._write_journal(self._journal_version)
        log.info("run_journal_adopted", key=key, runs=len(requests), dispatches=len(redo))
        return redo

    async def _take_in(self, key: str, *, start: bool = True) -> tuple[list[str], list[RunRequest]]:
        """Read the journal under ``key`` and schedule its runs (started unless ``start`` is False: only
        journaled); return (dispatch ids, run requests)."""
        entries = await self._read_journal(key)
        redo = list(dict.fromkeys(str(item["dispatch"]) for item in entries if "dispatch" in item))
        requests = [
            request for item in entries if "dispatch" not in item
            if (request := journaled_request(item, key)) is not None
        ]
        unique = {self._key(r): r for r in requests}
        requests = [r for key, r in unique.items() if key not in self._pending and not self._park(key, r)]
        for event_id in redo:
            self._dispatching[event_id] = None
        for request in requests:
            self._pending[self._key(request)] = request
            if start:
                self._spawn(request)
        return redo, requests

    def _park(self, key: str, request: RunRequest) -> bool:
        """Keep ``request`` in the journal, not run, when its agent is not configured (removed, or renamed);
        return whether it was parked."""
        if self._agents is None or request.agent_slug in self._agents:
            return False
        if key not in self._parked:
            log.warning(
                "run_parked", conversation_id=request.conversation_id, event_id=request.trigger_id,
                agent=request.agent_slug, note="its agent is not configured: kept in the run journal, "
                "run at a start with the agent configured again",
            )
        self._parked[key] = asdict(request)
        return True

    async def _read_journal(self, key: str) -> list[dict[str, Any]]:
        raw = await self._store.get_meta(key)
        if not raw:
            return []
        try:
            entries = json.loads(raw)
        except ValueError:
            entries = None
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            log.error("run_journal_unreadable", key=key)
            return []
        return entries

    async def drain(self, grace_s: float) -> int:
        """Stop accepting, wait up to ``grace_s`` for runs, cancel the rest; return how many were cancelled.

        Cancelled runs stay in the journal and are redone by :meth:`recover` on the next start.
        """
        self._accepting = False
        await self.journaled()
        cancelled = 0
        if await self._tasks.wait(grace_s):
            cancelled = await self._tasks.cancel_all()
        flush, self._flush_task = self._flush_task, None
        if flush is not None:
            flush.cancel()
            await asyncio.gather(flush, return_exceptions=True)
            self._write_journal_soon()  # the runs finished since the last write leave it now
        await self.journaled()
        return cancelled


def _fail_waiter(write: asyncio.Task[None], started: asyncio.Future[None]) -> None:
    """A journal write that failed before reaching the store fails the caller waiting on it."""
    error = None if write.cancelled() else write.exception()  # retrieved: it was logged
    if started.done():
        return
    if write.cancelled():
        started.cancel()
    elif error is not None:
        started.set_exception(error)
    else:
        started.set_result(None)  # covered by a newer write that started first
