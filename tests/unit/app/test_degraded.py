"""Intake on a bad day: store writes that fail are retried and reported as ``degraded``; strangers'
events cost no disk and are logged rate-limited; /metrics shows the pool's counters."""

from __future__ import annotations

import asyncio
import errno
import time
from collections.abc import AsyncIterator, Callable, MutableMapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from tenex_daemon import MemoryStore
from tenex_daemon.adapters.nostr.private import GiftWraps
from tenex_daemon.adapters.nostr.relay_pool import PoolHealth, PoolSettings, RelayPool
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.app import daemon as daemon_module
from tenex_daemon.app.daemon import Daemon
from tenex_daemon.app.home import init_home
from tenex_daemon.app.metrics import Metrics
from tenex_daemon.app.refusals import RefusalLog
from tenex_daemon.app.settings import load_settings
from tenex_daemon.app.status import read_status, relay_statuses, write_status
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.vocabulary import KIND_GIFT_WRAP
from tenex_daemon.services.dispatcher import HandleResult, Outcome
from tenex_daemon.services.private_messages import Intake
from tenex_daemon.testing.fakes import signers_for
from tests.conftest import Cast
from tests.pipeline import build_rig, cast_keys

RETRY_FAST = PoolSettings(retry_base=0.05, retry_cap=0.2, cursor_flush_interval=0.05)


class FlakyStore(MemoryStore):
    """A memory store whose writes fail with ENOSPC while ``failing`` is set (a full disk)."""

    def __init__(self) -> None:
        super().__init__()
        self.failing = False
        self.processed_writes = 0

    def _check(self) -> None:
        if self.failing:
            raise OSError(errno.ENOSPC, "No space left on device")

    async def create(self, conversation: Conversation) -> None:
        """Create, unless writes fail."""
        self._check()
        await super().create(conversation)

    async def save_state(self, conversation: Conversation) -> None:
        """Save, unless writes fail."""
        self._check()
        await super().save_state(conversation)

    async def set_meta(self, key: str, value: str) -> None:
        """Set a small value, unless writes fail."""
        self._check()
        await super().set_meta(key, value)

    async def mark_processed(self, event_id: str) -> None:
        """Mark processed (counted), unless writes fail."""
        self._check()
        self.processed_writes += 1
        await super().mark_processed(event_id)


@asynccontextmanager
async def daemon_with_pool(tmp_path: Path, cast: Cast, store: FlakyStore) -> AsyncIterator[Daemon]:
    """A Daemon whose intake (``_on_event``) runs the real pipeline over ``store``, fed by a relay-less pool."""
    init_home(tmp_path / "h", owner=cast.user.pubkey, relays=["ws://127.0.0.1:9"])
    daemon = Daemon(load_settings(tmp_path / "h"))
    rig = build_rig(cast, store=store)
    daemon.pipeline = rig.pipeline
    daemon.state = "running"
    pool = RelayPool([], on_event=daemon._on_event, store=store, settings=RETRY_FAST)
    daemon.pool = pool
    await pool.start()
    try:
        yield daemon
    finally:
        await pool.stop()
        await rig.settle()


async def wait_until(predicate: Callable[[], bool], within: float = 10.0) -> bool:
    """Poll ``predicate`` until it holds or ``within`` seconds pass."""
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def test_events_whose_store_writes_failed_are_retried_once_writes_work(tmp_path: Path, cast: Cast) -> None:
    """While writes fail the event is kept, the daemon reports ``degraded`` with the reason (not healthy)
    and counts it; once writes work it is accepted without any relay sending it again."""
    store = FlakyStore()
    store.failing = True
    event = cast.user_says("hello while the disk is full", kind=11, tags=[["p", cast.alice.pubkey]])
    async with daemon_with_pool(tmp_path, cast, store) as daemon:
        assert daemon.pool is not None
        await daemon.pool.intake(event, "ws://relay", "tenexd-mentions")
        assert await wait_until(lambda: daemon.pool is not None and daemon.pool.health().retries >= 1)
        status = daemon.status()
        assert status["degraded"] is not None
        assert "No space left on device" in status["degraded"]
        write_status(tmp_path / "status.json", status)
        report = read_status(tmp_path / "status.json", 60)
        assert not report.healthy
        assert "degraded" in report.reason
        assert b"tenexd_intake_retries_total" in daemon.metrics.render()

        store.failing = False
        assert await wait_until(lambda: store.processed_writes >= 1)
        assert await wait_until(lambda: daemon.status()["degraded"] is None)
        assert daemon.status()["events"]["accepted"] == 1
        assert await store.load(event.id) is not None


