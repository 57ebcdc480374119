"""What `tenexd status` says of runs: a backend that fails every run (a wrong key, a provider down) answers
each with an error reply, which counted as a run completed while status said nothing of it (only /metrics
had it); and the human output showed no run counts at all."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tenex_daemon.app.metrics import Metrics
from tenex_daemon.app.run_observer import MetricsObserver
from tenex_daemon.app.settings import load_settings
from tenex_daemon.app.status import DaemonState, new_status, write_status
from tenex_daemon.services import runs as runs_module
from tests import pipeline
from tests.conftest import Cast
from tests.unit.cli.conftest import home, tenexd

__all__ = ["home"]
from tests.unit.services.test_bursts import GatedBackend
from tests.unit.services.test_log_privacy import FailingBackend


async def test_runs_a_failing_backend_answered_with_an_error_reply_are_counted_by_kind(cast: Cast) -> None:
    """Two messages to an agent whose backend answers 401: the daemon's run observer (what status reads)
    counts two runs answered with an error, of kind ``auth``."""
    observer = MetricsObserver(Metrics())
    rig = pipeline.build_rig(cast, backend=FailingBackend(), observer=observer)
    for text in ("hi", "hello?"):
        await rig.dispatcher.handle(cast.user_says(text, kind=11, tags=[["p", cast.alice.pubkey]]))
    await rig.settle()

    assert dict(observer.error_replies) == {"auth": 2}
    assert rig.scheduler.completed == 2


async def test_a_run_given_up_after_its_last_try_is_counted_apart_from_its_tries(
    cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run whose every try fails (the store gone) is given up after its last: counted as one run dropped
    (status ``runs.dropped``, ``tenexd_runs_dropped_total``) beside its two failed tries, so a person left
    unanswered is told apart from failures that recovered."""
    monkeypatch.setattr(runs_module, "RUN_RETRY_S", (0.01,))
    metrics = Metrics()
    rig = pipeline.build_rig(cast)
    metrics.watch_runs(lambda: rig.scheduler.failed, lambda: rig.scheduler.dropped)

    async def failing(*_: object, **__: object) -> None:
        raise ConnectionResetError("the store went away")

    monkeypatch.setattr(rig.manager, "append_reply", failing)
    await rig.dispatcher.handle(cast.user_says("hello", kind=11, tags=[["p", cast.alice.pubkey]]))
    await rig.settle()

    assert (rig.scheduler.failed, rig.scheduler.dropped) == (2, 1)
    assert b"tenexd_runs_dropped_total 1.0" in metrics.render()


def test_the_human_status_shows_runs_completed_answered_with_an_error_and_tries_failed(home: Path) -> None:
    """`tenexd status` prints the runs completed, those answered with an error reply by kind, the tries
    that failed and the runs given up, as its --json has them."""
    settings = load_settings(home)
    status = new_status("0.0.0", home=str(home))
    status["state"] = DaemonState.RUNNING.value
    status["runs"] = {"completed": 5, "failed": 1, "dropped": 1, "with_error": {"auth": 3}, "parked": {}}
    write_status(settings.status_path, status)

    code, out = tenexd(home, "status")
    _, as_json = tenexd(home, "status", "--json")

    assert code == 0
    assert (
        "runs completed 5, answered with an error 3 (auth 3); tries failed 1 (each tried again), runs given up 1"
        in " ".join(out.split())
    )
    assert json.loads(as_json)["status"]["runs"]["with_error"] == {"auth": 3}


def test_the_human_status_shows_runs_kept_for_agents_not_configured(home: Path) -> None:
    """Runs a journal holds for an agent no longer configured (parked: its messages unanswered) show in
    `tenexd status` by agent, not only in the log; with none parked the line is left out."""
    settings = load_settings(home)
    status = new_status("0.0.0", home=str(home))
    status["state"] = DaemonState.RUNNING.value
    write_status(settings.status_path, status)
    _, without = tenexd(home, "status")
    status["runs"]["parked"] = {"carol": 2}
    write_status(settings.status_path, status)

    code, out = tenexd(home, "status")

    assert code == 0
    assert "runs kept for agents not configured 2 (carol 2)" in " ".join(out.split())
    assert "agents not configured" not in without


async def test_a_stop_notice_is_no_reply_published_nor_a_reply_latency(cast: Cast) -> None:
    """A run stopped while its model answers: the notice "Stopped: Alice." goes out, but the replies counted
    and the reply latencies (what status and /metrics show) hold nothing for it (it counted as a reply, and
    the person's wait before the stop as its latency)."""
    observer = MetricsObserver(Metrics())
    backend = GatedBackend()
    rig = pipeline.build_rig(cast, backend=backend, observer=observer)
    root = cast.user_says("take your time", kind=11, tags=[["p", cast.alice.pubkey]])
    observer.event_received(root.id, 1.0)
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(backend.asked.wait(), 5)

    report = await rig.dispatcher.stop(root.id, None, by="owner")
    await rig.settle()

    assert report.notice is not None
    assert [e.content for e in rig.publisher.published] == ["Stopped: Alice."]
    assert (observer.replies, list(observer.reply_latencies)) == (0, [])


def test_metrics_count_the_run_tries_that_failed() -> None:
    """/metrics carries the run tries that failed with an error, read at each scrape (a store gone for a
    moment showed in status only)."""
    metrics = Metrics()
    failed = [0]
    metrics.watch_runs(lambda: failed[0])
    failed[0] = 3

    assert "tenexd_run_tries_failed_total 3.0" in metrics.render().decode()
