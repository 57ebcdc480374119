"""Health is data: the daemon writes its status file, ``tenexd status`` reads it.

The daemon rewrites ``<home>/run/status.json`` every few seconds (atomically: temp
file, fsync, ``os.replace``). The reader never talks to the daemon, so it works when
the daemon is stuck: a file older than ``stale_after_s`` is *stale* (its age read on the boot
clock when it was written in this boot, so a wall clock set meanwhile changes nothing), except
one in state ``starting`` whose process is still the one that wrote it (its identity checked): a
start writes the file as it begins and again once it serves, however long it takes. A missing
file, a file the daemon marked ``stopped``, or one whose process is gone means *stopped*.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

from tenex_daemon.app.files import write_text_atomic
from tenex_daemon.runtime.boot import boot_id, boot_seconds
from tenex_daemon.runtime.code_id import code_id

if TYPE_CHECKING:
    from tenex_daemon.adapters.nostr.relay_pool import PoolHealth
    from tenex_daemon.services.descriptions import DescriptionJobs
    from tenex_daemon.services.outbox import Outbox
    from tenex_daemon.services.retention import Sweeper, SweepReport, SweepTotals
    from tenex_daemon.services.runs import RunScheduler


class DaemonState(StrEnum):
    """What the daemon says about itself in the status file."""

    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


class Health(StrEnum):
    """What the reader concludes."""

    RUNNING = "running"
    """The file is fresh (or its daemon is still starting) and the daemon has not stopped (it may be starting
    or stopping)."""
    STALE = "stale"
    """The daemon's process exists (or cannot be checked) but stopped updating the file."""
    STOPPED = "stopped"
    """No file, the daemon wrote ``stopped``, or its process is gone."""


class RelayStatus(TypedDict):
    """One relay in the status file (the pool's ``RelayHealth.to_dict()``)."""

    url: str
    state: str
    """idle | connecting | connected | backoff | stopped."""
    read: bool
    write: bool
    connected_since: float | None
    reconnects: int
    last_event_at: float | None
    events_received: int
    rejects: dict[str, int]
    notices: int
    authenticated: bool
    last_error: str | None
    oks_attributed: int
    """Answers (``OK``) without an event id, attributed to the EVENT they answer, since start."""
    oks_unmatched: int
    """Answers without an event id that could not be attributed, since start (logged ``ok_unmatched``)."""
    subscriptions_closed: int
    """Live subscriptions the relay ended (``CLOSED``) while connected, since start; each is sent again."""
    unserved: dict[str, UnservedSubscription]
    """Per live subscription the relay ended and has not served since (no EOSE, no event)."""


class UnservedSubscription(TypedDict):
    """A live subscription a relay ended and has not served since."""

    for_s: float
    message: str
    """The relay's ``CLOSED`` message (``restricted: ...``)."""


class ConversationCounts(TypedDict):
    """Conversations known to the daemon."""

    total: int
    archived: int
    by_phase: dict[str, int]


class EventCounts(TypedDict):
    """Incoming events: accepted, rejected by reason, and copies of events already taken in (by this
    daemon, or by another daemon sharing its database that won the event)."""

    accepted: int
    rejected: dict[str, int]
    duplicates: int
    own_copies: int
    """Gift wraps whose rumor one of the project's agents wrote (its answers come back: stored already):
    neither taken in nor refused."""
    retry_dropped: int
    """Incoming events whose handling failed, dropped from the full retry set (left to the relays and the
    next start), since start."""


class RunCounts(TypedDict):
    """Agent runs since start."""

    completed: int
    """Runs that ended with a reply saved (an error reply included: ``with_error``)."""
    failed: int
    """Tries that failed with an error (a store gone for a moment), each tried again (up to 31 a run)."""
    dropped: int
    """Runs given up after their last try failed (``run_dropped``): a person left unanswered."""
    with_error: dict[str, int]
    """Of ``completed``, those whose backend failed (a wrong key, a provider down), answered with an error
    reply, by the failure's kind."""
    parked: dict[str, int]
    """Runs a journal holds for an agent not configured (removed or renamed), by its slug: kept, run at a
    start with the agent configured again (``run_parked``)."""


class LatencySummary(TypedDict):
    """Recent reply latencies (trigger taken in to reply sent), in milliseconds."""

    count: int
    p50_ms: float | None
    p99_ms: float | None


