"""Prometheus metrics of one daemon, in its own registry (served at ``GET /metrics``).

Names carry the ``tenexd_`` namespace: ``tenexd_events_accepted_total{kind}``,
``tenexd_events_rejected_total{reason}``, ``tenexd_events_ran_nobody_total{reason}`` (accepted, no agent run:
an agent's own event, the hop limit, ...), ``tenexd_events_own_copies_total`` (the agents' own private
answers come back, not refused), ``tenexd_replies_published_total{agent}``,
``tenexd_agent_run_errors_total{agent,error}``, ``tenexd_agent_run_seconds{agent}`` (histogram),
``tenexd_runs_in_flight`` and ``tenexd_relay_connected{url}`` (gauges), ``tenexd_descriptions_total{source}``
and ``tenexd_descriptions_pending`` (conversations' titles and summaries),
``tenexd_retention_sweeps_total``, ``tenexd_retention_conversations_total{action}`` (``ended_idle``,
``archived``, ``deleted``) and ``tenexd_retention_errors_total`` (the retention sweeper), and
``tenexd_routing_fallbacks_total{reason}`` (routings the orchestrator's model did not decide).
The relay pool's own counters are read from its health at scrape time (:meth:`Metrics.watch_pool`):
``tenexd_frames_rejected_total{reason}``, ``tenexd_events_duplicate_total``,
``tenexd_intake_handler_errors_total``, ``tenexd_intake_retries_total``, ``tenexd_intake_retry_pending``,
``tenexd_intake_retry_dropped_total``, ``tenexd_relay_reconnects_total{url}`` and
``tenexd_relay_subscriptions_closed_total{url}``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from tenex_daemon.adapters.nostr.relay_pool import PoolHealth
from tenex_daemon.core.targeting import SkipReason
from tenex_daemon.services.orchestrator import RoutingStop
from tenex_daemon.services.retention import SweepReport

NAMESPACE = "tenexd"
_RAN_NOBODY = frozenset(reason.value for reason in (*SkipReason, *RoutingStop))
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)
RUN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _PoolCollector(Collector):
    """The relay pool's counters, read from its health snapshot at each scrape (nothing to keep in step)."""

    def __init__(self, source: Callable[[], PoolHealth | None], handled: Callable[[], int]) -> None:
        self._source = source
        self._handled = handled
        """Duplicates the handler found (an event another daemon sharing the database took in first)."""

    def describe(self) -> Iterable[Metric]:
        """Nothing described up front: the families depend on the snapshot."""
        return []

    def collect(self) -> Iterable[Metric]:
        """One family per pool counter, from the current health snapshot (none before the pool exists)."""
        health = self._source()
        if health is None:
            return []
        rejected = CounterMetricFamily(
            f"{NAMESPACE}_frames_rejected", "Relay frames refused by the codec or the pool, by reason.",
            labels=["reason"],
        )
        for reason, count in sorted(health.rejects.items()):
            rejected.add_metric([reason], count)
        reconnects = CounterMetricFamily(
            f"{NAMESPACE}_relay_reconnects", "Reconnections to a relay, by url.", labels=["url"]
        )
        closed = CounterMetricFamily(
            f"{NAMESPACE}_relay_subscriptions_closed",
            "Live subscriptions a relay ended (CLOSED) while connected, by url; each is sent again.",
            labels=["url"],
        )
        without_id = CounterMetricFamily(
            f"{NAMESPACE}_relay_oks_without_id",
            "Relay answers (OK) naming no event, by url and whether the EVENT they answer was told.",
            labels=["url", "outcome"],
        )
        for relay in health.relays:
            reconnects.add_metric([relay.url], relay.reconnects)
            closed.add_metric([relay.url], relay.subscriptions_closed)
            without_id.add_metric([relay.url, "attributed"], relay.oks_attributed)
            without_id.add_metric([relay.url, "unmatched"], relay.oks_unmatched)
        duplicates = "Copies of events already taken in or processed (by this daemon or another), dropped."
        errors = "Incoming events whose handling raised (each is retried)."
        retries = "Incoming events handed to the handler again after an error."
        pending = "Incoming events waiting for another try after an error."
        dropped = "Incoming events dropped from a full retry set (left to the relays and the next start)."
        return [
            rejected,
            CounterMetricFamily(
                f"{NAMESPACE}_events_duplicate", duplicates, value=health.duplicates + self._handled()
            ),
            CounterMetricFamily(f"{NAMESPACE}_intake_handler_errors", errors, value=health.consumer_errors),
            CounterMetricFamily(f"{NAMESPACE}_intake_retries", retries, value=health.retries),
            GaugeMetricFamily(f"{NAMESPACE}_intake_retry_pending", pending, value=health.retrying),
            CounterMetricFamily(f"{NAMESPACE}_intake_retry_dropped", dropped, value=health.retry_dropped),
            reconnects,
            closed,
            without_id,
        ]


