"""One event in the history of two conversations, for every store: a conversation created with a history
that holds an event another conversation holds already (two TENEX files holding one reply) is stored with
it, both keep it, and the event stays processed once. Before, PostgreSQL refused it with a raw
``UniqueViolationError`` (the events' primary key was the event id) where the other stores took it, and
``tenexd migrate --from`` stopped at the second file, never importing the later ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tenex_daemon.adapters.storage.tenex_import import import_tenex_home
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.search import SearchQuery
from tests.conftest import Cast
from tests.contract.conftest import StoreHarness
from tests.contract.test_store_contract import ids, new_conversation, stored

pytestmark = pytest.mark.integration


async def test_a_conversation_created_with_an_event_another_holds_keeps_it_and_so_does_the_other(
    harness: StoreHarness, cast: Cast
) -> None:
    """An event appended to one conversation, then in the history another is created with (and a third
    created with it too): each loads with its whole history, the event is processed, found in one of them,
    and appending it again changes nothing; the same after a reopen."""
    store = await harness.open()
    first = await stored(store, cast, "First")
    shared = cast.alice_says("a reply two files hold", tags=[["e", first.id]])
    assert await store.append_event(first.id, shared) is True
    second = new_conversation(cast, "Second")
    second.append(shared)
    await store.create(second)
    third = new_conversation(cast, "Third")
    third.append(shared)
    third.append(second.history[0])
    await store.create(third)

    for _ in range(2):
        assert ids(await store.load(first.id)) == [first.id, shared.id]
        assert ids(await store.load(second.id)) == [second.id, shared.id]
        assert ids(await store.load(third.id)) == [third.id, shared.id, second.id]
        assert await store.is_processed(shared.id)
        found = await store.find_event(shared.id)
        assert found is not None
        assert found[1] == shared
        assert found[0] in (first.id, second.id, third.id)
        counts = {row.id: row.event_count for row in await store.search(SearchQuery())}
        assert counts == {first.id: 2, second.id: 2, third.id: 3}
        store = await harness.reopen(store)
    assert await store.append_event(second.id, shared) is False
    assert ids(await store.load(second.id)) == [second.id, shared.id]


def _ndk(event: NostrEvent) -> str:
    """What NDK's ``serialize(true, true)`` writes for ``event`` (a TENEX file's history entry)."""
    return json.dumps([0, event.pubkey, event.created_at, event.kind, event.tags, event.content, event.sig,
                       event.id])


async def test_two_tenex_files_holding_one_event_are_both_imported_and_the_files_after_them(
    harness: StoreHarness, cast: Cast, tmp_path: Path
) -> None:
    """``import_tenex_home`` of three files, the first two holding one reply: all three are imported in
    every store (before, PostgreSQL's import stopped at the second with a raw database error)."""
    roots = [cast.user_says(f"root {n}", kind=11) for n in range(3)]
    shared = cast.alice_says("a reply present in two TENEX files", tags=[["e", roots[0].id]])
    folder = tmp_path / "conversations"
    folder.mkdir()
    for n, (root, extra) in enumerate(zip(roots, ([shared], [shared], []), strict=True)):
        data: dict[str, Any] = {"id": root.id, "history": [_ndk(e) for e in (root, *extra)]}
        (folder / f"{n}.json").write_text(json.dumps(data))
    store = await harness.open()

    report = await import_tenex_home(tmp_path, store)

    assert report.imported == [root.id for root in roots]
    assert report.failed == []
    for root, extra in zip(roots, ([shared], [shared], []), strict=True):
        assert ids(await store.load(root.id)) == [root.id, *(e.id for e in extra)]
