"""Small parts of the relay pool that need no socket: backoff, the seen-id LRU, health data."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from tenex_daemon.adapters.nostr.codec import OkMessage
from tenex_daemon.adapters.nostr.relay_pool import (
    PoolSettings,
    PublishError,
    PublishResult,
    ReceivedEvent,
    RelayPool,
    RelaySpec,
    RelayState,
    SeenIds,
    backoff_delay,
)
from tenex_daemon.adapters.nostr.relay_pool.outage import Renewals
from tenex_daemon.core.errors import EventRefusedError
from tenex_daemon.testing import KeyPair, sign_event


def test_backoff_grows_is_capped_and_jittered() -> None:
    """Delays double per attempt up to the cap, and the jitter stays within [delay/2, delay]."""
    upper = [backoff_delay(a, 0.5, 30.0, rng=lambda lo, hi: hi) for a in range(10)]
    lower = [backoff_delay(a, 0.5, 30.0, rng=lambda lo, hi: lo) for a in range(10)]
    assert upper[:4] == [0.5, 1.0, 2.0, 4.0]
    assert max(upper) == 30.0
    assert all(lo == hi / 2 for lo, hi in zip(lower, upper, strict=True))
    samples = {backoff_delay(3, 0.5, 30.0) for _ in range(20)}
    assert all(2.0 <= s <= 4.0 for s in samples)
    assert len(samples) > 1
    assert backoff_delay(10_000, 0.5, 30.0, rng=lambda lo, hi: hi) == 30.0


def test_seen_ids_is_a_bounded_lru() -> None:
    """SeenIds reports repeats, forgets the least recently seen past its size, and can discard."""
    seen = SeenIds(2)
    assert seen.add_if_new("a")
    assert not seen.add_if_new("a")
    assert seen.add_if_new("b")
    assert seen.add_if_new("c")  # evicts "a"
    assert seen.add_if_new("a")
    seen.discard("a")
    assert seen.add_if_new("a")


def test_health_of_an_unstarted_pool_is_json_ready() -> None:
    """Before start, every relay is listed idle, and the health data serializes to JSON."""
    pool = RelayPool(["ws://127.0.0.1:1", RelaySpec("ws://127.0.0.1:2", write=False)], settings=PoolSettings())
    health = pool.health()
    assert [r.state for r in health.relays] == [RelayState.IDLE, RelayState.IDLE]
    assert health.connected == 0
    data = json.loads(json.dumps(health.to_dict()))
    assert data["relays"][1] == {
        "url": "ws://127.0.0.1:2", "state": "idle", "read": True, "write": False, "connected_since": None,
        "reconnects": 0, "last_event_at": None, "events_received": 0, "rejects": {}, "notices": 0,
        "authenticated": False, "last_error": None, "oks_attributed": 0, "oks_unmatched": 0,
        "subscriptions_closed": 0, "unserved": {},
    }


def test_publish_error_names_each_relay() -> None:
    """A PublishError says which relay refused (and why) and which never answered."""
    error = PublishError(PublishResult("ab" * 32, rejected={"ws://a": "blocked: no"}, timed_out=("ws://b",)))
    assert "ws://a: blocked: no" in str(error)
    assert "ws://b: no answer" in str(error)


async def test_delivery_lanes_keep_order_per_key_and_run_keys_concurrently() -> None:
    """With lanes, a blocked key does not hold up other keys, and each key's events arrive in order."""
    from tenex_daemon.testing import KeyPair, sign_event

    keys = KeyPair.from_seed(77)
    blocked = asyncio.Event()
    seen: list[str] = []

    async def on_event(received: ReceivedEvent) -> None:
        if received.event.content == "a:1":
            await blocked.wait()
        seen.append(received.event.content)

    pool = RelayPool(
        [],
        on_event=on_event,
        settings=PoolSettings(delivery_lanes=8),
        lane_key=lambda event: event.content.split(":")[0],
    )
    await pool.start()
    try:
        events = [sign_event(keys, text, created_at=1_700_000_000 + n)
                  for n, text in enumerate(["a:1", "b:1", "a:2", "c:1", "b:2"])]
        for event in events:
            await pool.intake(event, "ws://relay", "sub")
        for _ in range(100):
            if len(seen) == 3:
                break
            await asyncio.sleep(0.01)
        assert sorted(seen) == ["b:1", "b:2", "c:1"]  # "a" is blocked, the others are not
        blocked.set()
        for _ in range(100):
            if len(seen) == 5:
                break
            await asyncio.sleep(0.01)
    finally:
        await pool.stop()
    assert [s for s in seen if s.startswith("a")] == ["a:1", "a:2"]
    assert [s for s in seen if s.startswith("b")] == ["b:1", "b:2"]
    assert pool.delivered == 5


