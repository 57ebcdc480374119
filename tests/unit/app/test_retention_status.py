"""The retention sweeper in the daemon's health data: Prometheus counters, the status document's
``retention`` part and the line `tenexd status` prints; the outbox's and the counters' lines there too."""

from __future__ import annotations

import pytest

from tenex_daemon import ConversationManager, MemoryStore
from tenex_daemon.app.metrics import Metrics
from tenex_daemon.app.status import new_status, retention_status
from tenex_daemon.cli.daemon_commands import _print_status_data
from tenex_daemon.services.retention import RetentionPolicy, Sweeper, SweepReport
from tenex_daemon.testing import FakeClock
from tests.conftest import Cast


def test_each_sweep_is_counted_in_the_metrics() -> None:
    """A sweep's report adds to the sweeps, to the conversations by action and to the errors."""
    metrics = Metrics()
    metrics.retention_swept(SweepReport(started_at=0, ended_idle=2, archived=1, deleted=3, errors=1))
    metrics.retention_swept(SweepReport(started_at=1, deleted=1))

    text = metrics.render().decode()

    assert "tenexd_retention_sweeps_total 2.0" in text
    assert 'tenexd_retention_conversations_total{action="ended_idle"} 2.0' in text
    assert 'tenexd_retention_conversations_total{action="archived"} 1.0' in text
    assert 'tenexd_retention_conversations_total{action="deleted"} 4.0' in text
    assert "tenexd_retention_errors_total 1.0" in text


async def test_the_status_part_shows_the_last_sweep_and_the_totals(cast: Cast) -> None:
    """Before a sweep the retention part is all zeros; after two it has the newest sweep's time (seconds),
    duration and counts, and the totals."""
    clock = FakeClock()
    manager = ConversationManager(MemoryStore(), cast.agents, cast.project.pubkey, clock=clock)
    sweeper = Sweeper(manager, RetentionPolicy(idle_timeout_min=1, archive_after_days=None))
    assert retention_status(sweeper) == new_status("0")["retention"]
    await manager.create_conversation(cast.user_says("hello", kind=11))
    clock.advance(2 * 60_000)
    await sweeper.sweep_once()
    clock.advance(1000)
    await sweeper.sweep_once()

    part = retention_status(sweeper)

    assert part["sweeps"] == 2
    assert part["last_sweep_at"] == clock.now / 1000
    assert part["last"] == {"ended_idle": 0, "archived": 0, "deleted": 0, "errors": 0}
    assert part["totals"] == {"ended_idle": 1, "archived": 0, "deleted": 0, "errors": 0}
    assert part["last_duration_s"] is not None


def test_tenexd_status_prints_the_retention_line(capsys: pytest.CaptureFixture[str]) -> None:
    """`tenexd status` prints the sweeps, the last one's time and what they did since start."""
    data = dict(new_status("0.1.0"))
    data["retention"] = {
        "sweeps": 7, "last_sweep_at": 0.0, "last_duration_s": 0.01,
        "last": {"ended_idle": 0, "archived": 0, "deleted": 0, "errors": 0},
        "totals": {"ended_idle": 3, "archived": 2, "deleted": 1, "errors": 0},
    }

    _print_status_data(data)

    printed = " ".join(capsys.readouterr().out.split())
    assert (
        "retention: 7 sweeps, last 1970-01-01 00:00:00Z; since start ended idle 3, archived 2, "
        "deleted 1, errors 0"
    ) in printed


def test_tenexd_status_prints_the_outbox_depth_and_its_oldest_entry(capsys: pytest.CaptureFixture[str]) -> None:
    """`tenexd status` says how many signed events wait for a relay and how long the oldest has waited;
    an empty outbox says so without an age."""
    data = dict(new_status("0.1.0"))
    data["outbox"] = {"depth": 3, "oldest_age_s": 245.2, "delivered": 12, "retries": 4}
    _print_status_data(data)
    waiting = " ".join(capsys.readouterr().out.split())
    data["outbox"] = {"depth": 0, "oldest_age_s": None, "delivered": 12, "retries": 4}
    _print_status_data(data)
    empty = " ".join(capsys.readouterr().out.split())

    assert "outbox: 3 waiting for a relay (oldest 4m 5s); 12 delivered, 4 retries since start" in waiting
    assert "outbox: 0 waiting for a relay; 12 delivered, 4 retries since start" in empty


def test_tenexd_status_prints_counts_as_totals_with_their_breakdown(capsys: pytest.CaptureFixture[str]) -> None:
    """`tenexd status` prints conversations by phase, rejections by reason and errors by kind as a total
    with its parts, largest first (never a Python dict); none at all prints 0."""
    data = dict(new_status("0.1.0"))
    data["conversations"] = {"total": 3, "archived": 0, "by_phase": {"plan": 1, "chat": 2}}
    data["events"] = {"accepted": 10, "rejected": {"too_large": 1, "author_not_allowed": 2}}
    data["errors"] = {"publish": 1}
    _print_status_data(data)
    busy = " ".join(capsys.readouterr().out.split())
    data["conversations"] = {"total": 0, "archived": 0, "by_phase": {}}
    data["events"], data["errors"] = {"accepted": 0, "rejected": {}}, {}
    _print_status_data(data)
    quiet = " ".join(capsys.readouterr().out.split())

    assert (
        "conversations 3 (chat 2, plan 1); runs in flight 0; replies 0; events accepted 10, "
        "rejected 3 (author_not_allowed 2, too_large 1); errors 1 (publish 1)"
    ) in busy
    assert "conversations 0; runs in flight 0; replies 0; events accepted 0, rejected 0; errors 0" in quiet
    assert "{" not in busy + quiet
    data["events"] = {"accepted": 1, "rejected": {"too_large": None, "odd": "x", "bad_signature": 2}}
    _print_status_data(data)  # a status file written by another version: what is not a number is left out
    assert "rejected 2 (bad_signature 2)" in " ".join(capsys.readouterr().out.split())
