"""ThreadManager (docs/ARCHITECTURE.md): pair keys, isolation, caching, callbacks, store persistence, failures."""

from __future__ import annotations

from pathlib import Path

import pytest

from tenex_daemon.adapters.storage.filesystem import FileSystemStore
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.core.threads import ConversationThread, ThreadPersistenceError, thread_key
from tenex_daemon.services.threads import ThreadManager


def test_keys_sort_the_pair_and_name_the_user() -> None:
    """Agent-agent keys are order-independent and the user thread ends in __USER."""
    assert thread_key("chat1", "Bob", "Alice") == "chat1__Alice__Bob"
    assert thread_key("chat1", "Alice", "Bob") == "chat1__Alice__Bob"
    assert thread_key("chat1", "Alice") == "chat1__Alice__USER"
    with pytest.raises(ValueError, match="must not contain"):
        thread_key("chat__1", "Alice")


async def test_threads_are_isolated_per_pair_and_cached() -> None:
    """Each pair gets its own thread; asking again (in either order) returns the same cached object."""
    manager = ThreadManager()
    user_a = await manager.get_thread("c", "A")
    a_b = await manager.get_thread("c", "A", "B")
    await manager.add_item_and_save(user_a, {"role": "user", "content": "hi A"})
    await manager.add_items_and_save(a_b, [{"role": "user", "content": "A asks B"}, {"role": "assistant"}])
    assert await manager.get_thread("c", "B", "A") is a_b
    assert await manager.get_thread("c", "A") is user_a
    assert user_a.items == [{"role": "user", "content": "hi A"}]
    assert len(a_b.items) == 2
    assert (await manager.get_thread("other-chat", "A")).items == []


async def test_callbacks_load_and_save_whole_threads() -> None:
    """The load callback is asked on a cache miss and the save callback gets the whole thread."""
    saved: dict[str, list[object]] = {"c__A__USER": ["old"]}
    loads: list[str] = []

    def load(thread_id: str) -> ConversationThread | None:
        loads.append(thread_id)
        items = saved.get(thread_id)
        return None if items is None else ConversationThread(thread_id=thread_id, items=list(items))

    async def save(thread: ConversationThread) -> None:
        saved[thread.thread_id] = list(thread.items)

    manager = ThreadManager(load_callback=load, save_callback=save)
    thread = await manager.get_thread("c", "A")
    await manager.add_item_and_save(thread, "new")
    await manager.get_thread("c", "A")
    assert loads == ["c__A__USER"]
    assert saved["c__A__USER"] == ["old", "new"]


async def test_failing_save_raises_clearly_and_loses_no_item() -> None:
    """A failing save raises ThreadPersistenceError; the items stay cached and go out with the next save."""
    saved: dict[str, list[object]] = {}
    fail = True

    def save(thread: ConversationThread) -> None:
        if fail:
            raise OSError("disk full")
        saved[thread.thread_id] = list(thread.items)

    manager = ThreadManager(save_callback=save)
    thread = await manager.get_thread("c", "A", "B")
    with pytest.raises(ThreadPersistenceError, match=r"could not save thread 'c__A__B'.*disk full"):
        await manager.add_item_and_save(thread, "first")
    assert manager.unsaved == {"c__A__B"}
    assert (await manager.get_thread("c", "B", "A")).items == ["first"]
    fail = False
    await manager.add_item_and_save(thread, "second")
    assert saved["c__A__B"] == ["first", "second"]
    assert manager.unsaved == set()


async def test_failing_load_raises_and_caches_nothing() -> None:
    """A failing load raises ThreadPersistenceError and leaves no empty thread that could overwrite the stored one."""
    def load(thread_id: str) -> ConversationThread | None:
        raise ConnectionError("database down")

    manager = ThreadManager(load_callback=load)
    with pytest.raises(ThreadPersistenceError, match="could not load"):
        await manager.get_thread("c", "A")
    assert manager.cached() == []


async def test_store_is_the_default_persistence(tmp_path: Path) -> None:
    """Without callbacks, threads persist in the conversation store and come back in a new manager."""
    store = FileSystemStore(tmp_path / "home")
    await store.open()
    manager = ThreadManager(store=store)
    thread = await manager.get_thread("c", "A", "B")
    await manager.add_items_and_save(thread, [{"content": "é ✓"}, {"tool": "x"}])
    await store.close()
    store = FileSystemStore(tmp_path / "home")
    await store.open()
    again = await ThreadManager(store=store).get_thread("c", "B", "A")
    assert again.items == [{"content": "é ✓"}, {"tool": "x"}]
    await store.close()


async def test_memory_store_persistence_is_shared_between_managers() -> None:
    """Two managers over one store see each other's saved threads."""
    store = MemoryStore()
    first = ThreadManager(store=store)
    await first.add_item_and_save(await first.get_thread("c", "A"), "hello")
    assert (await ThreadManager(store=store).get_thread("c", "A")).items == ["hello"]


async def test_the_cache_keeps_the_most_recent_saved_threads_and_reloads_the_rest() -> None:
    """Beyond max_cached, the least recently used saved threads leave memory and load again with their items."""
    store = MemoryStore()
    manager = ThreadManager(store=store, max_cached=2)
    for chat in ("c1", "c2", "c3"):
        await manager.add_item_and_save(await manager.get_thread(chat, "A"), f"in {chat}")
    assert manager.cached() == ["c2__A__USER", "c3__A__USER"]
    assert (await manager.get_thread("c1", "A")).items == ["in c1"]
    assert manager.cached() == ["c3__A__USER", "c1__A__USER"]
    assert len(manager._locks) <= 2


async def test_a_thread_with_unsaved_items_or_no_store_is_never_dropped() -> None:
    """A thread whose save failed stays cached, and a memory-only manager (its only copy) drops nothing."""
    saves = {"fail": True}

    def save(thread: ConversationThread) -> None:
        if saves["fail"]:
            raise OSError("disk full")

    def load(thread_id: str) -> ConversationThread | None:
        return None

    manager = ThreadManager(load, save, max_cached=1)
    kept = await manager.get_thread("c1", "A")
    with pytest.raises(ThreadPersistenceError):
        await manager.add_item_and_save(kept, "not yet saved")
    saves["fail"] = False
    await manager.add_item_and_save(await manager.get_thread("c2", "A"), "saved")
    assert "c1__A__USER" in manager.cached()
    assert (await manager.get_thread("c1", "A")) is kept

    memory_only = ThreadManager(max_cached=1)
    for chat in ("c1", "c2", "c3"):
        await memory_only.add_item_and_save(await memory_only.get_thread(chat, "A"), chat)
    assert len(memory_only.cached()) == 3
