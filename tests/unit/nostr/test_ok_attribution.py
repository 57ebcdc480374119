"""Which EVENT an ``OK`` without an event id answers (nostr-relay's refusals): attributed by deduction when
one frame is owed an answer, or once the others were answered by id; answers that cannot be told apart
make the connection send again, one EVENT at a time (relay_pool/oks.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from tenex_daemon.adapters.nostr.codec import OkMessage
from tenex_daemon.adapters.nostr.relay_pool import PoolSettings, RelayPool
from tenex_daemon.adapters.nostr.relay_pool.oks import RESEND, AwaitedOks
from tenex_daemon.adapters.nostr.relay_pool.types import refused_for_its_size
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.core.vocabulary import KIND_COMMENT

A, B, C = "aa" * 32, "bb" * 32, "cc" * 32
TOO_LARGE = "invalid: 280 characters should be enough for anybody"
"""PyPI nostr-relay's refusal of an event over its size limit, sent with an empty event id."""
TOO_OLD = "invalid: 1000 is too old"


def unnamed(message: str, accepted: bool = False) -> OkMessage:
    """An ``OK`` without an event id, as nostr-relay sends its refusals."""
    return OkMessage("", accepted, message)


def sent(oks: AwaitedOks, *event_ids: str) -> dict[str, asyncio.Future[OkMessage]]:
    """Each event's EVENT frame sent on the connection, with a publisher waiting for its answer."""
    futures = {event_id: oks.expect(event_id, 100) for event_id in event_ids}
    for event_id in event_ids:
        oks.sending(event_id)
    return futures


async def test_an_answer_without_id_is_the_only_frame_owed_one() -> None:
    """With one EVENT awaiting its OK, an OK without an id is that event's refusal, with the relay's words."""
    oks = AwaitedOks("ws://relay")
    futures = sent(oks, A)
    oks.answer(unnamed(TOO_LARGE))
    assert futures[A].result() == OkMessage(A, False, TOO_LARGE)
    assert (oks.attributed, oks.unmatched, dict(oks.owed)) == (1, 0, {})


async def test_with_several_in_flight_the_answer_waits_until_the_others_are_answered_by_id() -> None:
    """With three EVENTs awaiting their OK, an OK without an id is given to none until two were answered by
    id; then it is the third's."""
    oks = AwaitedOks("ws://relay")
    futures = sent(oks, A, B, C)
    oks.answer(unnamed(TOO_LARGE))
    assert not any(future.done() for future in futures.values())
    oks.answer(OkMessage(A, True, ""))
    assert not futures[B].done()
    assert not futures[C].done()
    oks.answer(OkMessage(C, False, "duplicate: exists"))
    assert futures[B].result() == OkMessage(B, False, TOO_LARGE)
    assert futures[A].result().accepted
    assert futures[C].result().is_success
    assert (oks.attributed, oks.unmatched, oks.one_at_a_time) == (1, 0, False)


async def test_a_frame_sent_after_the_answer_came_is_never_its_candidate() -> None:
    """An EVENT sent after an OK without an id came cannot have caused it: once the one sent before is the
    only candidate left, the answer is that one's, while the later EVENT still waits for its own."""
    oks = AwaitedOks("ws://relay")
    first = sent(oks, A, B)
    oks.answer(unnamed(TOO_LARGE))
    later = sent(oks, C)
    oks.answer(OkMessage(B, True, ""))
    assert first[A].result() == OkMessage(A, False, TOO_LARGE)
    assert not later[C].done()


async def test_as_many_identical_answers_as_frames_owed_are_each_ones() -> None:
    """Two EVENTs awaiting their OK and two identical OKs without an id: each event gets that refusal."""
    oks = AwaitedOks("ws://relay")
    futures = sent(oks, A, B)
    oks.answer(unnamed(TOO_LARGE))
    oks.answer(unnamed(TOO_LARGE))
    assert futures[A].result() == OkMessage(A, False, TOO_LARGE)
    assert futures[B].result() == OkMessage(B, False, TOO_LARGE)
    assert (oks.attributed, oks.unmatched, oks.one_at_a_time) == (2, 0, False)


