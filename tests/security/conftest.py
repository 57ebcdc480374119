"""The security tests' parts: a real relay, a relay that checks nothing, a raw websocket client, the daemon.

- ``relay``: nostr-sdk's LocalRelay in a child process (it verifies ids and signatures itself).
- :class:`OpenRelay`: a relay in the test's process that stores and forwards any ``EVENT`` frame as it
  came, unverified and again on every copy, so the daemon's own checks are the only filter.
- :func:`publish`, :func:`query`, :func:`wait_for_events`: a raw websocket client (``websockets``), no
  Nostr library between the test and the relay.
- :func:`running`: ``tenexd run`` as a subprocess on a home, stopped (SIGTERM, then kill by pid) at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from coincurve import PrivateKey
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from tenex_daemon.adapters.nostr.codec import event_id_digest
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.app.home import init_home
from tenex_daemon.app.status import read_status
from tests.e2e.conftest import relay
from tests.e2e.harness import DaemonProcess, Home
from tests.integration.nostr.harness import FakeRelay

__all__ = ["relay"]  # the real relay fixture of tests/e2e

Event = dict[str, Any]
Filter = dict[str, Any]


def make_home(path: Path, relays: Sequence[str], whitelist: Sequence[str] = ()) -> Home:
    """A home made by ``tenexd init`` (owner key generated) on ``relays``, with ``whitelist``."""
    return Home(path, init_home(path, whitelist=list(whitelist), relays=list(relays)))


@contextlib.asynccontextmanager
async def running(home: Home, env: dict[str, str] | None = None) -> AsyncIterator[DaemonProcess]:
    """``tenexd run`` on ``home`` for the block; SIGTERM at the end, kill by pid if it hangs."""
    process = DaemonProcess(home, env=env)
    await process.start()
    try:
        yield process
    finally:
        try:
            await process.stop()
        finally:
            process.kill()


def status_of(home: Home) -> dict[str, Any]:
    """The daemon's status document (``run/status.json``), however old."""
    report = read_status(home.path / "run" / "status.json", stale_after_s=3600)
    assert report.data is not None, "no status file"
    return dict(report.data)


def log_records(home: Home) -> list[dict[str, Any]]:
    """The daemon's JSON log lines (its stdout and stderr, ``daemon.log``), parsed; other lines skipped."""
    records = []
    path = home.path / "daemon.log"
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict):
                records.append(record)
    return records


async def wait_until(predicate: Callable[[], bool], within: float, what: str) -> None:
    """Poll ``predicate`` every 0.1 s until it holds; fail naming ``what`` after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(0.1)


# --- events, signed and forged ---------------------------------------------------------------------


def signed(signer: Signer, kind: int, content: str, tags: Sequence[Sequence[str]] = (), **fields: Any) -> Event:
    """A correctly signed event as a NIP-01 dict (``created_at`` may be given)."""
    return signer.sign(kind, content, [list(t) for t in tags], created_at=fields.get("created_at")).to_dict()


def forged(pubkey: str, kind: int, content: str, tags: Sequence[Sequence[str]], *, signed_by: Signer | None) -> Event:
    """An event claiming ``pubkey``: its id is right for its fields, its signature is ``signed_by``'s
    Schnorr signature over that id (a valid signature by the wrong key), or 64 random bytes when None."""
    created_at = int(time.time())
    tag_list = [list(t) for t in tags]
    digest = event_id_digest(pubkey, created_at, kind, tag_list, content)
    if signed_by is None:
        sig = os.urandom(64).hex()
    else:
        sig = PrivateKey(bytes.fromhex(signed_by.secret_hex())).sign_schnorr(digest, os.urandom(32)).hex()
    return {
        "id": digest.hex(), "pubkey": pubkey, "created_at": created_at, "kind": kind, "tags": tag_list,
        "content": content, "sig": sig,
    }


# --- a raw websocket client --------------------------------------------------------------------------


async def publish(url: str, events: Sequence[Event], within: float = 30.0) -> list[list[Any]]:
    """Send each event as an ``EVENT`` frame on one connection; return the relay's ``OK`` frames in order."""
    answers: list[list[Any]] = []
    async with asyncio.timeout(within), connect(url, max_size=None) as ws:
        for event in events:
            await ws.send(json.dumps(["EVENT", event]))
            while True:
                frame = json.loads(await ws.recv())
                if frame[0] == "OK":
                    answers.append(frame)
                    break
    return answers


