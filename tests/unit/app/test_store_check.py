"""A daemon refuses to start on an empty store while its home's own filesystem store holds conversations
(``storage.kind`` switched, ``storage.path`` moved, nothing copied): it would answer again every message
the relays still hold."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from tenex_daemon.adapters.nostr.relay_pool import Filter
from tenex_daemon.adapters.nostr.relay_pool.subscriptions import ANY_RELAY, cursor_key
from tenex_daemon.adapters.storage.filesystem import FileSystemStore
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.app.daemon import SUBSCRIPTION_ID, Daemon
from tenex_daemon.app.home import init_home
from tenex_daemon.app.settings import Settings, load_settings
from tenex_daemon.app.store_check import (
    FIRST_START_KEY,
    EmptyStoreError,
    StoreBehindRelaysError,
    check_the_store,
    note_the_first_start,
    refuse_a_store_behind,
    refuse_an_empty_store_beside_the_homes,
)
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.testing import sign_event
from tests import pipeline
from tests.conftest import Cast


async def home_with_a_conversation(tmp_path: Path, cast: Cast) -> Path:
    """An initialised home whose filesystem store holds one conversation."""
    home = tmp_path / "h"
    init_home(home, relays=["ws://127.0.0.1:9"])
    store = FileSystemStore(home)
    await store.open()
    rig = pipeline.build_rig(cast, store=store)
    await rig.manager.create_conversation(cast.user_says("hello", kind=11, tags=[["p", cast.alice.pubkey]]))
    await store.close()
    return home



async def store_moved(tmp_path: Path, home: Path) -> tuple[Path, Settings, FileSystemStore]:
    """``home``'s settings with ``storage.path`` moved to a new, empty folder, and that folder's store, open."""
    elsewhere = tmp_path / "elsewhere"
    settings = load_settings(home, {"TENEX_STORAGE__PATH": f'"{elsewhere}"'})
    store = FileSystemStore(elsewhere)
    await store.open()
    return elsewhere, settings, store

async def test_a_store_path_moved_to_an_empty_folder_is_refused_naming_what_the_home_holds(
    tmp_path: Path, cast: Cast
) -> None:
    """``storage.path`` pointing at a new, empty folder while the home holds a conversation: refused with one
    message naming the setting, the home's folder and its count, and the way out (rebuild, or move it
    aside); once the new store holds a conversation, or with the home's own store, it starts."""
    home = await home_with_a_conversation(tmp_path, cast)
    elsewhere, settings, store = await store_moved(tmp_path, home)
    try:
        with pytest.raises(EmptyStoreError) as refused:
            await refuse_an_empty_store_beside_the_homes(settings, store, SUBSCRIPTION_ID)
        message = str(refused.value)
        assert f"storage.path = '{elsewhere}'" in message
        assert f"{home / 'conversations'} holds 1" in message
        assert "tenexd conversations rebuild --all" in message
        assert f"tenexd migrate --from-store {home}" in message
        await refuse_an_empty_store_beside_the_homes(load_settings(home), store, SUBSCRIPTION_ID)  # the home's own: no check
        rig = pipeline.build_rig(cast, store=store)
        await rig.manager.create_conversation(cast.user_says("again", kind=11, tags=[["p", cast.alice.pubkey]]))
        await refuse_an_empty_store_beside_the_homes(settings, store, SUBSCRIPTION_ID)  # not empty: it starts
    finally:
        await store.close()


async def test_a_daemon_switched_to_another_store_kind_stops_at_start_before_reaching_a_relay(
    tmp_path: Path, cast: Cast
) -> None:
    """``storage.kind`` switched (here to the in-memory store) on a home holding a conversation: the
    daemon's start raises the refusal before it connects to any relay or answers anything."""
    home = await home_with_a_conversation(tmp_path, cast)
    daemon = Daemon(load_settings(home, {"TENEX_STORAGE__KIND": '"memory"'}))

    with pytest.raises(EmptyStoreError, match=r"storage\.kind = 'memory'"):
        await daemon.run()
    assert daemon.pool is None


async def test_a_store_retention_emptied_still_starts_by_its_relay_cursors(tmp_path: Path, cast: Cast) -> None:
    """A store with no conversation left (retention deleted them all) but a relay cursor of the daemon's
    subscription is a store used before: it starts, however many conversations the home's folder holds."""
    from tenex_daemon.adapters.nostr.relay_pool.subscriptions import cursor_key

    home = await home_with_a_conversation(tmp_path, cast)
    _, settings, store = await store_moved(tmp_path, home)
    try:
        await store.set_meta(cursor_key(SUBSCRIPTION_ID, settings.relays.urls[0]), "1700000000")
        await refuse_an_empty_store_beside_the_homes(settings, store, SUBSCRIPTION_ID)
    finally:
        await store.close()


