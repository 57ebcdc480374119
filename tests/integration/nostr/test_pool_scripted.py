"""The pool against small scripted relays: bad frames, resubscription cursors, AUTH, OK handling."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection

from tenex_daemon.adapters.nostr.codec import Limits, RejectReason, verify_event
from tenex_daemon.adapters.nostr.relay_pool import PoolSettings, RelayPool
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.vocabulary import KIND_COMMENT, KIND_RELAY_AUTH

from .conftest import FAST
from .harness import Collector, FakeRelay

pytestmark = [pytest.mark.integration]

AUTHOR = Signer.generate(label="author")


def event_frame(sub_id: str, event: NostrEvent | dict[str, Any]) -> str:
    """An EVENT frame carrying ``event``."""
    data = event.to_dict() if isinstance(event, NostrEvent) else event
    return json.dumps(["EVENT", sub_id, data])


def bad_frames(sub_id: str) -> list[tuple[str, RejectReason]]:
    """One malformed frame per reason code, each paired with the reason the pool must count."""
    good = AUTHOR.sign(KIND_COMMENT, "template").to_dict()
    forged = {**good, "content": "changed after signing"}
    other = AUTHOR.sign(KIND_COMMENT, "other")
    bad_sig = {**good, "sig": other.sig}
    nonhex = {**good, "pubkey": "zz" * 32}
    bad_tags = {**good, "tags": [["p", 5]]}
    huge = AUTHOR.sign(KIND_COMMENT, "x" * (256 * 1024 + 1)).to_dict()
    return [
        ("{not json", RejectReason.INVALID_JSON),
        ('{"an": "object"}', RejectReason.NOT_AN_ARRAY),
        (json.dumps(["EVENT", sub_id]), RejectReason.WRONG_ARITY),
        (json.dumps(["OK", "ab"]), RejectReason.WRONG_ARITY),
        (json.dumps(["WHAT", 1]), RejectReason.UNKNOWN_TYPE),
        (event_frame(sub_id, forged), RejectReason.BAD_ID),
        (event_frame(sub_id, bad_sig), RejectReason.BAD_SIGNATURE),
        (event_frame(sub_id, huge), RejectReason.OVERSIZED),
        (event_frame(sub_id, nonhex), RejectReason.BAD_SHAPE),
        (event_frame(sub_id, bad_tags), RejectReason.BAD_SHAPE),
        (json.dumps(["OK", "not-hex", True, ""]), RejectReason.BAD_FIELD),
    ]


async def test_bad_frames_are_counted_and_the_connection_keeps_working() -> None:
    """Every malformed frame is rejected with its reason counted; the next valid event still arrives."""
    valid = AUTHOR.sign(KIND_COMMENT, "the good one")

    async def script(fake: FakeRelay, ws: ServerConnection) -> None:
        req = await fake.recv(ws)
        for frame, _ in bad_frames(req[1]):
            await ws.send(frame)
        await ws.send(event_frame(req[1], valid))
        await ws.wait_closed()

    collector = Collector()
    async with FakeRelay(script) as fake, RelayPool([fake.url], on_event=collector, settings=FAST) as pool:
        await pool.subscribe("s", [{"kinds": [KIND_COMMENT]}])
        assert await collector.wait_for(lambda c: len(c.received) == 1, within=10)
        assert collector.ids == [valid.id]
        expected: dict[str, int] = {}
        for _, reason in bad_frames("s"):
            expected[reason.value] = expected.get(reason.value, 0) + 1
        health = pool.health()
        assert health.rejects == expected
        assert health.relays[0].reconnects == 0
        assert fake.connections == 1


async def test_resubscribe_after_reconnect_uses_persisted_cursor_minus_window() -> None:
    """After the relay drops the connection, the REQ is re-sent with since = last created_at - window."""
    created = int(time.time()) - FAST.slow_clock_allowance - 100  # older: asked from it, not capped
    first = AUTHOR.sign(KIND_COMMENT, "one", created_at=created)

    async def script(fake: FakeRelay, ws: ServerConnection) -> None:
        req = await fake.recv(ws)
        if fake.connections == 1:
            await ws.send(event_frame(req[1], first))
            await ws.send(json.dumps(["EOSE", req[1]]))
            await asyncio.sleep(0.3)
            await ws.close()
            return
        await ws.send(event_frame(req[1], first))  # the overlap comes back: dedupe drops it
        await ws.wait_closed()

    collector = Collector()
    store = MemoryStore()
    async with FakeRelay(script) as fake:
        async with RelayPool([fake.url], on_event=collector, store=store, settings=FAST) as pool:
            await pool.subscribe("s", [{"kinds": [KIND_COMMENT], "limit": 10}])
            reqs = await fake.wait_frames("REQ", 2)
            assert "since" not in reqs[0][2]
            assert reqs[1][2] == {"kinds": [KIND_COMMENT], "limit": 10, "since": created - FAST.since_window}
            await asyncio.sleep(0.3)
            assert collector.ids == [first.id]
            assert pool.health().relays[0].reconnects == 1
        assert await store.get_meta(f"nostr.cursor:s:{fake.url}") == str(created)
        # a restarted daemon starts from the persisted cursor
        async with RelayPool([fake.url], on_event=collector, store=store, settings=FAST) as pool:
            await pool.subscribe("s", [{"kinds": [KIND_COMMENT]}])
            reqs = await fake.wait_frames("REQ", 3)
            assert reqs[2][2]["since"] == created - FAST.since_window
            await asyncio.sleep(0.3)
            assert collector.ids == [first.id]


async def test_auth_challenge_answered_and_req_and_event_resent_once() -> None:
    """A relay that says auth-required gets a valid kind-22242 AUTH, then the REQ and EVENT again, once."""
    signer = Signer.generate(label="project")
    challenge = "challenge-123"
    state: dict[str, bool] = {"authed": False}

    async def script(fake: FakeRelay, ws: ServerConnection) -> None:
        while True:
            frame = await fake.recv(ws)
            if frame[0] == "REQ":
                if state["authed"]:
                    await ws.send(json.dumps(["EOSE", frame[1]]))
                else:
                    await ws.send(json.dumps(["AUTH", challenge]))
                    await ws.send(json.dumps(["CLOSED", frame[1], "auth-required: who are you"]))
            elif frame[0] == "EVENT":
                ok = state["authed"]
                message = "" if ok else "auth-required: sign in first"
                await ws.send(json.dumps(["OK", frame[1]["id"], ok, message]))
            elif frame[0] == "AUTH":
                event = frame[1]
                state["authed"] = event["kind"] == KIND_RELAY_AUTH and ["challenge", challenge] in event["tags"]
                await ws.send(json.dumps(["OK", event["id"], state["authed"], ""]))

    async with FakeRelay(script) as fake, RelayPool([fake.url], auth_signer=signer, settings=FAST) as pool:
        await pool.subscribe("s", [{"kinds": [KIND_COMMENT]}])
        auth_frames = await fake.wait_frames("AUTH", 1)
        auth_event = NostrEvent.model_validate(auth_frames[0][1])
        assert verify_event(auth_event)
        assert auth_event.pubkey == signer.pubkey
        assert ["relay", fake.url] in auth_event.tags
        assert len(await fake.wait_frames("REQ", 2)) == 2
        result = await pool.publish(AUTHOR.sign(KIND_COMMENT, "after auth"))
        assert result.ok
        await asyncio.sleep(0.2)
        assert len(fake.frames("REQ")) == 2  # re-sent once, not in a loop
        assert len(fake.frames("EVENT")) == 1  # already authenticated: sent once


async def test_ok_may_arrive_before_or_after_the_echo() -> None:
    """A publish resolves whether the relay sends OK before or after echoing the event to a subscription."""

    async def script(fake: FakeRelay, ws: ServerConnection) -> None:
        sub_id = ""
        while True:
            frame = await fake.recv(ws)
            if frame[0] == "REQ":
                sub_id = frame[1]
            elif frame[0] == "EVENT":
                echo = json.dumps(["EVENT", sub_id, frame[1]])
                ok = json.dumps(["OK", frame[1]["id"], True, ""])
                first, second = (echo, ok) if frame[1]["content"] == "echo first" else (ok, echo)
                await ws.send(first)
                await ws.send(second)

    collector = Collector()
    async with FakeRelay(script) as fake, RelayPool([fake.url], on_event=collector, settings=FAST) as pool:
        await pool.subscribe("s", [{"kinds": [KIND_COMMENT]}])
        await fake.wait_frames("REQ", 1)
        a = AUTHOR.sign(KIND_COMMENT, "echo first")
        b = AUTHOR.sign(KIND_COMMENT, "ok first")
        results = await asyncio.gather(pool.publish(a, timeout=3), pool.publish(b, timeout=3))
        assert all(r.ok for r in results)
        assert await collector.wait_for(lambda c: sorted(c.ids) == sorted([a.id, b.id]), within=5)


async def test_a_slow_consumer_does_not_block_ok_handling() -> None:
    """While the consumer is busy with an event, OK frames on the same socket still resolve publishes."""
    release = asyncio.Event()
    incoming = AUTHOR.sign(KIND_COMMENT, "slow to handle")

    async def script(fake: FakeRelay, ws: ServerConnection) -> None:
        while True:
            frame = await fake.recv(ws)
            if frame[0] == "REQ":
                await ws.send(event_frame(frame[1], incoming))
            elif frame[0] == "EVENT":
                await ws.send(json.dumps(["OK", frame[1]["id"], True, ""]))

    async def slow_consumer(_: object) -> None:
        await release.wait()

    async with FakeRelay(script) as fake, RelayPool([fake.url], on_event=slow_consumer, settings=FAST) as pool:
        await pool.subscribe("s", [{"kinds": [KIND_COMMENT]}])
        await fake.wait_frames("REQ", 1)
        await asyncio.sleep(0.1)
        result = await pool.publish(AUTHOR.sign(KIND_COMMENT, "reply"), timeout=3)
        assert result.ok
        release.set()


async def test_consumer_error_is_logged_and_the_event_is_not_marked_processed() -> None:
    """When the handler raises, the pool goes on, and the event id stays unprocessed for a retry."""
    events = [AUTHOR.sign(KIND_COMMENT, f"n{i}", created_at=int(time.time()) - 2 + i) for i in range(2)]

    async def script(fake: FakeRelay, ws: ServerConnection) -> None:
        req = await fake.recv(ws)
        for event in events:
            await ws.send(event_frame(req[1], event))
        await ws.send(json.dumps(["EOSE", req[1]]))  # stored events are taken in at EOSE
        await ws.wait_closed()

    seen: list[str] = []

    async def flaky(item: Any) -> None:
        seen.append(item.event.id)
        if item.event.id == events[0].id:
            raise RuntimeError("handler bug")

    store = MemoryStore()
    async with FakeRelay(script) as fake, RelayPool([fake.url], on_event=flaky, store=store, settings=FAST) as pool:
        await pool.subscribe("s", [{"kinds": [KIND_COMMENT]}])
        await fake.wait_frames("REQ", 1)
        for _ in range(50):
            if len(seen) == 2:
                break
            await asyncio.sleep(0.05)
        assert seen == [e.id for e in events]
        assert pool.health().consumer_errors == 1
    assert not await store.is_processed(events[0].id)
    assert await store.is_processed(events[1].id)


async def test_frame_size_limits() -> None:
    """A frame over the codec limit is refused in place; one over the websocket limit costs a reconnect."""
    valid = AUTHOR.sign(KIND_COMMENT, "after the big ones")

    async def script(fake: FakeRelay, ws: ServerConnection) -> None:
        req = await fake.recv(ws)
        if fake.connections == 1:
            await ws.send(json.dumps(["NOTICE", "n" * 40_000]))  # over the codec's 32 KiB
            await ws.send(json.dumps(["NOTICE", "n" * 100_000]))  # over websocket max_size: closes
        else:
            await ws.send(event_frame(req[1], valid))
        await ws.wait_closed()

    settings = PoolSettings(
        limits=Limits(max_frame_chars=32 * 1024), max_message_bytes=64 * 1024,
        backoff_base=0.05, backoff_cap=0.2,
    )
    collector = Collector()
    async with FakeRelay(script) as fake, RelayPool([fake.url], on_event=collector, settings=settings) as pool:
        await pool.subscribe("s", [{"kinds": [KIND_COMMENT]}])
        assert await collector.wait_for(lambda c: c.ids == [valid.id], within=10)
        health = pool.health()
        assert health.rejects == {"oversized_frame": 2}
        assert health.relays[0].reconnects == 1
