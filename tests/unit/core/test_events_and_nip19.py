"""NostrEvent shape validation, canonical ids, and NIP-19 encoding/decoding."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from pynostr.event import Event as PynostrEvent

from tenex_daemon import NostrEvent
from tenex_daemon.core import nip19
from tenex_daemon.core.events import compute_event_id
from tenex_daemon.testing import KeyPair, sign_event

PUBKEY = "a" * 64


def good_dict() -> dict[str, object]:
    """A well-formed event as a dict."""
    event = sign_event(KeyPair.from_seed(7), "hello", kind=1, tags=[["p", PUBKEY]], created_at=1)
    return event.to_dict()


def test_model_validate_accepts_a_nip01_dict() -> None:
    """A NIP-01 JSON object validates and round-trips through to_dict."""
    data = good_dict()
    event = NostrEvent.model_validate(data)
    assert event.to_dict() == data
    assert event.has_valid_id()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("id", "xyz"),
        ("id", "A" * 64),
        ("pubkey", "a" * 63),
        ("sig", "0" * 127),
        ("kind", -1),
        ("kind", 70000),
        ("kind", "1"),
        ("created_at", -5),
        ("created_at", 1.5),
        ("tags", [["p", 1]]),
        ("tags", "p"),
        ("content", None),
    ],
)
def test_shape_errors_are_rejected(field: str, value: object) -> None:
    """Wrong hex lengths, out-of-range ints, non-string tags and wrong types fail validation."""
    data = {**good_dict(), field: value}
    with pytest.raises(ValidationError):
        NostrEvent.model_validate(data)


@settings(deadline=None)  # a loaded machine's pause is no failure
@given(st.text(), st.lists(st.lists(st.text(), min_size=1, max_size=3), max_size=4), st.integers(0, 2**31))
def test_id_matches_pynostr(content: str, tags: list[list[str]], created_at: int) -> None:
    """Our NIP-01 id equals pynostr's for any content (unicode, control characters, U+2028) and tags."""
    theirs = PynostrEvent(content=content, pubkey=PUBKEY, created_at=created_at, kind=1, tags=tags)
    theirs.compute_id()
    assert compute_event_id(PUBKEY, created_at, 1, tags, content) == theirs.id


def test_id_of_known_vector() -> None:
    """The serialization escapes exactly what NIP-01 says (newline, quote, backslash) and keeps U+2028."""
    content = 'a\n"b"\\c\u2028🚀'
    expected_serial = '[0,"' + PUBKEY + '",1,1,[],"a\\n\\"b\\"\\\\c\u2028🚀"]'
    import hashlib

    assert compute_event_id(PUBKEY, 1, 1, [], content) == hashlib.sha256(expected_serial.encode()).hexdigest()


def test_tag_helpers() -> None:
    """tag_value, tag_values and has_tag read tags by name."""
    event = NostrEvent.model_validate(
        {**good_dict(), "tags": [["p", "x"], ["p", "y"], ["tool", "complete"], ["e"]]}
    )
    assert event.tag_value("p") == "x"
    assert event.tag_values("p") == ["x", "y"]
    assert event.has_tag("tool", "complete")
    assert not event.has_tag("tool", "other")
    assert event.tag_value("e") is None


KNOWN_NPUB = "npub10elfcs4fr0l0r8af98jlmgdh9c8tcxjvz9qkw038js35mp4dma8qzvjptg"
KNOWN_HEX = "7e7e9c42a91bfef19fa929e5fda1b72e0ebc1a4c1141673e2794234d86addf4e"


def test_npub_known_vector() -> None:
    """The NIP-19 spec's npub example decodes to its hex key and back."""
    entity = nip19.decode(KNOWN_NPUB)
    assert (entity.kind_name, entity.value) == ("npub", KNOWN_HEX)
    assert nip19.encode_npub(KNOWN_HEX) == KNOWN_NPUB


@settings(deadline=None)
@given(
    st.binary(min_size=32, max_size=32),
    st.lists(st.text(max_size=30), max_size=3),
    st.integers(0, 2**32 - 1),
    st.text(max_size=60),
)
def test_tlv_round_trips(raw: bytes, relays: list[str], kind: int, identifier: str) -> None:
    """nevent, nprofile and naddr decode to what was encoded."""
    hex_value = raw.hex()
    relays_t = tuple(r for r in relays if len(r.encode()) <= 255)
    nevent = nip19.decode(nip19.encode_nevent(hex_value, relays_t, hex_value, kind))
    assert (nevent.value, nevent.relays, nevent.author, nevent.kind) == (hex_value, relays_t, hex_value, kind)
    assert nip19.decode(nip19.encode_nprofile(hex_value, relays_t)).value == hex_value
    if len(identifier.encode()) <= 255:
        naddr = nip19.decode("nostr:" + nip19.encode_naddr(identifier, hex_value, kind, relays_t))
        assert (naddr.value, naddr.author, naddr.kind) == (identifier, hex_value, kind)


def test_tlv_in_any_order_is_accepted() -> None:
    """An nevent with TLV entries written 3, 2, 1, 0 (as nostr-tools does) decodes."""
    event_id, author = "11" * 32, "22" * 32
    data = (
        bytes([3, 4])
        + (1).to_bytes(4, "big")
        + bytes([2, 32])
        + bytes.fromhex(author)
        + bytes([1, 5])
        + b"wss:x"
        + bytes([0, 32])
        + bytes.fromhex(event_id)
    )
    entity = nip19.decode(nip19.bech32_encode("nevent", data))
    assert (entity.value, entity.author, entity.kind, entity.relays) == (event_id, author, 1, ("wss:x",))


@pytest.mark.parametrize(
    "text",
    [
        "npub1",
        "nope1qqqqqqqq",
        KNOWN_NPUB[:-1] + "q",
        KNOWN_NPUB.upper()[:10] + KNOWN_NPUB[10:],
        "note1" + "q" * 10,
    ],
)
def test_invalid_nip19_is_rejected(text: str) -> None:
    """Bad checksums, unknown prefixes, mixed case and wrong lengths raise Nip19Error."""
    with pytest.raises(nip19.Nip19Error):
        nip19.decode(text)


def test_long_strings_beyond_90_chars_decode() -> None:
    """bech32's 90-character limit is not enforced (naddr strings are long)."""
    text = nip19.encode_naddr("x" * 200, "33" * 32, 30023, ("wss://relay.example.com",))
    assert len(text) > 90
    assert nip19.decode(text).value == "x" * 200
