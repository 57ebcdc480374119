"""Publishing, fetching and NIP-42 auth against real relays."""

from __future__ import annotations

import asyncio

import pytest
from websockets.asyncio.server import ServerConnection

from tenex_daemon.adapters.nostr.relay_pool import (
    PoolSettings,
    PublishError,
    RelayEventResolver,
    RelayPool,
)
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.core import nip19
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.vocabulary import KIND_ARTICLE, KIND_COMMENT, KIND_CONVERSATION_ROOT

from .conftest import FAST
from .harness import Collector, FakeRelay, LocalRelayServer, NostrRelayProcess

pytestmark = [pytest.mark.integration]


async def test_auth_relay_subscribe_and_publish_succeed_after_auth(auth_relay: LocalRelayServer) -> None:
    """Against the auth-requiring LocalRelay, the pool answers AUTH, then publishes and receives."""
    project = Signer.generate(label="project")
    agent = Signer.generate(label="agent")
    collector = Collector()
    async with RelayPool([auth_relay.url], on_event=collector, store=MemoryStore(), auth_signer=project,
                         settings=FAST) as pool:
        await pool.subscribe("mentions", [{"kinds": [KIND_CONVERSATION_ROOT], "#p": [agent.pubkey]}])
        assert await pool.wait_connected(within=10)
        event = project.sign(KIND_CONVERSATION_ROOT, "hello after auth", [["p", agent.pubkey]])
        result = await pool.publish(event)
        assert result.accepted_by == (auth_relay.url,)
        assert await collector.wait_for(lambda c: event.id in c.ids, within=10)
        assert pool.health().relays[0].authenticated
        fetched = await pool.fetch_event(event.id)
        assert fetched == event


async def test_auth_relay_refuses_a_pool_without_a_signer(auth_relay: LocalRelayServer) -> None:
    """Without an auth signer the auth relay's refusal surfaces as a PublishError naming the relay."""
    author = Signer.generate()
    async with RelayPool([auth_relay.url], settings=FAST) as pool:
        assert await pool.wait_connected(within=10)
        with pytest.raises(PublishError, match="auth-required"):
            await pool.publish(author.sign(KIND_COMMENT, "no auth"), timeout=3)


async def test_duplicate_publish_counts_as_success(real_relay: LocalRelayServer | NostrRelayProcess) -> None:
    """Publishing the same event twice succeeds both times (nostr-relay answers `OK false duplicate:`)."""
    author = Signer.generate()
    event = author.sign(KIND_COMMENT, "twice")
    async with RelayPool([real_relay.url], settings=FAST) as pool:
        first = await pool.publish(event)
        second = await pool.publish(event)
        assert first.ok
        assert second.ok


async def test_nostr_relay_empty_id_rejection_times_out(nostr_relay: NostrRelayProcess) -> None:
    """nostr-relay answers a bad signature with an OK whose id is empty: the publish times out, named."""
    author = Signer.generate()
    good = author.sign(KIND_COMMENT, "original")
    forged = NostrEvent.model_validate({**good.to_dict(), "sig": "0" * 128})
    async with RelayPool([nostr_relay.url], settings=FAST) as pool:
        assert await pool.wait_connected(within=10)
        with pytest.raises(PublishError) as caught:
            await pool.publish(forged, timeout=1.5)
        assert caught.value.result.timed_out == (nostr_relay.url,)


async def test_publish_is_done_when_one_of_two_relays_accepts(local_relay: LocalRelayServer) -> None:
    """A relay that never answers does not hold up a publish another relay accepted."""
    async def silent(fake: FakeRelay, ws: ServerConnection) -> None:
        while True:
            await fake.recv(ws)

    author = Signer.generate()
    async with FakeRelay(silent) as fake, RelayPool([fake.url, local_relay.url], settings=FAST) as pool:
        assert await pool.wait_connected(within=10)
        loop = asyncio.get_running_loop()
        started = loop.time()
        result = await pool.publish(author.sign(KIND_COMMENT, "one is enough"), timeout=30)
        assert result.accepted_by == (local_relay.url,)
        assert result.pending == (fake.url,)
        assert loop.time() - started < 15  # not the silent relay's 30 s


async def test_resolver_finds_note_nevent_and_naddr(local_relay: LocalRelayServer) -> None:
    """The relay-backed EventResolver finds events by note, nevent and naddr."""
    author = Signer.generate()
    note = author.sign(KIND_COMMENT, "referenced")
    article = author.sign(KIND_ARTICLE, "# Spec", [["d", "spec"], ["title", "Spec"]])
    async with RelayPool([local_relay.url], settings=PoolSettings(fetch_timeout=5)) as pool:
        await pool.publish(note)
        await pool.publish(article)
        resolver = RelayEventResolver(pool, timeout=5)
        assert await resolver.resolve(nip19.decode(nip19.encode_note(note.id))) == note
        nevent = nip19.encode_nevent(note.id, (local_relay.url,), author.pubkey, KIND_COMMENT)
        assert await resolver.resolve(nip19.decode("nostr:" + nevent)) == note
        naddr = nip19.encode_naddr("spec", author.pubkey, KIND_ARTICLE)
        assert await resolver.resolve(nip19.decode(naddr)) == article
        assert await resolver.resolve(nip19.decode(nip19.encode_note("ab" * 32))) is None
