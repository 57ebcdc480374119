"""ThreadManager: isolated, persistent threads per communication pair within a chat (docs/ARCHITECTURE.md).

Threads are cached in memory, the most recently used ``max_cached`` of them when they can be
loaded again (saved threads only: one with items not yet persisted stays). Persistence uses the
user's ``load_callback(thread_id)`` and ``save_callback(thread)`` (plain functions or coroutines)
or, when none are given, the conversation store's small-value space (``get_meta``/``set_meta``
under ``thread:<id>``). Deleting a conversation erases its stored threads in every store
(:mod:`~tenex_daemon.core.erasure`); :meth:`ThreadManager.forget_conversation` drops the cached ones.
A failing callback raises :class:`ThreadPersistenceError` and loses nothing: the items stay
in the cached thread and go out with the next successful save.

A store several daemons share (``shared``; by default whether it is a
:class:`~tenex_daemon.core.ports.Peers`, as PostgreSQL's is) may hold what another daemon added since
this one cached a thread: :meth:`ThreadManager.get_thread` then loads the thread again each time, and a
save loads it again under the store's lease on ``thread:<id>`` and appends to what is stored only the
items added here since it was loaded, so no daemon overwrites another's exchange.
"""

from __future__ import annotations

import asyncio
import inspect
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import structlog

from tenex_daemon.core.erasure import THREAD_VALUE_PREFIX
from tenex_daemon.core.ports import Peers, SmallValues
from tenex_daemon.core.threads import KEY_SEPARATOR, ConversationThread, ThreadPersistenceError, thread_key

log = structlog.get_logger(__name__)

ThreadLoadCallback = Callable[[str], "ConversationThread | Awaitable[ConversationThread | None] | None"]
ThreadSaveCallback = Callable[[ConversationThread], "Awaitable[None] | None"]

META_PREFIX = THREAD_VALUE_PREFIX
"""The small values of threads are kept under ``thread:<thread id>``."""
DEFAULT_MAX_CACHED = 1_000
"""Threads kept in memory at most (when they can be loaded again): a daemon runs for months."""


