"""Parts of the fault runs: a real client streaming messages (nostr-tools), and the tally of the answers
read back from the relays afterwards (each message answered once: none lost, none doubled)."""

from __future__ import annotations

import asyncio
import json
import random
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.e2e.harness import REPO, DaemonProcess, Home, node_client

STREAM_CLIENT = REPO / "tests" / "node" / "stream_client.mjs"
REPLY_KINDS = (1, 1111)


class StreamClient:
    """The nostr-tools stream client (``tests/node/stream_client.mjs``) as one long-lived process: each
    :meth:`send` signs a message as the person and returns once every relay it went to accepted it."""

    def __init__(self, relays: Sequence[str], secret: str) -> None:
        self.relays = list(relays)
        self.secret = secret
        self.sent: list[str] = []
        self._proc: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> StreamClient:
        self._proc = await asyncio.create_subprocess_exec(
            "node", str(STREAM_CLIENT),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        await self._write({"relays": self.relays, "secret": self.secret})
        return self

    async def __aexit__(self, *exc: object) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.returncode is None:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()

    async def _write(self, line: dict[str, Any]) -> None:
        assert self._proc is not None
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(line).encode() + b"\n")
        await self._proc.stdin.drain()

    async def send(
        self, content: str, tags: list[list[str]], *, kind: int = 11, to: Sequence[int] | None = None,
        within: float = 150.0,
    ) -> str:
        """Sign and publish one message (to the relays at indexes ``to``, else all); return its id."""
        assert self._proc is not None
        assert self._proc.stdout is not None
        request: dict[str, Any] = {"kind": kind, "content": content, "tags": tags}
        if to is not None:
            request["to"] = list(to)
        await self._write(request)
        line = await asyncio.wait_for(self._proc.stdout.readline(), within)
        if not line:
            assert self._proc.stderr is not None
            error = await self._proc.stderr.read()
            raise RuntimeError(f"stream client ended: {error.decode(errors='replace')}")
        answer = json.loads(line)
        event_id = str(answer["id"])
        self.sent.append(event_id)
        return event_id


@dataclass
class Tally:
    """What the relays hold in answer to each sent message."""

    sent: list[str]
    replies: dict[str, set[str]] = field(default_factory=dict)

    @property
    def lost(self) -> list[str]:
        """Messages with no answer."""
        return [m for m in self.sent if not self.replies.get(m)]

    @property
    def doubled(self) -> dict[str, int]:
        """Messages answered more than once, with their answer counts."""
        return {m: len(self.replies[m]) for m in self.sent if len(self.replies.get(m, ())) > 1}

    def figures(self) -> dict[str, int]:
        """The counts a report line carries."""
        return {"messages": len(self.sent), "lost": len(self.lost), "doubled": len(self.doubled)}


QUERY_IDS = 100
"""Messages asked about per query: a relay caps what one query returns (LocalRelay at 500 events)."""


async def read_replies(
    relays: Sequence[str], authors: Sequence[str], sent: Sequence[str], since: int
) -> dict[str, set[str]]:
    """Every reply by ``authors`` since ``since`` on any of ``relays`` to a message of ``sent``, by the
    message it answers (its ``e`` tag); asked in slices of ``QUERY_IDS`` messages."""
    replies: defaultdict[str, set[str]] = defaultdict(set)
    for url in relays:
        for start in range(0, len(sent), QUERY_IDS):
            ids = list(sent[start : start + QUERY_IDS])
            answer = await node_client({
                "op": "query", "relay": url, "timeout_ms": 20000,
                "filters": [{"kinds": list(REPLY_KINDS), "authors": list(authors), "#e": ids, "since": since}],
            })
            for event in answer["events"]:
                parent = next((tag[1] for tag in event["tags"] if len(tag) > 1 and tag[0] == "e"), None)
                if parent is not None:
                    replies[parent].add(event["id"])
    return dict(replies)


async def tally(
    relays: Sequence[str], authors: Sequence[str], sent: list[str], since: int, *, within: float = 90.0,
    quiet_for: float = 2.0,
) -> Tally:
    """Wait until every sent message has an answer on the relays (or ``within`` passed), wait
    ``quiet_for`` more (a second answer, if any, would come now), and count."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    result = Tally(sent, await read_replies(relays, authors, sent, since))
    while result.lost and loop.time() < deadline:
        await asyncio.sleep(1.0)
        result = Tally(sent, await read_replies(relays, authors, sent, since))
    await asyncio.sleep(quiet_for)
    return Tally(sent, await read_replies(relays, authors, sent, since))


def message_tags(home: Home, n: int) -> list[list[str]]:
    """Half the messages address the planner, half the project (the orchestrator routes them)."""
    return [["p", home.agent("planner") if n % 2 == 0 else home.project]]


def answering_agents(home: Home) -> list[str]:
    """The agents whose replies count as answers."""
    return [home.agent(slug) for slug in ("planner", "orchestrator", "executor")]


async def keep_sending(
    client: StreamClient, home: Home, until: Callable[[], bool], rng: random.Random, *, gap: tuple[float, float],
    label: str = "message",
) -> None:
    """Send messages with random gaps until ``until()`` says stop."""
    n = len(client.sent)
    while not until():
        await client.send(f"{label} {n}: plan something", message_tags(home, n))
        n += 1
        await asyncio.sleep(rng.uniform(*gap))


async def restart_daemon(daemon: DaemonProcess, action: Callable[[], Awaitable[None]] | None = None) -> None:
    """SIGKILL the daemon, run ``action`` while it is down, and start it again."""
    daemon.kill()
    if action is not None:
        await action()
    await daemon.start()


def log_tails(daemons: Sequence[DaemonProcess], lines: int = 15) -> str:
    """The ends of the daemons' logs, for failure messages."""
    return "\n".join(d.log_tail(lines) for d in daemons)


def home_data(home: Home) -> Path:
    """The home's data folder (the file store)."""
    return home.path / "data"
