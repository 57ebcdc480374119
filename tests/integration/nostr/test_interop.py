"""Interop with nostr-tools (Node): signatures and NIP-19 strings made by each side are read by the other."""

from __future__ import annotations

import pytest

from tenex_daemon.adapters.nostr.codec import validate_event_dict, verify_event
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.core import nip19
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.testing import KeyPair

from .harness import NodeTool

pytestmark = [pytest.mark.integration]

CONTENTS = [
    "plain ascii",
    "unicode: ünïcødé, 日本語, Ελληνικά",
    "emoji: 👩‍💻🚀✨ and a flag 🇳🇱",
    "line separators: a\u2028b\u2029c",
    "escapes: quote \" backslash \\ newline \n tab \t cr \r control \x01 del \x7f",
    "x" * 100_000,
    "🎉" * 25_000,
]
TAGS = [["p", "a" * 64], ["title", "Tïtle 🚀\u2028"], ["t", ""]]


async def test_events_signed_by_tenexd_verify_in_nostr_tools(node: NodeTool) -> None:
    """nostr-tools verifies tenexd's signatures and recomputes the same ids, for awkward content."""
    signer = Signer.generate()
    events = [signer.sign(1111, content, TAGS) for content in CONTENTS]
    result = await node.call({"op": "verify", "events": [e.to_dict() for e in events]})
    assert result["valid"] == [True] * len(events)
    assert result["ids_match"] == [True] * len(events)


async def test_events_signed_by_nostr_tools_verify_in_tenexd(node: NodeTool) -> None:
    """tenexd's validator accepts nostr-tools' events (id and signature) for awkward content."""
    keys = KeyPair.generate()
    templates = [{"kind": 11, "content": c, "tags": TAGS, "created_at": 1_700_000_000 + i}
                 for i, c in enumerate(CONTENTS)]
    result = await node.call({"op": "sign", "secret": keys.secret, "templates": templates})
    for raw, template in zip(result["events"], templates, strict=True):
        event = validate_event_dict(raw)
        assert event.pubkey == keys.pubkey
        assert event.content == template["content"]
        assert verify_event(event)


async def test_tampered_nostr_tools_event_is_refused(node: NodeTool) -> None:
    """A nostr-tools event whose content was changed after signing fails tenexd's checks."""
    keys = KeyPair.generate()
    result = await node.call({"op": "sign", "secret": keys.secret,
                              "templates": [{"kind": 1, "content": "original", "tags": []}]})
    raw = dict(result["events"][0])
    raw["content"] = "tampered"
    assert not verify_event(NostrEvent.model_validate(raw))


async def test_nip19_made_by_nostr_tools_decodes_in_tenexd(node: NodeTool) -> None:
    """npub, nsec, note, nprofile, nevent and naddr from nostr-tools decode to the same values here."""
    keys = KeyPair.generate()
    event_id = "c0" * 32
    relays = ["wss://relay.example.com", "ws://127.0.0.1:7777"]
    items = [
        {"type": "npub", "hex": keys.pubkey},
        {"type": "nsec", "hex": keys.secret},
        {"type": "note", "hex": event_id},
        {"type": "nprofile", "hex": keys.pubkey, "relays": relays},
        {"type": "nevent", "hex": event_id, "relays": relays, "author": keys.pubkey, "kind": 1111},
        {"type": "naddr", "identifier": "my-project ✨", "author": keys.pubkey, "kind": 31933, "relays": relays},
    ]
    encoded = (await node.call({"op": "encode", "items": items}))["encoded"]
    decoded = [nip19.decode(text) for text in encoded]
    assert [d.kind_name for d in decoded] == ["npub", "nsec", "note", "nprofile", "nevent", "naddr"]
    assert [d.value for d in decoded] == [keys.pubkey, keys.secret, event_id, keys.pubkey, event_id,
                                          "my-project ✨"]
    assert decoded[3].relays == tuple(relays)
    assert (decoded[4].relays, decoded[4].author, decoded[4].kind) == (tuple(relays), keys.pubkey, 1111)
    assert (decoded[5].relays, decoded[5].author, decoded[5].kind) == (tuple(relays), keys.pubkey, 31933)
    assert nip19.decode("nostr:" + encoded[4]).value == event_id


async def test_nip19_made_by_tenexd_decodes_in_nostr_tools(node: NodeTool) -> None:
    """Every NIP-19 string tenexd writes decodes in nostr-tools to the same values."""
    keys = KeyPair.generate()
    event_id = "d1" * 32
    relays = ("wss://relay.example.com",)
    texts = [
        nip19.encode_npub(keys.pubkey),
        nip19.encode_nsec(keys.secret),
        nip19.encode_note(event_id),
        nip19.encode_nprofile(keys.pubkey, relays),
        nip19.encode_nevent(event_id, relays, keys.pubkey, 11),
        nip19.encode_naddr("launch-plan", keys.pubkey, 30023, relays),
    ]
    decoded = (await node.call({"op": "decode", "items": texts}))["decoded"]
    assert decoded[0] == {"type": "npub", "data": keys.pubkey}
    assert decoded[1] == {"type": "nsec", "data": keys.secret}
    assert decoded[2] == {"type": "note", "data": event_id}
    assert decoded[3] == {"type": "nprofile", "data": {"pubkey": keys.pubkey, "relays": list(relays)}}
    assert decoded[4] == {"type": "nevent", "data": {"id": event_id, "relays": list(relays),
                                                     "author": keys.pubkey, "kind": 11}}
    assert decoded[5] == {"type": "naddr", "data": {"identifier": "launch-plan", "pubkey": keys.pubkey,
                                                    "kind": 30023, "relays": list(relays)}}