class _ScriptedRelay:
    """A writable relay connection that answers every publish as told (no socket)."""

    def __init__(self, url: str, answer: OkMessage | Exception | None) -> None:
        self.url = url
        self.spec = RelaySpec(url)
        self._answer = answer

    async def publish(self, event: object, deadline: float) -> OkMessage | None:
        if isinstance(self._answer, Exception):
            raise self._answer
        return self._answer


@pytest.mark.parametrize("relays", [1, 2])
@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (OkMessage("x", True, ""), {"accepted_by": True}),
        (OkMessage("x", False, "duplicate: have it"), {"accepted_by": True}),
        (OkMessage("x", False, "blocked: no"), {"rejected": "blocked: no"}),
        (None, {"timed_out": True}),
        (RuntimeError("boom"), {"rejected": "error: RuntimeError"}),
    ],
)
async def test_each_relay_answer_counts_the_same_with_one_relay_or_several(
    relays: int, answer: OkMessage | Exception | None, expected: dict[str, object]
) -> None:
    """A publish sorts each relay's answer (accepted, duplicate, refused, none, an error raised) the same
    way whether one relay is written to (awaited directly) or several (one task each)."""
    pool = RelayPool([f"ws://127.0.0.1:{n}" for n in range(1, relays + 1)])
    urls = [spec.url for spec in pool.specs]
    pool._relays = {url: _ScriptedRelay(url, answer) for url in urls}  # type: ignore[misc]
    event = sign_event(KeyPair.from_seed(78), "hello", kind=1)

    result = await pool.publish(event, raise_on_failure=False)

    if "accepted_by" in expected:
        assert result.ok
        assert result.accepted_by[0] in urls
    elif "rejected" in expected:
        assert dict(result.rejected) == dict.fromkeys(urls, expected["rejected"])
    else:
        assert sorted(result.timed_out) == sorted(urls)  # in the order the relays answered
    if not result.ok:
        with pytest.raises(PublishError):
            await pool.publish(event)


def test_a_publish_is_refused_for_good_only_when_every_relay_refused_it_for_its_size() -> None:
    """``blocked:`` or ``invalid:`` for the event's size from every relay asked make the error final (an
    EventRefusedError, the relays' words kept); a relay that did not answer, is still trying, accepted, or
    refused for another reason (an author not let in, a clock, ``rate-limited:``, ``error:``) leaves it an
    ordinary PublishError, tried again."""
    size = "blocked: event size (70998 bytes) exceeds maximum allowed size (65536 bytes)"
    final = PublishResult("e1", rejected={"ws://a": size, "ws://b": "invalid: event too large"})
    error = PublishError.of(final)
    assert isinstance(error, EventRefusedError)
    assert error.reasons == (size, "invalid: event too large")
    for passing in (
        PublishResult("e1", rejected={"ws://a": size}, timed_out=("ws://b",)),
        PublishResult("e1", rejected={"ws://a": size}, pending=("ws://b",)),
        PublishResult("e1", rejected={"ws://a": size, "ws://b": "rate-limited: slow down"}),
        PublishResult("e1", rejected={"ws://a": "blocked: pubkey not allowed"}),
        PublishResult("e1", rejected={"ws://a": "invalid: created_at too far off from the current time"}),
        PublishResult("e1", rejected={"ws://a": "error: ConnectionClosed"}),
        PublishResult("e1"),
    ):
        assert not isinstance(PublishError.of(passing), EventRefusedError)


OUTAGE = "tenex_daemon.adapters.nostr.relay_pool.outage"


