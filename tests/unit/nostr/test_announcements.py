"""What the project announces: kind-0 profiles tagged as a bot's and its owner's, and the kind-24010
heartbeat naming each agent's model and tools (docs/PROTOCOL.md)."""

from __future__ import annotations

import json

from tenex_daemon.adapters.nostr.announcements import (
    AgentCapabilities,
    dm_relays_event,
    heartbeat_event,
    profile_event,
)
from tenex_daemon.adapters.nostr.codec import profile_tags, verify_event
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.core.agents import Agent
from tenex_daemon.testing import KeyPair

OWNER = KeyPair.from_seed(71)
ALICE = Signer.from_text(KeyPair.from_seed(72).secret, label="alice")
BOB = Signer.from_text(KeyPair.from_seed(73).secret, label="bob")
CAROL = Signer.from_text(KeyPair.from_seed(74).secret, label="carol")
PROJECT = Signer.from_text(KeyPair.from_seed(75).secret, label="project")
AGENTS = [
    Agent(slug="alice", name="Alice", pubkey=ALICE.pubkey),
    Agent(slug="bob", name="Bob", pubkey=BOB.pubkey),
    Agent(slug="carol", name="Carol", pubkey=CAROL.pubkey),
]


def test_profile_carries_bot_and_owner_tags() -> None:
    """A kind-0 profile is signed by the agent, names it in its content, and carries ``["bot"]`` and
    ``["p", <owner>]``; without an owner, only ``["bot"]``."""
    event = profile_event(ALICE, AGENTS[0], "You plan.", OWNER.pubkey)

    assert (event.kind, event.pubkey) == (0, ALICE.pubkey)
    assert verify_event(event)
    assert event.tags == [["bot"], ["p", OWNER.pubkey]]
    assert json.loads(event.content) == {"name": "Alice", "display_name": "Alice", "about": "You plan."}
    assert profile_event(ALICE, AGENTS[0], "You plan.").tags == [["bot"]]
    assert profile_tags(None) == [["bot"]]


def test_heartbeat_names_each_agents_model_and_tools() -> None:
    """The heartbeat keeps one ``agent`` tag per agent and the project's ``a``, then one ``model`` tag per
    model and one ``tool`` tag per tool, each listing the agents' slugs in the agents' order."""
    capabilities = {
        "bob": AgentCapabilities("gpt-4o", ("complete", "get_conversation")),
        "alice": AgentCapabilities("gpt-4o", ("complete", "switch_phase")),
        "carol": AgentCapabilities("claude-sonnet", ("complete",)),
    }

    event = heartbeat_event(PROJECT, AGENTS, (OWNER.pubkey, "proj"), capabilities)

    assert (event.kind, event.pubkey) == (24010, PROJECT.pubkey)
    assert verify_event(event)
    assert event.tags == [
        ["agent", ALICE.pubkey, "alice"],
        ["agent", BOB.pubkey, "bob"],
        ["agent", CAROL.pubkey, "carol"],
        ["a", f"31933:{OWNER.pubkey}:proj"],
        ["model", "gpt-4o", "alice", "bob"],
        ["model", "claude-sonnet", "carol"],
        ["tool", "complete", "alice", "bob", "carol"],
        ["tool", "switch_phase", "alice"],
        ["tool", "get_conversation", "bob"],
    ]


def test_an_agent_without_model_or_capabilities_gets_no_model_tag() -> None:
    """An agent with no model gets only its tools' tags, one missing from the capabilities none, and a
    heartbeat built without capabilities has only the agent and project tags."""
    event = heartbeat_event(PROJECT, AGENTS, None, {"alice": AgentCapabilities(None, ("complete",))})

    assert event.tags[len(AGENTS):] == [["tool", "complete", "alice"]]
    assert heartbeat_event(PROJECT, AGENTS[:1], None).tags == [["agent", ALICE.pubkey, "alice"]]


def test_an_agents_relay_list_names_each_relay_once() -> None:
    """An agent's kind-10050 relay list (NIP-17) is signed by the agent, empty, and names each relay once
    in the order given: where NIP-17 clients send the agent private messages."""
    relays = ["wss://relay.one", "ws://127.0.0.1:7000", "wss://relay.one"]

    event = dm_relays_event(ALICE, relays)

    assert (event.kind, event.pubkey, event.content) == (10050, ALICE.pubkey, "")
    assert verify_event(event)
    assert event.tags == [["relay", "wss://relay.one"], ["relay", "ws://127.0.0.1:7000"]]
