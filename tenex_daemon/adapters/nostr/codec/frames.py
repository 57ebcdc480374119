"""NIP-01 relay frames: what a relay sends parsed into typed messages, what tenexd sends encoded.

Incoming events are validated here (shape, sizes, id, signature); nothing here does I/O:
the relay pool feeds frames in and acts on the typed messages that come out. Every frame
that cannot be used becomes a :class:`Rejection` carrying a :class:`RejectReason`; no
exception escapes :func:`parse_relay_frame`.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final, Literal, TypeAlias

import orjson
import pydantic_core
from coincurve import PublicKeyXOnly
from pydantic import TypeAdapter, ValidationError

from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.ids import is_hex

DEFAULT_MAX_CONTENT_BYTES: Final = 256 * 1024
DEFAULT_MAX_FRAME_CHARS: Final = 1024 * 1024
DEFAULT_MAX_TAGS: Final = 2000
DEFAULT_MAX_SUBSCRIPTION_ID: Final = 64
MAX_FUTURE_S: Final = 86_400
"""An event may be dated at most this far (one day) past now: later is refused (docs/PROTOCOL.md)."""

_ID_ENCODER: Final = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
"""The reference NIP-01 serializer (``core.events.serialize_for_id``), kept as the fallback."""


class RejectReason(StrEnum):
    """Why a frame or an event was refused. Counted per relay and logged."""

    INVALID_JSON = "invalid_json"
    NOT_AN_ARRAY = "not_an_array"
    UNKNOWN_TYPE = "unknown_type"
    WRONG_ARITY = "wrong_arity"
    BAD_FIELD = "bad_field"
    OVERSIZED_FRAME = "oversized_frame"
    OVERSIZED = "oversized"
    TOO_MANY_TAGS = "too_many_tags"
    BAD_SHAPE = "bad_shape"
    BAD_ENCODING = "bad_encoding"
    BAD_ID = "bad_id"
    BAD_PUBKEY = "bad_pubkey"
    BAD_SIGNATURE = "bad_signature"
    BAD_CREATED_AT = "bad_created_at"
    UNKNOWN_SUBSCRIPTION = "unknown_subscription"


@dataclass(frozen=True, slots=True)
class Limits:
    """Size limits applied to every incoming frame and event."""

    max_frame_chars: int = DEFAULT_MAX_FRAME_CHARS
    max_content_bytes: int = DEFAULT_MAX_CONTENT_BYTES
    max_tags: int = DEFAULT_MAX_TAGS


DEFAULT_LIMITS: Final = Limits()
_NO_SIZE_LIMITS: Final = Limits(max_frame_chars=2**62, max_content_bytes=2**62, max_tags=2**62)


@dataclass(slots=True)  # not frozen: built once per received event, and frozen init costs 0.6 µs more
class EventMessage:
    """``["EVENT", <subscription id>, <event>]`` with a validated event."""

    subscription_id: str
    event: NostrEvent


@dataclass(slots=True)  # not frozen, as EventMessage
class KnownEventMessage:
    """An ``EVENT`` whose id matches its fields and is in the caller's ``known`` set.

    Its signature was not checked: the id is the hash of every signed field, so this
    is the same event the caller already verified, and it is only ever dropped as a
    duplicate (or verified with :func:`verify_event` if it must be used). With
    several relays, this saves the signature check on every copy after the first.
    """

    subscription_id: str
    event: NostrEvent


@dataclass(frozen=True, slots=True)
class EoseMessage:
    """``["EOSE", <subscription id>]``: stored events end, live ones follow."""

    subscription_id: str


@dataclass(frozen=True, slots=True)
class OkMessage:
    """``["OK", <event id>, <accepted>, <message>]``.

    ``event_id`` may be empty: nostr-relay answers some rejections that way.
    """

    event_id: str
    accepted: bool
    message: str

    @property
    def prefix(self) -> str:
        """The machine-readable prefix of the message (``duplicate``, ``auth-required``...)."""
        return _prefix(self.message)

    @property
    def is_success(self) -> bool:
        """Whether the relay has the event (accepted, or a ``duplicate:`` answer either way)."""
        return self.accepted or self.prefix == "duplicate"


@dataclass(frozen=True, slots=True)
class NoticeMessage:
    """``["NOTICE", <message>]``: human-readable text from the relay."""

    message: str


@dataclass(frozen=True, slots=True)
class ClosedMessage:
    """``["CLOSED", <subscription id>, <message>]``: the relay ended a subscription."""

    subscription_id: str
    message: str

    @property
    def prefix(self) -> str:
        """The machine-readable prefix of the message (``auth-required``...)."""
        return _prefix(self.message)


@dataclass(frozen=True, slots=True)
class AuthMessage:
    """``["AUTH", <challenge>]``: the relay asks for NIP-42 authentication."""

    challenge: str


@dataclass(frozen=True, slots=True)
class Rejection:
    """A frame that was refused, with its reason.

    ``subscription_id``, ``event_id`` and ``created_at`` are filled when the frame got far enough to
    name them (an ``EVENT`` whose event failed validation): a catch-up pages past refused events by
    their dates as by any other.
    """

    reason: RejectReason
    detail: str
    subscription_id: str | None = None
    event_id: str | None = None
    created_at: int | None = None


RelayMessage: TypeAlias = (
    EventMessage | KnownEventMessage | EoseMessage | OkMessage | NoticeMessage | ClosedMessage | AuthMessage
)


class EventRejectedError(Exception):
    """Raised by :func:`validate_event_dict` for an event that must not be used."""

    def __init__(self, reason: RejectReason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


def _prefix(message: str) -> str:
    head, sep, _ = message.partition(":")
    return head.strip() if sep else ""


class PublicKeyCache:
    """An LRU of parsed x-only public keys: parsing a key costs as much as half a verify."""

    def __init__(self, maxsize: int = 4096) -> None:
        self._maxsize = maxsize
        self._keys: OrderedDict[str, PublicKeyXOnly] = OrderedDict()

    def get(self, pubkey_hex: str) -> PublicKeyXOnly:
        """Return the key object for a 64-hex public key; raise ValueError if off the curve."""
        key = self._keys.get(pubkey_hex)
        if key is not None:
            self._keys.move_to_end(pubkey_hex)
            return key
        key = PublicKeyXOnly(bytes.fromhex(pubkey_hex))
        self._keys[pubkey_hex] = key
        if len(self._keys) > self._maxsize:
            self._keys.popitem(last=False)
        return key

    def __len__(self) -> int:
        return len(self._keys)


_DEFAULT_KEY_CACHE: Final = PublicKeyCache()


def event_id_digest(pubkey: str, created_at: int, kind: int, tags: list[list[str]], content: str) -> bytes:
    """Return the 32-byte NIP-01 id of these fields (same bytes as :func:`core.events.compute_event_id`).

    orjson writes exactly what ``json.dumps(..., ensure_ascii=False, separators=(",", ":"))``
    writes (escapes for quote, backslash and control characters only; U+2028 and all other
    characters as UTF-8; a property test holds it to that) about ten times faster (0.6 µs
    against pydantic-core's 2.0 µs for a typical reply's fields). Raises
    ``UnicodeEncodeError`` when a string holds a lone surrogate.
    """
    fields = [0, pubkey, created_at, kind, tags, content]
    try:
        serialized = orjson.dumps(fields)
    except orjson.JSONEncodeError:
        serialized = _ID_ENCODER(fields).encode("utf-8")  # raises UnicodeEncodeError on surrogates
    return hashlib.sha256(serialized).digest()


def _check_sizes(content: object, tags: object, limits: Limits) -> None:
    if isinstance(content, str) and len(content) > limits.max_content_bytes // 4:
        size = len(content.encode("utf-8", "surrogatepass"))
        if size > limits.max_content_bytes:
            raise EventRejectedError(
                RejectReason.OVERSIZED, f"content is {size} bytes (limit {limits.max_content_bytes})"
            )
    if isinstance(tags, list) and len(tags) > limits.max_tags:
        raise EventRejectedError(RejectReason.TOO_MANY_TAGS, f"{len(tags)} tags (limit {limits.max_tags})")


def _created_at_problem(created_at: int) -> str | None:
    """Why ``created_at`` is refused (more than a day past now), None when it is fine."""
    if created_at > time.time() + MAX_FUTURE_S:
        return f"created_at {created_at} is more than {MAX_FUTURE_S} s in the future"
    return None


def _check_id_and_signature(event: NostrEvent, key_cache: PublicKeyCache | None) -> None:
    try:
        digest = event_id_digest(event.pubkey, event.created_at, event.kind, event.tags, event.content)
    except UnicodeEncodeError:
        raise EventRejectedError(RejectReason.BAD_ENCODING, "a string is not valid UTF-8") from None
    if digest.hex() != event.id:
        raise EventRejectedError(RejectReason.BAD_ID, f"id {event.id} does not match the event's hash")
    cache = _DEFAULT_KEY_CACHE if key_cache is None else key_cache
    try:
        key = cache.get(event.pubkey)
    except ValueError:
        raise EventRejectedError(
            RejectReason.BAD_PUBKEY, f"pubkey {event.pubkey} is not on the curve"
        ) from None
    try:
        valid = key.verify(bytes.fromhex(event.sig), digest)
    except ValueError:
        valid = False
    if not valid:
        raise EventRejectedError(RejectReason.BAD_SIGNATURE, f"signature of {event.id} does not verify")


def validate_event_dict(
    data: object, *, limits: Limits = DEFAULT_LIMITS, key_cache: PublicKeyCache | None = None
) -> NostrEvent:
    """Return a fully checked event (shape, sizes, id, signature) or raise :class:`EventRejectedError`.

    Sizes are checked before anything costly; the id is recomputed here (never
    trusted), and the signature is verified with a cached key object.
    """
    if not isinstance(data, dict):
        raise EventRejectedError(RejectReason.BAD_SHAPE, "event is not an object")
    _check_sizes(data.get("content"), data.get("tags"), limits)
    try:
        event = NostrEvent.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "event"
        raise EventRejectedError(RejectReason.BAD_SHAPE, f"{where}: {first['msg']}") from None
    _check_id_and_signature(event, key_cache)
    problem = _created_at_problem(event.created_at)
    if problem is not None:
        raise EventRejectedError(RejectReason.BAD_CREATED_AT, problem)
    return event


_EVENT_FRAME: Final = TypeAdapter(tuple[Literal["EVENT"], str, NostrEvent]).validator
"""A well-formed ``["EVENT", sub, event]`` frame parsed and shape-checked in one pass (pydantic-core)."""
_EVENT_PREFIXES: Final = frozenset({'["EVENT"', b'["EVENT"'})


def _fast_event_frame(
    text: str | bytes, limits: Limits, key_cache: PublicKeyCache | None, known: Container[str] | None
) -> EventMessage | KnownEventMessage | Rejection | None:
    """The common case, flat and in one parsing pass; None sends anything unusual to the detailed path.

    Same checks as :func:`validate_event_dict`, in the same order of outcome; written
    out inline because this runs once per received event (see benchmarks/bench_transport.py).
    """
    try:
        _, sub_id, event = _EVENT_FRAME.validate_json(text)
    except ValidationError:
        return None
    content = event.content
    tags = event.tags
    if len(content) > limits.max_content_bytes // 4 or len(tags) > limits.max_tags:
        try:
            _check_sizes(content, tags, limits)
        except EventRejectedError as exc:
            return Rejection(exc.reason, exc.detail, sub_id, event.id, event.created_at)
    pubkey = event.pubkey
    try:
        serialized = orjson.dumps([0, pubkey, event.created_at, event.kind, tags, content])
    except orjson.JSONEncodeError:
        return None
    digest = hashlib.sha256(serialized).digest()
    if digest.hex() != event.id:
        detail = f"id {event.id} does not match the event's hash"
        return Rejection(RejectReason.BAD_ID, detail, sub_id, event.id, event.created_at)
    if known is not None and event.id in known:
        return KnownEventMessage(sub_id, event)
    cache = _DEFAULT_KEY_CACHE if key_cache is None else key_cache
    try:
        key = cache.get(pubkey)
    except ValueError:
        detail = f"pubkey {pubkey} is not on the curve"
        return Rejection(RejectReason.BAD_PUBKEY, detail, sub_id, event.id, event.created_at)
    try:
        valid = key.verify(bytes.fromhex(event.sig), digest)
    except ValueError:
        valid = False
    if not valid:
        detail = f"signature of {event.id} does not verify"
        return Rejection(RejectReason.BAD_SIGNATURE, detail, sub_id, event.id, event.created_at)
    problem = _created_at_problem(event.created_at)
    if problem is not None:
        return Rejection(RejectReason.BAD_CREATED_AT, problem, sub_id, event.id, event.created_at)
    return EventMessage(sub_id, event)


def verify_event(event: NostrEvent, *, key_cache: PublicKeyCache | None = None) -> bool:
    """Return whether an already-shaped event's id matches its fields and its signature verifies."""
    try:
        validate_event_dict(event.to_dict(), limits=_NO_SIZE_LIMITS, key_cache=key_cache)
    except EventRejectedError:
        return False
    return True


