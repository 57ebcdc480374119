"""The Nostr wire codec: relay frames in, validated events out, reply tags built.

This is the only module that knows NIP-01 message shapes and the tag shapes of
threading (NIP-10, NIP-22); kind numbers and tag names come from
:mod:`tenex_daemon.core.vocabulary`. Nothing here does I/O: the relay pool feeds
frames in and acts on the typed messages that come out.

Every frame that cannot be used becomes a :class:`Rejection` carrying a
:class:`RejectReason`; no exception escapes :func:`parse_relay_frame`.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final, Literal, TypeAlias

import orjson
import pydantic_core
from coincurve import PublicKeyXOnly
from pydantic import TypeAdapter, ValidationError

from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.vocabulary import (
    ERROR_SYSTEM,
    KIND_PROJECT,
    KIND_RELAY_AUTH,
    TAG_ADDRESS,
    TAG_CHALLENGE,
    TAG_DELEGATION,
    TAG_ERROR,
    TAG_EVENT,
    TAG_LLM_COMPLETION_TOKENS,
    TAG_LLM_MODEL,
    TAG_LLM_PROMPT_TOKENS,
    TAG_NET_TIME,
    TAG_PARENT_KIND,
    TAG_PHASE,
    TAG_PUBKEY,
    TAG_RELAY,
    TAG_ROOT_AUTHOR,
    TAG_ROOT_EVENT,
    TAG_ROOT_KIND,
    TAG_SESSION,
    TAG_TOOL,
    TOOL_COMPLETE,
)

DEFAULT_MAX_CONTENT_BYTES: Final = 256 * 1024
DEFAULT_MAX_FRAME_CHARS: Final = 1024 * 1024
DEFAULT_MAX_TAGS: Final = 2000
DEFAULT_MAX_SUBSCRIPTION_ID: Final = 64

_HEX: Final = frozenset("0123456789abcdef")
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

    ``subscription_id`` and ``event_id`` are filled when the frame got far enough to
    name them (an ``EVENT`` whose event failed validation).
    """

    reason: RejectReason
    detail: str
    subscription_id: str | None = None
    event_id: str | None = None


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