class OutboxStatus(TypedDict):
    """Signed events waiting for a relay's ``OK true`` (the durable outbox)."""

    depth: int
    oldest_age_s: float | None
    delivered: int
    """Events delivered since start."""
    retries: int
    """Publish attempts that no relay accepted, since start (each was tried again)."""
    refused: int
    """Events every relay refused for good, since start (not sent again; the person is told)."""


class DescriptionStatus(TypedDict):
    """Conversations' titles and summaries (docs/ARCHITECTURE.md, "Conversation lifecycle")."""

    queued: int
    """Conversations waiting to be described (with the one being described)."""
    described: int
    """Descriptions made since start."""
    fallbacks: int
    """Of those, made with the fallback text (the model failed, timed out or answered unreadably)."""
    unpublished: int
    """Descriptions whose kind-513 event no relay has accepted yet (tried again with backoff)."""
    published: int
    retries: int
    refused: int
    """kind-513 events every relay refused for good (not tried again until the description changes)."""


def no_descriptions() -> DescriptionStatus:
    """The descriptions' counters before the service runs: every one at zero."""
    return DescriptionStatus(
        queued=0, described=0, fallbacks=0, unpublished=0, published=0, retries=0, refused=0
    )


def outbox_status(outbox: Outbox | None) -> OutboxStatus:
    """The outbox's part of the status (zeros before the daemon built it)."""
    if outbox is None:
        return OutboxStatus(depth=0, oldest_age_s=None, delivered=0, retries=0, refused=0)
    age = outbox.oldest_age_s()
    return OutboxStatus(
        depth=outbox.depth,
        oldest_age_s=None if age is None else round(age, 3),
        delivered=outbox.delivered,
        retries=outbox.retries,
        refused=outbox.refused,
    )


def run_counts(scheduler: RunScheduler | None, error_replies: Mapping[str, int]) -> RunCounts:
    """The runs' part of the status (zeros before the daemon built its scheduler)."""
    if scheduler is None:
        return RunCounts(completed=0, failed=0, dropped=0, with_error=dict(error_replies), parked={})
    return RunCounts(
        completed=scheduler.completed, failed=scheduler.failed, dropped=scheduler.dropped,
        with_error=dict(error_replies), parked=scheduler.parked,
    )


def descriptions_status(jobs: DescriptionJobs | None) -> DescriptionStatus:
    """The titles' and summaries' part of the status (zeros before the service runs)."""
    if jobs is None:
        return no_descriptions()
    return DescriptionStatus(
        queued=jobs.queued,
        described=sum(jobs.described.values()),
        fallbacks=jobs.described["fallback"],
        unpublished=jobs.unpublished,
        published=jobs.published,
        retries=jobs.retries,
        refused=jobs.refused,
    )


class SweepCounts(TypedDict):
    """What retention sweeps did to conversations."""

    ended_idle: int
    archived: int
    deleted: int
    errors: int


class RetentionStatus(TypedDict):
    """The retention sweeper (docs/ARCHITECTURE.md, "Conversation lifecycle"): its sweeps since start."""

    sweeps: int
    last_sweep_at: float | None
    """When the newest sweep started (Unix seconds; None before the first)."""
    last_duration_s: float | None
    last: SweepCounts
    """The newest sweep's counts (zeros before the first)."""
    totals: SweepCounts
    """Every sweep's counts added up since start."""


def _sweep_counts(source: SweepReport | SweepTotals | None) -> SweepCounts:
    if source is None:
        return SweepCounts(ended_idle=0, archived=0, deleted=0, errors=0)
    return SweepCounts(
        ended_idle=source.ended_idle, archived=source.archived, deleted=source.deleted, errors=source.errors
    )


def retention_status(sweeper: Sweeper | None) -> RetentionStatus:
    """The sweeper's part of the status: its newest report and totals (zeros without a sweeper)."""
    last = None if sweeper is None else sweeper.last
    return RetentionStatus(
        sweeps=0 if sweeper is None else sweeper.totals.sweeps,
        last_sweep_at=None if last is None else last.started_at / 1000,
        last_duration_s=None if last is None else last.duration_s,
        last=_sweep_counts(last),
        totals=_sweep_counts(None if sweeper is None else sweeper.totals),
    )


class AgentEntry(TypedDict):
    """One configured agent."""

    slug: str
    name: str
    pubkey: str


