"""nostr-sdk's LocalRelay in a process of its own, for :class:`harness.LocalRelayServer`.

``python -m tests.integration.nostr.local_relay_child --path DIR --port N [--auth]`` prints
``ready`` once the relay serves and runs until its standard input closes (or it is killed).
A process of its own makes "the relay died" exact: its listener goes with it (an in-process
``LocalRelay.shutdown()`` can leave the listener accepting).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import nostr_sdk
from nostr_sdk import nostr_sdk as nostr_sdk_ffi


async def serve(path: Path, port: int, auth: bool) -> None:
    """Run the relay until standard input closes."""
    # The LMDB backend calls back into Python from relay threads: on this loop.
    nostr_sdk_ffi.uniffi_set_event_loop(asyncio.get_running_loop())
    db: Any = await nostr_sdk.NostrLmdb.open(str(path))
    builder = (
        nostr_sdk.LocalRelayBuilder()
        .addr("127.0.0.1")
        .port(port)
        .database(db)
        .rate_limit(nostr_sdk.RateLimit(max_reqs=1000, notes_per_minute=100_000))
    )
    if auth:
        builder = builder.nip42(nostr_sdk.LocalRelayBuilderNip42(mode=nostr_sdk.LocalRelayBuilderNip42Mode.BOTH))
    relay: Any = builder.build()
    await relay.run()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    await asyncio.to_thread(sys.stdin.buffer.read)
    relay.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--path", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--auth", action="store_true")
    args = parser.parse_args()
    args.path.mkdir(parents=True, exist_ok=True)
    asyncio.run(serve(args.path, args.port, args.auth))