async def test_a_strangers_event_is_not_written_to_the_processed_ledger(tmp_path: Path, cast: Cast) -> None:
    """An event refused as ``author_not_allowed`` is deduped in memory, never marked processed in the
    store; a copy of it is dropped as a duplicate."""
    store = FlakyStore()
    stranger = cast.factory.event(cast.other_user, "let me in", kind=1111, tags=[["p", cast.alice.pubkey]])
    async with daemon_with_pool(tmp_path, cast, store) as daemon:
        assert daemon.pool is not None
        await daemon.pool.intake(stranger, "ws://relay", "tenexd-mentions")
        assert await wait_until(lambda: daemon.events_ignored["author_not_allowed"] == 1)
        await daemon.pool.intake(stranger, "ws://other", "tenexd-mentions")
        await asyncio.sleep(0.1)
        assert daemon.events_ignored["author_not_allowed"] == 1
        assert daemon.pool.duplicates == 1
    assert store.processed_writes == 0
    assert not await store.is_processed(stranger.id)


async def test_a_strangers_event_the_intake_refuses_is_refused_as_a_strangers(tmp_path: Path, cast: Cast) -> None:
    """A stranger's kind 14 in the clear, and a stranger's mention when agents answer private messages only,
    are counted as ``author_not_allowed`` and cost no disk, as any stranger's event; the owner's kind 14 in
    the clear is refused for what it is, with a log line."""
    store = FlakyStore()
    strangers = [
        cast.factory.event(cast.other_user, "in the clear", kind=14, tags=[["p", cast.alice.pubkey]]),
        cast.factory.event(cast.other_user, "a mention", kind=1111, tags=[["p", cast.alice.pubkey]]),
    ]
    owners = cast.factory.event(cast.user, "in the clear too", kind=14, tags=[["p", cast.alice.pubkey]])
    async with daemon_with_pool(tmp_path, cast, store) as daemon:
        assert daemon.pool is not None
        assert daemon.pipeline is not None
        daemon.intake = Intake(None, daemon.pipeline.manager.agents, public=False)
        with capture_logs() as logs:
            for event in [*strangers, owners]:
                await daemon.pool.intake(event, "ws://relay", "tenexd-mentions")
            assert await wait_until(lambda: sum(daemon.events_ignored.values()) == 3)
    assert daemon.events_ignored == {"author_not_allowed": 2, "private_message_in_the_clear": 1}
    assert not await store.is_processed(strangers[0].id)
    assert not await store.is_processed(strangers[1].id)
    refused = [(entry["reason"], entry["author"]) for entry in logs if entry["event"] == "event_refused"]
    assert refused == [
        ("author_not_allowed", cast.other_user.pubkey),
        ("private_message_in_the_clear", cast.user.pubkey),
    ]


async def _refused_across_a_minute(
    daemon: Daemon, events: list[NostrEvent], subscription: str, reason: str, refusal_log: RefusalLog
) -> list[MutableMapping[str, Any]]:
    """Take in all but the last of ``events`` (each refused for ``reason``), move ``refusal_log``'s clock
    a minute on, take in the last; return every log entry made meanwhile."""
    assert daemon.pool is not None
    with capture_logs() as logs:
        for event in events[:-1]:
            await daemon.pool.intake(event, "ws://relay", subscription)
        assert await wait_until(lambda: daemon.events_ignored[reason] == len(events) - 1)
        refusal_log.clock = lambda: time.monotonic() + 61
        await daemon.pool.intake(events[-1], "ws://relay", subscription)
        assert await wait_until(lambda: daemon.events_ignored[reason] == len(events))
    return logs


async def test_author_not_allowed_is_logged_once_per_author_per_minute(tmp_path: Path, cast: Cast) -> None:
    """Three events from one stranger log one ``author_not_allowed`` line; a minute later the next one
    logs again with the count of lines suppressed in between."""
    store = FlakyStore()
    events: list[NostrEvent] = [
        cast.factory.event(cast.other_user, f"spam {n}", kind=1111, tags=[["p", cast.alice.pubkey]])
        for n in range(4)
    ]
    async with daemon_with_pool(tmp_path, cast, store) as daemon:
        logs = await _refused_across_a_minute(
            daemon, events, "tenexd-mentions", "author_not_allowed", daemon.stranger_log
        )
    lines = [entry for entry in logs if entry["event"] == "event_refused"]
    assert [entry["author"] for entry in lines] == [cast.other_user.pubkey] * 2
    assert [entry["suppressed"] for entry in lines] == [0, 2]
    assert all(entry["reason"] == "author_not_allowed" for entry in lines)