class StatusData(TypedDict):
    """The status file's contract (what ``tenexd status`` and ``GET /api/v1/status`` read).

    Times are Unix seconds (float); the daemon fills every key. Example::

        {"version": "0.1.0", "code": "3f2a9c41d07e", "pid": 4242, "state": "running", "started_at": 1.7e9,
         "updated_at": 1.7e9,
         "uptime_s": 12.5, "home": "/srv/tenex", "relays": [{"url": "ws://127.0.0.1:7777",
         "state": "connected", "reconnects": 0, ...}], "conversations": {"total": 3, "archived": 0,
         "by_phase": {"chat": 2, "plan": 1}}, "runs_in_flight": 1,
         "runs": {"completed": 9, "failed": 0, "dropped": 0, "with_error": {}, "parked": {}},
         "last_event_at": 1.7e9, "events": {"accepted": 10, "rejected": {"author_not_allowed": 2},
         "duplicates": 4, "own_copies": 2}, "replies": 7,
         "reply_latency": {"count": 7, "p50_ms": 8.1, "p99_ms": 20.3},
         "outbox": {"depth": 0, "oldest_age_s": null, "delivered": 7, "retries": 0, "refused": 0},
         "descriptions": {"queued": 0, "described": 2, "fallbacks": 0, "unpublished": 0, "published": 2,
         "retries": 0, "refused": 0},
         "retention": {"sweeps": 12, "last_sweep_at": 1.7e9, "last_duration_s": 0.004, "last": {"ended_idle":
         1, "archived": 0, "deleted": 0, "errors": 0}, "totals": {"ended_idle": 3, ...}},
         "errors": {}, "routing_fallbacks": {"invalid_answer": 1}, "degraded": null,
         "embedded_relay": "ws://127.0.0.1:7777", "embedded_relay_pid": 4243,
         "embedded_relay_restarts": 0, "embedded_relay_last_restart_reason": null,
         "control_socket": "/srv/tenex/run/control.sock",
         "agents": [{"slug": "planner", "name": "Planner", "pubkey": "..."}]}
    """

    version: str
    code: str
    """The digest of the daemon's source files when it started (:func:`tenex_daemon.runtime.code_id.code_id`):
    ``tenexd status`` says when it differs from the code installed (a restart is due)."""
    pid: int
    state: str
    """A :class:`DaemonState` value."""
    started_at: float
    updated_at: float
    uptime_s: float
    home: str
    relays: list[RelayStatus]
    conversations: ConversationCounts
    runs_in_flight: int
    runs: RunCounts
    last_event_at: float | None
    events: EventCounts
    replies: int
    reply_latency: LatencySummary
    outbox: OutboxStatus
    descriptions: DescriptionStatus
    retention: RetentionStatus
    errors: dict[str, int]
    routing_fallbacks: dict[str, int]
    """Routings the orchestrator's model did not decide, by why: ``invalid_answer`` (two invalid answers: a
    person's message routed by the rules, a completion to the default agent), ``backend_failed`` (routed
    by the rules); empty when no model routes."""
    degraded: str | None
    """Why the daemon serves but is not healthy (incoming events it could not store, retried), or None."""
    embedded_relay: str | None
    """The embedded relay's URL when it runs."""
    embedded_relay_pid: int | None
    embedded_relay_restarts: int
    embedded_relay_last_restart_reason: str | None
    """Why the embedded relay was last started again: ``exited`` or ``unresponsive`` (killed); None: never."""
    control_socket: str
    """The control API's Unix socket."""
    agents: list[AgentEntry]
    process: str | None
    """The daemon process's identity beside its pid (:func:`process_identity`): a pid a crashed daemon
    left, taken since by another process, is not taken for the daemon."""
    boot_id: NotRequired[str | None]
    """The machine's boot when the file was written (:func:`write_status` adds it; the API's has none)."""
    updated_boot_s: NotRequired[float]
    """When the file was written, on that boot's clock (seconds since boot): its age, read in the same boot,
    is what no step of the wall clock (NTP, a person) moves."""


