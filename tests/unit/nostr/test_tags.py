"""The codec's tag shapes besides agent replies: a person's reply, a conversation root, typing,
partials, the heartbeat, and which root an event names."""

from __future__ import annotations

from tenex_daemon.adapters.nostr.codec import (
    conversation_root_tags,
    heartbeat_tags,
    person_reply_tags,
    refers_to_root,
    streaming_tags,
    typing_tags,
)
from tenex_daemon.testing import KeyPair, sign_event

USER = KeyPair.from_seed(401)
AGENT = KeyPair.from_seed(402)
OTHER = KeyPair.from_seed(403)
ROOT_ID = "ab" * 32


def test_a_person_replying_to_a_root_names_it_as_root_and_parent() -> None:
    """Replying to a root event copies it as root (E/K/P) and parent (e/k), then one p per destination."""
    root = sign_event(USER, "root", kind=11)
    root_id, tags = person_reply_tags(root, [AGENT.pubkey, OTHER.pubkey, AGENT.pubkey])
    assert root_id == root.id
    assert tags == [
        ["E", root.id, "", USER.pubkey], ["K", "11"], ["P", USER.pubkey],
        ["e", root.id, "", USER.pubkey], ["k", "11"], ["p", AGENT.pubkey], ["p", OTHER.pubkey],
    ]


def test_a_person_replying_to_a_reply_copies_its_root_tags_as_written() -> None:
    """The parent's E, K and P values are copied verbatim; a missing K is 11; a missing P leaves P out."""
    parent = sign_event(AGENT, "re", tags=[["E", ROOT_ID, "", OTHER.pubkey], ["K", "1934"], ["P", OTHER.pubkey]])
    root_id, tags = person_reply_tags(parent, [AGENT.pubkey])
    assert root_id == ROOT_ID
    assert tags == [
        ["E", ROOT_ID, "", OTHER.pubkey], ["K", "1934"], ["P", OTHER.pubkey],
        ["e", parent.id, "", AGENT.pubkey], ["k", "1111"], ["p", AGENT.pubkey],
    ]
    bare = sign_event(AGENT, "re", tags=[["E", "not-hex"]])
    assert person_reply_tags(bare, [])[1] == [
        ["E", "not-hex", "", ""], ["K", "11"], ["e", bare.id, "", AGENT.pubkey], ["k", "1111"],
    ]


def test_conversation_root_typing_partial_and_heartbeat_tags() -> None:
    """A root carries its title (when it has one), p and the project's a; typing one e; a partial e, e-reply and streaming; the
    heartbeat one agent tag per agent and the project's a."""
    assert conversation_root_tags("Plan", [AGENT.pubkey], (USER.pubkey, "proj")) == [
        ["title", "Plan"], ["p", AGENT.pubkey], ["a", f"31933:{USER.pubkey}:proj"],
    ]
    assert conversation_root_tags(None, [AGENT.pubkey], (USER.pubkey, "proj")) == [  # untitled
        ["p", AGENT.pubkey], ["a", f"31933:{USER.pubkey}:proj"],
    ]
    assert typing_tags("c" * 64) == [["e", "c" * 64]]
    assert streaming_tags("c" * 64, "t" * 64, 3) == [["e", "c" * 64], ["e", "t" * 64, "", "reply"], ["streaming", "3"]]
    assert heartbeat_tags([(AGENT.pubkey, "alice"), (OTHER.pubkey, "bob")], (USER.pubkey, "proj")) == [
        ["agent", AGENT.pubkey, "alice"], ["agent", OTHER.pubkey, "bob"], ["a", f"31933:{USER.pubkey}:proj"],
    ]
    assert heartbeat_tags([], None) == []


def test_an_event_refers_to_its_root_by_nip22_or_any_nip10_e_tag() -> None:
    """A NIP-22 E or any e tag naming the id counts; another id or a p tag does not."""
    nip22 = sign_event(AGENT, "a", tags=[["E", ROOT_ID], ["e", "cd" * 32]])
    nip10 = sign_event(AGENT, "b", kind=1, tags=[["e", "cd" * 32], ["e", ROOT_ID, "", "reply"]])
    unrelated = sign_event(AGENT, "c", tags=[["p", ROOT_ID]])
    assert refers_to_root(nip22, ROOT_ID)
    assert refers_to_root(nip10, ROOT_ID)
    assert not refers_to_root(unrelated, ROOT_ID)
    assert not refers_to_root(nip22, "ef" * 32)