def test_a_flood_from_fresh_keys_logs_at_most_the_windows_lines() -> None:
    """2,000 refusals, each from a key of its own, log 20 lines in a minute (one per author would log
    2,000); a minute later the next line counts the 1,980 refusals left out."""
    from tenex_daemon.app.refusals import RefusalLog

    now = [0.0]
    refusals = RefusalLog()
    refusals.clock = lambda: now[0]
    with capture_logs() as logs:
        for n in range(2_000):
            refusals.refused(f"{n:064x}", f"{n + 1:064x}", 1111, "author_not_allowed")
        now[0] = 61.0
        refusals.refused("f" * 64, "e" * 64, 1111, "author_not_allowed")
    lines = [entry for entry in logs if entry["event"] == "event_refused"]
    assert len(lines) == 21
    assert lines[-1]["others"] == 1_980

async def test_refused_gift_wraps_are_logged_once_a_minute_per_reason_whatever_their_one_time_keys(
    tmp_path: Path, cast: Cast
) -> None:
    """Five unreadable gift wraps, each signed by its own one-time key, log one ``event_refused`` line;
    a minute later the next one logs again with the count suppressed in between; each is counted."""
    store = FlakyStore()
    wraps = [
        Signer.generate().sign(KIND_GIFT_WRAP, f"no NIP-44 payload {n}", [["p", cast.alice.pubkey]])
        for n in range(6)
    ]
    async with daemon_with_pool(tmp_path, cast, store) as daemon:
        assert daemon.pipeline is not None
        daemon.intake = Intake(GiftWraps(signers_for(cast_keys(cast))), daemon.pipeline.manager.agents)
        logs = await _refused_across_a_minute(
            daemon, wraps, "tenexd-wraps", "wrap_unreadable", daemon.intake_refusal_log
        )
    lines = [entry for entry in logs if entry["event"] == "event_refused"]
    assert [entry["reason"] for entry in lines] == ["wrap_unreadable"] * 2
    assert [entry["suppressed"] for entry in lines] == [0, 4]
    assert [entry for entry in logs if entry["log_level"] != "debug" and entry["event"] != "event_refused"] == []
    assert store.processed_writes == 0


def test_metrics_show_frame_rejects_duplicates_handler_errors_and_reconnects() -> None:
    """/metrics carries the pool's frame rejections by reason, duplicates, handler errors, retries and
    each relay's reconnects and answers without an event id, read from its health at scrape time."""
    pool = RelayPool(["ws://127.0.0.1:9"], settings=PoolSettings())
    base = pool.health()
    relay = base.relays[0]
    changed = {"state": relay.state, "reconnects": 3, "oks_attributed": 8, "oks_unmatched": 1}
    health = PoolHealth(
        (type(relay)(**{**relay.to_dict(), **changed}),),
        delivered=5, duplicates=7, consumer_errors=2, queued=0, rejects={"bad_signature": 4},
        retrying=1, retries=6,
    )
    metrics = Metrics()
    metrics.watch_pool(lambda: health)
    text = metrics.render().decode()
    assert 'tenexd_frames_rejected_total{reason="bad_signature"} 4.0' in text
    assert "tenexd_events_duplicate_total 7.0" in text
    assert "tenexd_intake_handler_errors_total 2.0" in text
    assert "tenexd_intake_retries_total 6.0" in text
    assert "tenexd_intake_retry_pending 1.0" in text
    assert 'tenexd_relay_reconnects_total{url="ws://127.0.0.1:9"} 3.0' in text
    assert 'tenexd_relay_oks_without_id_total{outcome="attributed",url="ws://127.0.0.1:9"} 8.0' in text
    assert 'tenexd_relay_oks_without_id_total{outcome="unmatched",url="ws://127.0.0.1:9"} 1.0' in text
    assert [(r["oks_attributed"], r["oks_unmatched"]) for r in relay_statuses(health)] == [(8, 1)]


class MuteStore(MemoryStore):
    """A memory store that stops answering while ``mute`` is set (a database restarting)."""

    mute = False

    async def phase_counts(self) -> dict[tuple[str, bool], int]:
        """Count, unless mute."""
        if self.mute:
            raise ConnectionError("connection was closed in the middle of operation")
        return await super().phase_counts()