def relay_statuses(health: PoolHealth | None) -> list[RelayStatus]:
    """The relays of the pool's health, as the status document shows them."""
    return [
        RelayStatus(
            url=relay.url, state=relay.state.value, read=relay.read, write=relay.write,
            connected_since=relay.connected_since, reconnects=relay.reconnects,
            last_event_at=relay.last_event_at, events_received=relay.events_received,
            rejects=dict(relay.rejects), notices=relay.notices,
            authenticated=relay.authenticated, last_error=relay.last_error,
            oks_attributed=relay.oks_attributed, oks_unmatched=relay.oks_unmatched,
            subscriptions_closed=relay.subscriptions_closed,
            unserved={
                sub: UnservedSubscription(for_s=for_s, message=why)
                for sub, (for_s, why) in relay.unserved.items()
            },
        )
        for relay in (health.relays if health is not None else ())
    ]


def process_identity(pid: int) -> str | None:
    """The boot's id and the process's start time (clock ticks since boot) of process ``pid``: unique to
    one process of one boot; None when it cannot be read (no such process, no ``/proc``)."""
    boot = boot_id()
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    if boot is None:
        return None
    fields = stat_line.rpartition(")")[2].split()  # the name, in parentheses, may hold spaces
    return f"{boot}:{fields[19]}" if len(fields) > 19 else None


def new_status(
    version: str, *, pid: int | None = None, started_at: float | None = None, home: str = ""
) -> StatusData:
    """Return a status in state ``starting`` with every counter at zero (the daemon updates it)."""
    now = time.time()
    start = now if started_at is None else started_at
    pid = os.getpid() if pid is None else pid
    return StatusData(
        version=version,
        code=code_id(),
        pid=pid,
        state=DaemonState.STARTING.value,
        started_at=start,
        updated_at=now,
        uptime_s=max(0.0, now - start),
        home=home,
        relays=[],
        conversations=ConversationCounts(total=0, archived=0, by_phase={}),
        runs_in_flight=0,
        runs=RunCounts(completed=0, failed=0, dropped=0, with_error={}, parked={}),
        last_event_at=None,
        events=EventCounts(accepted=0, rejected={}, duplicates=0, own_copies=0, retry_dropped=0),
        replies=0,
        reply_latency=LatencySummary(count=0, p50_ms=None, p99_ms=None),
        outbox=OutboxStatus(depth=0, oldest_age_s=None, delivered=0, retries=0, refused=0),
        descriptions=no_descriptions(),
        retention=retention_status(None),
        errors={},
        routing_fallbacks={},
        degraded=None,
        embedded_relay=None,
        embedded_relay_pid=None,
        embedded_relay_restarts=0,
        embedded_relay_last_restart_reason=None,
        control_socket="",
        agents=[],
        process=process_identity(pid),
    )


def write_status(path: str | os.PathLike[str], data: StatusData) -> None:
    """Write ``data`` as JSON atomically: temp file beside it, fsync, ``os.replace``, fsync the folder.

    ``updated_at`` is set to now, ``boot_id`` and ``updated_boot_s`` to this boot's (and ``uptime_s``, from
    ``started_at``, when the data has none). The
    file is created with mode 0600 and its folder with 0700 if missing. Blocking: call
    it from a thread (``asyncio.to_thread``) inside the event loop.
    """
    target = Path(path)
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    payload: dict[str, Any] = dict(data)
    now = time.time()
    payload["updated_at"] = now
    payload["boot_id"], payload["updated_boot_s"] = boot_id(), round(boot_seconds(), 3)
    started = payload.get("started_at")
    if isinstance(started, int | float) and not isinstance(payload.get("uptime_s"), int | float):
        payload["uptime_s"] = round(max(0.0, now - float(started)), 3)
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), default=str)
    write_text_atomic(target, text)
    if payload.get("state") == "starting":
        _sweep_stale_temps(target, now)


STALE_TEMP_S = 60.0
"""A status file's temp file older than this, found when a daemon starts, was left by a kill mid-write."""


def _sweep_stale_temps(target: Path, now: float) -> None:
    """Remove the temp files of ``target`` a killed write left (``.<name>.<random>.tmp``, older than
    :data:`STALE_TEMP_S`: a write in progress is younger)."""
    for temp in target.parent.glob(f".{target.name}.*.tmp"):
        with contextlib.suppress(OSError):
            if now - temp.stat().st_mtime > STALE_TEMP_S:
                temp.unlink()


