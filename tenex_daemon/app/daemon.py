"""The daemon: relays in, conversations kept, agents run, replies out; health written for `tenexd status`.

Lifecycle (docs/STYLE.md): signals only set an event (a second one forces the exit: ``stop_signals.py``);
on stop, intake stops, in-flight runs get a grace period, then the control API, relay connections and the
store close, in that order.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections import Counter
from collections.abc import Coroutine
from functools import partial
from typing import Any, TypeVar

import structlog

from tenex_daemon import __version__
from tenex_daemon.adapters.llm.claude_code import end_leftover_calls
from tenex_daemon.adapters.nostr.announcements import AgentCapabilities, announce, heartbeat_event
from tenex_daemon.adapters.nostr.classifier import classify_event, conversation_lane
from tenex_daemon.adapters.nostr.codec import Limits
from tenex_daemon.adapters.nostr.composer import SignedReplyComposer
from tenex_daemon.adapters.nostr.private import GiftWrapPublisher, GiftWraps, PrivateReplyComposer
from tenex_daemon.adapters.nostr.profiles import RelayProfileNames
from tenex_daemon.adapters.nostr.publisher import PoolPublisher
from tenex_daemon.adapters.nostr.relay_pool import (
    PoolSettings,
    ReceivedEvent,
    RelayEventResolver,
    RelayPool,
    Remember,
)
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.adapters.nostr.status_events import StatusEventPublisher
from tenex_daemon.app.embedded_relay import EmbeddedRelay
from tenex_daemon.app.intake_filters import addressed_since, intake_filters
from tenex_daemon.app.metrics import Metrics
from tenex_daemon.app.notify import (
    READY_WITHIN_S,
    STOPPING_WITHIN_S,
    SystemdNotifier,
    keep_starting,
    ready_lines,
    stopping_lines,
)
from tenex_daemon.app.refusals import RefusalLog
from tenex_daemon.app.run_observer import MetricsObserver
from tenex_daemon.app.settings import Settings, StorageKind
from tenex_daemon.app.status import (
    AgentEntry,
    Backlog,
    ConversationCounts,
    RelaysDown,
    StatusData,
    degraded_reason,
    descriptions_status,
    outbox_status,
    process_identity,
    relay_statuses,
    retention_status,
    run_counts,
    write_status,
)
from tenex_daemon.app.stop_signals import StopSignals
from tenex_daemon.app.store_check import check_the_store, open_when_free, refuse_a_store_behind
from tenex_daemon.app.watchdog import PROBE_EVERY_S, Watchdog, store_probe, watchdog_key
from tenex_daemon.app.wiring import (
    Pipeline,
    PipelineOptions,
    PipelinePorts,
    build_agent_profile,
    build_agents,
    build_descriptions,
    build_orchestrator,
    build_pipeline,
    build_store,
    instance_keys,
    load_signers,
    routing_fallbacks,
    wraps_key_for,
)
from tenex_daemon.core.agents import Agent
from tenex_daemon.core.errors import TenexError
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.ports import PeerMessages, Peers, Store
from tenex_daemon.core.targeting import SkipReason
from tenex_daemon.core.vocabulary import (
    KIND_GIFT_WRAP,
    KIND_STOP,
)
from tenex_daemon.runtime.background import BackgroundTasks, unless_set
from tenex_daemon.runtime.code_id import code_id
from tenex_daemon.runtime.failures import log_failure
from tenex_daemon.runtime.loop_errors import LoopErrors
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.services.descriptions import DescriptionJobs
from tenex_daemon.services.dispatcher import HandleResult, Outcome
from tenex_daemon.services.outbox import every_outbox, outbox_key_for
from tenex_daemon.services.private_messages import AGENT_PRIVATE_COPY, Intake
from tenex_daemon.services.retention import RetentionPolicy, Sweeper, WallClockSteps
from tenex_daemon.services.runs import journal_key_for
from tenex_daemon.services.upgrade import save_upgraded_conversations

log = structlog.get_logger(__name__)
T = TypeVar("T")

BEHIND_CHECK_WAIT_S = 2.0
"""How long the start waits for the relays' answer to whether the store is behind them."""

REDISPATCH_RETRY_S = (1.0, 10.0, 60.0)
"""Waits before each retry of a dispatch interrupted by a crash that fails again."""

PEER_GRACE_S = 5.0
"""How long another daemon's name must stay free before it is believed dead and taken over."""
STATUS_COUNT_WAIT_S = 5.0
"""How long the status loop waits for the store's conversation counts before it writes the status as
degraded (a database that does not answer)."""
SUBSCRIPTION_ID = "tenexd-mentions"
PRIVATE_SUBSCRIPTION_ID = "tenexd-private"
"""Gift wraps (kind 1059) p-tagging an agent: private messages (NIP-17)."""
WRAP_LOOKBACK_S = 2 * 24 * 3600
"""A gift wrap is dated up to two days in the past (NIP-59): a re-subscription asks that much further back."""