def _is_hex(value: object, length: int) -> bool:
    return isinstance(value, str) and len(value) == length and _HEX.issuperset(value)


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
            return Rejection(exc.reason, exc.detail, sub_id, event.id)
    pubkey = event.pubkey
    try:
        serialized = orjson.dumps([0, pubkey, event.created_at, event.kind, tags, content])
    except orjson.JSONEncodeError:
        return None
    digest = hashlib.sha256(serialized).digest()
    if digest.hex() != event.id:
        detail = f"id {event.id} does not match the event's hash"
        return Rejection(RejectReason.BAD_ID, detail, sub_id, event.id)
    if known is not None and event.id in known:
        return KnownEventMessage(sub_id, event)
    cache = _DEFAULT_KEY_CACHE if key_cache is None else key_cache
    try:
        key = cache.get(pubkey)
    except ValueError:
        return Rejection(RejectReason.BAD_PUBKEY, f"pubkey {pubkey} is not on the curve", sub_id, event.id)
    try:
        valid = key.verify(bytes.fromhex(event.sig), digest)
    except ValueError:
        valid = False
    if not valid:
        detail = f"signature of {event.id} does not verify"
        return Rejection(RejectReason.BAD_SIGNATURE, detail, sub_id, event.id)
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
    if not isinstance(message, list) or not message:
        return Rejection(RejectReason.NOT_AN_ARRAY, "frame is not a non-empty JSON array")
    kind = message[0]
    n = len(message)
    if kind == "EVENT":
        if n != 3:
            return Rejection(RejectReason.WRONG_ARITY, f"EVENT has {n} elements, expected 3")
        sub_id = message[1]
        if not isinstance(sub_id, str):
            return Rejection(RejectReason.BAD_FIELD, "subscription id is not a string")
        raw = message[2]
        try:
            event = validate_event_dict(raw, limits=limits, key_cache=key_cache)
        except EventRejectedError as exc:
            raw_id = raw.get("id") if isinstance(raw, dict) else None
            return Rejection(
                exc.reason, exc.detail, sub_id, raw_id if _is_hex(raw_id, 64) else None
            )
        return EventMessage(sub_id, event)
    if kind == "OK":
        if n != 4:
            return Rejection(RejectReason.WRONG_ARITY, f"OK has {n} elements, expected 4")
        event_id, accepted, text_message = message[1], message[2], message[3]
        if not isinstance(event_id, str) or not (event_id == "" or _is_hex(event_id, 64)):
            return Rejection(RejectReason.BAD_FIELD, "OK event id is not 64 hex characters")
        if not isinstance(accepted, bool) or not isinstance(text_message, str):
            return Rejection(RejectReason.BAD_FIELD, "OK needs a boolean and a message")
        return OkMessage(event_id, accepted, text_message)
    if kind == "EOSE":
        if n != 2:
            return Rejection(RejectReason.WRONG_ARITY, f"EOSE has {n} elements, expected 2")
        if not isinstance(message[1], str):
            return Rejection(RejectReason.BAD_FIELD, "subscription id is not a string")
        return EoseMessage(message[1])
    if kind == "CLOSED":
        if n not in (2, 3):
            return Rejection(RejectReason.WRONG_ARITY, f"CLOSED has {n} elements, expected 3")
        reason_text = message[2] if n == 3 else ""
        if not isinstance(message[1], str) or not isinstance(reason_text, str):
            return Rejection(RejectReason.BAD_FIELD, "CLOSED fields must be strings")
        return ClosedMessage(message[1], reason_text)
    if kind == "NOTICE":
        if n != 2:
            return Rejection(RejectReason.WRONG_ARITY, f"NOTICE has {n} elements, expected 2")
        if not isinstance(message[1], str):
            return Rejection(RejectReason.BAD_FIELD, "NOTICE message is not a string")
        return NoticeMessage(message[1])
    if kind == "AUTH":
        if n != 2:
            return Rejection(RejectReason.WRONG_ARITY, f"AUTH has {n} elements, expected 2")
        if not isinstance(message[1], str):
            return Rejection(RejectReason.BAD_FIELD, "AUTH challenge is not a string")
        return AuthMessage(message[1])
    shown = kind[:20] if isinstance(kind, str) else type(kind).__name__
    return Rejection(RejectReason.UNKNOWN_TYPE, f"unknown message type {shown!r}")


# --- frames we send -------------------------------------------------------------------------


def encode_req(subscription_id: str, filters: Sequence[dict[str, Any]]) -> str:
    """Return ``["REQ", id, filter...]`` as JSON text."""
    return json.dumps(["REQ", subscription_id, *filters], ensure_ascii=False, separators=(",", ":"))


def encode_close(subscription_id: str) -> str:
    """Return ``["CLOSE", id]`` as JSON text."""
    return json.dumps(["CLOSE", subscription_id])


def encode_event(event: NostrEvent) -> str:
    """Return ``["EVENT", event]`` as JSON text."""
    return json.dumps(["EVENT", event.to_dict()], ensure_ascii=False, separators=(",", ":"))


def encode_auth(event: NostrEvent) -> str:
    """Return ``["AUTH", event]`` as JSON text."""
    return json.dumps(["AUTH", event.to_dict()], ensure_ascii=False, separators=(",", ":"))


def auth_event_template(relay_url: str, challenge: str) -> tuple[int, list[list[str]], str]:
    """Return (kind, tags, content) of the NIP-42 event that answers ``challenge``."""
    return KIND_RELAY_AUTH, [[TAG_RELAY, relay_url], [TAG_CHALLENGE, challenge]], ""


# --- threading -------------------------------------------------------------------------------


class ThreadStyle(StrEnum):
    """Which convention an event's threading tags follow."""

    NONE = "none"
    NIP22 = "nip22"
    NIP10_MARKED = "nip10-marked"
    NIP10_POSITIONAL = "nip10-positional"