@dataclass(frozen=True, slots=True)
class StatusReport:
    """What :func:`read_status` found: a verdict, the data, how old it is and why."""

    state: Health
    data: dict[str, Any] | None
    age_s: float | None
    """Seconds since the daemon last wrote the file (None without a readable file)."""
    reason: str
    """One sentence for people: what was found."""
    path: Path

    @property
    def daemon_state(self) -> str | None:
        """What the daemon wrote about itself (starting | running | stopping | stopped)."""
        if self.data is None:
            return None
        value = self.data.get("state")
        return value if isinstance(value, str) else None

    @property
    def healthy(self) -> bool:
        """Whether the daemon is up and serving: a fresh file in state ``running``, not degraded."""
        return (self.state is Health.RUNNING and self.daemon_state == DaemonState.RUNNING.value
                and not self.degraded)

    @property
    def degraded(self) -> str | None:
        """Why the daemon said it is degraded (it serves, but e.g. cannot store what arrives), or None."""
        value = None if self.data is None else self.data.get("degraded")
        return value if isinstance(value, str) and value else None

    def to_dict(self) -> dict[str, Any]:
        """Return JSON-ready data: verdict, health, age, reason, path and the daemon's own status."""
        return {
            "state": self.state.value,
            "healthy": self.healthy,
            "age_s": None if self.age_s is None else round(self.age_s, 3),
            "reason": self.reason,
            "path": str(self.path),
            "status": self.data,
        }


PID_MAX = 2**31 - 1
"""The largest process id a system may have (``pid_t`` is a 32-bit signed integer); past it ``os.kill``
cannot even be asked."""


def _pid_of(value: object) -> int | None:
    """``value`` as a process id: a whole number from 1 to :data:`PID_MAX` (not a boolean, not a float),
    else None."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= PID_MAX:
        return value
    return None


def _timestamp(value: object) -> float | None:
    """``value`` as seconds since the epoch: a finite number (not a boolean), else None."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    try:
        seconds = float(value)
    except OverflowError:  # a whole number past any float
        return None
    return seconds if math.isfinite(seconds) else None


def _process_exists(pid: int) -> bool | None:
    """Whether a process with this id exists (None when it cannot be told)."""
    if _pid_of(pid) is None:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return None
    return True


def read_status(
    path: str | os.PathLike[str], stale_after_s: float, *, now: float | None = None, home: Path | None = None
) -> StatusReport:
    """Read the status file and judge it: running, stale or stopped (see :class:`Health`); with ``home``, a
    file another home's daemon wrote (this home a copy of that one) reads as stopped. Its age is read on the
    boot clock when it was written in this boot, else on the wall clock (``now``, when given: the caller's).

    Never raises for a missing, unreadable or malformed file: that is a report too; but a file this user may
    not read raises PermissionError: who may not read it cannot tell whether the daemon runs.
    """
    target = Path(path)
    moment = time.time() if now is None else now
    try:
        raw = target.read_text(encoding="utf-8")
    except FileNotFoundError:
        return StatusReport(Health.STOPPED, None, None, f"not running: no status file at {target}", target)
    except PermissionError:
        raise
    except OSError as exc:
        return StatusReport(
            Health.STOPPED, None, None, f"not running: cannot read {target} ({exc.strerror})", target
        )
    except UnicodeDecodeError:  # not text the daemon wrote: as any content that is not its JSON
        raw = ""
    try:
        loaded = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON; a number of too many digits; arrays nested too deep
        loaded = None
    if not isinstance(loaded, dict):
        return StatusReport(Health.STALE, None, None, f"status file {target} is not a JSON object", target)
    data: dict[str, Any] = loaded
    if data.get("pid") is not None and _pid_of(data["pid"]) is None:
        return StatusReport(
            Health.STALE, None, None,
            f"status file {target} is not valid: its pid is not a process id (a whole number from 1 to "
            f"{PID_MAX})",
            target,
        )
    updated = _timestamp(data.get("updated_at"))
    if updated is None:
        try:
            updated = target.stat().st_mtime
        except FileNotFoundError:  # removed since it was read (a stop's last write replaces it): as read
            updated = moment
    age = max(0.0, moment - updated)
    if now is None:
        age = _boot_age(data, age)
    return _judge(data, age, stale_after_s, target, f"status updated {age:.1f} s ago", home)


def _boot_age(data: Mapping[str, Any], wall_age: float) -> float:
    """The seconds since a status file was written, on the boot clock when it was written in this boot (a
    wall clock set since, forward or back, changes nothing); else ``wall_age``."""
    written = data.get("updated_boot_s")
    if not isinstance(written, int | float) or isinstance(written, bool) or not math.isfinite(written):
        return wall_age
    boot = data.get("boot_id")
    if not isinstance(boot, str) or boot != boot_id():
        return wall_age
    return max(0.0, boot_seconds() - float(written))


