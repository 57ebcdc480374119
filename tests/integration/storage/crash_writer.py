"""The writer process of the crash test: appends events under load, printing each accepted id.

Run as ``python -m tests.integration.storage.crash_writer HOME POLICY``. Lines on stdout:
``A <conversation> <event>`` once ``append_event`` (or ``create``) returned, ``S <conversation> <n>``
once a snapshot with ``metadata.extra["n"] == n`` was saved, ``READY`` when the load starts.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

from tenex_daemon.adapters.storage.filesystem import FileSystemStore, FsyncPolicy
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.search import SearchQuery
from tenex_daemon.testing import KeyPair, sign_event

CONVERSATIONS = 6


def say(line: str) -> None:
    """Write one whole line to stdout at once (a file: survives the kill)."""
    os.write(1, (line + "\n").encode())


async def main(home: str, policy: FsyncPolicy) -> None:
    """Open the home, make sure the conversations exist, then append until killed."""
    store = FileSystemStore(home, fsync=policy)
    await store.open()
    keys = KeyPair.from_seed(7)
    ids = sorted(row.id for row in await store.search(SearchQuery()))
    while len(ids) < CONVERSATIONS:
        root = sign_event(keys, f"root {time.time_ns()}", kind=11, tags=[["title", f"crash {len(ids)}"]])
        conversation = Conversation(id=root.id, title=f"crash {len(ids)}")
        conversation.append(root)
        await store.create(conversation)
        say(f"A {root.id} {root.id}")
        ids.append(root.id)
    say("READY")

    async def writer(conversation_id: str) -> None:
        conversation = await store.load(conversation_id)
        assert conversation is not None
        n = int(conversation.metadata.extra.get("n", 0))
        while True:
            n += 1
            # the pid: a writer restarted within the same second (ids have whole-second times)
            # from an older snapshot's n must not make the previous writer's events again
            event = sign_event(keys, f"{conversation_id[:8]} #{n} {os.getpid()} " + "x" * (n % 300))
            await store.append_event(conversation_id, event)
            say(f"A {conversation_id} {event.id}")
            if n % 7 == 0:
                conversation.metadata.extra["n"] = n
                await store.save_state(conversation)
                say(f"S {conversation_id} {n}")

    await asyncio.gather(*(writer(cid) for cid in ids))


if __name__ == "__main__":
    policy: FsyncPolicy = "batch" if sys.argv[2] == "batch" else "always"
    asyncio.run(main(sys.argv[1], policy))
