"""Fixtures shared by every test: a cast of people and agents, and a manager over a MemoryStore."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import pytest

from tenex_daemon import Agent, ConversationManager, MemoryStore, NostrEvent
from tenex_daemon.testing import EventFactory, FakeClock, FakeResolver, KeyPair, make_agent
from tests.llm_servers import llama_server, scripted_server, smollm2_path

__all__ = ["llama_server", "scripted_server", "smollm2_path"]


@dataclass
class Cast:
    """The people and agents of a test conversation."""

    user: KeyPair
    other_user: KeyPair
    project: KeyPair
    alice: Agent
    alice_keys: KeyPair
    bob: Agent
    bob_keys: KeyPair
    orchestrator: Agent
    orchestrator_keys: KeyPair
    factory: EventFactory

    @property
    def agents(self) -> list[Agent]:
        """Every configured agent."""
        return [self.alice, self.bob, self.orchestrator]

    def user_says(self, content: str, *, kind: int = 1111, tags: Iterable[Iterable[str]] = ()) -> NostrEvent:
        """A signed event from the user."""
        return self.factory.event(self.user, content, kind=kind, tags=tags)

    def alice_says(self, content: str, *, kind: int = 1111, tags: Iterable[Iterable[str]] = ()) -> NostrEvent:
        """A signed event from Alice."""
        return self.factory.event(self.alice_keys, content, kind=kind, tags=tags)

    def bob_says(self, content: str, *, kind: int = 1111, tags: Iterable[Iterable[str]] = ()) -> NostrEvent:
        """A signed event from Bob."""
        return self.factory.event(self.bob_keys, content, kind=kind, tags=tags)


@pytest.fixture(scope="session")
def cast() -> Cast:
    """Deterministic keys for a user, the project and three agents."""
    alice, alice_keys = make_agent("alice", "Alice", 11)
    bob, bob_keys = make_agent("bob", "Bob", 12)
    orchestrator, orchestrator_keys = make_agent("orchestrator", "Orchestrator", 13, orchestrator=True)
    return Cast(
        user=KeyPair.from_seed(1),
        other_user=KeyPair.from_seed(2),
        project=KeyPair.from_seed(3),
        alice=alice,
        alice_keys=alice_keys,
        bob=bob,
        bob_keys=bob_keys,
        orchestrator=orchestrator,
        orchestrator_keys=orchestrator_keys,
        factory=EventFactory(),
    )


@pytest.fixture
def clock() -> FakeClock:
    """A clock moved by hand."""
    return FakeClock()


@pytest.fixture
def resolver() -> FakeResolver:
    """An event resolver over events the test adds."""
    return FakeResolver()


@pytest.fixture
def manager(cast: Cast, clock: FakeClock, resolver: FakeResolver) -> ConversationManager:
    """A ConversationManager over a MemoryStore, the cast's agents and a fake clock; the user is the owner."""
    return ConversationManager(
        MemoryStore(),
        cast.agents,
        cast.project.pubkey,
        resolver=resolver,
        clock=clock,
        resolve_timeout=0.2,
        owner_pubkey=cast.user.pubkey,
    )