def parse_relay_frame(
    text: str | bytes,
    *,
    limits: Limits = DEFAULT_LIMITS,
    key_cache: PublicKeyCache | None = None,
    known: Container[str] | None = None,
) -> RelayMessage | Rejection:
    """Parse one frame a relay sent; return a typed message or a :class:`Rejection`.

    Never raises: every malformed input maps to a reason code. ``known`` holds ids of
    events the caller has already verified: a copy of one comes back as a
    :class:`KnownEventMessage` without a second signature check.
    """
    if text[:8] in _EVENT_PREFIXES and len(text) <= limits.max_frame_chars:
        fast = _fast_event_frame(text, limits, key_cache, known)
        if fast is not None:
            return fast
    try:
        return _parse(text, limits, key_cache)
    except RecursionError:
        return Rejection(RejectReason.INVALID_JSON, "nesting too deep")

def _parse(text: str | bytes, limits: Limits, key_cache: PublicKeyCache | None) -> RelayMessage | Rejection:
    if len(text) > limits.max_frame_chars:
        return Rejection(
            RejectReason.OVERSIZED_FRAME, f"frame is {len(text)} long (limit {limits.max_frame_chars})"
        )
    try:
        # pydantic-core's JSON parser: same values as json.loads, twice as fast; it refuses
        # escaped lone surrogates (not UTF-8) and nesting past its recursion limit.
        message: Any = pydantic_core.from_json(text)
    except ValueError as exc:
        return Rejection(RejectReason.INVALID_JSON, str(exc)[:200])
    except TypeError:  # pydantic-core's answer to a str holding a lone surrogate: no UTF-8, so no JSON
        return Rejection(RejectReason.BAD_ENCODING, "frame is not valid UTF-8 text")
    if not isinstance(message, list) or not message:
        return Rejection(RejectReason.NOT_AN_ARRAY, "frame is not a non-empty JSON array")
    kind = message[0]
    parser = _PARSERS.get(kind) if isinstance(kind, str) else None
    if parser is None:
        shown = kind[:20] if isinstance(kind, str) else type(kind).__name__
        return Rejection(RejectReason.UNKNOWN_TYPE, f"unknown message type {shown!r}")
    return parser(message, limits, key_cache)


