"""A nostr-tools client publishes to real relays; the pool delivers each event once, threading read right."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from tenex_daemon.adapters.nostr.codec import ThreadStyle, read_threading
from tenex_daemon.adapters.nostr.relay_pool import RelayPool
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.core.events import compute_event_id
from tenex_daemon.core.vocabulary import KIND_COMMENT, KIND_CONVERSATION_ROOT, KIND_NOTE
from tenex_daemon.testing import KeyPair

from .conftest import FAST
from .harness import Collector, LocalRelayServer, NodeTool, NostrRelayProcess

pytestmark = [pytest.mark.integration]

AGENT = KeyPair.from_seed(101)
USER = KeyPair.from_seed(102)


def conversation_templates(created_at: int) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """A kind-11 root, two NIP-22 replies and a NIP-10 kind-1 reply, all p-tagging the agent.

    Returns the templates and the ids they will hash to (nostr-tools computes the same).
    """
    ids: dict[str, str] = {}

    def template(name: str, kind: int, content: str, tags: list[list[str]], offset: int) -> dict[str, Any]:
        ids[name] = compute_event_id(USER.pubkey, created_at + offset, kind, tags, content)
        return {"kind": kind, "content": content, "tags": tags, "created_at": created_at + offset}

    root = template("root", KIND_CONVERSATION_ROOT, "Plan the launch ✨", [
        ["title", "Launch"], ["p", AGENT.pubkey]], 0)
    first = template("first", KIND_COMMENT, "first reply\u2028with U+2028", [
        ["E", ids["root"], "", USER.pubkey], ["K", "11"], ["P", USER.pubkey],
        ["e", ids["root"], "", USER.pubkey], ["k", "11"], ["p", AGENT.pubkey]], 1)
    second = template("second", KIND_COMMENT, "second reply 日本語", [
        ["E", ids["root"], "", USER.pubkey], ["K", "11"], ["P", USER.pubkey],
        ["e", ids["first"], "", USER.pubkey], ["k", "1111"], ["p", AGENT.pubkey]], 2)
    note = template("note", KIND_NOTE, "a NIP-10 reply", [
        ["e", ids["root"], "", "root"], ["e", ids["first"], "", "reply"], ["p", AGENT.pubkey]], 3)
    return [root, first, second, note], ids


async def publish_and_collect(urls: list[str], node: NodeTool) -> tuple[Collector, dict[str, str], RelayPool]:
    """Start a pool over ``urls``, publish the conversation with nostr-tools, wait for delivery."""
    collector = Collector()
    pool = RelayPool(urls, on_event=collector, store=MemoryStore(), settings=FAST)
    await pool.start()
    await pool.subscribe("mentions", [{"kinds": [KIND_CONVERSATION_ROOT, KIND_COMMENT, KIND_NOTE],
                                       "#p": [AGENT.pubkey]}])
    assert await pool.wait_connected(within=15)
    templates, ids = conversation_templates(int(time.time()) - 10)
    result = await node.call({"op": "publish", "relays": urls, "secret": USER.secret,
                              "templates": templates, "deadline_ms": 20000})
    published = {line["published"] for line in result["lines"] if "published" in line}
    assert published == set(ids.values())
    assert await collector.wait_for(lambda c: len(c.received) >= len(ids), within=20)
    await asyncio.sleep(0.5)  # late copies from other relays would show up now
    return collector, ids, pool


async def duplicates_seen(pool: RelayPool, at_least: int, within: float = 20.0) -> int:
    """The copies ``pool`` has dropped as duplicates, once at least ``at_least`` (or after ``within`` s): a
    relay sends its stored copies when it gets to them, later on a loaded machine."""
    deadline = time.monotonic() + within
    while pool.health().duplicates < at_least and time.monotonic() < deadline:  # noqa: ASYNC110 - a counter
        await asyncio.sleep(0.05)
    return pool.health().duplicates


def assert_threading(collector: Collector, ids: dict[str, str]) -> None:
    """Check that every delivered event's threading names the right root and parent."""
    by_id = {r.event.id: r.event for r in collector.received}
    root = read_threading(by_id[ids["root"]])
    assert root.is_root
    first = read_threading(by_id[ids["first"]])
    assert (first.style, first.root_id, first.root_kind, first.parent_id, first.parent_kind) == (
        ThreadStyle.NIP22, ids["root"], 11, ids["root"], 11)
    assert first.root_author == USER.pubkey
    second = read_threading(by_id[ids["second"]])
    assert (second.root_id, second.root_kind, second.parent_id, second.parent_kind) == (
        ids["root"], 11, ids["first"], 1111)
    note = read_threading(by_id[ids["note"]])
    assert (note.style, note.root_id, note.parent_id) == (ThreadStyle.NIP10_MARKED, ids["root"], ids["first"])


async def test_nostr_tools_events_delivered_exactly_once(
    real_relay: LocalRelayServer | NostrRelayProcess, node: NodeTool
) -> None:
    """Kind 11 and 1111 events published by nostr-tools to a real relay reach the consumer once each."""
    collector, ids, pool = await publish_and_collect([real_relay.url], node)
    try:
        assert sorted(collector.ids) == sorted(ids.values())
        assert_threading(collector, ids)
        assert pool.health().relays[0].rejects == {}
    finally:
        await pool.stop()


async def test_three_relays_each_event_delivered_once(
    local_relay: LocalRelayServer, nostr_relay: NostrRelayProcess, tmp_path: Any, node: NodeTool
) -> None:
    """The same events through three relays at once are each delivered exactly once."""
    third = LocalRelayServer(tmp_path / "third")
    await third.start()
    try:
        urls = [local_relay.url, nostr_relay.url, third.url]
        collector, ids, pool = await publish_and_collect(urls, node)
        try:
            assert sorted(collector.ids) == sorted(ids.values())
            assert {r.relay_url for r in collector.received} <= set(urls)
            health = pool.health()
            assert health.delivered == len(ids)
            assert await duplicates_seen(pool, len(ids)) >= len(ids)  # the other relays' copies, dropped
            assert_threading(collector, ids)
        finally:
            await pool.stop()
    finally:
        third.stop()


async def test_restart_of_the_daemon_does_not_redeliver(local_relay: LocalRelayServer, node: NodeTool) -> None:
    """A second pool over the same store (a restarted daemon) does not deliver events handled before."""
    store = MemoryStore()
    collector = Collector()
    filters = [{"kinds": [KIND_CONVERSATION_ROOT, KIND_COMMENT, KIND_NOTE], "#p": [AGENT.pubkey]}]
    async with RelayPool([local_relay.url], on_event=collector, store=store, settings=FAST) as pool:
        await pool.subscribe("mentions", filters)
        templates, ids = conversation_templates(int(time.time()) - 10)
        await node.call({"op": "publish", "relays": [local_relay.url], "secret": USER.secret,
                         "templates": templates})
        assert await collector.wait_for(lambda c: len(c.received) == len(ids))
    cursor = await store.get_meta(f"nostr.cursor:mentions:{local_relay.url}")
    assert cursor is not None
    assert int(cursor) == max(t["created_at"] for t in templates)
    again = Collector()
    async with RelayPool([local_relay.url], on_event=again, store=store, settings=FAST) as pool:
        await pool.subscribe("mentions", filters)
        assert await pool.wait_connected(within=10)
        assert await duplicates_seen(pool, len(ids)) >= len(ids)  # the relay sent its stored copies again
        await asyncio.sleep(0.5)  # any more would come now
        assert again.received == []
        assert pool.health().duplicates == len(ids)
