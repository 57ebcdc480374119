"""Agents and the directory that tells who an author is."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from enum import Enum

from pydantic import BaseModel, ConfigDict

from tenex_daemon.core.errors import UnknownAgentError


class Agent(BaseModel):
    """A configured agent: stable slug, display name, public key; one may be the orchestrator."""

    model_config = ConfigDict(frozen=True)

    slug: str
    name: str
    pubkey: str
    orchestrator: bool = False

    def __init__(self, slug: str, name: str, pubkey: str, orchestrator: bool = False) -> None:
        """``Agent(slug, name, pubkey, orchestrator=False)``: its fields positional or by keyword."""
        super().__init__(slug=slug, name=name, pubkey=pubkey, orchestrator=orchestrator)


class AuthorRole(Enum):
    """What an event's author is to the project."""

    USER = "user"
    AGENT = "agent"
    PROJECT = "project"
    FOREIGN_AGENT = "foreign_agent"
    """An author unknown to the project whose event carries the tags agents write."""


AGENT_MARKER_TAGS = frozenset({"net-time", "llm-model"})
"""Tags only agent replies carry (docs/PROTOCOL.md); an unknown author using them claims to be an agent."""


class AgentDirectory:
    """Looks agents up by slug and by public key."""

    def __init__(
        self, agents: Iterable[Agent], project_pubkey: str | None = None, owner_pubkey: str | None = None
    ) -> None:
        self._by_slug: dict[str, Agent] = {}
        self._by_pubkey: dict[str, Agent] = {}
        for agent in agents:
            if agent.slug in self._by_slug:
                raise ValueError(f"duplicate agent slug {agent.slug!r}")
            if agent.pubkey in self._by_pubkey:
                other = self._by_pubkey[agent.pubkey].slug
                raise ValueError(f"agents {other!r} and {agent.slug!r} share a key")
            self._by_slug[agent.slug] = agent
            self._by_pubkey[agent.pubkey] = agent
        self.project_pubkey = project_pubkey
        self.owner_pubkey = owner_pubkey

    @classmethod
    def of(
        cls, agents: Iterable[Agent] | AgentDirectory, project_pubkey: str | None, owner_pubkey: str | None
    ) -> AgentDirectory:
        """``agents`` as a directory: a directory itself (the project's and owner's keys set on it when
        given), or a new one."""
        if not isinstance(agents, AgentDirectory):
            return cls(agents, project_pubkey, owner_pubkey)
        if project_pubkey is not None:
            agents.project_pubkey = project_pubkey
        if owner_pubkey is not None:
            agents.owner_pubkey = owner_pubkey
        return agents

    def __iter__(self) -> Iterator[Agent]:
        return iter(self._by_slug.values())

    def __len__(self) -> int:
        return len(self._by_slug)

    def get(self, slug: str) -> Agent:
        """Return the agent with ``slug`` or raise :class:`UnknownAgentError`."""
        try:
            return self._by_slug[slug]
        except KeyError:
            raise UnknownAgentError(slug, tuple(self._by_slug)) from None

    def find(self, slug: str) -> Agent | None:
        """Return the agent with ``slug``, or None."""
        return self._by_slug.get(slug)

    def by_pubkey(self, pubkey: str) -> Agent | None:
        """Return the agent whose key is ``pubkey``, or None."""
        return self._by_pubkey.get(pubkey)

    @property
    def pubkey_map(self) -> dict[str, Agent]:
        """Agents keyed by public key (read-only by convention)."""
        return self._by_pubkey

    @property
    def orchestrator(self) -> Agent | None:
        """The orchestrator agent, if one is configured."""
        return next((a for a in self._by_slug.values() if a.orchestrator), None)

    def may_set_session(self, pubkey: str) -> bool:
        """Whether an event by ``pubkey`` may name an agent's backend session (docs/CONTEXT.md step 5).

        Only the project's own agents and the owner may: a session id taken from anyone else's
        event would let them resume (and read) a session that is not theirs.
        """
        return pubkey in self._by_pubkey or (self.owner_pubkey is not None and pubkey == self.owner_pubkey)

    def role_of(self, pubkey: str, claims_agent: bool = False) -> AuthorRole:
        """Return whether an author is one of our agents, the project key, another agent or a user.

        ``claims_agent`` tells an unknown author that writes agent-only tags
        (:func:`claims_agent`) apart from a person.
        """
        if pubkey in self._by_pubkey:
            return AuthorRole.AGENT
        if self.project_pubkey is not None and pubkey == self.project_pubkey:
            return AuthorRole.PROJECT
        if claims_agent:
            return AuthorRole.FOREIGN_AGENT
        return AuthorRole.USER


def claims_agent(tags: list[list[str]]) -> bool:
    """Return whether an event's tags are ones only agent replies carry."""
    return any(tag and tag[0] in AGENT_MARKER_TAGS for tag in tags)