def _wrong_arity(message: list[Any], expected: int) -> Rejection:
    detail = f"{message[0]} has {len(message)} elements, expected {expected}"
    return Rejection(RejectReason.WRONG_ARITY, detail)


def _parse_event(
    message: list[Any], limits: Limits, key_cache: PublicKeyCache | None
) -> EventMessage | Rejection:
    if len(message) != 3:
        return _wrong_arity(message, 3)
    sub_id = message[1]
    if not isinstance(sub_id, str):
        return Rejection(RejectReason.BAD_FIELD, "subscription id is not a string")
    raw = message[2]
    try:
        event = validate_event_dict(raw, limits=limits, key_cache=key_cache)
    except EventRejectedError as exc:
        raw_id = raw.get("id") if isinstance(raw, dict) else None
        raw_at = raw.get("created_at") if isinstance(raw, dict) else None
        created_at = raw_at if type(raw_at) is int else None
        return Rejection(exc.reason, exc.detail, sub_id, raw_id if is_hex(raw_id, 64) else None, created_at)
    return EventMessage(sub_id, event)


def _parse_ok(message: list[Any], _limits: Limits, _keys: PublicKeyCache | None) -> OkMessage | Rejection:
    if len(message) != 4:
        return _wrong_arity(message, 4)
    event_id, accepted, text_message = message[1], message[2], message[3]
    if not isinstance(event_id, str) or not (event_id == "" or is_hex(event_id, 64)):
        return Rejection(RejectReason.BAD_FIELD, "OK event id is not 64 hex characters")
    if not isinstance(accepted, bool) or not isinstance(text_message, str):
        return Rejection(RejectReason.BAD_FIELD, "OK needs a boolean and a message")
    return OkMessage(event_id, accepted, text_message)


