"""PyPI nostr-relay refuses an event over its size limit with an ``OK`` whose event id is EMPTY (``web.py``:
``["OK", "", false, "invalid: 280 characters should be enough for anybody"]``): the pool attributes it to
the EVENT it answers, so the publish is refused for good with the relay's words instead of read as no answer
and tried again forever, and the person gets the notice."""

from __future__ import annotations

import asyncio
import time

import pytest

from tenex_daemon.adapters.nostr.publisher import PoolPublisher
from tenex_daemon.adapters.nostr.relay_pool import RelayPool
from tenex_daemon.adapters.nostr.relay_pool.types import RefusedForGoodError
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.core.errors import EventRefusedError
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.llm import CompletionResult
from tenex_daemon.core.vocabulary import KIND_COMMENT, TAG_ERROR
from tenex_daemon.services.outbox import Outbox, OutboxEntry
from tenex_daemon.testing.fakes import FakePublisher, ScriptedBackend
from tests import pipeline
from tests.conftest import Cast

from .conftest import FAST
from .harness import NostrRelayProcess

pytestmark = [pytest.mark.integration]

AUTHOR = Signer.generate(label="author")
TOO_LARGE = "invalid: 280 characters should be enough for anybody"
"""nostr-relay's words (``validators.is_not_too_large``) for content over ``max_event_size``."""
OVER_LIMIT = "x" * (1_048_576 + 1)
"""Content one character over the harness's ``max_event_size`` (well under the websocket's frame limit)."""


async def test_an_event_too_large_for_nostr_relay_is_refused_for_good_with_its_words(
    nostr_relay: NostrRelayProcess,
) -> None:
    """An event over nostr-relay's size limit, published beside a small one, raises RefusedForGoodError
    with the relay's words before the publish timeout (answered, not silent), while the small one is
    accepted."""
    async with RelayPool([nostr_relay.url], settings=FAST) as pool:
        assert await pool.wait_connected(within=10)
        started = time.monotonic()
        big, small = await asyncio.gather(
            pool.publish(AUTHOR.sign(KIND_COMMENT, OVER_LIMIT)),
            pool.publish(AUTHOR.sign(KIND_COMMENT, "small")),
            return_exceptions=True,
        )
        took = time.monotonic() - started
    assert isinstance(big, RefusedForGoodError), big
    assert big.reasons == (TOO_LARGE,)
    assert big.result.timed_out == ()
    # nostr-relay sleeps 2 s before each refusal's OK, and as long before every later answer on the connection
    assert took < FAST.publish_timeout
    assert not isinstance(small, BaseException)
    assert small.ok


async def test_the_outbox_gives_up_an_event_nostr_relay_refuses_for_its_size(
    nostr_relay: NostrRelayProcess,
) -> None:
    """The outbox holding an event over nostr-relay's size limit gives it up as refused for good with the
    relay's words (its notice path runs once) instead of trying it again."""
    refusals: list[EventRefusedError] = []

    async def on_refused(entry: OutboxEntry, refusal: EventRefusedError) -> None:
        refusals.append(refusal)

    store = MemoryStore()
    async with RelayPool([nostr_relay.url], store=store, settings=FAST) as pool:
        assert await pool.wait_connected(within=10)
        outbox = Outbox(store, PoolPublisher(pool, {}, {}, publish_timeout_s=5.0), on_refused=on_refused)
        try:
            await outbox.add("conv", AUTHOR.sign(KIND_COMMENT, OVER_LIMIT), agent_slug="a")
            async with asyncio.timeout(10):
                while outbox.refused < 1:  # noqa: ASYNC110 - the outbox's own task publishes
                    await asyncio.sleep(0.05)
        finally:
            await outbox.close()
    assert [r.reasons for r in refusals] == [(TOO_LARGE,)]
    assert (outbox.depth, outbox.retries) == (0, 0)


async def _published_by(pool: RelayPool, author: str, within_s: float) -> list[NostrEvent]:
    """The kind-1111 events of ``author`` on the relay, once there is one (or ``within_s`` passed)."""
    async with asyncio.timeout(within_s):
        while not (found := await pool.fetch([{"kinds": [KIND_COMMENT], "authors": [author]}])):  # noqa: ASYNC110
            await asyncio.sleep(0.2)  # the relay is polled: it tells nothing
    return found


class RelayPublisher(FakePublisher):
    """The pipeline's publisher over a real relay pool (typing indicators are only recorded)."""

    def __init__(self, pool: RelayPool) -> None:
        super().__init__()
        self.pool = PoolPublisher(pool, {}, {}, publish_timeout_s=5.0)

    async def publish(self, event: NostrEvent) -> None:
        """Publish through the pool (raising as it raises) and record what a relay accepted."""
        await self.pool.publish(event)
        self.published.append(event)


async def test_the_person_gets_the_notice_when_nostr_relay_refuses_an_answer_for_its_size(
    nostr_relay: NostrRelayProcess, cast: Cast
) -> None:
    """Alice's answer is over nostr-relay's size limit: the person can read on the relay her notice naming
    the relay's words, addressed to the person and tagged as a system error, and the outbox holds nothing."""
    async with RelayPool([nostr_relay.url], settings=FAST) as pool:
        assert await pool.wait_connected(within=10)
        backend = ScriptedBackend([CompletionResult(text=OVER_LIMIT, model="scripted")])
        rig = pipeline.build_rig(cast, backend=backend, publisher=RelayPublisher(pool))
        root = cast.user_says("Tell me everything", kind=11, tags=[["p", cast.alice.pubkey]])
        await rig.dispatcher.handle(root)
        await rig.settle(timeout_s=30)
        # the notice goes out through the outbox, after the refusal: on the connection the pool opened anew
        on_relay = await _published_by(pool, cast.alice.pubkey, within_s=15)
    expected = (
        "Alice's answer could not be published: the relays refused it "
        f"({TOO_LARGE})."
    )
    assert [e.content for e in on_relay] == [expected]
    assert on_relay[0].has_tag(TAG_ERROR, "system")
    assert on_relay[0].tag_values("p") == [cast.user.pubkey]
    outbox = rig.pipeline.outbox
    assert (outbox.refused, outbox.depth, outbox.retries) == (1, 0, 0)


async def test_publishes_after_several_refusals_are_answered_at_once_not_slowed_by_nostr_relay(
    nostr_relay: NostrRelayProcess,
) -> None:
    """nostr-relay sleeps before every later frame of a connection after each refusal (2 s, doubling): after
    four refusals for size, a fifth small event is still accepted well within the publish timeout, as the
    pool opens a fresh connection after each such refusal."""
    async with RelayPool([nostr_relay.url], settings=FAST) as pool:
        assert await pool.wait_connected(within=10)
        for _ in range(4):
            with pytest.raises(RefusedForGoodError):
                await pool.publish(AUTHOR.sign(KIND_COMMENT, OVER_LIMIT))
        started = time.monotonic()
        result = await pool.publish(AUTHOR.sign(KIND_COMMENT, "small, after the refusals"))
        took = time.monotonic() - started
    assert result.ok
    assert took < 2.0