async def test_a_store_whose_relays_were_all_replaced_still_counts_as_used(tmp_path: Path, cast: Cast) -> None:
    """A store holding no conversation and no cursor on the relays the settings name now, but the cursor its
    subscription had on the relays it was asked of before (every relay replaced since), is a store used
    before: it starts."""
    from tenex_daemon.adapters.nostr.relay_pool.subscriptions import ANY_RELAY, cursor_key

    home = await home_with_a_conversation(tmp_path, cast)
    _, settings, store = await store_moved(tmp_path, home)
    try:
        await store.set_meta(cursor_key(SUBSCRIPTION_ID, ANY_RELAY), "1700000000")
        await refuse_an_empty_store_beside_the_homes(settings, store, SUBSCRIPTION_ID)
    finally:
        await store.close()


async def test_the_behind_check_asks_for_the_agents_replies_since_the_cursor_and_refuses_unknown_ones(
    cast: Cast,
) -> None:
    """A store that never subscribed is not checked (no relay asked); with a cursor, the relays are asked for
    the agents' replies since it (minus the window), and one the store has not processed is refused, naming
    the rebuild; processed ones pass."""
    store = MemoryStore()
    asked: list[list[Filter]] = []
    reply = cast.alice_says("an answer given after the backup")
    answers: list[NostrEvent] = [reply]

    async def fetch(filters: Sequence[Filter]) -> list[NostrEvent]:
        asked.append(list(filters))
        return answers

    await refuse_a_store_behind(store, fetch, [cast.alice.pubkey], SUBSCRIPTION_ID, 300)
    assert asked == []
    await store.set_meta(cursor_key(SUBSCRIPTION_ID, ANY_RELAY), "1700000000")

    with pytest.raises(StoreBehindRelaysError, match=r"they hold 1 replies .*`tenexd conversations rebuild --all`"):
        await refuse_a_store_behind(store, fetch, [cast.alice.pubkey], SUBSCRIPTION_ID, 300)

    assert asked[0] == [{"authors": [cast.alice.pubkey], "kinds": [1, 1111], "since": 1_699_999_700, "limit": 20}]
    await store.mark_processed(reply.id)
    await refuse_a_store_behind(store, fetch, [cast.alice.pubkey], SUBSCRIPTION_ID, 300)


async def test_the_behind_check_leaves_out_the_agents_replies_from_before_the_stores_first_start(
    cast: Cast, tmp_path: Path
) -> None:
    """A store started anew (the old one's folder moved aside) notes its first start, and the relays are
    asked only for the agents' replies since then, not for those the old store answered before it: its second
    start was refused for them."""
    init_home(tmp_path / "h")
    settings = load_settings(tmp_path / "h", {})
    store = MemoryStore()
    asked: list[list[Filter]] = []

    async def fetch(filters: Sequence[Filter]) -> list[NostrEvent]:
        asked.append(list(filters))
        return []

    await check_the_store(settings, store, SUBSCRIPTION_ID, "ab" * 32)
    first = await store.get_meta(FIRST_START_KEY)
    assert first is not None
    await store.set_meta(cursor_key(SUBSCRIPTION_ID, ANY_RELAY), str(int(first) + 10))  # within the window
    await check_the_store(settings, store, SUBSCRIPTION_ID, "ab" * 32)  # noted once

    await refuse_a_store_behind(store, fetch, [cast.alice.pubkey], SUBSCRIPTION_ID, 300)

    assert await store.get_meta(FIRST_START_KEY) == first
    assert asked[0][0]["since"] == int(first)


async def test_the_behind_check_believes_only_what_it_asked_for_and_reads_a_relays_own_cursor(
    cast: Cast,
) -> None:
    """A relay answering with a stranger's note, or an agent's reply older than asked for (it ignored the
    author list or ``since``), refuses nothing; with no agents, or a damaged cursor only, nothing is asked (a
    home of no agents was refused for any stranger's note); a home from before the relay-independent cursor
    is checked from its relays' own cursors, and no first start is noted over them."""
    store = MemoryStore()
    url = "ws://relay.example"
    await store.set_meta(cursor_key(SUBSCRIPTION_ID, url), "1800000000")
    await note_the_first_start(store, SUBSCRIPTION_ID, [url])
    stranger = cast.user_says("a stranger's note", kind=1)
    old = sign_event(cast.alice_keys, "an old reply", kind=1111, created_at=1_700_000_000)
    asked: list[list[Filter]] = []

    async def careless(filters: Sequence[Filter]) -> list[NostrEvent]:
        asked.append(list(filters))
        return [stranger, old]

    await refuse_a_store_behind(store, careless, [], SUBSCRIPTION_ID, 300, urls=[url])
    assert asked == []
    damaged = MemoryStore()
    await damaged.set_meta(cursor_key(SUBSCRIPTION_ID, url), "not a time")
    await refuse_a_store_behind(damaged, careless, [cast.alice.pubkey], SUBSCRIPTION_ID, 300, urls=[url])
    assert asked == []  # a damaged cursor is no cursor: not asked from the beginning of time
    await refuse_a_store_behind(store, careless, [cast.alice.pubkey], SUBSCRIPTION_ID, 300, urls=[url])

    assert asked[0][0]["since"] == 1_800_000_000 - 300
    assert await store.get_meta(FIRST_START_KEY) is None
