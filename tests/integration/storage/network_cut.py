"""Run inside a network namespace of its own (``unshare -n``): start PostgreSQL there, open a store, cut
the network (loopback down) while one statement waits for its answer and before another is sent, and
print as JSON what each statement raised and when, and how long the store took to close."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from tenex_daemon.adapters.storage.postgres import PostgresStore
from tests.contract.postgres_server import PostgresServer


async def _timed(statement: Any, started: float) -> dict[str, Any]:
    try:
        answer = await asyncio.wait_for(statement, 120)
    except Exception as error:
        return {"raised": type(error).__name__, "after_s": time.monotonic() - started}
    return {"answered": repr(answer), "after_s": time.monotonic() - started}


async def _loopback(state: str) -> None:
    """Bring this namespace's loopback ``up`` or ``down``."""
    ip = await asyncio.create_subprocess_exec("ip", "link", "set", "lo", state)
    if await ip.wait() != 0:
        raise RuntimeError(f"ip link set lo {state} failed")


async def main() -> dict[str, Any]:
    await _loopback("up")
    server = PostgresServer.start()
    try:
        store = PostgresStore(await server.create_database())
        await store.open()
        held = await store.pool.acquire()  # a second connection, idle when the network goes
        started = time.monotonic()
        waiting = asyncio.create_task(_timed(store.pool.fetchval("SELECT pg_sleep(3)"), started))
        await asyncio.sleep(0.5)
        await _loopback("down")
        sent = await _timed(held.fetchval("SELECT 1"), time.monotonic())
        result: dict[str, Any] = {"waiting": await waiting, "sent_after_the_cut": sent}
        await _loopback("up")
        closing = time.monotonic()
        await asyncio.wait_for(store.close(), 60)
        result["close_s"] = time.monotonic() - closing
        return result
    finally:
        server.stop()


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())))
