"""NIP-19 bech32 entities (npub, nsec, note, nprofile, nevent, naddr), pure Python.

TLV entries are accepted in any order (nostr-tools writes them 3, 2, 1, 0) and
bech32's 90-character limit is not enforced, as NIP-19 asks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Final

_CHARSET: Final = "qpzry9x8gf2tvdw0s3jn54khce6mua7l"
_CHARSET_INDEX: Final = {c: i for i, c in enumerate(_CHARSET)}
_GENERATOR: Final = (0x3B6A57B2, 0x26508E6D, 0x1EA119FA, 0x3D4233DD, 0x2A1462B3)

TLV_SPECIAL: Final = 0
TLV_RELAY: Final = 1
TLV_AUTHOR: Final = 2
TLV_KIND: Final = 3

NOSTR_URI_PATTERN: Final = re.compile(r"nostr:((?:note|nevent|naddr|npub|nprofile)1[02-9ac-hj-np-z]+)")
"""Matches ``nostr:`` URIs (NIP-21); group 1 is the bech32 string."""


class Nip19Error(ValueError):
    """A string is not a valid NIP-19 entity."""


def _polymod(values: list[int]) -> int:
    chk = 1
    for value in values:
        top = chk >> 25
        chk = (chk & 0x1FFFFFF) << 5 ^ value
        for i in range(5):
            chk ^= _GENERATOR[i] if ((top >> i) & 1) else 0
    return chk


def _hrp_expand(hrp: str) -> list[int]:
    return [ord(x) >> 5 for x in hrp] + [0] + [ord(x) & 31 for x in hrp]


def _convert_bits(data: list[int] | bytes, from_bits: int, to_bits: int, pad: bool) -> list[int]:
    acc = 0
    bits = 0
    out: list[int] = []
    maxv = (1 << to_bits) - 1
    for value in data:
        if value < 0 or value >> from_bits:
            raise Nip19Error("invalid data value")
        acc = (acc << from_bits) | value
        bits += from_bits
        while bits >= to_bits:
            bits -= to_bits
            out.append((acc >> bits) & maxv)
    if pad:
        if bits:
            out.append((acc << (to_bits - bits)) & maxv)
    elif bits >= from_bits or ((acc << (to_bits - bits)) & maxv):
        raise Nip19Error("invalid padding")
    return out


def bech32_encode(hrp: str, data: bytes) -> str:
    """Encode bytes as bech32 with the given human-readable part."""
    values = _convert_bits(data, 8, 5, True)
    checksum_input = _hrp_expand(hrp) + values + [0] * 6
    polymod = _polymod(checksum_input) ^ 1
    checksum = [(polymod >> 5 * (5 - i)) & 31 for i in range(6)]
    return hrp + "1" + "".join(_CHARSET[d] for d in values + checksum)


def bech32_decode(text: str) -> tuple[str, bytes]:
    """Decode a bech32 string into its human-readable part and bytes."""
    if text.lower() != text and text.upper() != text:
        raise Nip19Error("mixed case")
    text = text.lower()
    pos = text.rfind("1")
    if pos < 1 or pos + 7 > len(text):
        raise Nip19Error("missing separator or checksum")
    hrp = text[:pos]
    try:
        values = [_CHARSET_INDEX[c] for c in text[pos + 1 :]]
    except KeyError as exc:
        raise Nip19Error(f"invalid character {exc.args[0]!r}") from None
    if _polymod(_hrp_expand(hrp) + values) != 1:
        raise Nip19Error("bad checksum")
    return hrp, bytes(_convert_bits(values[:-6], 5, 8, False))


@dataclass(frozen=True, slots=True)
class Entity:
    """A decoded NIP-19 entity.

    ``kind_name`` is the prefix (``npub``, ``nevent``...). ``value`` is the hex key or
    id (for ``naddr`` the ``d`` identifier). ``author`` and ``kind`` come from TLV
    entries when present.
    """

    kind_name: str
    value: str
    relays: tuple[str, ...] = field(default=())
    author: str | None = None
    kind: int | None = None

    @property
    def is_event_reference(self) -> bool:
        """Whether the entity points at an event (note, nevent, naddr)."""
        return self.kind_name in ("note", "nevent", "naddr")


def _parse_tlv(data: bytes) -> dict[int, list[bytes]]:
    result: dict[int, list[bytes]] = {}
    i = 0
    while i < len(data):
        if i + 2 > len(data):
            raise Nip19Error("truncated TLV entry")
        t, length = data[i], data[i + 1]
        value = data[i + 2 : i + 2 + length]
        if len(value) != length:
            raise Nip19Error("truncated TLV value")
        result.setdefault(t, []).append(value)
        i += 2 + length
    return result


def _one_32(tlv: dict[int, list[bytes]], t: int, what: str) -> str:
    values = tlv.get(t)
    if not values or len(values[0]) != 32:
        raise Nip19Error(f"{what} must be 32 bytes")
    return values[0].hex()


def decode(text: str) -> Entity:
    """Decode a NIP-19 string (with or without the ``nostr:`` prefix)."""
    text = text.removeprefix("nostr:")
    hrp, data = bech32_decode(text)
    if hrp in ("npub", "nsec", "note"):
        if len(data) != 32:
            raise Nip19Error(f"{hrp} must hold 32 bytes")
        return Entity(hrp, data.hex())
    if hrp not in ("nprofile", "nevent", "naddr"):
        raise Nip19Error(f"unknown prefix {hrp!r}")
    tlv = _parse_tlv(data)
    try:
        relays = tuple(v.decode("utf-8") for v in tlv.get(TLV_RELAY, []))
    except UnicodeDecodeError:
        raise Nip19Error("relay is not UTF-8") from None
    author_values = tlv.get(TLV_AUTHOR)
    author: str | None = None
    if author_values:
        if len(author_values[0]) != 32:
            raise Nip19Error("author must be 32 bytes")
        author = author_values[0].hex()
    kind_values = tlv.get(TLV_KIND)
    kind: int | None = None
    if kind_values:
        if len(kind_values[0]) != 4:
            raise Nip19Error("kind must be 4 bytes")
        kind = int.from_bytes(kind_values[0], "big")
    if hrp == "nprofile":
        return Entity(hrp, _one_32(tlv, TLV_SPECIAL, "pubkey"), relays)
    if hrp == "nevent":
        return Entity(hrp, _one_32(tlv, TLV_SPECIAL, "event id"), relays, author, kind)
    special = tlv.get(TLV_SPECIAL)
    if special is None:
        raise Nip19Error("naddr needs a d identifier")
    if author is None or kind is None:
        raise Nip19Error("naddr needs an author and a kind")
    try:
        identifier = special[0].decode("utf-8")
    except UnicodeDecodeError:
        raise Nip19Error("d identifier is not UTF-8") from None
    return Entity(hrp, identifier, relays, author, kind)


def _tlv(t: int, value: bytes) -> bytes:
    if len(value) > 255:
        raise Nip19Error("TLV value longer than 255 bytes")
    return bytes([t, len(value)]) + value


def encode_npub(pubkey_hex: str) -> str:
    """Encode a hex public key as npub."""
    return bech32_encode("npub", bytes.fromhex(pubkey_hex))


def encode_nsec(secret_hex: str) -> str:
    """Encode a hex secret key as nsec."""
    return bech32_encode("nsec", bytes.fromhex(secret_hex))


def encode_note(event_id_hex: str) -> str:
    """Encode an event id as note."""
    return bech32_encode("note", bytes.fromhex(event_id_hex))


def encode_nprofile(pubkey_hex: str, relays: tuple[str, ...] = ()) -> str:
    """Encode a public key and relay hints as nprofile."""
    data = _tlv(TLV_SPECIAL, bytes.fromhex(pubkey_hex))
    data += b"".join(_tlv(TLV_RELAY, r.encode()) for r in relays)
    return bech32_encode("nprofile", data)


def encode_nevent(
    event_id_hex: str,
    relays: tuple[str, ...] = (),
    author: str | None = None,
    kind: int | None = None,
) -> str:
    """Encode an event id with optional relay hints, author and kind as nevent."""
    data = _tlv(TLV_SPECIAL, bytes.fromhex(event_id_hex))
    data += b"".join(_tlv(TLV_RELAY, r.encode()) for r in relays)
    if author is not None:
        data += _tlv(TLV_AUTHOR, bytes.fromhex(author))
    if kind is not None:
        data += _tlv(TLV_KIND, kind.to_bytes(4, "big"))
    return bech32_encode("nevent", data)


def encode_naddr(identifier: str, author: str, kind: int, relays: tuple[str, ...] = ()) -> str:
    """Encode an addressable event's coordinates as naddr."""
    data = _tlv(TLV_SPECIAL, identifier.encode())
    data += b"".join(_tlv(TLV_RELAY, r.encode()) for r in relays)
    data += _tlv(TLV_AUTHOR, bytes.fromhex(author)) + _tlv(TLV_KIND, kind.to_bytes(4, "big"))
    return bech32_encode("naddr", data)