async def test_different_answers_that_cannot_be_told_apart_are_sent_again_one_at_a_time() -> None:
    """Two EVENTs awaiting their OK and two different OKs without an id: neither is guessed; both publishers
    are told to send again, the connection now sends one at a time, and the two answers count as unmatched."""
    oks = AwaitedOks("ws://relay")
    futures = sent(oks, A, B)
    oks.answer(unnamed(TOO_LARGE))
    oks.answer(unnamed(TOO_OLD))
    assert futures[A].result() is RESEND
    assert futures[B].result() is RESEND
    assert (oks.one_at_a_time, oks.unmatched, oks.attributed, dict(oks.owed)) == (True, 2, 0, {})


async def test_an_answer_without_id_when_no_frame_is_owed_one_is_counted_unmatched() -> None:
    """An OK without an id while no EVENT was sent (a waiter alone, never sent) resolves nothing and is
    counted as unmatched."""
    oks = AwaitedOks("ws://relay")
    waiting = oks.expect(A, 100)
    oks.answer(unnamed(TOO_LARGE))
    assert not waiting.done()
    assert (oks.unmatched, oks.attributed) == (1, 0)


async def test_the_same_event_sent_twice_owes_two_answers() -> None:
    """An event whose EVENT went out twice on the connection owes two OKs: two OKs without an id are both
    its own, and another EVENT in flight is not given the second one."""
    oks = AwaitedOks("ws://relay")
    futures = sent(oks, A, A, B)
    oks.answer(unnamed(TOO_LARGE))
    oks.answer(unnamed(TOO_LARGE))
    assert not futures[B].done()
    oks.answer(OkMessage(B, True, ""))
    assert futures[A].result() == OkMessage(A, False, TOO_LARGE)
    assert futures[B].result() == OkMessage(B, True, "")
    assert (oks.attributed, oks.unmatched, dict(oks.owed)) == (2, 0, {})


async def test_a_close_counts_the_answers_still_unattributed() -> None:
    """Answers without an id still waiting when the connection closes are counted as unmatched, and nothing
    stays owed or in one-at-a-time mode."""
    oks = AwaitedOks("ws://relay")
    sent(oks, A, B)
    oks.answer(unnamed(TOO_LARGE))
    oks.closed()
    assert (oks.unmatched, dict(oks.owed), oks.unnamed, oks.one_at_a_time) == (1, {}, [], False)


def test_nostr_relays_size_refusal_is_a_refusal_for_good() -> None:
    """nostr-relay's words for an event over its size limit count as a refusal for its size (for good),
    while its other ``invalid:`` refusals do not."""
    assert refused_for_its_size(TOO_LARGE)
    assert not refused_for_its_size(TOO_OLD)
    assert not refused_for_its_size("invalid: Bad signature")


# -- through a connection --------------------------------------------------------------------------------

AUTHOR = Signer.generate(label="author")
SETTINGS = PoolSettings(backoff_base=0.05, backoff_cap=0.2, publish_timeout=5.0)