async def test_a_store_that_does_not_answer_is_shown_as_degraded_in_the_status_file(
    tmp_path: Path, cast: Cast
) -> None:
    """While the store does not answer, the status file is still written, saying ``degraded`` and why (it
    was not written at all: `tenexd status` said running, then stale); once it answers, it is healthy again."""
    init_home(tmp_path / "h", owner=cast.user.pubkey, relays=["ws://127.0.0.1:9"])
    daemon = Daemon(load_settings(tmp_path / "h", {"TENEX_DAEMON__STATUS_INTERVAL_S": "0.05"}))
    store = MuteStore()
    daemon.store = store
    daemon.state = "running"
    path = daemon.settings.status_path
    path.parent.mkdir(parents=True, exist_ok=True)
    store.mute = True
    loop = asyncio.create_task(daemon._status_loop())
    try:
        assert await wait_until(lambda: path.exists() and read_status(path, 60).degraded is not None)
        report = read_status(path, 60)
        assert not report.healthy
        assert "store: not answering (connection was closed in the middle of operation)" in report.reason
        store.mute = False
        assert await wait_until(lambda: read_status(path, 60).degraded is None)
        assert read_status(path, 60).healthy
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


class SilentStore(MemoryStore):
    """A memory store whose counts never answer while ``silent`` is set (a network gone silent)."""

    silent = False
    asked = 0

    async def phase_counts(self) -> dict[tuple[str, bool], int]:
        """Count, unless silent: then wait forever (until cancelled)."""
        self.asked += 1
        if self.silent:
            await asyncio.Event().wait()
        return await super().phase_counts()