async def query(url: str, filters: Sequence[Filter], within: float = 10.0) -> list[Event]:
    """The relay's stored events matching ``filters`` (one ``REQ``, read until ``EOSE``)."""
    events: list[Event] = []
    async with asyncio.timeout(within), connect(url, max_size=None) as ws:
        await ws.send(json.dumps(["REQ", "q", *filters]))
        while True:
            frame = json.loads(await ws.recv())
            if frame[0] == "EVENT" and frame[1] == "q":
                events.append(frame[2])
            elif frame[0] in ("EOSE", "CLOSED"):
                break
        await ws.send(json.dumps(["CLOSE", "q"]))
    return events


async def wait_for_events(url: str, filters: Sequence[Filter], count: int, within: float = 15.0) -> list[Event]:
    """Query every 0.2 s until at least ``count`` events match; return them (fail after ``within`` s)."""
    deadline = time.monotonic() + within
    while True:
        found = await query(url, filters)
        if len(found) >= count:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(found)} events match {filters} on {url} after {within}s, expected {count}")
        await asyncio.sleep(0.2)


def replies_to(root_id: str, authors: Sequence[str]) -> list[Filter]:
    """Filters of the agents' replies in a thread: NIP-22 comments naming the root in ``E``, kind-1
    replies naming it in ``e``."""
    return [
        {"kinds": [1111], "#E": [root_id], "authors": list(authors)},
        {"kinds": [1], "#e": [root_id], "authors": list(authors)},
    ]


# --- a relay that checks nothing ---------------------------------------------------------------------


def matches(filter_: Filter, event: Event) -> bool:
    """Whether ``event`` matches one NIP-01 filter (ids, authors, kinds, since, until, ``#x`` tags)."""
    for name, field in (("ids", "id"), ("authors", "pubkey"), ("kinds", "kind")):
        if name in filter_ and event.get(field) not in filter_[name]:
            return False
    created_at = event.get("created_at")
    if not isinstance(created_at, int):
        return False
    if created_at < filter_.get("since", -(2**63)) or created_at > filter_.get("until", 2**63):
        return False
    raw_tags = event.get("tags")
    tags: list[Any] = raw_tags if isinstance(raw_tags, list) else []
    for name, wanted in filter_.items():
        if name.startswith("#") and not any(
            isinstance(t, list) and len(t) > 1 and t[0] == name[1:] and t[1] in wanted for t in tags
        ):
            return False
    return True


class OpenRelay(FakeRelay):
    """A websocket relay that verifies nothing: every ``EVENT`` frame is answered ``OK true``, stored as it
    came and forwarded to every matching live subscription, again for every copy (a hostile relay, or a
    replaying one). Stored events are served on ``REQ`` (filters honoured), then ``EOSE``."""

    def __init__(self) -> None:
        super().__init__(lambda _relay, ws: self._connection(ws))
        self.events: list[Event] = []
        self._subs: dict[tuple[ServerConnection, str], list[Filter]] = {}

    async def _connection(self, ws: ServerConnection) -> None:
        try:
            while True:
                frame = await self.recv(ws)
                if frame[0] == "EVENT" and isinstance(frame[1], dict):
                    await ws.send(json.dumps(["OK", frame[1].get("id", ""), True, ""]))
                    await self.inject(frame[1])
                elif frame[0] == "REQ":
                    self._subs[(ws, frame[1])] = frame[2:]
                    for event in list(self.events):
                        if any(matches(f, event) for f in frame[2:]):
                            await ws.send(json.dumps(["EVENT", frame[1], event]))
                    await ws.send(json.dumps(["EOSE", frame[1]]))
                elif frame[0] == "CLOSE":
                    self._subs.pop((ws, frame[1]), None)
        finally:
            for key in [k for k in self._subs if k[0] is ws]:
                del self._subs[key]

    async def inject(self, event: Event) -> None:
        """Store ``event`` as it is and send it to every live subscription it matches."""
        self.events.append(event)
        for (ws, sub_id), filters in list(self._subs.items()):
            if any(matches(f, event) for f in filters):
                with contextlib.suppress(ConnectionClosed):
                    await ws.send(json.dumps(["EVENT", sub_id, event]))


@pytest.fixture
async def open_relay() -> AsyncIterator[OpenRelay]:
    """A relay that checks nothing (see :class:`OpenRelay`)."""
    server = OpenRelay()
    async with server:
        yield server


async def control_get(home: Home, path: str) -> tuple[int, Any]:
    """GET ``path`` from the daemon's control API over its Unix socket; return (status, JSON body)."""
    connector = aiohttp.UnixConnector(path=str(home.path / "run" / "control.sock"))
    async with aiohttp.ClientSession(connector=connector) as session, session.get(f"http://tenexd{path}") as answer:
        return answer.status, await answer.json(content_type=None)