def _parse_eose(message: list[Any], _limits: Limits, _keys: PublicKeyCache | None) -> EoseMessage | Rejection:
    if len(message) != 2:
        return _wrong_arity(message, 2)
    if not isinstance(message[1], str):
        return Rejection(RejectReason.BAD_FIELD, "subscription id is not a string")
    return EoseMessage(message[1])


def _parse_closed(
    message: list[Any], _limits: Limits, _keys: PublicKeyCache | None
) -> ClosedMessage | Rejection:
    if len(message) not in (2, 3):
        return _wrong_arity(message, 3)
    reason_text = message[2] if len(message) == 3 else ""
    if not isinstance(message[1], str) or not isinstance(reason_text, str):
        return Rejection(RejectReason.BAD_FIELD, "CLOSED fields must be strings")
    return ClosedMessage(message[1], reason_text)


def _parse_notice(
    message: list[Any], _limits: Limits, _keys: PublicKeyCache | None
) -> NoticeMessage | Rejection:
    if len(message) != 2:
        return _wrong_arity(message, 2)
    if not isinstance(message[1], str):
        return Rejection(RejectReason.BAD_FIELD, "NOTICE message is not a string")
    return NoticeMessage(message[1])


def _parse_auth(message: list[Any], _limits: Limits, _keys: PublicKeyCache | None) -> AuthMessage | Rejection:
    if len(message) != 2:
        return _wrong_arity(message, 2)
    if not isinstance(message[1], str):
        return Rejection(RejectReason.BAD_FIELD, "AUTH challenge is not a string")
    return AuthMessage(message[1])


