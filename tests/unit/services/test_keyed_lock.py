"""KeyedLock: one holder per key, other keys free, and no lock left behind by a holder, a failure or a
waiter that gave up."""

from __future__ import annotations

import asyncio

import pytest

from tenex_daemon.services.locks import KeyedLock


async def test_one_holder_per_key_and_other_keys_are_free() -> None:
    """While a key is held a second holder of it waits, and a holder of another key does not."""
    locks = KeyedLock()
    order: list[str] = []
    release = asyncio.Event()

    async def hold(key: str, name: str) -> None:
        async with locks.hold(key):
            order.append(f"{name} in")
            if name == "first":
                await release.wait()
            order.append(f"{name} out")

    first = asyncio.create_task(hold("a", "first"))
    await asyncio.sleep(0)
    second = asyncio.create_task(hold("a", "second"))
    await hold("b", "other")
    release.set()
    await asyncio.gather(first, second)

    assert order == ["first in", "other in", "other out", "first out", "second in", "second out"]
    assert len(locks) == 0


async def test_a_failure_or_a_cancelled_waiter_leaves_no_lock_behind() -> None:
    """A block that raises releases its key; a waiter cancelled before it got the key leaves nothing:
    once nobody holds or waits, the map is empty."""
    locks = KeyedLock()
    with pytest.raises(ValueError, match="boom"):
        async with locks.hold("a"):
            raise ValueError("boom")
    assert len(locks) == 0

    holding = asyncio.Event()
    release = asyncio.Event()

    async def holder() -> None:
        async with locks.hold("a"):
            holding.set()
            await release.wait()

    async def waiter() -> None:
        async with locks.hold("a"):
            pass

    held = asyncio.create_task(holder())
    await holding.wait()
    waiting = asyncio.create_task(waiter())
    await asyncio.sleep(0)
    assert len(locks) == 1
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    release.set()
    await held
    assert len(locks) == 0