class Relay:
    """A local websockets relay that refuses ``old`` and ``big`` EVENTs with an empty id and accepts the rest.
    It holds the first two EVENTs and answers them together; each later one (on this connection or a later
    one) it answers 0.2 s after it came. It records when each EVENT came and when it was answered."""

    def __init__(self) -> None:
        self.held: list[list[Any]] = []
        self.events: list[str] = []
        """The content of each EVENT read, in order."""
        self.came: list[float] = []
        self.answered: list[float] = []
        self.url = ""

    async def serve(self, ws: ServerConnection) -> None:
        frames: asyncio.Queue[list[Any]] = asyncio.Queue()

        async def read() -> None:
            while True:
                frame = json.loads(await ws.recv())
                if frame[0] == "EVENT":
                    self.events.append(frame[1]["content"])
                    self.came.append(time.monotonic())
                frames.put_nowait(frame)

        tasks = {asyncio.create_task(read()), asyncio.create_task(self._answer(ws, frames))}
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)  # the connection closed
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _answer(self, ws: ServerConnection, frames: asyncio.Queue[list[Any]]) -> None:
        held = self.held
        while True:
            frame = await frames.get()
            if frame[0] == "REQ":
                await ws.send(json.dumps(["EOSE", frame[1]]))
            if frame[0] != "EVENT":
                continue
            if len(held) < 2:  # the relay's first two EVENTs, whichever connection they came on
                held.append(frame)
                if len(held) == 2:
                    for each in held:
                        await self._send_answer(ws, each)
                continue
            await asyncio.sleep(0.2)
            await self._send_answer(ws, frame)

    async def _send_answer(self, ws: ServerConnection, frame: list[Any]) -> None:
        content = frame[1]["content"]
        if content.startswith("big"):
            answer = ["OK", "", False, TOO_LARGE]
        elif content.startswith("old"):
            answer = ["OK", "", False, TOO_OLD]
        else:
            answer = ["OK", frame[1]["id"], True, ""]
        await ws.send(json.dumps(answer))
        self.answered.append(time.monotonic())


@contextlib.asynccontextmanager
async def running(relay: Relay) -> AsyncIterator[Relay]:
    async with serve(relay.serve, "127.0.0.1", 0) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        relay.url = f"ws://127.0.0.1:{port}"
        yield relay


async def test_refusals_told_apart_only_by_sending_again_one_at_a_time_reach_each_publisher() -> None:
    """Two EVENTs in flight refused with empty ids and different words: the pool sends both again one at a
    time, each refusal reaches its own publisher with the relay's words well before the timeout, and the
    size refusal counts as refused for good."""
    async with running(Relay()) as relay, RelayPool([relay.url], settings=SETTINGS) as pool:
        assert await pool.wait_connected(within=5)
        started = time.monotonic()
        big, old = await asyncio.gather(
            pool.publish(AUTHOR.sign(KIND_COMMENT, "big " * 10), raise_on_failure=False),
            pool.publish(AUTHOR.sign(KIND_COMMENT, "old news"), raise_on_failure=False),
        )
        took = time.monotonic() - started
        oks = pool._relays[relay.url].oks
        one_at_a_time, unmatched = oks.one_at_a_time, oks.unmatched
    assert list(big.rejected.values()) == [TOO_LARGE]
    assert big.refused_for_good
    assert list(old.rejected.values()) == [TOO_OLD]
    assert not old.refused_for_good
    assert took < SETTINGS.publish_timeout / 2
    assert sorted(relay.events[2:]) == sorted(relay.events[:2])  # each sent again once
    assert relay.came[3] >= relay.answered[2]  # the second sent again only once the first was answered
    assert one_at_a_time
    assert unmatched == 2


async def test_a_refusal_with_empty_id_beside_an_accepted_event_reaches_its_publisher() -> None:
    """An oversized and a small EVENT in flight together: the small one is accepted by id, so the OK without
    an id is the other's: refused for good with the relay's words, nothing sent again."""
    async with running(Relay()) as relay, RelayPool([relay.url], settings=SETTINGS) as pool:
        assert await pool.wait_connected(within=5)
        big, small = await asyncio.gather(
            pool.publish(AUTHOR.sign(KIND_COMMENT, "big " * 10), raise_on_failure=False),
            pool.publish(AUTHOR.sign(KIND_COMMENT, "small"), raise_on_failure=False),
        )
        oks = pool._relays[relay.url].oks
        counts = (oks.attributed, oks.unmatched, oks.one_at_a_time)
    assert big.refused_for_good
    assert list(big.rejected.values()) == [TOO_LARGE]
    assert small.ok
    assert len(relay.events) == 2
    assert counts == (1, 0, False)