async def test_a_store_that_never_answers_is_shown_as_degraded_in_the_status_file(
    tmp_path: Path, cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store whose count hangs (no error, no answer) does not stop the status file being written: it says
    ``degraded``, no answer within the wait, and the count is not started again while one waits."""
    monkeypatch.setattr(daemon_module, "STATUS_COUNT_WAIT_S", 0.05)
    init_home(tmp_path / "h", owner=cast.user.pubkey, relays=["ws://127.0.0.1:9"])
    daemon = Daemon(load_settings(tmp_path / "h", {"TENEX_DAEMON__STATUS_INTERVAL_S": "0.02"}))
    store = SilentStore()
    store.silent = True
    daemon.store = store
    daemon.state = "running"
    path = daemon.settings.status_path
    path.parent.mkdir(parents=True, exist_ok=True)
    loop = asyncio.create_task(daemon._status_loop())
    try:
        assert await wait_until(lambda: path.exists() and read_status(path, 60).degraded is not None)
        assert "store: not answering (no answer within 0.05 s)" in read_status(path, 60).reason
        await asyncio.sleep(0.2)  # several status writes
        assert store.asked == 1
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


class RestartingStore(FlakyStore):
    """A database restarting: the next new conversation is stored but its commit's answer is lost (an
    error), then ``refusals`` reads fail (the server starting again), then everything works."""

    def __init__(self) -> None:
        super().__init__()
        self.lose_next_create = False
        self.refusals = 0

    async def create(self, conversation: Conversation) -> None:
        """Store it; maybe lose the answer."""
        await super().create(conversation)
        if self.lose_next_create:
            self.lose_next_create = False
            self.refusals = 2
            raise ConnectionError("connection was closed in the middle of operation")

    async def is_processed(self, event_id: str) -> bool:
        """Answer, unless the server is still starting."""
        if self.refusals:
            self.refusals -= 1
            raise ConnectionRefusedError("Connect call failed")
        return await super().is_processed(event_id)


async def test_an_event_stored_by_a_try_whose_answer_was_lost_is_answered_through_the_relay_pool(
    tmp_path: Path, cast: Cast
) -> None:
    """Through the relay pool's retries: a new conversation's commit lands but its answer is lost, the next
    tries fail before the handler (the database starting again), and then the pool finds the event stored.
    It hands it to the handler all the same, which dispatches it: the agent answers once (the pool dropped
    it as processed, silently: nobody answered until a daemon restarted)."""
    store = RestartingStore()
    store.lose_next_create = True
    event = cast.user_says("hello while the database restarts", kind=11, tags=[["p", cast.alice.pubkey]])
    async with daemon_with_pool(tmp_path, cast, store) as daemon:
        assert daemon.pool is not None
        assert daemon.pipeline is not None
        await daemon.pool.intake(event, "ws://relay", "tenexd-mentions")
        async with asyncio.timeout(10):  # until the agent's answer is saved
            while (stored := await store.load(event.id)) is None or len(stored.history) < 2:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        assert await wait_until(lambda: daemon.pool is not None and daemon.pool.health().retrying == 0)
        await daemon.pipeline.dispatcher.scheduler.drain(10)
        conversation = await store.load(event.id)
        assert conversation is not None
        assert [e.pubkey for e in conversation.history] == [cast.user.pubkey, cast.alice.pubkey]


async def test_an_event_another_daemon_took_in_first_counts_as_a_duplicate_not_a_refusal(
    tmp_path: Path, cast: Cast
) -> None:
    """An event the handler finds taken in already (daemons sharing a database: another one won it) is
    counted with the duplicates, in the status and /metrics, not among the refused events (it read
    "rejected 15 (duplicate 15)" beside "duplicates 0")."""
    store = FlakyStore()
    event = cast.user_says("hello", kind=11, tags=[["p", cast.alice.pubkey]])
    async with daemon_with_pool(tmp_path, cast, store) as daemon:
        daemon._count(event, HandleResult(Outcome.DUPLICATE, conversation_id=event.id))

        counts = daemon.status()["events"]
        assert (counts["rejected"], counts["duplicates"]) == ({}, 1)
        assert b"tenexd_events_duplicate_total 1.0" in daemon.metrics.render()
        assert b'reason="duplicate"' not in daemon.metrics.render()


async def test_an_accepted_event_that_runs_no_agent_is_counted_with_its_reason(tmp_path: Path, cast: Cast) -> None:
    """Events taken in from a relay that are accepted into a conversation but run no agent (a root p-tagging
    only someone else; one side of a send_message exchange) count as accepted and, by their reason, in
    ``tenexd_events_ran_nobody_total``; an event that runs an agent is not counted there."""
    root = cast.user_says("for someone else", kind=11, tags=[["p", cast.other_user.pubkey]])
    thread = [["E", root.id, "", root.pubkey], ["K", "11"], ["e", root.id]]
    copy = cast.factory.event(cast.alice_keys, "asked bob", tags=[*thread, ["p", cast.bob.pubkey], ["delegation", "t"]])
    async with daemon_with_pool(tmp_path, cast, FlakyStore()) as daemon:
        assert daemon.pool is not None
        for event in (root, copy):
            await daemon.pool.intake(event, "ws://relay", "tenexd-mentions")
        assert await wait_until(lambda: daemon.status()["events"]["accepted"] == 2)

        text = daemon.metrics.render()
        assert b'tenexd_events_ran_nobody_total{reason="addressed_elsewhere"} 1.0' in text
        assert b'tenexd_events_ran_nobody_total{reason="delegation"} 1.0' in text
        assert text.count(b"tenexd_events_ran_nobody_total{") == 2


def test_an_event_the_orchestrator_ran_nobody_for_is_counted_with_its_stop() -> None:
    """A completion stored while the orchestrator's routing stopped (the turn limit, a repeated decision)
    counts in ``tenexd_events_ran_nobody_total`` by that stop: a routing loop cut off is a number to alert on."""
    metrics = Metrics()
    metrics.event_accepted(1111, "turn_limit", stored=True)
    metrics.event_accepted(1111, "repeated_decision", stored=True)
    text = metrics.render()
    assert b'tenexd_events_ran_nobody_total{reason="turn_limit"} 1.0' in text
    assert b'tenexd_events_ran_nobody_total{reason="repeated_decision"} 1.0' in text


async def test_the_metrics_gauges_stay_true_while_the_status_file_cannot_be_written(
    tmp_path: Path, cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the status file's write failing (a full disk), /metrics still shows the relay as not connected
    (the gauges were refreshed after the write, so a failed write froze them at their last values)."""
    init_home(tmp_path / "h", owner=cast.user.pubkey, relays=["ws://127.0.0.1:9"])
    daemon = Daemon(load_settings(tmp_path / "h"))
    daemon.pool = RelayPool(["ws://127.0.0.1:9"], settings=PoolSettings())  # never started: not connected
    daemon.metrics.set_relay_connected("ws://127.0.0.1:9", True)  # what the last good refresh showed

    async def full_disk() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(daemon, "_write_status", full_disk)
    await daemon._write_status_and_gauges()

    assert daemon.errors["status"] == 1
    assert 'tenexd_relay_connected{url="ws://127.0.0.1:9"} 0.0' in daemon.metrics.render().decode()