def test_renewals_in_a_row_wait_longer_up_to_the_cap_and_never_start_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """A relay refusing right after each reconnect: the pauses grow to the backoff cap and stay there (a
    pause longer than stable_after is no stable connection: the streak goes on), and start over only once
    a connection stayed up stable_after seconds."""
    now = [0.0]
    monkeypatch.setattr(f"{OUTAGE}.time", SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(f"{OUTAGE}.backoff_delay", lambda a, base, cap: backoff_delay(a, base, cap, rng=max))
    renewals = Renewals(PoolSettings(backoff_base=0.5, backoff_cap=30.0, stable_after=10.0))
    pauses = []
    for _ in range(10):
        pause = renewals.pause()
        pauses.append(pause)
        now[0] += pause + 0.1  # renewed again 0.1 s after the new connection opened

    now[0] += 10.0
    assert pauses == [0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert renewals.pause() == 0.0


async def until(condition: Callable[[], bool], within: float = 3.0) -> None:
    """Wait until ``condition()`` holds, at most ``within`` seconds (the caller's assertions say what failed)."""
    deadline = asyncio.get_running_loop().time() + within
    while not condition() and asyncio.get_running_loop().time() < deadline:  # noqa: ASYNC110 - polled state
        await asyncio.sleep(0.01)


async def test_a_lane_waiting_outside_lends_its_slot_and_keeps_its_order() -> None:
    """With every lane taken by an event waiting on a model (inside ``outside_lane``), another key's event is
    taken in meanwhile; a waiting key's later event still comes after it; a task a handler started (a run
    that routes later) lends nothing of the lane, and the slots add up again once all is done."""
    from tenex_daemon.runtime.lanes import outside_lane

    keys = KeyPair.from_seed(78)
    model = asyncio.Event()
    hold = asyncio.Event()
    seen: list[str] = []
    started: list[asyncio.Task[None]] = []

    async def later_run() -> None:
        async with outside_lane():  # not the lane's task: lends nothing
            seen.append("run")

    async def on_event(received: ReceivedEvent) -> None:
        content = received.event.content
        if content.endswith(":1") and content[0] in "ab":
            started.append(asyncio.create_task(later_run()))
            async with outside_lane():
                await model.wait()
        if content[0] in "gh":  # holding its lane
            await hold.wait()
        seen.append(content)

    pool = RelayPool([], on_event=on_event, settings=PoolSettings(delivery_lanes=2),
                     lane_key=lambda event: event.content.split(":")[0])
    await pool.start()
    try:
        for n, text in enumerate(["a:1", "b:1", "a:2", "c:1"]):
            await pool.intake(sign_event(keys, text, created_at=1_700_000_000 + n), "ws://relay", "sub")
        await until(lambda: "c:1" in seen)
        assert seen == ["run", "run", "c:1"]  # both lanes were lent while "a" and "b" waited on a model
        model.set()
        await until(lambda: len(seen) == 6)
        assert [s for s in seen if s.startswith("a")] == ["a:1", "a:2"]
        assert sorted(seen[3:]) == ["a:1", "a:2", "b:1"]
        for n, text in enumerate(["g:1", "h:1", "i:1"]):  # two slots again, not more: "i" waits for one
            await pool.intake(sign_event(keys, text, created_at=1_700_000_010 + n), "ws://relay", "sub")
        await asyncio.sleep(0.3)
        assert len(seen) == 6
        hold.set()
        await until(lambda: len(seen) == 9)
    finally:
        hold.set()
        await pool.stop()
        await asyncio.gather(*started)
    assert sorted(seen[6:]) == ["g:1", "h:1", "i:1"]
    assert pool.delivered == 7


async def test_a_lender_holding_a_lock_the_other_lanes_wait_for_takes_its_slot_back_at_once() -> None:
    """Three events of one conversation in distinct lanes (kind-1 notes of one channel), two lanes: the first
    holds the conversation's routing lock and lends its slot while its model answers; the other two take the
    lanes and wait for the lock. The first takes its slot back beyond the bound rather than wait for one of
    theirs (intake froze for good), all three are handled, and the bound holds again after."""
    from tenex_daemon.runtime.lanes import outside_lane

    keys = KeyPair.from_seed(79)
    routing = asyncio.Lock()
    seen: list[str] = []
    hold = asyncio.Event()

    async def on_event(received: ReceivedEvent) -> None:
        content = received.event.content
        if content.startswith("note"):
            async with routing:
                async with outside_lane():
                    await asyncio.sleep(0.2)  # the orchestrator's model
                seen.append(content)
        else:
            await hold.wait()  # holding its lane
            seen.append(content)

    pool = RelayPool([], on_event=on_event, settings=PoolSettings(delivery_lanes=2),
                     lane_key=lambda event: event.content)
    await pool.start()
    try:
        for n, text in enumerate(["note 1", "note 2", "note 3"]):
            await pool.intake(sign_event(keys, text, created_at=1_700_000_000 + n), "ws://relay", "sub")
        await until(lambda: len(seen) == 3)
        assert sorted(seen) == ["note 1", "note 2", "note 3"]
        for n, text in enumerate(["x", "y", "z"]):  # two slots again, not more: "z" waits for one
            await pool.intake(sign_event(keys, text, created_at=1_700_000_010 + n), "ws://relay", "sub")
        await asyncio.sleep(0.3)
        assert len(seen) == 3
        hold.set()
        await until(lambda: len(seen) == 6)
    finally:
        hold.set()
        await pool.stop()
    assert sorted(seen[3:]) == ["x", "y", "z"]