def live_report(data: dict[str, Any], path: str | os.PathLike[str], file_age_s: float | None) -> StatusReport:
    """Judge the status the daemon answered on its control API just now (never stale: it answered). When its
    status file is older than :data:`FILE_LAG_NOTED_S` (a full disk stops its writes), the reason says so."""
    report = _judge(data, 0.0, float("inf"), Path(path), "answered on its control API")
    if file_age_s is not None and file_age_s > FILE_LAG_NOTED_S:
        note = f"; its status file was last written {file_age_s:.0f} s ago (is the disk full?)"
        report = StatusReport(report.state, report.data, report.age_s, report.reason + note, report.path)
    return report


FILE_LAG_NOTED_S = 10.0
"""A status file older than this while the daemon answers live is pointed out (its writes fail)."""


def _same_folder(one: Path, other: Path) -> bool:
    """Whether two paths name one folder (one that is gone, or no path, is not the other)."""
    if one == other:
        return True
    try:
        return os.path.samefile(one, other)
    except (OSError, ValueError):
        return False


def _judge(
    data: dict[str, Any], age: float, stale_after_s: float, target: Path, when: str, home: Path | None = None
) -> StatusReport:
    """Running, stale or stopped, from a status document ``age`` seconds old (of ``home``'s daemon)."""
    pid = data.get("pid")
    process = _pid_of(pid)
    daemon_state = data.get("state")
    if daemon_state == DaemonState.STOPPED.value:
        return StatusReport(Health.STOPPED, data, age, f"not running: pid {pid} stopped cleanly", target)
    written_for = data.get("home")
    if home is not None and isinstance(written_for, str) and written_for and not _same_folder(
        Path(written_for), home
    ):
        return StatusReport(
            Health.STOPPED, data, age,
            f"not running here: the status file is the daemon's of {written_for} (pid {pid}), not of this "
            f"home ({home}): is this home a copy of that one?",
            target,
        )
    if process is not None and _process_exists(process) is False:
        return StatusReport(
            Health.STOPPED, data, age,
            f"not running: pid {pid} is gone without writing 'stopped' (killed or crashed)", target,
        )
    recorded = data.get("process")
    current = process_identity(process) if process is not None and isinstance(recorded, str) else None
    if current is not None and current != recorded:
        return StatusReport(
            Health.STOPPED, data, age,
            f"not running: pid {pid} is another process now; the daemon is gone without writing 'stopped' "
            "(killed or crashed)",
            target,
        )
    # a daemon still starting (a long catch-up) writes its status again only once it serves: while its
    # process is the one that wrote the file (its identity checked), it reads as starting, never stale
    if daemon_state == DaemonState.STARTING.value and current is not None:
        return StatusReport(Health.RUNNING, data, age, f"starting: pid {pid}, {when}", target)
    if age > stale_after_s:
        return StatusReport(
            Health.STALE, data, age,
            f"stale: pid {pid} last updated its status {age:.0f} s ago (limit {stale_after_s:g} s); "
            "the daemon may be stuck, or unable to write it (a full disk, no file descriptor left: see its "
            "log)",
            target,
        )
    degraded = data.get("degraded")
    if daemon_state == DaemonState.RUNNING.value and isinstance(degraded, str) and degraded:
        reason = f"degraded: pid {pid}, {when}: {degraded}"
    elif daemon_state == DaemonState.RUNNING.value:
        reason = f"running: pid {pid}, {when}"
    else:
        reason = f"{daemon_state}: pid {pid}, {when}"
    return StatusReport(Health.RUNNING, data, age, reason, target)


RELAYS_DOWN_DEGRADED_S = 60.0
"""Seconds without any relay connected after which the daemon says it is degraded: it hears nobody and
its answers wait in the outbox."""


class RelaysDown:
    """Since when no relay has been connected (relays down, the embedded relay dead)."""

    def __init__(self) -> None:
        self._since: float | None = None

    def seconds(self, health: PoolHealth | None, now: float) -> float:
        """How long no relay has been connected as of ``now`` (0 while one is, or before the pool runs);
        ``now`` from a monotonic clock (a wall clock stepped back would hide the outage)."""
        if health is None or not health.relays or health.connected:
            self._since = None
            return 0.0
        if self._since is None:
            self._since = now
        return now - self._since