_PARSERS: Final[dict[str, Callable[[list[Any], Limits, PublicKeyCache | None], RelayMessage | Rejection]]] = {
    "EVENT": _parse_event,
    "OK": _parse_ok,
    "EOSE": _parse_eose,
    "CLOSED": _parse_closed,
    "NOTICE": _parse_notice,
    "AUTH": _parse_auth,
}
"""One parser per message type a relay sends (NIP-01, NIP-42)."""


# --- frames we send -------------------------------------------------------------------------


def encode_req(subscription_id: str, filters: Sequence[dict[str, Any]]) -> str:
    """Return ``["REQ", id, filter...]`` as JSON text."""
    return json.dumps(["REQ", subscription_id, *filters], ensure_ascii=False, separators=(",", ":"))


def encode_close(subscription_id: str) -> str:
    """Return ``["CLOSE", id]`` as JSON text."""
    return json.dumps(["CLOSE", subscription_id])


def encode_event(event: NostrEvent) -> str:
    """Return ``["EVENT", event]`` as JSON text (orjson: the same text as ``json.dumps`` without
    spaces and ``ensure_ascii``, see :func:`event_id_digest`; json writes what orjson refuses)."""
    frame = ["EVENT", event.to_dict()]
    try:
        return orjson.dumps(frame).decode()
    except orjson.JSONEncodeError:
        return json.dumps(frame, ensure_ascii=False, separators=(",", ":"))


def encode_auth(event: NostrEvent) -> str:
    """Return ``["AUTH", event]`` as JSON text."""
    return json.dumps(["AUTH", event.to_dict()], ensure_ascii=False, separators=(",", ":"))

