"""The daemon's run observer: run outcomes into the Prometheus metrics, recent reply latencies kept
for the status document."""

from __future__ import annotations

import time
from collections import Counter, OrderedDict, deque

from tenex_daemon.app.metrics import Metrics
from tenex_daemon.app.status import LatencySummary
from tenex_daemon.core.llm import BackendErrorKind
from tenex_daemon.services.runs import RunRequest

BACKEND_FAILURES = frozenset(
    kind.value for kind in BackendErrorKind if kind is not BackendErrorKind.CONTEXT_TOO_LONG
)
"""Error replies that say the agent's backend fails (a wrong key, a provider down or refusing): not a message
too long for the model (``context_too_long``), an empty answer or a model calling tools without end."""
RECEIVED_MEMORY = 10_000
"""Arrival times kept for reply latency (triggers older than the newest 10,000 are not timed)."""
LATENCY_MEMORY = 1_000
"""Reply latencies kept for the status document's p50/p99."""


class MetricsObserver:
    """Feeds run outcomes into the Prometheus metrics; keeps recent reply latencies for the status."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self.replies = 0
        self.received_at: OrderedDict[str, float] = OrderedDict()
        """Trigger id -> when the pool took it in (bounded: the newest RECEIVED_MEMORY)."""
        self.reply_latencies: deque[float] = deque(maxlen=LATENCY_MEMORY)
        """Seconds from trigger taken in to reply sent, newest last."""
        self.error_replies: Counter[str] = Counter()
        """Runs whose backend failed (a wrong key, a provider down), answered with an error reply, by the
        failure's kind, since start."""
        self.failing: dict[str, tuple[int, str, float]] = {}
        """Agent slug -> (its runs in a row, newest last, that ended in an error reply of its backend; the
        newest one's failure kind; when it ended, monotonic): an agent whose every run fails is one the
        operator must mend."""

    def event_received(self, event_id: str, received_at: float) -> None:
        """Remember when an event that may trigger runs arrived."""
        self.received_at[event_id] = received_at
        if len(self.received_at) > RECEIVED_MEMORY:
            self.received_at.popitem(last=False)

    def latency_summary(self) -> LatencySummary:
        """p50/p99 (ms) of the recent reply latencies, for the status document."""
        recent = sorted(self.reply_latencies)
        if not recent:
            return LatencySummary(count=0, p50_ms=None, p99_ms=None)

        def at(q: float) -> float:
            return round(recent[min(len(recent) - 1, round(q * (len(recent) - 1)))] * 1000, 2)

        return LatencySummary(count=len(recent), p50_ms=at(0.5), p99_ms=at(0.99))

    def run_finished(self, request: RunRequest, seconds: float, error: str | None) -> None:
        """Record a run's latency and failure kind."""
        self._metrics.observe_agent_run(request.agent_slug, seconds)
        if error is None:
            self.failing.pop(request.agent_slug, None)
            return
        self.error_replies[error] += 1
        self._metrics.agent_run_error(request.agent_slug, error)
        if error not in BACKEND_FAILURES:  # the message or the model's doing, not a backend to mend
            return
        in_a_row, _, _ = self.failing.get(request.agent_slug, (0, error, 0.0))
        self.failing[request.agent_slug] = (in_a_row + 1, error, time.monotonic())

    def reply_published(self, agent_slug: str, trigger_id: str, sent_at: float) -> None:
        """Count a published reply and record how long after its trigger arrived it was sent."""
        self.replies += 1
        self._metrics.reply_published(agent_slug)
        received_at = self.received_at.get(trigger_id)
        if received_at is not None:
            latency = max(0.0, sent_at - received_at)
            self.reply_latencies.append(latency)
            self._metrics.observe_reply_latency(latency)