@dataclass(frozen=True, slots=True)
class Threading:
    """Where an event sits in a thread.

    ``root_id`` is None for an event that is itself a root (then the conversation id
    is the event's own id: :func:`conversation_id`). ``root_kind`` is known for
    NIP-22 (``K``) only. ``parent_id`` is the event replied to.
    """

    style: ThreadStyle
    root_id: str | None = None
    root_kind: int | None = None
    root_author: str | None = None
    parent_id: str | None = None
    parent_kind: int | None = None
    parent_author: str | None = None

    @property
    def is_root(self) -> bool:
        """Whether the event starts a thread (no root reference)."""
        return self.root_id is None


def _int_or_none(value: str | None) -> int | None:
    if value is None or not value.isdigit() or len(value) > 10:
        return None
    return int(value)


def _first(tags: list[list[str]], name: str) -> list[str] | None:
    for tag in tags:
        if len(tag) > 1 and tag[0] == name:
            return tag
    return None


def _author_hint(tag: list[str] | None) -> str | None:
    if tag is not None and len(tag) > 3 and _is_hex(tag[3], 64):
        return tag[3]
    return None


def read_threading(event: NostrEvent) -> Threading:
    """Read the thread position of ``event`` from NIP-22 tags, else NIP-10 ``e`` tags.

    NIP-22: ``E``/``K``/``P`` name the root, ``e``/``k``/``p`` the parent (a reply
    straight to the root may omit ``e``). NIP-10 marked: ``e`` with ``root`` /
    ``reply`` markers (a lone ``root`` is also the parent). NIP-10 positional: the
    first ``e`` is the root and the last the parent; ``mention`` tags are skipped.
    Ids that are not 64 hex characters are ignored.
    """
    tags = event.tags
    root_tag = _first(tags, TAG_ROOT_EVENT)
    if root_tag is not None and _is_hex(root_tag[1], 64):
        root_kind_tag = _first(tags, TAG_ROOT_KIND)
        root_author_tag = _first(tags, TAG_ROOT_AUTHOR)
        parent_tag = _first(tags, TAG_EVENT)
        if parent_tag is not None and not _is_hex(parent_tag[1], 64):
            parent_tag = None
        parent_kind_tag = _first(tags, TAG_PARENT_KIND)
        parent_author_tag = _first(tags, TAG_PUBKEY)
        root_kind = _int_or_none(root_kind_tag[1]) if root_kind_tag else None
        root_author = root_author_tag[1] if root_author_tag and _is_hex(root_author_tag[1], 64) else None
        if parent_tag is None:
            return Threading(
                ThreadStyle.NIP22, root_tag[1], root_kind, root_author or _author_hint(root_tag),
                root_tag[1], root_kind, root_author or _author_hint(root_tag),
            )
        parent_author = _author_hint(parent_tag) or (
            parent_author_tag[1] if parent_author_tag and _is_hex(parent_author_tag[1], 64) else None
        )
        return Threading(
            ThreadStyle.NIP22, root_tag[1], root_kind, root_author or _author_hint(root_tag),
            parent_tag[1], _int_or_none(parent_kind_tag[1]) if parent_kind_tag else None, parent_author,
        )
    e_tags = [t for t in tags if len(t) > 1 and t[0] == TAG_EVENT and _is_hex(t[1], 64)]
    if not e_tags:
        return Threading(ThreadStyle.NONE)
    marked_root = next((t for t in e_tags if len(t) > 3 and t[3] == "root"), None)
    marked_reply = next((t for t in e_tags if len(t) > 3 and t[3] == "reply"), None)
    if marked_root is not None or marked_reply is not None:
        root: list[str] = marked_root or marked_reply  # type: ignore[assignment]  # one is set
        parent: list[str] = marked_reply or marked_root  # type: ignore[assignment]  # one is set
        return Threading(
            ThreadStyle.NIP10_MARKED, root[1], None, _nip10_author(root),
            parent[1], None, _nip10_author(parent),
        )
    positional = [t for t in e_tags if not (len(t) > 3 and t[3] == "mention")]
    if not positional:
        return Threading(ThreadStyle.NONE)
    return Threading(
        ThreadStyle.NIP10_POSITIONAL, positional[0][1], None, None, positional[-1][1], None, None
    )


def _nip10_author(tag: list[str]) -> str | None:
    # NIP-10 marked tags: ["e", id, relay, marker, pubkey]
    if len(tag) > 4 and _is_hex(tag[4], 64):
        return tag[4]
    return None