class InstanceNameTakenError(TenexError):
    """Another daemon on the database holds this daemon's name (``daemon.instance_id``)."""

    def __init__(self, instance: str) -> None:
        super().__init__(
            f"another daemon on this database is named {instance!r} (daemon.instance_id), or the database "
            "does not answer: each daemon sharing a database needs its own instance_id (is this home's "
            "daemon running already?)"
        )


class ShuttingDownError(RuntimeError):
    """Raised to the relay pool for events arriving during shutdown, so they are not marked processed."""


class Daemon:
    """tenexd's long-running process for one project home."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.notifier = SystemdNotifier()
        self.state = "starting"
        self.started_at = time.time()
        self._started = time.monotonic()  # uptime: a wall clock stepped back does not make it negative
        self.last_event_at: float | None = None
        self.events_accepted: Counter[str] = Counter()
        self.events_ignored: Counter[str] = Counter()
        self.own_copies = 0
        self.errors: Counter[str] = Counter()
        self._stop_requested: asyncio.Event | None = None
        self.signals = StopSignals(self.request_stop)
        """SIGTERM, SIGINT: the first asks for the graceful stop, a second forces the exit."""
        self._ready = asyncio.Event()
        self._status_writes = asyncio.Lock()
        """One status file write at a time (the status loop's and the lifecycle's)."""
        self._stopping = False
        self._background = BackgroundTasks("daemon")
        self._conversation_counts = ConversationCounts(total=0, archived=0, by_phase={})
        self._store_error: str | None = None
        self._relays_down = RelaysDown()
        self._watchdog: Watchdog | None = None
        """Probes the store (and pings systemd's watchdog when asked): a stuck store shows as degraded."""
        self._process = process_identity(os.getpid())
        """Why the store did not answer the status loop's last count (None: it did), shown as degraded."""
        self.embedded_relay: EmbeddedRelay | None = None
        self.store: Store | None = None
        self._store_opened = False
        """Whether the store opened (a filesystem store: its lock taken): the status file is this daemon's."""
        self.pool: RelayPool | None = None
        self.instance = settings.daemon.instance_id or uuid.uuid4().hex[:12]
        """This daemon's name among those sharing a PostgreSQL database."""
        self._peers: Peers | None = None
        self._peer_free_since: dict[str, tuple[float, int]] = {}
        """Peers whose name was found free, and since when (monotonic); see ``_believed_dead``."""
        self._lifetime = contextlib.AsyncExitStack()
        self.pipeline: Pipeline | None = None
        """Manager, runner, dispatcher and scheduler (:func:`build_pipeline`), once started."""
        self._gift_wraps: GiftWrapPublisher | None = None
        """Private replies' wraps, kept until a relay took each (taken over with a dead daemon's outbox)."""
        self.agents: list[Agent] = []
        self.project_signer: Signer | None = None
        self._observer = MetricsObserver(self.metrics)
        self.descriptions: DescriptionJobs | None = None
        """Titles, summaries and their kind-513 events (:func:`build_descriptions`), once started."""
        self.sweeper: Sweeper | None = None
        """The retention sweeper (idle ending, archiving, deleting), once started."""
        self.intake: Intake | None = None
        """Gift wraps opened, the answer setting applied, before the dispatcher (once started)."""
        self.stranger_log = RefusalLog()
        self.intake_refusal_log = RefusalLog()
        """What the intake refused (gift wraps, and what daemon.answer excludes), logged once a minute per
        reason: each wrap comes from a one-time key."""
        self.metrics.watch_pool(lambda: self.pool.health() if self.pool is not None else None)
        self.metrics.watch_runs(
            lambda: self.pipeline.scheduler.failed if self.pipeline is not None else 0,
            lambda: self.pipeline.scheduler.dropped if self.pipeline is not None else 0,
        )
        self.metrics.watch_routing(lambda: routing_fallbacks(self.pipeline))

    # --- the ControlTarget protocol -------------------------------------------------------

    @property
    def manager(self) -> ConversationManager:
        """The conversation manager (available once the daemon has started)."""
        if self.pipeline is None:
            raise RuntimeError("the daemon has not started yet")
        return self.pipeline.manager

    def status(self) -> StatusData:
        """Return the health snapshot written to the status file and served by the control API."""
        now = time.time()
        pool_health = self.pool.health() if self.pool is not None else None
        embedded = self.embedded_relay
        scheduler = self.pipeline.scheduler if self.pipeline is not None else None
        ignored = dict(self.events_ignored)
        rejected = {**(dict(pool_health.rejects) if pool_health is not None else {}), **ignored}
        outbox = outbox_status(self.pipeline.outbox if self.pipeline is not None else None)
        return StatusData({
            "version": __version__,
            "code": code_id(),
            "pid": os.getpid(),
            "state": self.state,
            "started_at": self.started_at,
            "updated_at": now,
            "uptime_s": round(time.monotonic() - self._started, 3),
            "home": str(self.settings.home),
            "relays": relay_statuses(pool_health),
            "conversations": self._conversation_counts,
            "runs_in_flight": scheduler.in_flight if scheduler is not None else 0,
            "runs": run_counts(scheduler, self._observer.error_replies),
            "last_event_at": self.last_event_at,
            "events": {
                "accepted": sum(self.events_accepted.values()),
                "rejected": rejected,
                "duplicates": (pool_health.duplicates if pool_health is not None else 0)
                + self.metrics.handled_duplicates,
                "own_copies": self.own_copies,
                "retry_dropped": pool_health.retry_dropped if pool_health is not None else 0,
            },
            "replies": self._observer.replies,
            "reply_latency": self._observer.latency_summary(),
            "outbox": outbox,
            "descriptions": descriptions_status(self.descriptions),
            "retention": retention_status(self.sweeper),
            "errors": dict(self.errors),
            "routing_fallbacks": dict(routing_fallbacks(self.pipeline)),
            "degraded": degraded_reason(
                pool_health, self._store_error, self._relays_down.seconds(pool_health, time.monotonic()),
                self._watchdog.stuck_s() if self._watchdog is not None else None,
                Backlog(
                    outbox["oldest_age_s"], self.settings.daemon.outbox_warn_after_s, self._observer.failing,
                    time.monotonic(),
                ),
            ),
            "embedded_relay": embedded.url if embedded is not None else None,
            "embedded_relay_pid": embedded.pid if embedded is not None else None,
            "embedded_relay_restarts": embedded.restarts if embedded is not None else 0,
            "embedded_relay_last_restart_reason": embedded.last_restart_reason if embedded else None,
            "control_socket": str(self.settings.control_socket_path),
            "agents": [AgentEntry(slug=a.slug, name=a.name, pubkey=a.pubkey) for a in self.agents],
            "process": self._process,
        })

    def reply_latencies(self) -> list[float]:
        """Seconds from each recent trigger taken in to its reply sent (oldest first, the newest 1,000)."""
        return list(self._observer.reply_latencies)

    # --- lifecycle ------------------------------------------------------------------------

    async def wait_ready(self) -> None:
        """Return once the daemon serves (relays subscribed, control API up)."""
        await self._ready.wait()

    def request_stop(self) -> None:
        """Ask the daemon to stop (what a first SIGTERM or SIGINT does)."""
        if self._stop_requested is not None:
            self._stop_requested.set()

    @property
    def relay_urls(self) -> list[str]:
        """Every relay the daemon connects to (the embedded one first)."""
        urls = list(self.settings.relays.urls)
        if self.embedded_relay is not None and self.embedded_relay.url not in urls:
            urls.insert(0, self.embedded_relay.url)
        return urls

    async def run(self) -> None:
        """Start everything, serve until asked to stop, then shut down in reverse order."""
        from tenex_daemon.app.control_api import ControlServer

        control = ControlServer(
            self, self.settings.control_socket_path, self.settings.control.tcp_port,
            token_path=self.settings.control_token_path,
        )
        control.check()  # a control file or path it cannot start with: said before anything starts
        self._stop_requested = asyncio.Event()
        loop = asyncio.get_running_loop()
        handler = loop.get_exception_handler()
        loop.set_exception_handler(LoopErrors())  # a repeating OSError of asyncio's own: once a minute
        self.signals.install(loop)
        try:
            extending = keep_starting(self.notifier, until=self._stop_requested)
            starting = self._background.spawn(extending, "start timeout extension")
            try:
                await self._start()
            finally:
                starting.cancel()
            if self._stop_requested.is_set():  # SIGTERM while starting: never said ready, nor served
                return
            await control.start()
            self.state = "running"
            self._ready.set()
            await self._write_status()
            await self.notifier.heard(*ready_lines(), within_s=READY_WITHIN_S)
            self.notifier.status(f"serving {len(self.agents)} agents on {len(self.relay_urls)} relays")
            log.info("daemon_ready", relays=self.relay_urls, agents=[a.slug for a in self.agents])
            await self._stop_requested.wait()
        finally:
            try:
                await self._shutdown(control)
            finally:  # a shutdown that fails (a store that cannot close) gives the loop its handlers back too
                self.signals.remove(loop)
                loop.set_exception_handler(handler)

    async def _start(self) -> None:
        settings = self.settings
        if not settings.relays.urls and not settings.relays.embedded:
            raise RuntimeError("no relay configured: pass --relay URL or --embedded-relay")
        signers, project_signer = load_signers(settings)
        self.project_signer = project_signer
        self.agents = build_agents(settings, signers)
        # the store first: its lock says when another daemon has the home (StoreLockedError), before
        # anything of this one (its embedded relay, its status file) touches what that daemon holds
        self.store = build_store(settings)
        await open_when_free(self.store)  # a tenexd command may be reading the home a moment
        await check_the_store(settings, self.store, SUBSCRIPTION_ID, project_signer.pubkey, self.agents)
        settings.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        end_leftover_calls(settings.run_dir)  # claude-code calls a daemon killed outright left
        if settings.relays.embedded:
            self.embedded_relay = EmbeddedRelay(
                settings.embedded_relay_path, settings.relays.embedded_host, settings.relays.embedded_port
            )
            await self.embedded_relay.start()
        if isinstance(self.store, Peers) and settings.storage.kind is StorageKind.POSTGRES:
            self._peers = self.store  # daemons sharing the database: hold this one's name while it lives
            try:
                await self._lifetime.enter_async_context(self.store.alive(self._peer_name(self.instance)))
            except TimeoutError:  # the lock did not come: another session holds it (or the database is mute)
                raise InstanceNameTakenError(self.instance) from None
        self._store_opened = True  # the home is this daemon's (its store, its name on a shared database)
        await self._write_status()  # "starting" now, not how the last run ended

        self.pool = RelayPool(
            self.relay_urls, on_event=self._on_event, store=self.store, auth_signer=project_signer,
            settings=PoolSettings(
                since_window=settings.relays.since_window_s,
                delivery_lanes=settings.daemon.intake_lanes,
                limits=Limits(max_content_bytes=settings.daemon.max_content_bytes),
            ),
            lane_key=conversation_lane,
            on_connect=self._relay_connected,
        )
        profiles = {
            a.slug: build_agent_profile(a, agent, settings)
            for a, agent in zip(settings.agents, self.agents, strict=True)
        }
        project = (settings.owner, settings.project.d_tag) if settings.owner else None
        publisher = PoolPublisher(
            self.pool,
            signers,
            {a.slug: a for a in self.agents},
            typing_min_interval_s=settings.daemon.typing_min_interval_s,
            publish_timeout_s=settings.relays.publish_timeout_s,
        )
        wraps = GiftWraps(signers)  # NIP-17: private messages opened, replies wrapped, with the agents' keys
        options = PipelineOptions.from_settings(
            settings, project_signer.pubkey, self.instance if self._peers is not None else None
        )
        # a private conversation's replies: wrapped, the wraps kept until a relay took them
        gift_wraps = GiftWrapPublisher(publisher, wraps, self.store, wraps_key_for(options.outbox_key))
        self._gift_wraps = gift_wraps
        pubkeys_by_slug = {a.slug: a.pubkey for a in self.agents}
        composer = PrivateReplyComposer(SignedReplyComposer(signers, project), pubkeys_by_slug)
        ports = PipelinePorts(
            store=self.store,
            composer=composer,
            publisher=gift_wraps,
            classify=classify_event,
            partials=publisher if settings.daemon.stream_partials else None,
            resolver=RelayEventResolver(self.pool, store=self.store),
            names=RelayProfileNames(self.pool),
            fetcher=self.pool,
            observer=self._observer,
            peers=self._peers,
            messages=self.store if self._peers is not None and isinstance(self.store, PeerMessages) else None,
            status=StatusEventPublisher(
                self.pool, project_signer, project, publish_timeout_s=settings.relays.publish_timeout_s
            ),
        )
        backends = {slug: p.backend for slug, p in profiles.items()}
        self.pipeline = build_pipeline(
            self.agents,
            profiles,
            ports,
            options,
            orchestrator=partial(build_orchestrator, settings, backends=backends),
        )
        answer = settings.daemon.answer
        directory = self.pipeline.manager.agents
        self.intake = Intake(wraps, directory, public=answer.public, private=answer.private)
        self.descriptions = build_descriptions(
            settings, self.pipeline, profiles, project_signer, publisher,
            on_described=self.metrics.description_made,
        )

        if not await self._reach_relays(signers):
            return  # stopped: nothing taken up yet (journaled runs, the outbox: the next start's)
        pubkeys = [a.pubkey for a in self.agents] + [project_signer.pubkey]
        pipeline = self.pipeline
        # the outbox first: a recovered run that publishes a saved reply again adds to it; before it the
        # wraps its private replies had (sent again unchanged)
        await gift_wraps.recover()
        await pipeline.outbox.recover(self.store.find_event)
        await gift_wraps.keep_only(pipeline.outbox.event_ids())
        await save_upgraded_conversations(pipeline.manager)  # before any run, sweep or description
        await pipeline.scheduler.recover()
        # stops made through another daemon's CLI or API (daemons sharing a database), from now on
        await self._lifetime.enter_async_context(pipeline.stopper.hearing(pipeline.scheduler))
        self.descriptions.start()  # titles and summaries: what a crash left is found in the store
        await self.descriptions.recover()
        # a crash came mid-dispatch: events never stored are left to the relays (before the
        # subscription delivers them again), the others are dispatched again once it runs
        redo = await pipeline.dispatcher.stored_dispatches(pipeline.scheduler.dispatches_to_redo())
        filters = intake_filters(self.settings, pubkeys, await addressed_since(self.store))
        await self.pool.subscribe(SUBSCRIPTION_ID, filters)
        if answer.private:
            wrapped = [{"kinds": [KIND_GIFT_WRAP], "#p": [a.pubkey for a in self.agents]}]
            await self.pool.subscribe(PRIVATE_SUBSCRIPTION_ID, wrapped, lookback_s=WRAP_LOOKBACK_S)
        if redo:
            self._spawn(self._redispatch(redo), "redispatch")
        if self._peers is not None:
            await self._take_over_dead_peers()
            self._spawn(self._takeover_loop(), "takeover of dead daemons")
        await self._refresh_counts()
        self._spawn(self._status_loop(), "status writer")
        if self.embedded_relay is not None:
            self._spawn(self.embedded_relay.supervise(self.pool.retry_now), "embedded relay supervisor")
        self._spawn(self._heartbeat_loop(), "heartbeat")
        self.sweeper = Sweeper(
            pipeline.manager, RetentionPolicy.of(settings.conversations), threads=pipeline.threads,
            on_sweep=self.metrics.retention_swept, undelivered=pipeline.outbox.holds,
            busy=pipeline.scheduler.holds, clock_steps=WallClockSteps(self.store),
            held_elsewhere=every_outbox(self.store, self._peers, project_signer.pubkey),
        )
        sweep_every_s = settings.conversations.sweep_interval_min * 60
        self._spawn(self.sweeper.run_forever(sweep_every_s), "retention sweeper")
        interval = self.notifier.watchdog_interval_s()  # pinged while the store's writes go through
        probe = store_probe(self.store, self.instance if self._peers is not None else None)
        self._watchdog = Watchdog(self.notifier, probe, ping=interval is not None)
        self._spawn(self._watchdog.run(interval / 2 if interval else PROBE_EVERY_S), "store watchdog")

    async def _reach_relays(self, signers: dict[str, Signer]) -> bool:
        """Connect to the relays and announce the agents; False once a stop is asked for meanwhile: the waits
        on the relays give way to it (SIGTERM with the relays down took up to 15 s)."""
        assert self.pool is not None
        await self.pool.start()
        connected = await self._unless_stopped(self.pool.wait_connected(count=1, within=10.0))
        if connected is False:  # nor is it known whether the store is behind them (a home restored)
            log.warning("no_relay_connected_yet", relays=self.relay_urls, store_behind_checked=False)
        if connected and self.store is not None:  # a home restored from a backup: refused before answering
            fetch = partial(self.pool.fetch, timeout=BEHIND_CHECK_WAIT_S)
            agents, window = [a.pubkey for a in self.agents], self.settings.relays.since_window_s
            behind = refuse_a_store_behind(
                self.store, fetch, agents, SUBSCRIPTION_ID, window, urls=self.relay_urls
            )
            await self._unless_stopped(behind)
        await self._unless_stopped(self._announce(signers))
        return self._stop_requested is None or not self._stop_requested.is_set()

    async def _unless_stopped(self, step: Coroutine[Any, Any, T]) -> T | None:
        """``step``'s result, or None (``step`` cancelled) once a stop is asked for first."""
        return await step if self._stop_requested is None else await unless_set(self._stop_requested, step)

    async def _announce(self, signers: dict[str, Signer]) -> None:
        """Each agent's profile, and its relay list when private messages are answered (:func:`announce`)."""
        assert self.pool is not None
        about = {a.slug: a.instructions for a in self.settings.agents}
        dm_relays = self.relay_urls if self.settings.daemon.answer.private else None
        agents = [(agent, signers[agent.slug], about[agent.slug]) for agent in self.agents]
        await announce(self.pool, agents, self.settings.owner, dm_relays)

    async def _shutdown(self, control: Any) -> None:
        self._stopping = True
        if self.pool is not None:  # events taken in from now on are the relays' to send again
            self.pool.leave_to_relays()
        self.state = "stopping"
        await self.notifier.heard(*stopping_lines(), within_s=STOPPING_WITHIN_S)
        lines = log.info if self._store_opened else log.debug  # a start refused says so itself
        lines("daemon_stopping")
        if self.pool is not None:
            with contextlib.suppress(Exception):
                await self.pool.unsubscribe(SUBSCRIPTION_ID)
                await self.pool.unsubscribe(PRIVATE_SUBSCRIPTION_ID)
        if self.descriptions is not None:
            await self.descriptions.stop()  # what is left is found in the store at next start
        if self.pipeline is not None:
            # a stop asked while starting waits for no run the start began (they stay journaled)
            grace_s = self.settings.daemon.grace_period_s if self._ready.is_set() else 0.0
            cancelled = await self.pipeline.scheduler.drain(grace_s)
            if cancelled:
                log.warning("runs_cancelled_at_shutdown", count=cancelled, note="redone at next start")
            if self.pipeline.live_status is not None:
                await self.pipeline.live_status.close(2.0)  # the "idle" statuses of the runs that ended
            await self.pipeline.stopper.close()  # runs are drained: a stop heard now has nothing to do
        try:  # a step that fails (a database gone) still lets the store close and the relay child stop
            if self.pipeline is not None:
                unsent = await self.pipeline.runner.flush(5.0)
                await self.pipeline.outbox.close()
                if unsent:
                    note = "kept in the outbox for the next start"
                    log.warning("replies_unpublished_at_shutdown", count=unsent, note=note)
            await control.stop()  # made before anything started: stopping one never started removes nothing
            await self._background.cancel_all()
            if self.pool is not None:
                await self.pool.stop()
            await self._lifetime.aclose()
        finally:
            try:
                if self.store is not None:
                    await self.store.close()
            finally:  # a store that fails to close (a full disk) still lets the relay child stop
                if self.embedded_relay is not None:
                    await asyncio.to_thread(self.embedded_relay.stop)
                self.state = "stopped"
                if self._store_opened:  # one refused the home (store or name in use) never writes its status
                    with contextlib.suppress(OSError):
                        await self._write_status()
                lines("daemon_stopped")

    # --- events ---------------------------------------------------------------------------

    def _relay_connected(self, url: str) -> None:
        """A relay (re)connected: what waits in the outbox, and the descriptions (kind 513) waiting out a
        retry, are published again at once."""
        if self.pipeline is not None:
            self.pipeline.outbox.wake()
        if self.descriptions is not None:
            self.descriptions.relay_connected()

    async def _on_event(self, received: ReceivedEvent) -> Remember | None:
        """Handle one validated, new event from the relays; raising leaves it unprocessed (the pool
        retries it); a stranger's event is remembered in memory only (no disk for strangers)."""
        if self._stopping or self.pipeline is None:
            raise ShuttingDownError("shutting down; the event will be delivered again after restart")
        admitted = self.intake.admit(received.event) if self.intake is not None else received.event
        if admitted == AGENT_PRIVATE_COPY:  # an agent's own answer come back: stored already, not refused
            self.own_copies += 1
            self.metrics.own_copy()
            return Remember.IN_MEMORY
        if isinstance(admitted, str):  # a wrap that does not open, or what daemon.answer excludes
            refused = received.event
            if refused.kind != KIND_GIFT_WRAP and not self.pipeline.dispatcher.allows(refused.pubkey):
                admitted = SkipReason.AUTHOR_NOT_ALLOWED.value  # a stranger's first: no disk for strangers
            remember = self._count(refused, HandleResult(Outcome.IGNORED, admitted))
            if admitted == SkipReason.AUTHOR_NOT_ALLOWED.value:
                return remember
            # A refused wrap is signed by a one-time key the allow-list cannot judge: anyone can send them,
            # so, like a stranger's event, it is deduplicated in memory only (no disk for strangers). Each
            # reason is logged at most once a minute (one-time keys make per-author limits useless).
            self.intake_refusal_log.refused(refused.id, refused.pubkey, refused.kind, admitted, key=admitted)
            return Remember.IN_MEMORY if refused.kind == KIND_GIFT_WRAP else remember
        event = admitted  # a gift wrap's rumor in its place
        self._observer.event_received(event.id, received.received_at)
        structlog.contextvars.bind_contextvars(event_id=event.id)
        try:
            result = await self.pipeline.dispatcher.handle(event)
        except Exception:
            self.errors["handler"] += 1
            raise
        finally:
            structlog.contextvars.unbind_contextvars("event_id")
        self.last_event_at = time.time()
        remember = self._count(event, result)
        if event.kind == KIND_STOP and remember is None and self._peers is not None:
            # daemons sharing a database: each carries a stop out for its own runs, so it is not marked
            # processed where the others would skip it (stop requests are ephemeral: relays keep none)
            return Remember.IN_MEMORY
        return remember

    def _count(self, event: NostrEvent, result: HandleResult) -> Remember | None:
        if result.outcome in (Outcome.SCHEDULED, Outcome.STORED):
            self.events_accepted[str(event.kind)] += 1
            self.metrics.event_accepted(event.kind, result.reason, stored=result.outcome is Outcome.STORED)
            return None
        if result.outcome is Outcome.DUPLICATE:  # taken in already: another daemon on the database won it
            self.metrics.event_duplicate()
            return None
        reason = result.reason or result.outcome.value
        self.events_ignored[reason] += 1
        self.metrics.event_rejected(reason)
        if reason == SkipReason.AUTHOR_NOT_ALLOWED.value:
            self.stranger_log.refused(event.id, event.pubkey, event.kind, reason)
            return Remember.IN_MEMORY
        return None

    def _peer_name(self, instance: str) -> str:
        assert self.project_signer is not None
        return f"instance:{self.project_signer.pubkey}.{instance}"

    async def _takeover_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.daemon.takeover_interval_s)
            try:
                await self._take_over_dead_peers()
            except Exception as exc:
                self._peer_free_since.clear()  # a name counts as dead only when seen free at each look
                self.errors["takeover"] += 1
                log_failure(log, "takeover_failed", exc)

    async def _take_over_dead_peers(self) -> None:
        """Answer what a daemon that died on the shared database held: for each other daemon's run
        journal or outbox whose daemon no longer holds its name, take both over (runs and dispatches
        into this daemon's journal, entries into its outbox), then forget its keys."""
        assert self._peers is not None
        assert self.pipeline is not None
        assert self.project_signer is not None
        project = self.project_signer.pubkey
        own = instance_keys(project, self.instance)
        found: set[str] = set()
        for base in (journal_key_for(project), outbox_key_for(project)):
            for key in await self._peers.keys_with_prefix(base + "."):
                found.add(key[len(base) + 1 :])
        legacy = await self._peers.keys_with_prefix(journal_key_for(project))
        if journal_key_for(project) in legacy:
            found.add("")  # a journal left by a daemon of a version without instance names
        for gone_from_view in set(self._peer_free_since) - found:
            del self._peer_free_since[gone_from_view]
        for instance in sorted(found):
            keys = instance_keys(project, instance or None)
            if keys == own:
                continue
            async with self._peers.try_take(self._peer_name(instance)) as free:
                if not self._believed_dead(instance, free):
                    continue
                redo = await self.pipeline.scheduler.adopt(keys[0])
                assert self.store is not None
                assert self._gift_wraps is not None
                await self._gift_wraps.recover(key=wraps_key_for(keys[1]))
                await self.pipeline.outbox.recover(self.store.find_event, key=keys[1])
                await self._gift_wraps.keep_only(self.pipeline.outbox.event_ids())
                for key in (*keys, wraps_key_for(keys[1]), watchdog_key(instance)):
                    await self._peers.forget(key)
            log.warning("dead_daemon_taken_over", instance=instance or "(unnamed)", dispatches=len(redo))
            stored = await self.pipeline.dispatcher.stored_dispatches(redo)
            if stored:
                self._spawn(self._redispatch(stored), f"redispatch of {instance or 'unnamed'}")

    def _believed_dead(self, instance: str, free: bool) -> bool:
        """Whether a peer whose name is ``free`` now is dead: its name must have been found free at every
        look for ``PEER_GRACE_S`` while this daemon kept its own (a database restart frees every name at
        once, and live daemons take theirs again within about a second: a failed look, or this daemon's
        own name lost meanwhile, starts the count again)."""
        assert self._peers is not None
        now, lost = time.monotonic(), self._peers.names_lost
        since, lost_then = self._peer_free_since.pop(instance, (now, lost))
        if free and lost == lost_then and now - since >= PEER_GRACE_S:
            return True
        if free:  # the count goes on (from now, if this daemon's own name was lost meanwhile)
            self._peer_free_since[instance] = (since, lost) if lost == lost_then else (now, lost)
        return False

    async def _redispatch(self, event_ids: list[str]) -> None:
        """Finish the dispatches a crash interrupted (each may ask the orchestrator's model); one
        that keeps failing (``REDISPATCH_RETRY_S``) is logged and dropped, not retried at every start."""
        assert self.pipeline is not None
        dispatcher, scheduler = self.pipeline.dispatcher, self.pipeline.scheduler
        for event_id in event_ids:
            for attempt, wait_s in enumerate((*REDISPATCH_RETRY_S, None), start=1):
                try:
                    await dispatcher.redispatch(event_id)
                    break
                except Exception:
                    self.errors["handler"] += 1
                    action = "dropped" if wait_s is None else f"retry in {wait_s:g} s"
                    log.exception("redispatch_failed", event_id=event_id, attempt=attempt, action=action)
                if wait_s is None:
                    scheduler.dispatched(event_id, at_once=True)
                else:
                    await asyncio.sleep(wait_s)

    # --- background loops -----------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        self._background.spawn(coro, name)

    async def _refresh_counts(self) -> None:
        if self.store is None:
            return
        counts = await self.store.phase_counts()  # every few seconds: no summary rows built
        by_phase: Counter[str] = Counter()
        for (phase, _), n in counts.items():
            by_phase[phase] += n
        self._conversation_counts = ConversationCounts(
            total=sum(counts.values()),
            archived=sum(n for (_, archived), n in counts.items() if archived),
            by_phase=dict(by_phase),
        )

    async def _write_status(self) -> None:
        async with self._status_writes:  # each taken at its turn: the file ends with the newest state
            status = self.status()
            write = asyncio.ensure_future(asyncio.to_thread(write_status, self.settings.status_path, status))
            try:
                await asyncio.shield(write)
            except asyncio.CancelledError:  # the thread writes on: the next write waits for it all the same
                with contextlib.suppress(Exception):  # its failure must not take the cancellation's place
                    await write
                raise

    async def _status_loop(self) -> None:
        interval = self.settings.daemon.status_interval_s
        counting: asyncio.Task[None] | None = None
        try:
            while True:
                counting = await self._count_for_status(counting)
                await self._write_status_and_gauges()
                await asyncio.sleep(interval)
        finally:
            if counting is not None:
                counting.cancel()

    async def _count_for_status(self, counting: asyncio.Task[None] | None) -> asyncio.Task[None] | None:
        """Count the conversations for the status, waiting ``STATUS_COUNT_WAIT_S`` at most: a store that
        fails or does not answer (a database restarting, a network gone silent) is shown as degraded and the
        status is written all the same, with the last counts. A count still waiting goes on, and is not
        started again; returned so, else None."""
        if counting is None:
            counting = asyncio.create_task(self._refresh_counts(), name="status counts")
        done, _ = await asyncio.wait({counting}, timeout=STATUS_COUNT_WAIT_S)
        if not done:
            self._store_error = f"no answer within {STATUS_COUNT_WAIT_S:g} s"
            return counting
        exc = counting.exception()
        if exc is None:
            self._store_error = None
        else:  # the store is away: the status is still written
            self.errors["status"] += 1
            self._store_error = str(exc) or type(exc).__name__
        if self._store_error is not None:
            log.warning("status_counts_failed", error=self._store_error, action="last counts shown")
        return None

    async def _write_status_and_gauges(self) -> None:
        """Refresh the gauges /metrics reads, then write the status file (an error is counted and logged):
        a write that fails (a full disk) leaves the gauges true, for the alerts that matter then."""
        try:
            if self.pool is not None:
                for relay in self.pool.health().relays:
                    self.metrics.set_relay_connected(relay.url, relay.state.value == "connected")
            if self.pipeline is not None:
                self.metrics.set_runs_in_flight(self.pipeline.scheduler.in_flight)
                outbox = self.pipeline.outbox
                self.metrics.set_outbox(outbox.depth, outbox.oldest_age_s(), outbox.refused)
            if (jobs := self.descriptions) is not None:
                self.metrics.set_descriptions_pending(jobs.queued + jobs.unpublished)
            await self._write_status()
        except Exception as exc:  # a full disk: one line each time, no traceback (status says degraded)
            self.errors["status"] += 1
            log_failure(log, "status_write_failed", exc, brief=(OSError,))

    async def _heartbeat_loop(self) -> None:
        assert self.pool is not None
        assert self.project_signer is not None
        project = (self.settings.owner, self.settings.project.d_tag) if self.settings.owner else None
        assert self.pipeline is not None
        runner = self.pipeline.runner
        capabilities = {
            slug: AgentCapabilities(p.model or p.backend.name, runner.offered_tools(slug))
            for slug, p in runner.profiles.items()
        }
        while True:
            event = heartbeat_event(self.project_signer, self.agents, project, capabilities)
            await self.pool.publish(event, timeout=5.0, raise_on_failure=False)
            await asyncio.sleep(self.settings.daemon.heartbeat_interval_s)