class ThreadManager:
    """Gets, creates, caches and saves :class:`ConversationThread` objects.

    With no callbacks and no ``store``, threads live in memory only (and are never dropped). With a
    ``store`` several daemons share (``shared``, None: whether ``store`` is a
    :class:`~tenex_daemon.core.ports.Peers`), a cached thread is only a starting point: see the module
    docstring.
    """

    def __init__(
        self,
        load_callback: ThreadLoadCallback | None = None,
        save_callback: ThreadSaveCallback | None = None,
        store: SmallValues | None = None,
        max_cached: int = DEFAULT_MAX_CACHED,
        shared: bool | None = None,
    ) -> None:
        if max_cached < 1:
            raise ValueError("max_cached must be at least 1")
        self._threads: OrderedDict[str, ConversationThread] = OrderedDict()
        # a dropped thread must load back what was saved: both callbacks, or the store alone
        loadable = (load_callback is not None and save_callback is not None) or (
            store is not None and load_callback is None and save_callback is None
        )
        self._max_cached = max_cached if loadable else None
        self._load_callback = load_callback
        self._save_callback = save_callback
        self._store = store
        self._locks: dict[str, asyncio.Lock] = {}
        by_store = store is not None and load_callback is None and save_callback is None
        self._shared = by_store and (isinstance(store, Peers) if shared is None else shared)
        self._stored_count: dict[str, int] = {}
        """Shared store: how many of a cached thread's first items are what was loaded or saved; the
        rest were added here since and are what its next save appends to the stored thread."""
        self.unsaved: set[str] = set()
        """Ids of cached threads whose latest items are not yet persisted."""

    @staticmethod
    def key(chat_id: str, agent: str, other: str | None = None) -> str:
        """Return the thread id of a pair (see :func:`~tenex_daemon.core.threads.thread_key`)."""
        return thread_key(chat_id, agent, other)

    def _lock(self, thread_id: str) -> asyncio.Lock:
        lock = self._locks.get(thread_id)
        if lock is None:
            lock = self._locks[thread_id] = asyncio.Lock()
        return lock

    async def get_thread(self, chat_id: str, agent: str, other: str | None = None) -> ConversationThread:
        """Return the pair's thread: cached, else loaded, else new (not saved until changed). On a shared
        store it is loaded each time: the cached object then holds what is stored, followed by the items
        added here and not saved yet.

        Raises :class:`ThreadPersistenceError` when loading fails; nothing is cached then,
        so a later save cannot overwrite the stored thread with an empty one.
        """
        thread_id = thread_key(chat_id, agent, other)
        cached = self._threads.get(thread_id)
        if cached is not None and not self._shared:
            self._threads.move_to_end(thread_id)
            return cached
        async with self._lock(thread_id):
            cached = self._threads.get(thread_id)
            if cached is not None and not self._shared:
                self._threads.move_to_end(thread_id)
                return cached
            loaded = await self._load_checked(thread_id)
            if cached is not None:  # a shared store: another daemon may have added to it
                self._refresh(cached, loaded)
                self._threads.move_to_end(thread_id)
                return cached
            thread = loaded or ConversationThread(thread_id=thread_id)
            self._threads[thread_id] = thread
            self._stored_count[thread_id] = len(thread.items)
        self._trim()
        return thread

    async def _load_checked(self, thread_id: str) -> ConversationThread | None:
        """Load the stored thread; a failure or a thread of another id is :class:`ThreadPersistenceError`."""
        try:
            loaded = await self._load(thread_id)
        except Exception as exc:
            log.error("thread_load_failed", thread_id=thread_id, error=str(exc))
            raise ThreadPersistenceError(thread_id, "load", exc) from exc
        if loaded is not None and loaded.thread_id != thread_id:
            raise ThreadPersistenceError(
                thread_id, "load", ValueError(f"callback returned thread {loaded.thread_id!r}")
            )
        return loaded

    def _refresh(self, cached: ConversationThread, loaded: ConversationThread | None) -> None:
        """Bring a cached thread up to what is stored, keeping after it the items added here since."""
        thread_id = cached.thread_id
        added = cached.items[self._stored_count.get(thread_id, len(cached.items)):]
        stored = [] if loaded is None else loaded.items
        cached.items = [*stored, *_not_stored(added, stored)]
        if loaded is not None:
            kept = cached.metadata if thread_id in self.unsaved else {}
            cached.metadata = {**loaded.metadata, **kept}
        self._stored_count[thread_id] = len(stored)

    async def _load(self, thread_id: str) -> ConversationThread | None:
        if self._load_callback is not None:
            result = self._load_callback(thread_id)
            if inspect.isawaitable(result):
                result = await result
            return result
        if self._store is not None:
            data = await self._store.get_meta(META_PREFIX + thread_id)
            return None if data is None else ConversationThread.from_json(data)
        return None

    async def save_thread(self, thread: ConversationThread) -> None:
        """Persist the whole thread; raises :class:`ThreadPersistenceError` on failure (items kept). On a
        shared store a thread this manager handed out adds to the stored one the items added since it was
        loaded (:meth:`_save_shared`)."""
        if self._threads.get(thread.thread_id) is not thread:
            self._stored_count.pop(thread.thread_id, None)  # not the cached one: its loaded part is unknown
        self._threads[thread.thread_id] = thread
        self._threads.move_to_end(thread.thread_id)
        self.unsaved.add(thread.thread_id)
        async with self._lock(thread.thread_id):
            try:
                if self._save_callback is not None:
                    result = self._save_callback(thread)
                    if inspect.isawaitable(result):
                        await result
                elif self._store is not None and self._shared:
                    await self._save_shared(self._store, thread)
                elif self._store is not None:
                    await self._store.set_meta(META_PREFIX + thread.thread_id, thread.to_json())
            except Exception as exc:
                log.error("thread_save_failed", thread_id=thread.thread_id, error=str(exc))
                raise ThreadPersistenceError(thread.thread_id, "save", exc) from exc
            self.unsaved.discard(thread.thread_id)
        self._trim()

    async def _save_shared(self, store: SmallValues, thread: ConversationThread) -> None:
        """Under the store's lease on the thread, load it again and append the items added here since it
        was loaded (``thread`` then holds the result). Of a thread this manager no longer knows the loaded
        part of (left out of the cache during its exchange, or not handed out here), the items past what it
        shares with the stored thread from the start count as added: another daemon's items stay."""
        key = META_PREFIX + thread.thread_id
        count = self._stored_count.get(thread.thread_id)
        async with store.lease(key):
            data = await store.get_meta(key)
            stored = [] if data is None else ConversationThread.from_json(data).items
            if count is None:
                count = _shared_start(thread.items, stored)
            items = [*stored, *_not_stored(thread.items[count:], stored)]
            saved = ConversationThread(thread_id=thread.thread_id, items=items, metadata=thread.metadata)
            await store.set_meta(key, saved.to_json())
        thread.items = saved.items
        self._stored_count[thread.thread_id] = len(saved.items)

    def _trim(self) -> None:
        """Drop the least recently used threads beyond ``max_cached`` that are saved and idle
        (they load again on demand), and the locks nobody holds of threads not cached."""
        if self._max_cached is None or len(self._threads) <= self._max_cached:
            return
        for thread_id in list(self._threads):
            if len(self._threads) <= self._max_cached:
                break
            lock = self._locks.get(thread_id)
            if thread_id in self.unsaved or (lock is not None and not _idle(lock)):
                continue
            del self._threads[thread_id]
            self._stored_count.pop(thread_id, None)
        for thread_id, lock in list(self._locks.items()):
            if thread_id not in self._threads and _idle(lock):
                del self._locks[thread_id]

    async def add_item_and_save(self, thread: ConversationThread, item: Any) -> None:
        """Append ``item`` and save the thread."""
        thread.add_item(item)
        await self.save_thread(thread)

    async def add_items_and_save(self, thread: ConversationThread, items: Sequence[Any]) -> None:
        """Append ``items`` in order and save the thread."""
        thread.add_items(items)
        await self.save_thread(thread)

    def forget_conversation(self, chat_id: str) -> list[str]:
        """Drop every cached thread of the conversation (it was deleted); return their ids.

        Its stored threads are erased by the store's ``delete`` (:mod:`~tenex_daemon.core.erasure`);
        with user callbacks, erasing what they stored is theirs to do.
        """
        prefix = f"{chat_id}{KEY_SEPARATOR}"
        dropped = [thread_id for thread_id in self._threads if thread_id.startswith(prefix)]
        for thread_id in dropped:
            del self._threads[thread_id]
            self._stored_count.pop(thread_id, None)
            self.unsaved.discard(thread_id)
            lock = self._locks.get(thread_id)
            if lock is not None and _idle(lock):
                del self._locks[thread_id]
        if dropped:
            log.info("threads_forgotten", conversation_id=chat_id, threads=len(dropped))
        return dropped

    def cached(self) -> list[str]:
        """Return the ids of the threads held in memory."""
        return list(self._threads)


def _not_stored(added: Sequence[Any], stored: Sequence[Any]) -> list[Any]:
    """The ``added`` items to append after ``stored``: all, but an exchange's item (one naming its
    ``event_id``) already stored, which a thread never holds twice."""
    ids = {item.get("event_id") for item in stored if isinstance(item, dict)} - {None}
    return [item for item in added if not (isinstance(item, dict) and item.get("event_id") in ids)]


def _shared_start(items: Sequence[Any], stored: Sequence[Any]) -> int:
    """How many leading ``items`` are the stored thread's own leading items."""
    count = 0
    for mine, theirs in zip(items, stored, strict=False):
        if mine != theirs:
            break
        count += 1
    return count


def _idle(lock: asyncio.Lock) -> bool:
    """Nobody holds ``lock`` or waits for it (a waiter just woken does not hold it yet)."""
    return not lock.locked() and not getattr(lock, "_waiters", None)
