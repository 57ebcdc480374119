"""Test helpers shipped with tenexd: signed event factories, a fake clock, a fake resolver.

Fakes are for unit tests; integration tests use real relays and servers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import count

from coincurve import PrivateKey, PublicKeyXOnly

from tenex_daemon.core import nip19
from tenex_daemon.core.agents import Agent
from tenex_daemon.core.events import NostrEvent, compute_event_id


@dataclass(frozen=True)
class KeyPair:
    """A secp256k1 key pair for tests (hex secret and x-only hex public key)."""

    secret: str
    pubkey: str

    @classmethod
    def generate(cls) -> KeyPair:
        """Return a fresh random key pair."""
        key = PrivateKey()
        return cls(key.secret.hex(), PublicKeyXOnly.from_secret(key.secret).format().hex())

    @classmethod
    def from_seed(cls, seed: int) -> KeyPair:
        """Return a deterministic key pair (seed >= 1)."""
        secret = seed.to_bytes(32, "big")
        return cls(secret.hex(), PublicKeyXOnly.from_secret(secret).format().hex())

    @property
    def npub(self) -> str:
        """The public key as npub."""
        return nip19.encode_npub(self.pubkey)


def sign_event(
    keys: KeyPair,
    content: str,
    *,
    kind: int = 1111,
    tags: Iterable[Iterable[str]] = (),
    created_at: int | None = None,
) -> NostrEvent:
    """Return a correctly hashed and Schnorr-signed event."""
    tag_list = [list(t) for t in tags]
    ts = int(time.time()) if created_at is None else created_at
    event_id = compute_event_id(keys.pubkey, ts, kind, tag_list, content)
    sig = PrivateKey(bytes.fromhex(keys.secret)).sign_schnorr(bytes.fromhex(event_id), os.urandom(32))
    return NostrEvent(
        id=event_id,
        pubkey=keys.pubkey,
        created_at=ts,
        kind=kind,
        tags=tag_list,
        content=content,
        sig=sig.hex(),
    )


@dataclass
class EventFactory:
    """Makes signed events with increasing timestamps for a cast of users and agents."""

    start: int = 1_700_000_000
    _clock: count[int] = field(init=False)

    def __post_init__(self) -> None:
        self._clock = count(self.start)

    def event(
        self, keys: KeyPair, content: str, *, kind: int = 1111, tags: Iterable[Iterable[str]] = ()
    ) -> NostrEvent:
        """Return a signed event one second after the previous one."""
        return sign_event(keys, content, kind=kind, tags=tags, created_at=next(self._clock))


def make_agent(slug: str, name: str, seed: int, *, orchestrator: bool = False) -> tuple[Agent, KeyPair]:
    """Return an agent with a deterministic key pair."""
    keys = KeyPair.from_seed(seed)
    return Agent(slug=slug, name=name, pubkey=keys.pubkey, orchestrator=orchestrator), keys


class FakeClock:
    """A clock the test moves by hand (milliseconds)."""

    def __init__(self, now_ms: int = 1_700_000_000_000) -> None:
        self.now = now_ms
        self.monotonic = 0
        """The duration clock's reading: moved by :meth:`advance`, not by :meth:`step`."""

    def now_ms(self) -> int:
        """Return the current fake time."""
        return self.now

    def monotonic_ms(self) -> int:
        """Return the fake duration clock's reading."""
        return self.monotonic

    def advance(self, milliseconds: int) -> None:
        """Move the clock forward: time passes."""
        self.now += milliseconds
        self.monotonic += milliseconds

    def step(self, milliseconds: int) -> None:
        """Set the wall clock by ``milliseconds`` (back when negative), as NTP does: no time passes."""
        self.now += milliseconds


class FakeResolver:
    """An event resolver over a fixed set of events; records each lookup."""

    def __init__(self, events: Mapping[str, NostrEvent] | None = None, *, delay: float = 0.0) -> None:
        self.events: dict[str, NostrEvent] = dict(events or {})
        self.lookups: list[nip19.Entity] = []
        self.delay = delay

    def add(self, event: NostrEvent, key: str | None = None) -> None:
        """Make ``event`` resolvable by id (or by an ``naddr`` key ``kind:author:d``)."""
        self.events[key or event.id] = event

    async def resolve(self, entity: nip19.Entity) -> NostrEvent | None:
        """Return the event the entity points at, if known."""
        import asyncio

        self.lookups.append(entity)
        if self.delay:
            await asyncio.sleep(self.delay)
        if entity.kind_name == "naddr":
            return self.events.get(f"{entity.kind}:{entity.author}:{entity.value}")
        return self.events.get(entity.value)