def conversation_id(event: NostrEvent) -> str:
    """Return the id of the conversation ``event`` belongs to: its root, or itself when it is one."""
    return read_threading(event).root_id or event.id


@dataclass(frozen=True, slots=True)
class ThreadRoot:
    """The conversation root a reply points at: id, kind and author."""

    id: str
    kind: int
    pubkey: str

    @classmethod
    def of(cls, event: NostrEvent) -> ThreadRoot:
        """The root fields of an event that is itself the root."""
        return cls(event.id, event.kind, event.pubkey)


def root_of(event: NostrEvent) -> ThreadRoot:
    """Return the conversation root of ``event`` as far as its tags tell.

    A root event is its own root; a NIP-22 reply names root id, kind and author;
    for NIP-10 replies the kind is unknown and taken as the reply's own kind.
    """
    threading = read_threading(event)
    if threading.root_id is None:
        return ThreadRoot.of(event)
    return ThreadRoot(
        threading.root_id,
        threading.root_kind if threading.root_kind is not None else event.kind,
        threading.root_author or "",
    )


def build_reply_tags(
    trigger: NostrEvent,
    destinations: Iterable[str],
    *,
    root: ThreadRoot | NostrEvent | None = None,
    project: tuple[str, str] | None = None,
    phase: str | None = None,
    net_time_seconds: int | None = None,
    session_id: str | None = None,
    complete: bool = False,
    llm_model: str | None = None,
    prompt_tokens: int | None = None,
    completion_tokens: int | None = None,
    error: bool = False,
    delegation: str | None = None,
    relay_hint: str = "",
) -> list[list[str]]:
    """Return the tags of an agent's kind-1111 reply to ``trigger`` (PROTOCOL.md).

    Root ``E``/``K``/``P`` come from the conversation root (``root``, else read from
    the trigger's tags, else the trigger itself), parent ``e``/``k`` from the
    trigger; every ``p`` is then replaced by one per destination. ``project`` is
    ``(owner pubkey, project d-tag)`` for the ``a`` tag. Optional tags follow in the
    order PROTOCOL.md lists them; ``delegation`` (a ``send_message`` exchange's thread
    id) adds ``["delegation", <thread id>]`` last.
    """
    thread_root = root_of(trigger) if root is None else (
        ThreadRoot.of(root) if isinstance(root, NostrEvent) else root
    )
    tags: list[list[str]] = [
        [TAG_ROOT_EVENT, thread_root.id, relay_hint, thread_root.pubkey]
        if thread_root.pubkey else [TAG_ROOT_EVENT, thread_root.id, relay_hint],
        [TAG_ROOT_KIND, str(thread_root.kind)],
    ]
    if thread_root.pubkey:
        tags.append([TAG_ROOT_AUTHOR, thread_root.pubkey])
    tags.append([TAG_EVENT, trigger.id, relay_hint, trigger.pubkey])
    tags.append([TAG_PARENT_KIND, str(trigger.kind)])
    seen: set[str] = set()
    for pubkey in destinations:
        if pubkey not in seen:
            seen.add(pubkey)
            tags.append([TAG_PUBKEY, pubkey])
    if project is not None:
        owner, identifier = project
        tags.append([TAG_ADDRESS, f"{KIND_PROJECT}:{owner}:{identifier}"])
    if phase is not None:
        tags.append([TAG_PHASE, phase])
    if net_time_seconds is not None:
        tags.append([TAG_NET_TIME, str(net_time_seconds)])
    if session_id is not None:
        tags.append([TAG_SESSION, session_id])
    if complete:
        tags.append([TAG_TOOL, TOOL_COMPLETE])
    if llm_model is not None:
        tags.append([TAG_LLM_MODEL, llm_model])
    if prompt_tokens is not None:
        tags.append([TAG_LLM_PROMPT_TOKENS, str(prompt_tokens)])
    if completion_tokens is not None:
        tags.append([TAG_LLM_COMPLETION_TOKENS, str(completion_tokens)])
    if error:
        tags.append([TAG_ERROR, ERROR_SYSTEM])
    if delegation is not None:
        tags.append([TAG_DELEGATION, delegation])
    return tags