class SilentAuthRelay:
    """A relay that, like nostr-relay with NIP-42 on, challenges each connection and never answers the AUTH,
    and refuses every EVENT at once with an empty id and its size refusal."""

    def __init__(self) -> None:
        self.auths = 0
        self.url = ""

    async def serve(self, ws: ServerConnection) -> None:
        await ws.send(json.dumps(["AUTH", "challenge"]))
        async for raw in ws:
            frame = json.loads(raw)
            if frame[0] == "AUTH":
                self.auths += 1
            elif frame[0] == "REQ":
                await ws.send(json.dumps(["EOSE", frame[1]]))
            elif frame[0] == "EVENT":
                await ws.send(json.dumps(["OK", "", False, TOO_LARGE]))


async def test_an_auth_left_unanswered_is_never_a_candidate_of_a_refusal_without_id() -> None:
    """With an AUTH sent and never answered (nostr-relay), oversized EVENTs refused with empty ids, one while
    the AUTH's wait runs and one after it, each reach their publisher as refused for good at once (before, the
    AUTH counted as a candidate of the first answer and stayed owed, and no later answer was told)."""
    relay = SilentAuthRelay()
    async with serve(relay.serve, "127.0.0.1", 0) as server:
        relay.url = f"ws://127.0.0.1:{next(iter(server.sockets)).getsockname()[1]}"
        auth = replace(SETTINGS, auth_timeout=1.0)
        async with RelayPool([relay.url], settings=auth, auth_signer=Signer.generate(label="project")) as pool:
            assert await pool.wait_connected(within=5)
            started = time.monotonic()
            during = await pool.publish(AUTHOR.sign(KIND_COMMENT, "big " * 10), raise_on_failure=False)
            await asyncio.sleep(1.2)  # the AUTH's wait is over, unanswered
            after = await pool.publish(AUTHOR.sign(KIND_COMMENT, "big " * 11), raise_on_failure=False)
            took = time.monotonic() - started
            oks = pool._relays[relay.url].oks
            counts = (oks.attributed, oks.unmatched)
    assert relay.auths == 2  # one per connection: the pool opened a fresh one after the first refusal
    assert during.refused_for_good
    assert after.refused_for_good
    assert took < 1.2 + SETTINGS.publish_timeout / 2
    assert counts == (2, 0)


class RefusingRelay:
    """A write-restricted relay, as nostr-relay answers an author it does not allow: every EVENT refused at
    once with an empty id. It records when each connection opened."""

    def __init__(self) -> None:
        self.opened: list[float] = []
        self.url = ""

    async def serve(self, ws: ServerConnection) -> None:
        self.opened.append(time.monotonic())
        with contextlib.suppress(ConnectionClosed):  # the pool renews it: closed while an answer is sent
            async for raw in ws:
                frame = json.loads(raw)
                if frame[0] == "REQ":
                    await ws.send(json.dumps(["EOSE", frame[1]]))
                elif frame[0] == "EVENT":
                    await ws.send(json.dumps(["OK", "", False, "blocked: pubkey not allowed"]))


async def test_a_relay_refusing_everything_is_not_reconnected_to_at_once_for_each_refusal() -> None:
    """Each refusal without an event id renews the connection, but only the first at once: renewals in a
    row wait a growing backoff, so a relay refusing all we send is not reconnected to per event."""
    relay = RefusingRelay()
    async with serve(relay.serve, "127.0.0.1", 0) as server:
        relay.url = f"ws://127.0.0.1:{next(iter(server.sockets)).getsockname()[1]}"
        paced = replace(SETTINGS, backoff_base=0.4, backoff_cap=0.8)
        async with RelayPool([relay.url], settings=paced) as pool:
            assert await pool.wait_connected(within=5)
            refused_at = []
            for n in range(3):
                result = await pool.publish(AUTHOR.sign(KIND_COMMENT, f"note {n}"), raise_on_failure=False)
                assert not result.ok
                refused_at.append(time.monotonic())
                assert await pool.wait_connected(within=5)
    gaps = [opened - refused for opened, refused in zip(relay.opened[1:], refused_at, strict=False)]
    assert len(relay.opened) == 4  # one connection renewed per refusal
    assert gaps[0] < 0.2  # the first renewal at once
    assert gaps[1] >= 0.2  # the next ones after half a backoff or more (0.4 s, then 0.8 s)
    assert gaps[2] >= 0.4
