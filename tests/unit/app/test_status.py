"""The status file: atomic writes, and a reader that tells running, stale and stopped apart."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

from tenex_daemon.app.status import Health, RelayStatus, live_report, new_status, read_status, write_status
from tenex_daemon.runtime.boot import boot_id


def test_written_status_reads_back_as_running_and_healthy(tmp_path: Path) -> None:
    """A fresh file in state running is healthy, with its relays and counts intact."""
    path = tmp_path / "run" / "status.json"
    data = new_status("0.1.0")
    data["state"] = "running"
    relay = RelayStatus(
        url="ws://127.0.0.1:7777", state="connected", read=True, write=True, connected_since=None,
        reconnects=0, last_event_at=None, events_received=0, rejects={}, notices=0,
        authenticated=False, last_error=None, oks_attributed=0, oks_unmatched=0, subscriptions_closed=1,
        unserved={"tenexd-mentions": {"for_s": 12.5, "message": "restricted: members only"}},
    )
    data["relays"] = [relay]
    write_status(path, data)
    report = read_status(path, stale_after_s=30)
    assert report.state is Health.RUNNING
    assert report.healthy
    assert report.data is not None
    assert report.data["relays"][0] == relay
    assert report.data["pid"] == os.getpid()
    assert report.age_s is not None
    assert report.age_s < 5
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == ["status.json"]


def test_no_file_means_stopped(tmp_path: Path) -> None:
    """Without a status file the daemon is reported stopped, with the path in the reason."""
    report = read_status(tmp_path / "status.json", 30)
    assert report.state is Health.STOPPED
    assert not report.healthy
    assert "no status file" in report.reason


def test_old_file_is_stale(tmp_path: Path) -> None:
    """A file whose updated_at is older than the limit is stale, even if it says running."""
    path = tmp_path / "status.json"
    data = new_status("0.1.0")
    data["state"] = "running"
    write_status(path, data)
    report = read_status(path, stale_after_s=30, now=time.time() + 31)
    assert report.state is Health.STALE
    assert not report.healthy
    assert "stale" in report.reason
    assert "stuck" in report.reason


def test_stopped_written_by_the_daemon_or_a_dead_pid_is_stopped(tmp_path: Path) -> None:
    """state=stopped, or a pid that no longer exists, reads as stopped."""
    path = tmp_path / "status.json"
    data = new_status("0.1.0")
    data["state"] = "stopped"
    write_status(path, data)
    assert read_status(path, 30).state is Health.STOPPED
    data["state"] = "running"
    data["pid"] = 2**22 + 12345
    write_status(path, data)
    report = read_status(path, 30)
    assert report.state is Health.STOPPED
    assert "gone" in report.reason


def test_starting_is_running_but_not_yet_healthy(tmp_path: Path) -> None:
    """A fresh file in state starting is up (running) but not healthy yet."""
    path = tmp_path / "status.json"
    write_status(path, new_status("0.1.0"))
    report = read_status(path, 30)
    assert report.state is Health.RUNNING
    assert report.daemon_state == "starting"
    assert not report.healthy


def test_malformed_file_is_reported_not_raised(tmp_path: Path) -> None:
    """Garbage in the file gives a stale report instead of an exception."""
    path = tmp_path / "status.json"
    path.write_text("{not json")
    assert read_status(path, 30).state is Health.STALE


def test_write_sets_updated_at_and_uptime(tmp_path: Path) -> None:
    """write_status stamps updated_at and recomputes uptime_s from started_at."""
    path = tmp_path / "status.json"
    data = new_status("0.1.0", started_at=time.time() - 100)
    write_status(path, data)
    stored = json.loads(path.read_text())
    assert abs(stored["updated_at"] - time.time()) < 5
    assert 99 <= stored["uptime_s"] < 110
    assert read_status(path, 30).to_dict()["status"]["version"] == "0.1.0"


def test_a_starting_daemon_removes_the_temp_files_a_killed_status_write_left(tmp_path: Path) -> None:
    """The first status write of a daemon's life (state starting) removes the status file's temp files
    older than a minute (a kill mid-write left them) and leaves a younger one (a write in progress)."""
    path = tmp_path / "status.json"
    old, young = tmp_path / ".status.json.abc123.tmp", tmp_path / ".status.json.def456.tmp"
    for temp in (old, young):
        temp.write_text("{")
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))

    write_status(path, new_status("0.1.0"))

    assert not old.exists()
    assert young.exists()
    assert read_status(path, 30).daemon_state == "starting"


def test_a_status_answered_live_is_judged_as_it_is_and_a_lagging_file_is_pointed_out(tmp_path: Path) -> None:
    """What the daemon answers on its control API now is never stale; its ``degraded`` makes it unhealthy
    with the reason, and a status file much older (its writes fail: a full disk) is pointed out."""
    path = tmp_path / "status.json"
    data = dict(new_status("0.1.0"), pid=os.getpid(), state="running", degraded="intake: No space left on device")

    report = live_report(data, path, file_age_s=120.0)

    assert report.state is Health.RUNNING
    assert not report.healthy
    assert report.reason.startswith(f"degraded: pid {os.getpid()}, answered on its control API: intake: No space")
    assert report.reason.endswith("its status file was last written 120 s ago (is the disk full?)")
    assert live_report(dict(data, degraded=None), path, file_age_s=1.0).healthy


def test_no_relay_connected_for_a_minute_is_degraded() -> None:
    """With every relay down (the embedded one dead, or the network gone) the daemon hears nobody: not
    degraded at first or at 59 s, degraded from 60 s on with the relays' last error, and healthy again as
    soon as one connects."""
    from tenex_daemon.adapters.nostr.relay_pool import PoolHealth, RelayHealth, RelayState
    from tenex_daemon.app.status import RelaysDown, degraded_reason

    def pool(state: RelayState) -> PoolHealth:
        relay = RelayHealth("ws://127.0.0.1:7777", state, True, True, None, 3, None, 0, {}, 0, False,
                            "ConnectionRefusedError: Connect call failed")
        return PoolHealth((relay,), 0, 0, 0, 0, {})

    down = RelaysDown()
    assert degraded_reason(pool(RelayState.BACKOFF), None, down.seconds(pool(RelayState.BACKOFF), 1000.0)) is None
    assert degraded_reason(pool(RelayState.BACKOFF), None, down.seconds(pool(RelayState.BACKOFF), 1059.0)) is None
    reason = degraded_reason(pool(RelayState.BACKOFF), None, down.seconds(pool(RelayState.BACKOFF), 1061.0))
    assert reason == "relays: none connected for 61 s (last error: ConnectionRefusedError: Connect call failed)"
    assert down.seconds(pool(RelayState.CONNECTED), 1062.0) == 0.0
    assert degraded_reason(pool(RelayState.CONNECTED), None, 0.0) is None


def test_an_outbox_stuck_past_its_warning_and_an_agent_whose_runs_all_fail_are_degraded() -> None:
    """A signed event waiting past ``daemon.outbox_warn_after_s`` for a relay to take it (relays refusing or
    silent: the replies reach nobody), and an agent whose last three runs each ended in an error reply of its
    backend, the newest within 15 minutes, make the daemon degraded with the reason; a shorter wait, two
    failures in a row, older ones, a run since that answered, or messages too long for the model, do not."""
    from tenex_daemon.app.metrics import Metrics
    from tenex_daemon.app.run_observer import MetricsObserver
    from tenex_daemon.app.status import FAILING_RECENT_S, Backlog, degraded_reason
    from tenex_daemon.services.runs import RunRequest

    assert degraded_reason(None, None, 0.0, backlog=Backlog(299.0, 300.0)) is None
    assert degraded_reason(None, None, 0.0, backlog=Backlog(301.5, 300.0)) == (
        "outbox: a signed event has waited 301 s for a relay to take it (relays refusing or not answering?)"
    )
    observer = MetricsObserver(Metrics())
    request = RunRequest("c" * 64, "e" * 64, "alice")

    def failing(after_s: float = 0.0) -> str | None:
        return degraded_reason(None, None, 0.0, backlog=Backlog(failing=observer.failing, now=time.monotonic() + after_s))

    for _ in range(2):
        observer.run_finished(request, 0.1, "unreachable")
    assert failing() is None
    observer.run_finished(request, 0.1, "unreachable")
    assert failing() == "agent alice: its last 3 runs ended in an error reply (unreachable)"
    assert failing(after_s=FAILING_RECENT_S) is None  # nobody wrote to it since: its next run will tell
    observer.run_finished(request, 0.1, None)
    assert failing() is None
    for _ in range(3):  # a person's messages too long for the model: no backend to mend
        observer.run_finished(request, 0.1, "context_too_long")
    assert failing() is None


def test_a_subscription_every_relay_refuses_for_a_minute_is_degraded() -> None:
    """A relay connected but ending the daemon's subscription (``CLOSED restricted:``) hears nothing for it:
    degraded once every connected reading relay has left the subscription unserved for a minute (a relay down
    beside it serves nothing either), not while one of them serves it, nor before the minute."""
    from tenex_daemon.adapters.nostr.relay_pool import PoolHealth, RelayHealth, RelayState
    from tenex_daemon.app.status import degraded_reason

    def relay(url: str, unserved: dict[str, tuple[float, str]], state: RelayState = RelayState.CONNECTED) -> RelayHealth:
        return RelayHealth(url, state, True, True, None, 0, None, 0, {}, 0, False, None,
                           subscriptions_closed=len(unserved), unserved=unserved)

    refused = {"tenexd-mentions": (75.0, "restricted: members only")}
    one = PoolHealth((relay("ws://a", refused),), 0, 0, 0, 0, {})
    assert degraded_reason(one, None, 0.0) == (
        "relays: subscription tenexd-mentions refused by every connected relay for 75 s (restricted: members only)"
    )
    beside_one_down = PoolHealth((relay("ws://a", refused), relay("ws://b", {}, RelayState.BACKOFF)), 0, 0, 0, 0, {})
    assert degraded_reason(beside_one_down, None, 0.0) == degraded_reason(one, None, 0.0)
    served_by_another = PoolHealth((relay("ws://a", refused), relay("ws://b", {})), 0, 0, 0, 0, {})
    assert degraded_reason(served_by_another, None, 0.0) is None
    young = PoolHealth((relay("ws://a", {"tenexd-mentions": (59.0, "restricted: members only")}),), 0, 0, 0, 0, {})
    assert degraded_reason(young, None, 0.0) is None


def test_a_pid_another_process_took_since_is_not_taken_for_the_daemon(tmp_path: Path) -> None:
    """A status file a killed daemon left, whose pid another live process has now (a reboot, a container):
    read as stopped, not running, because the process's identity beside the pid differs; the daemon's own
    identity reads as running."""
    import pytest

    if not Path("/proc/self/stat").exists():
        pytest.skip("process identities are read from /proc")
    path = tmp_path / "status.json"
    data = new_status("0.1.0")
    data["state"] = "running"
    write_status(path, data)
    assert read_status(path, 30).state is Health.RUNNING
    data["process"] = "another-boot:12345"  # the pid is this test's, alive: another process than the file's
    write_status(path, data)
    report = read_status(path, 30)
    assert report.state is Health.STOPPED
    assert "another process" in report.reason


def test_a_start_longer_than_the_stale_limit_reads_as_starting_while_its_process_lives(tmp_path: Path) -> None:
    """A daemon writes its status as its start begins and again once it serves: a start that takes longer
    than the stale limit (a long catch-up) reads as starting, not stale, while the pid is still the process
    that wrote the file (its identity checked). A file whose process cannot be identified is judged by its
    age as before, and a daemon that serves is stale as before."""
    import pytest

    if not Path("/proc/self/stat").exists():
        pytest.skip("process identities are read from /proc")
    path = tmp_path / "status.json"
    write_status(path, new_status("0.1.0"))  # state starting, this process's pid and identity
    report = read_status(path, stale_after_s=30, now=time.time() + 120)
    assert report.state is Health.RUNNING
    assert report.reason.startswith("starting: pid ")
    assert report.daemon_state == "starting"
    assert not report.healthy
    unknown = new_status("0.1.0")
    unknown["process"] = None
    write_status(path, unknown)
    assert read_status(path, stale_after_s=30, now=time.time() + 120).state is Health.STALE
    running = new_status("0.1.0")
    running["state"] = "running"
    write_status(path, running)
    assert read_status(path, stale_after_s=30, now=time.time() + 120).state is Health.STALE


def test_a_status_file_copied_with_its_home_is_not_taken_for_this_homes_daemon(tmp_path: Path) -> None:
    """A home copied while its daemon ran holds that daemon's status file, naming the original home and a
    live pid: `tenexd status` on the copy said running (the original's relays and counts); it says no
    daemon runs here, naming the home the file is of."""
    original, copy = tmp_path / "original", tmp_path / "copy"
    data = new_status("0.1.0", home=str(original))
    data["state"] = "running"
    write_status(original / "run" / "status.json", data)
    write_status(copy / "run" / "status.json", data)

    in_copy = read_status(copy / "run" / "status.json", stale_after_s=30, home=copy)
    in_original = read_status(original / "run" / "status.json", stale_after_s=30, home=original)

    assert in_copy.state is Health.STOPPED
    assert in_copy.reason.startswith(f"not running here: the status file is the daemon's of {original}")
    assert in_original.state is Health.RUNNING


def _written_then_clock_set(path: Path, wall_step_s: float, boot_age_s: float, boot: str | None = None) -> None:
    """A running daemon's status file, written ``boot_age_s`` ago on the boot clock, read after the wall
    clock was set by ``wall_step_s`` (its ``updated_at`` moved back by as much, as a reader sees it)."""
    data = new_status("0.1.0")
    data["state"] = "running"
    write_status(path, data)
    written = json.loads(path.read_text())
    written["updated_at"] -= wall_step_s + boot_age_s
    written["updated_boot_s"] -= boot_age_s
    if boot is not None:
        written["boot_id"] = boot
    path.write_text(json.dumps(written))


def test_a_wall_clock_set_since_the_status_was_written_does_not_change_its_age(tmp_path: Path) -> None:
    """The status file carries its boot and the boot clock's reading: a file written 2 s ago reads as fresh
    though the wall clock was set an hour ahead since (it read as stale, exit 1), and one written 100 s ago
    reads as stale though the wall clock was set two minutes back (it read as fresh: a stuck daemon hidden)."""
    if boot_id() is None:
        pytest.skip("no boot id here (/proc): status files are aged on the wall clock alone")
    fresh, stuck = tmp_path / "fresh.json", tmp_path / "stuck.json"
    _written_then_clock_set(fresh, wall_step_s=3600, boot_age_s=2)
    _written_then_clock_set(stuck, wall_step_s=-120, boot_age_s=100)

    fresh_report, stuck_report = read_status(fresh, 30), read_status(stuck, 30)

    assert fresh_report.state is Health.RUNNING
    assert fresh_report.age_s is not None
    assert 2 <= fresh_report.age_s < 10
    assert stuck_report.state is Health.STALE
    assert stuck_report.age_s is not None
    assert stuck_report.age_s >= 100


def test_a_status_file_of_another_boot_is_aged_on_the_wall_clock(tmp_path: Path) -> None:
    """A boot clock reading is only compared within its boot: a file another boot wrote (the machine
    restarted since) is judged by its ``updated_at``, as a file without the boot fields is."""
    path = tmp_path / "status.json"
    _written_then_clock_set(path, wall_step_s=3600, boot_age_s=2, boot="another-boot")

    report = read_status(path, 30)

    assert report.state is Health.STALE
    assert report.age_s is not None
    assert report.age_s >= 3600