FAILING_RUNS_DEGRADED = 3
"""Runs of one agent in a row ending in an error reply (its backend failing) after which the daemon says it
is degraded: every person it hears is answered with an error."""
FAILING_RECENT_S = 900.0
"""Seconds after an agent's last failed run for which its failures in a row still make the daemon degraded:
an agent nobody wrote to since a provider's outage is not reported for ever (its next run tells)."""


@dataclass(frozen=True)
class Backlog:
    """What waits on the daemon's way out, for :func:`degraded_reason`."""

    outbox_oldest_s: float | None = None
    """How long the oldest signed event in the outbox has waited for a relay to take it (None: none waits)."""
    outbox_limit_s: float = float("inf")
    """Past this wait the outbox is stuck (``daemon.outbox_warn_after_s``)."""
    failing: Mapping[str, tuple[int, str, float]] = field(default_factory=dict)
    """Agent slug -> (runs in a row ending in an error reply of its backend, the newest one's failure kind,
    when it ended: monotonic)."""
    now: float = 0.0
    """The monotonic clock's reading, for the age of ``failing``'s newest failures."""


def degraded_reason(
    pool_health: PoolHealth | None, store_error: str | None, relays_down_s: float,
    store_stuck_s: float | None = None, backlog: Backlog | None = None,
) -> str | None:
    """Why the daemon is degraded (its store does not answer; a write to it has waited ``store_stuck_s``,
    long enough to call it stuck; incoming events it failed to handle, retried; no relay connected for
    :data:`RELAYS_DOWN_DEGRADED_S` or more; what it signed waits past ``daemon.outbox_warn_after_s`` for a
    relay to take it; an agent's last :data:`FAILING_RUNS_DEGRADED` runs or more each ended in an error
    reply of its backend, the newest within :data:`FAILING_RECENT_S`), or None."""
    reasons = []
    if store_error is not None:
        reasons.append(f"store: not answering ({store_error})")
    if store_stuck_s is not None:
        reasons.append(f"store: a write has waited {int(store_stuck_s)} s (a disk or a database that hangs?)")
    if pool_health is not None and pool_health.retrying:
        reasons.append(
            f"intake: {pool_health.retrying} incoming events failed to be handled and are retried "
            f"with backoff (last error: {pool_health.last_consumer_error})"
        )
    if pool_health is not None:
        reasons.extend(_unserved_reasons(pool_health))
    if pool_health is not None and relays_down_s >= RELAYS_DOWN_DEGRADED_S:
        errors = sorted({r.last_error for r in pool_health.relays if r.last_error})
        last = f" (last error: {errors[0]})" if errors else ""
        reasons.append(f"relays: none connected for {int(relays_down_s)} s{last}")
    if backlog is not None:
        reasons.extend(_backlog_reasons(backlog))
    return "; ".join(reasons) or None


def _backlog_reasons(backlog: Backlog) -> list[str]:
    reasons = []
    if backlog.outbox_oldest_s is not None and backlog.outbox_oldest_s >= backlog.outbox_limit_s:
        reasons.append(
            f"outbox: a signed event has waited {int(backlog.outbox_oldest_s)} s for a relay to take it "
            "(relays refusing or not answering?)"
        )
    for slug, (in_a_row, kind, at) in sorted(backlog.failing.items()):
        if in_a_row >= FAILING_RUNS_DEGRADED and backlog.now - at < FAILING_RECENT_S:
            reasons.append(f"agent {slug}: its last {in_a_row} runs ended in an error reply ({kind})")
    return reasons


def _unserved_reasons(health: PoolHealth) -> list[str]:
    """A live subscription every connected reading relay ended and has not served for
    :data:`RELAYS_DOWN_DEGRADED_S`: the daemon, connected, hears nothing of what it asks for there (relays
    down are not asked: with none connected, "none connected" says it)."""
    readers = [relay for relay in health.relays if relay.read and relay.state == "connected"]
    if not readers:
        return []
    refused = set.intersection(*(set(relay.unserved) for relay in readers))
    reasons = []
    for sub in sorted(refused):
        for_s = min(relay.unserved[sub][0] for relay in readers)
        if for_s >= RELAYS_DOWN_DEGRADED_S:
            message = readers[0].unserved[sub][1]
            reasons.append(
                f"relays: subscription {sub} refused by every connected relay for {int(for_s)} s ({message})"
            )
    return reasons