class _RunsCollector(Collector):
    """The run scheduler's tries that failed with an error (a store gone for a moment, a lease lost), read at
    each scrape: no run outcome /metrics counts otherwise (``agent_run_errors`` counts error replies)."""

    def __init__(self, failed: Callable[[], int], dropped: Callable[[], int]) -> None:
        self._failed = failed
        self._dropped = dropped

    def describe(self) -> Iterable[Metric]:
        """Nothing described up front."""
        return []

    def collect(self) -> Iterable[Metric]:
        """The counts since start."""
        failed = "Agent run tries that failed with an error (each tried again, up to 31 a run)."
        dropped = "Agent runs given up after their last try failed (a person left unanswered)."
        return [
            CounterMetricFamily(f"{NAMESPACE}_run_tries_failed", failed, value=self._failed()),
            CounterMetricFamily(f"{NAMESPACE}_runs_dropped", dropped, value=self._dropped()),
        ]


class _RoutingCollector(Collector):
    """The routings the orchestrator's model did not decide, by why, read at each scrape."""

    def __init__(self, source: Callable[[], Mapping[str, int]]) -> None:
        self._source = source

    def describe(self) -> Iterable[Metric]:
        """Nothing described up front."""
        return []

    def collect(self) -> Iterable[Metric]:
        """The counts since start, by reason."""
        family = CounterMetricFamily(
            f"{NAMESPACE}_routing_fallbacks",
            "Routings the orchestrator's model did not decide (invalid_answer: two invalid answers; "
            "backend_failed: its call failed), routed by the rules or to the default agent instead.",
            labels=["reason"],
        )
        for reason, count in sorted(self._source().items()):
            family.add_metric([reason], count)
        return [family]


class Metrics:
    """The daemon's counters, histogram and gauges; nothing global (a registry per instance)."""

    content_type: str = CONTENT_TYPE_LATEST
    """The HTTP content type of :meth:`render`'s output."""

    def __init__(self) -> None:
        """Create every metric in a fresh :class:`CollectorRegistry`."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.handled_duplicates = 0
        """Events the handler found taken in already (exported with the pool's duplicates)."""
        self.events_accepted = Counter(
            "events_accepted", "Incoming events accepted into a conversation, by kind.",
            ["kind"], namespace=NAMESPACE, registry=self.registry,
        )
        self.events_rejected = Counter(
            "events_rejected", "Incoming events refused or ignored, by reason.",
            ["reason"], namespace=NAMESPACE, registry=self.registry,
        )
        self.events_ran_nobody = Counter(
            "events_ran_nobody",
            "Incoming events accepted into a conversation that ran no agent, by reason (an agent's own event,"
            " the agent-to-agent hop limit, addressed to nobody here, one side of a send_message exchange).",
            ["reason"], namespace=NAMESPACE, registry=self.registry,
        )
        self.events_own_copies = Counter(
            "events_own_copies",
            "The agents' own private answers come back from the relays (stored already, not refused).",
            namespace=NAMESPACE, registry=self.registry,
        )
        self.replies_published = Counter(
            "replies_published", "Agent replies published to at least one relay, by agent.",
            ["agent"], namespace=NAMESPACE, registry=self.registry,
        )
        self.agent_run_errors = Counter(
            "agent_run_errors", "Agent runs that failed, by agent and error class.",
            ["agent", "error"], namespace=NAMESPACE, registry=self.registry,
        )
        self.agent_run_seconds = Histogram(
            "agent_run_seconds", "Duration of agent runs (context, backend, publish), by agent.",
            ["agent"], namespace=NAMESPACE, registry=self.registry, buckets=RUN_BUCKETS,
        )
        self.reply_latency_seconds = Histogram(
            "reply_latency_seconds",
            "From an incoming event taken from a relay to the agent's reply sent to the relays.",
            namespace=NAMESPACE, registry=self.registry, buckets=LATENCY_BUCKETS,
        )
        self.runs_in_flight = Gauge(
            "runs_in_flight", "Agent runs in progress.", namespace=NAMESPACE, registry=self.registry,
        )
        self.relay_connected = Gauge(
            "relay_connected", "1 when the relay is connected, else 0.",
            ["url"], namespace=NAMESPACE, registry=self.registry,
        )
        self.outbox_depth = Gauge(
            "outbox_depth", "Signed events waiting for a relay to accept them.",
            namespace=NAMESPACE, registry=self.registry,
        )
        self.outbox_oldest_age = Gauge(
            "outbox_oldest_age_seconds", "Age of the oldest signed event waiting for a relay (0: none).",
            namespace=NAMESPACE, registry=self.registry,
        )
        self.outbox_refused = Gauge(
            "outbox_refused_events", "Signed events every relay refused for good since start.",
            namespace=NAMESPACE, registry=self.registry,
        )

        self.descriptions = Counter(
            "descriptions", "Conversation titles and summaries made, by source (model, fallback).",
            ["source"], namespace=NAMESPACE, registry=self.registry,
        )
        self.descriptions_pending = Gauge(
            "descriptions_pending",
            "Conversations waiting to be described or for a relay to accept their kind-513 event.",
            namespace=NAMESPACE, registry=self.registry,
        )

        self.retention_sweeps = Counter(
            "retention_sweeps", "Retention sweeps made.", namespace=NAMESPACE, registry=self.registry,
        )
        self.retention_conversations = Counter(
            "retention_conversations",
            "Conversations the retention sweeper changed, by action (ended_idle, archived, deleted).",
            ["action"], namespace=NAMESPACE, registry=self.registry,
        )
        self.retention_errors = Counter(
            "retention_errors", "Retention sweep steps that failed (the sweep went on).",
            namespace=NAMESPACE, registry=self.registry,
        )
        self.control_requests_refused = Counter(
            "control_requests_refused", "Control API requests (or connections) on the TCP port refused.",
            ["reason"], namespace=NAMESPACE, registry=self.registry,
        )
        self.control_errors = Counter(
            "control_errors", "Control API requests answered with an error, by HTTP status.",
            ["status"], namespace=NAMESPACE, registry=self.registry,
        )

    def event_accepted(self, kind: int, reason: str | None = None, *, stored: bool = False) -> None:
        """Count an accepted incoming event of this kind. ``stored``: it was only stored, for ``reason``,
        counted by it too when it is one of :class:`SkipReason` or :class:`RoutingStop` (it ran no agent:
        docs/PROTOCOL.md's rule 5, the targeting rules, and the orchestrator's stops: a routing loop cut off
        by the turn limit is a number to alert on)."""
        self.events_accepted.labels(kind=str(kind)).inc()
        if stored and reason in _RAN_NOBODY:
            self.events_ran_nobody.labels(reason=reason).inc()

    def event_rejected(self, reason: str) -> None:
        """Count an incoming event refused or ignored for ``reason``."""
        self.events_rejected.labels(reason=reason).inc()

    def own_copy(self) -> None:
        """Count an agent's own private answer come back through the subscription."""
        self.events_own_copies.inc()

    def control_request_refused(self, reason: str) -> None:
        """Count a control API request refused for ``reason`` (bad_host, cross_origin, no/bad_token), or a
        connection closed as it came (too_many_connections)."""
        self.control_requests_refused.labels(reason=reason).inc()

    def control_error(self, status: int) -> None:
        """Count a control API request answered with an error of HTTP ``status``."""
        self.control_errors.labels(status=str(status)).inc()

    def reply_published(self, agent: str) -> None:
        """Count a reply published by ``agent``."""
        self.replies_published.labels(agent=agent).inc()

    def observe_reply_latency(self, seconds: float) -> None:
        """Record the time from a trigger's arrival to its reply being sent."""
        self.reply_latency_seconds.observe(seconds)

    def agent_run_error(self, agent: str, error: str) -> None:
        """Count a failed run of ``agent`` (``error``: an error class name or short code)."""
        self.agent_run_errors.labels(agent=agent, error=error).inc()

    def observe_agent_run(self, agent: str, seconds: float) -> None:
        """Record the duration of one run of ``agent``."""
        self.agent_run_seconds.labels(agent=agent).observe(seconds)

    @contextmanager
    def agent_run(self, agent: str) -> Iterator[None]:
        """Time one run: in flight while inside, duration observed, an escaping exception counted."""
        self.runs_in_flight.inc()
        started = time.perf_counter()
        try:
            yield
        except Exception as exc:
            self.agent_run_error(agent, type(exc).__name__)
            raise
        finally:
            self.runs_in_flight.dec()
            self.observe_agent_run(agent, time.perf_counter() - started)

    def set_runs_in_flight(self, count: int) -> None:
        """Set the in-flight gauge (for a daemon that counts runs itself)."""
        self.runs_in_flight.set(count)

    def set_outbox(self, depth: int, oldest_age_s: float | None, refused: int = 0) -> None:
        """Signed events waiting for a relay, the age of the oldest (0 when none waits), and those every
        relay refused for good since start."""
        self.outbox_depth.set(depth)
        self.outbox_oldest_age.set(oldest_age_s or 0.0)
        self.outbox_refused.set(refused)

    def description_made(self, source: str) -> None:
        """Count a conversation's title and summary made (``source``: model or fallback)."""
        self.descriptions.labels(source=source).inc()

    def set_descriptions_pending(self, count: int) -> None:
        """Conversations waiting to be described or published."""
        self.descriptions_pending.set(count)

    def retention_swept(self, report: SweepReport) -> None:
        """Count one retention sweep and what it did."""
        self.retention_sweeps.inc()
        for action in ("ended_idle", "archived", "deleted"):
            self.retention_conversations.labels(action=action).inc(getattr(report, action))
        self.retention_errors.inc(report.errors)

    def set_relay_connected(self, url: str, connected: bool) -> None:
        """Set one relay's connection gauge."""
        self.relay_connected.labels(url=url).set(1 if connected else 0)

    def set_relays(self, states: Iterable[tuple[str, bool]]) -> None:
        """Set every relay's gauge from (url, connected) pairs."""
        for url, connected in states:
            self.set_relay_connected(url, connected)

    def watch_runs(self, failed: Callable[[], int], dropped: Callable[[], int] = lambda: 0) -> None:
        """Export the run tries that failed and the runs given up, read from ``failed`` and ``dropped`` at
        each scrape."""
        self.registry.register(_RunsCollector(failed, dropped))

    def watch_routing(self, source: Callable[[], Mapping[str, int]]) -> None:
        """Export the routings the orchestrator's model did not decide (``source``, read at each scrape)."""
        self.registry.register(_RoutingCollector(source))

    def watch_pool(self, source: Callable[[], PoolHealth | None]) -> None:
        """Export the relay pool's counters, read from ``source`` (its health; None before it exists)."""
        self.registry.register(_PoolCollector(source, lambda: self.handled_duplicates))

    def event_duplicate(self) -> None:
        """Count an event the handler found taken in already (another daemon sharing the database won it)."""
        self.handled_duplicates += 1

    def render(self) -> bytes:
        """Return every metric in the Prometheus text exposition format."""
        return generate_latest(self.registry)
