"""Hypothesis fuzzing of the relay frame codec and of what a relay connection does with each frame.

Every frame goes twice through the code: once to :func:`parse_relay_frame` alone (the codec's answer is
checked against an oracle) and once to a :class:`RelayConnection`'s reader (``_on_frame``, the function
its websocket loop calls), whose reaction (a counted rejection, an event handed to the pool's delivery or
to a fetch, a known copy counted, an OK resolved) must match the codec's answer without logging an
exception or failing a background task. The oracle of acceptance is independent of the codec: an event
is accepted only if this module signed exactly those fields (and nostr-sdk, a Rust implementation,
verifies it), and refused otherwise.

``scale`` sizes it: about 2,000 frames under ``scripts/test``, over 100,000 under ``scripts/faults``
(``TENEX_FAULTS_FULL=1``); each test records its figures, the last one the module's total.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import nostr_sdk
import pytest
from coincurve import PrivateKey, PublicKeyXOnly
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenex_daemon.adapters.nostr.codec import (
    DEFAULT_MAX_CONTENT_BYTES,
    DEFAULT_MAX_FRAME_CHARS,
    DEFAULT_MAX_TAGS,
    AuthMessage,
    ClosedMessage,
    EoseMessage,
    EventMessage,
    KnownEventMessage,
    NoticeMessage,
    OkMessage,
    PublicKeyCache,
    Rejection,
    RejectReason,
    parse_relay_frame,
)
from tenex_daemon.adapters.nostr.codec.frames import MAX_FUTURE_S
from tenex_daemon.adapters.nostr.relay_pool import PoolSettings, RelaySpec
from tenex_daemon.adapters.nostr.relay_pool.connection import RelayConnection, _Fetch
from tenex_daemon.adapters.nostr.relay_pool.subscriptions import Subscription, Subscriptions
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.core.events import NostrEvent, compute_event_id
from tenex_daemon.testing import KeyPair
from tests.evidence import record, scale

pytestmark = [pytest.mark.slow]

URL: Final = "wss://fuzz.invalid"
LIVE: Final = "live"
"""The connection's live subscription: its events go to the pool's delivery (the sink here)."""
FETCH: Final = "fetch"
"""A one-off fetch in progress on the connection: its events are collected, EOSE/CLOSED end it."""
OK_ID: Final = "ab" * 32
"""An event id a publisher waits an OK for, in every batch."""
KEYS: Final = [KeyPair.from_seed(seed) for seed in (501, 502, 503)]
OFF_CURVE: Final = [x.to_bytes(32, "big").hex() for x in (5, 7, 9)]
"""x-only public keys that are not on secp256k1."""
FIELDS: Final = ("id", "pubkey", "created_at", "kind", "tags", "content", "sig")
DAY_AHEAD: Final = int(time.time()) + MAX_FUTURE_S
"""Bounds away from the codec's "one day past now" edge (the oracle and the codec read the clock apart)."""

TOTAL_TARGET: Final = scale(2_000, 100_000)
PARTS: Final = {
    # name: (hypothesis examples, frames per example at least)
    "garbage": (scale(40, 2_000), 30),
    "shapes": (scale(40, 800), 20),
    "mutations": (scale(40, 800), 12),
    "limits": (scale(6, 100), 3),
}
TALLY: dict[str, Counter[str]] = {}
"""Each part's figures once it passed (the total test adds them up)."""


def _fuzz(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


# --- the oracle -----------------------------------------------------------------------------------

SIGNED: dict[str, tuple[set[str], str]] = {}
"""id -> (the canonical JSON of the 7 fields of each signature made, of the 6 signed ones) of every event
signed here."""


def _canonical(data: Mapping[str, Any], fields: Sequence[str] = FIELDS) -> str | None:
    """The fields as JSON that tells ``1`` from ``1.0`` and ``true``; None when one is missing."""
    if not all(name in data for name in fields):
        return None
    try:
        return json.dumps([data[name] for name in fields])
    except (TypeError, ValueError):
        return None


def signed(keys: KeyPair, content: str, kind: int, tags: list[list[str]], created_at: int) -> dict[str, Any]:
    """A correctly hashed and signed event as a dict, remembered as signed by this module.

    BIP-340 with all-zero auxiliary bytes: the same fields always get the same signature, so that
    hypothesis, which replays its choices, sees the same data each time (no state outside its draws).
    """
    event_id = compute_event_id(keys.pubkey, created_at, kind, tags, content)
    sig = PrivateKey(bytes.fromhex(keys.secret)).sign_schnorr(bytes.fromhex(event_id), bytes(32)).hex()
    event: dict[str, Any] = {
        "id": event_id, "pubkey": keys.pubkey, "created_at": created_at, "kind": kind,
        "tags": [list(tag) for tag in tags], "content": content, "sig": sig,
    }
    entry = SIGNED.setdefault(event["id"], (set(), _canonical(event, FIELDS[:-1]) or ""))
    entry[0].add(_canonical(event) or "")
    return event


def _signed_entry(data: Mapping[str, Any]) -> tuple[set[str], str] | None:
    event_id = data.get("id")
    return SIGNED.get(event_id) if isinstance(event_id, str) else None


def within_limits(data: Mapping[str, Any]) -> bool:
    """Whether a signed event's date and sizes pass the codec's rules (docs/PROTOCOL.md, rule 1 and 2)."""
    content, tags, created_at = data["content"], data["tags"], data["created_at"]
    return (
        created_at <= time.time() + MAX_FUTURE_S
        and len(content.encode("utf-8")) <= DEFAULT_MAX_CONTENT_BYTES
        and len(tags) <= DEFAULT_MAX_TAGS
    )


def verifies(data: object) -> bool:
    """The oracle: ``data`` is exactly an event this module signed, dated and sized within the limits."""
    if not isinstance(data, dict):
        return False
    entry = _signed_entry(data)
    return entry is not None and _canonical(data) in entry[0] and within_limits(data)


def verifies_but_sig(data: object) -> bool:
    """``data`` has the signed fields of an event signed here (any ``sig``): a copy a known id covers."""
    if not isinstance(data, dict):
        return False
    entry = _signed_entry(data)
    return entry is not None and _canonical(data, FIELDS[:-1]) == entry[1]


def independently_verifies(data: Mapping[str, Any]) -> bool:
    """nostr-sdk's own (Rust) check of the id and the Schnorr signature; for an event it does not read
    (it refuses an empty tag, which NIP-01 allows), core's json-based id and coincurve's BIP-340 verify."""
    try:
        event = nostr_sdk.Event.from_json(json.dumps(data, ensure_ascii=False))
    except nostr_sdk.NostrSdkError:
        event_id = compute_event_id(data["pubkey"], data["created_at"], data["kind"], data["tags"], data["content"])
        key = PublicKeyXOnly(bytes.fromhex(data["pubkey"]))
        return event_id == data["id"] and key.verify(bytes.fromhex(data["sig"]), bytes.fromhex(event_id))
    ok: bool = event.verify()
    return ok


def clean_json(value: object) -> bool:
    """Whether ``value`` makes text the codec reads as JSON: no lone surrogate (no UTF-8). NaN and Infinity
    are read (pydantic-core's extension of JSON): they can only sit in fields NIP-01 does not name, which
    are ignored, so the event is still exactly the signed one."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except ValueError:  # UnicodeEncodeError included
        return False
    return True


OTHER_MESSAGES: Final = (OkMessage, EoseMessage, ClosedMessage, NoticeMessage, AuthMessage)


def judge(result: object, known: set[str]) -> str:
    """Check one answer of the codec; return its category (accepted, known_copy, rejected, message)."""
    if isinstance(result, Rejection):
        assert isinstance(result.reason, RejectReason), result
        assert isinstance(result.detail, str), result
        assert result.detail, result
        return "rejected"
    if isinstance(result, EventMessage):
        event = result.event.to_dict()
        assert verifies(event), f"accepted an event that was not signed so: {event!r:.300}"
        assert independently_verifies(event), f"nostr-sdk refuses an accepted event: {event!r:.300}"
        return "accepted"
    if isinstance(result, KnownEventMessage):
        assert result.event.id in known, "a known copy of an unknown id"
        assert result.event.has_valid_id(), "a known copy whose id does not hash its fields"
        return "known_copy"
    assert isinstance(result, OTHER_MESSAGES), f"unexpected answer {result!r:.200}"
    return "message"


# --- the relay connection under test --------------------------------------------------------------


class Sink:
    """The pool's delivery as a connection sees it: takes events in, remembers their ids as seen."""

    def __init__(self) -> None:
        self.known: set[str] = set()
        self.taken: list[NostrEvent] = []
        self.copies = 0

    @property
    def seen(self) -> set[str]:
        """Ids taken in: a relay's copy of one skips the signature check."""
        return self.known

    async def intake(self, event: NostrEvent, url: str, sub_id: str) -> None:
        """An event of a live subscription: taken in once, a later copy only counted (as the delivery does)."""
        assert sub_id == LIVE
        assert url == URL
        if event.id in self.known:
            self.copies += 1
            return
        self.known.add(event.id)
        self.taken.append(event)

    def count_known_copy(self, event: NostrEvent, url: str, sub_id: str) -> None:
        """A copy of an event already taken in."""
        assert event.id in self.known
        self.copies += 1

    async def settled(self) -> bool:
        """Every event is handed over as it is taken in: nothing to wait for."""
        return True


class LogSpy:
    """Stands in for the connection's logger: keeps every ``exception`` call (a frame that broke it)."""

    def __init__(self) -> None:
        self.exceptions: list[str] = []
        self.lines = 0

    def bind(self, **_: object) -> LogSpy:
        return self

    def info(self, *_: object, **__: object) -> None:
        self.lines += 1

    def warning(self, *_: object, **__: object) -> None:
        self.lines += 1

    def exception(self, message: str, **_: object) -> None:
        self.exceptions.append(f"{message}: {sys.exc_info()[1]!r}")


@dataclass
class Wire:
    """One relay connection (no socket), fed frames as its websocket reader would."""

    runner: asyncio.Runner
    sink: Sink = field(default_factory=Sink)
    spy: LogSpy = field(default_factory=LogSpy)
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    conn: RelayConnection | None = None

    async def open(self) -> None:
        subscriptions = Subscriptions(120)
        await subscriptions.add(Subscription(LIVE, [{"kinds": [1, 11, 1111]}]), [URL], None)
        self.conn = RelayConnection(
            RelaySpec(URL),
            PoolSettings(auth_timeout=0.0),
            subscriptions=subscriptions,
            sink=self.sink,
            key_cache=PublicKeyCache(),
            auth_signer=Signer(bytes.fromhex(KEYS[0].secret)),
            spawn=self._spawn,
        )
        self.conn.log = self.spy

    def _spawn(self, coro: Any, name: str) -> None:
        self.tasks.append(asyncio.get_running_loop().create_task(coro, name=name))

    def feed(self, frames: Sequence[str | bytes]) -> Counter[str]:
        """Give each frame to the codec and to the connection; return the categories counted."""
        return self.runner.run(self._feed(frames))

    async def _feed(self, frames: Sequence[str | bytes]) -> Counter[str]:
        conn = self.conn
        assert conn is not None
        conn.fetches = {FETCH: _Fetch(done=asyncio.get_running_loop().create_future())}
        conn.pending_ok.clear()
        waiting = conn.expect_ok(OK_ID)
        tally: Counter[str] = Counter()
        known = self.sink.known  # grows as the connection takes events in, after each frame's own parse
        for frame in frames:
            result = parse_relay_frame(frame, known=known)  # never raises (else the test fails here)
            tally[judge(result, known)] += 1
            tally["frames"] += 1
            await self._through_connection(conn, frame, result)
        results = await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()
        failed = [r for r in results if isinstance(r, BaseException)]
        assert not failed, f"background tasks of the connection failed: {failed[:3]!r}"
        assert not self.spy.exceptions, f"the connection logged exceptions: {self.spy.exceptions[:3]}"
        if waiting.done():
            tally["ok_resolved"] += 1
        return tally

    async def _through_connection(self, conn: RelayConnection, frame: str | bytes, result: object) -> None:
        """The connection's reaction to a frame must be the one its codec answer calls for."""
        rejects = Counter(conn.rejects)  # (the expectations below read the sink before the frame goes in)
        taken, copies, notices = len(self.sink.taken), self.sink.copies, conn.notices
        fetched = len(conn.fetches[FETCH].events)
        was_known = isinstance(result, EventMessage | KnownEventMessage) and result.event.id in self.sink.known
        await conn._on_frame(frame)
        expected = Counter(rejects)
        new_taken, new_fetched, new_copies = 0, 0, 0
        if isinstance(result, Rejection):
            expected[result.reason.value] += 1
        elif isinstance(result, EventMessage | KnownEventMessage):
            sub = result.subscription_id
            if sub == FETCH:
                if isinstance(result, EventMessage) or verifies(result.event.to_dict()):
                    new_fetched = 1
                else:
                    expected[RejectReason.BAD_SIGNATURE.value] += 1
            elif sub == LIVE:
                new_taken, new_copies = (0, 1) if was_known else (1, 0)
            else:
                expected[RejectReason.UNKNOWN_SUBSCRIPTION.value] += 1
        assert Counter(conn.rejects) == expected, f"{result!r:.200}: rejects {conn.rejects} != {expected}"
        assert len(self.sink.taken) == taken + new_taken, f"{result!r:.200}"
        assert self.sink.copies == copies + new_copies, f"{result!r:.200}"
        assert len(conn.fetches[FETCH].events) == fetched + new_fetched, f"{result!r:.200}"
        assert conn.notices == notices + isinstance(result, NoticeMessage)
        if new_taken:
            assert isinstance(result, EventMessage)
            assert self.sink.taken[-1] == result.event


@pytest.fixture(scope="module")
def wire() -> Iterator[Wire]:
    """A relay connection with a live subscription, a fetch and an auth signer, in its own event loop."""
    with asyncio.Runner() as runner:
        the_wire = Wire(runner)
        runner.run(the_wire.open())
        yield the_wire


def finish(part: str, tally: Counter[str]) -> None:
    """Assert a part fuzzed as many frames as it should, keep its figures and record them."""
    examples, per_example = PARTS[part]
    assert tally["frames"] >= examples * per_example, f"{part}: only {tally['frames']} frames"
    TALLY[part] = tally
    record(f"fuzz.frames.{part}", crashes=0, **{k: v for k, v in sorted(tally.items())})


# --- strategies -----------------------------------------------------------------------------------

NASTY: Final = [
    "\x00", "\ud800", "\udfff", "\ud83d", "\u2028", "\u2029", "\ufeff", "\x7f", "\x1f", "é", "😀",
    "\U0010ffff", '"', "\\", "\\u0000", "\\ud800", "\n", "\t", " ", "[", "]", "{", "}", ",", ":",
]
any_text = st.one_of(
    st.text(st.characters(exclude_categories=()), max_size=40),
    st.lists(st.sampled_from(NASTY) | st.text(max_size=4), max_size=12).map("".join),
)
"""Any string, lone surrogates, NUL and JSON punctuation included."""
HEX: Final = "0123456789abcdef"
hex64 = st.text(HEX, min_size=64, max_size=64)
BIG_INTS: Final = [2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**70, -1, -(2**63), -(2**64)]
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from(BIG_INTS)
    | st.floats()
    | any_text
    | hex64
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(any_text, children, max_size=4),
    max_leaves=10,
)


def _strip_surrogates(text: str) -> str:
    return "".join(c for c in text if not 0xD800 <= ord(c) <= 0xDFFF)


signable_text = any_text.map(_strip_surrogates)
signable_tags = st.lists(st.lists(signable_text, max_size=4), max_size=5)
kinds = st.sampled_from([0, 1, 11, 14, 513, 1111, 1934, 4199, 24133, 24134, 65535]) | st.integers(0, 65535)
past_dates = st.integers(0, DAY_AHEAD - 3_600)


def dump(value: object, form: str) -> str | bytes:
    """``value`` as a frame in one of the forms relays send (compact, spaced, ASCII-escaped, bytes)."""
    if form == "bytes":
        return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")
    if form == "ascii":
        return json.dumps(value)
    separators = (",", ":") if form == "compact" else (", ", ": ")
    return json.dumps(value, ensure_ascii=False, separators=separators)


forms = st.sampled_from(["compact", "spaced", "ascii", "bytes"])
JSONISH: Final = '[]{}",:.0123456789eE+-truefalsnul\\/ \t\nEVENTOKCLSDNIAUHabcdef'
garbage_frames = st.one_of(
    st.text(st.characters(exclude_categories=()), max_size=300),
    st.binary(max_size=300),
    st.text(JSONISH, max_size=200),
    st.text(JSONISH, max_size=200).map(lambda s: '["EVENT"' + s),
    st.binary(max_size=200).map(lambda b: b'["EVENT"' + b),
    st.integers(1, 3_000).map(lambda n: '["EVENT","live",' + "[" * n + "]" * n + "]"),
    st.integers(1, 3_000).map(lambda n: "[" * n),
    st.builds(dump, json_values, forms),
)
"""Frames of any text or bytes: near-JSON, truncated, nested deep, invalid UTF-8."""

message_types = st.sampled_from(["EVENT", "OK", "EOSE", "CLOSED", "NOTICE", "AUTH", "COUNT", "REQ", "", "event"])
specials = st.sampled_from(
    [LIVE, FETCH, "", OK_ID, "auth-required: sign in", "duplicate: have it", "error: no", "x" * 65,
     True, False, None, 0, -1, 2**64, 1.5]
)
event_like = st.fixed_dictionaries(
    {},
    optional={
        "id": hex64 | json_values,
        "pubkey": st.sampled_from([k.pubkey for k in KEYS]) | hex64 | json_values,
        "created_at": past_dates | json_values,
        "kind": kinds | json_values,
        "tags": signable_tags | json_values,
        "content": any_text | json_values,
        "sig": st.text(HEX, min_size=128, max_size=128) | json_values,
    },
)
"""Dicts shaped like events, any field missing or of any value (never signed: never to be accepted)."""
relay_messages = st.one_of(
    st.builds(lambda t, rest: [t, *rest], message_types, st.lists(specials | json_values | event_like, max_size=5)),
    st.builds(lambda s, e: ["EVENT", s, e], specials | any_text, event_like),
    st.builds(lambda i, a, m: ["OK", i, a, m], st.sampled_from([OK_ID, ""]) | hex64 | specials, st.booleans() | specials, any_text | specials),
    st.builds(lambda s: ["EOSE", s], specials | any_text),
    st.builds(lambda s, m: ["CLOSED", s, m], specials | any_text, specials | any_text),
    st.builds(lambda s: ["CLOSED", s], specials | any_text),
    st.builds(lambda m: ["NOTICE", m], any_text | specials),
    st.builds(lambda c: ["AUTH", c], any_text | specials),
)
shaped_frames = st.builds(dump, relay_messages, forms)
"""Arrays shaped like every relay message (NIP-01, NIP-42), each position of any value."""


# --- mutations of signed events -------------------------------------------------------------------

Mutation = Callable[[st.DrawFn, dict[str, Any]], RejectReason | None]
"""Changes an event dict in place; returns the reason the codec must give when it is the only change."""


def _flip(draw: st.DrawFn, value: str) -> str:
    at = draw(st.integers(0, len(value) - 1))
    other = draw(st.sampled_from([c for c in HEX if c != value[at]]))
    return value[:at] + other + value[at + 1:]


def _rehash(event: dict[str, Any]) -> None:
    event["id"] = compute_event_id(
        event["pubkey"], event["created_at"], event["kind"], event["tags"], event["content"]
    )


def _resign(event: dict[str, Any], keys: KeyPair | None = None) -> None:
    """Sign the (well-typed) fields again with their author's key."""
    author = keys or next(k for k in KEYS if k.pubkey == event["pubkey"])
    event.update(signed(author, event["content"], event["kind"], event["tags"], event["created_at"]))


def _well_typed(event: dict[str, Any]) -> bool:
    return (
        isinstance(event.get("pubkey"), str) and event["pubkey"] in {k.pubkey for k in KEYS}
        and type(event.get("created_at")) is int and event["created_at"] >= 0
        and type(event.get("kind")) is int and 0 <= event["kind"] <= 65535
        and isinstance(event.get("content"), str) and _strip_surrogates(event["content"]) == event["content"]
        and isinstance(event.get("tags"), list)
        and all(isinstance(t, list) and all(isinstance(s, str) and _strip_surrogates(s) == s for s in t)
                for t in event["tags"])
    )


def m_replace(draw: st.DrawFn, event: dict[str, Any]) -> RejectReason | None:
    event[draw(st.sampled_from(FIELDS))] = draw(json_values)
    return None


def m_remove(draw: st.DrawFn, event: dict[str, Any]) -> RejectReason | None:
    event.pop(draw(st.sampled_from(FIELDS)), None)
    return RejectReason.BAD_SHAPE


def m_flip_id(draw: st.DrawFn, event: dict[str, Any]) -> RejectReason | None:
    event["id"] = _flip(draw, event["id"]) if isinstance(event.get("id"), str) and event["id"] else event.get("id")
    return RejectReason.BAD_ID


def m_flip_sig(draw: st.DrawFn, event: dict[str, Any]) -> RejectReason | None:
    if isinstance(event.get("sig"), str) and event["sig"]:
        event["sig"] = _flip(draw, event["sig"])
    return RejectReason.BAD_SIGNATURE


def m_flip_pubkey(draw: st.DrawFn, event: dict[str, Any]) -> RejectReason | None:
    if isinstance(event.get("pubkey"), str) and event["pubkey"]:
        event["pubkey"] = _flip(draw, event["pubkey"])
    return RejectReason.BAD_ID


def m_other_author(draw: st.DrawFn, event: dict[str, Any]) -> RejectReason | None:
    """Another (valid or off-curve) author, the id hashed again, the signature kept."""
    if not _well_typed(event):
        return None
    author = draw(st.sampled_from([k.pubkey for k in KEYS if k.pubkey != event["pubkey"]] + OFF_CURVE))
    event["pubkey"] = author
    _rehash(event)
    return RejectReason.BAD_PUBKEY if author in OFF_CURVE else RejectReason.BAD_SIGNATURE


def m_content(draw: st.DrawFn, event: dict[str, Any]) -> RejectReason | None:
    content = draw(any_text)
    changed = content != event.get("content")
    event["content"] = content
    if _strip_surrogates(content) != content:
        return None  # the JSON form decides: an escaped lone surrogate is no JSON, a raw one no UTF-8
    return RejectReason.BAD_ID if changed else None


def m_resign_content(draw: st.DrawFn, event: dict[str, Any]) -> RejectReason | None:
    event["content"] = draw(signable_text | st.sampled_from(["\x00", "a\x00b", "\u2028", "😀" * 30]))
    if _well_typed(event):
        _resign(event)
    return None


def m_created_at(draw: st.DrawFn, event: dict[str, Any]) -> RejectReason | None:
    """An odd date, not signed again: refused for its shape or its id."""
    value = draw(st.sampled_from(BIG_INTS) | st.floats() | st.sampled_from(["1700000000", True, None, [1]]))
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0 and value != event.get("created_at"):
        reason: RejectReason | None = RejectReason.BAD_ID
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        reason = None
    else:
        reason = RejectReason.BAD_SHAPE
    event["created_at"] = value
    return reason


def m_resign_created_at(draw: st.DrawFn, event: dict[str, Any]) -> RejectReason | None:
    """A date signed again: in the past it is fine, over a day ahead (up to 2**70) it is refused."""
    future = draw(st.booleans())
    when = draw(st.integers(DAY_AHEAD + 3_600, 2**70) if future else past_dates)
    event["created_at"] = when
    if not _well_typed(event):
        return None
    _resign(event)
    return RejectReason.BAD_CREATED_AT if future else None


def m_kind(draw: st.DrawFn, event: dict[str, Any]) -> RejectReason | None:
    """A kind out of range or of another type (not signed again), or any valid kind signed again."""
    if draw(st.booleans()):
        event["kind"] = draw(st.sampled_from([-1, 65536, 2**70, 1.0, True, "1", None]))
        return RejectReason.BAD_SHAPE
    event["kind"] = draw(kinds)
    if _well_typed(event):
        _resign(event)
    return None


def m_tags(draw: st.DrawFn, event: dict[str, Any]) -> RejectReason | None:
    """Tags deep, of other types, or unicode ones signed again."""
    choice = draw(st.sampled_from(["deep", "not_strings", "not_list", "resigned"]))
    if choice == "deep":
        depth = draw(st.integers(2, 60))
        nested: Any = "x"
        for _ in range(depth):
            nested = [nested]
        event["tags"] = [nested]
        return RejectReason.BAD_SHAPE
    if choice == "not_strings":
        event["tags"] = [["p", draw(st.sampled_from([1, None, 1.5, True, {"a": "b"}, ["x"]]))]]
        return RejectReason.BAD_SHAPE
    if choice == "not_list":
        event["tags"] = draw(st.sampled_from([{}, "p", 1, None, [["p"], "e"]]))
        return RejectReason.BAD_SHAPE
    event["tags"] = draw(st.lists(st.lists(signable_text, max_size=6), max_size=30))
    if _well_typed(event):
        _resign(event)
    return None


def m_sig(draw: st.DrawFn, event: dict[str, Any]) -> RejectReason | None:
    """A signature in upper case or of the wrong length (shape), empty or another event's (refused)."""
    sig = event.get("sig")
    if not isinstance(sig, str) or len(sig) != 128:
        return None
    choice = draw(st.sampled_from(["upper", "short", "empty", "other"]))
    if choice == "upper":
        if sig.upper() == sig:
            return None
        event["sig"] = sig.upper()
        return RejectReason.BAD_SHAPE
    if choice == "short":
        event["sig"] = sig[:-1]
        return RejectReason.BAD_SHAPE
    if choice == "empty":
        event["sig"] = ""
        return RejectReason.BAD_SIGNATURE
    event["sig"] = draw(st.sampled_from(OTHER_SIGNATURES))
    return RejectReason.BAD_SIGNATURE if event["sig"] != sig else None


def m_upper_id(draw: st.DrawFn, event: dict[str, Any]) -> RejectReason | None:
    event_id = event.get("id")
    if not isinstance(event_id, str) or event_id.upper() == event_id:
        return None
    event["id"] = event_id.upper()
    return RejectReason.BAD_SHAPE


def m_extra(draw: st.DrawFn, event: dict[str, Any]) -> RejectReason | None:
    """A field NIP-01 does not know: ignored."""
    event[draw(st.sampled_from(["extra", "ID", "relays", "seenOn"]))] = draw(json_values)
    return None


OTHER_SIGNATURES: Final = [signed(keys, "other", 1, [], 1_700_000_000)["sig"] for keys in KEYS]
"""Valid signatures of other events."""
MUTATIONS: Final[list[Mutation]] = [
    m_replace, m_remove, m_flip_id, m_flip_sig, m_flip_pubkey, m_other_author, m_content, m_resign_content,
    m_created_at, m_resign_created_at, m_kind, m_tags, m_sig, m_upper_id, m_extra,
]


@dataclass
class Mutated:
    """A signed event after its mutations, and the reason expected when one mutation decides it."""

    event: dict[str, Any]
    sub: object
    form: str
    reason: RejectReason | None
    mutations: list[str]

    def frame(self, slow: bool = False) -> str | bytes:
        """The EVENT frame; ``slow`` adds a leading space, which skips the codec's fast path."""
        text = dump(["EVENT", self.sub, self.event], self.form)
        if slow:
            return b" " + text if isinstance(text, bytes) else " " + text
        return text


@st.composite
def mutated_events(draw: st.DrawFn) -> Mutated:
    """An event signed here, then zero to three mutations, for a subscription id of any kind, in any form."""
    keys = draw(st.sampled_from(KEYS))
    event = signed(keys, draw(signable_text), draw(kinds), draw(signable_tags), draw(past_dates))
    chosen = draw(st.lists(st.sampled_from(MUTATIONS), max_size=3))
    reasons = [mutation(draw, event) for mutation in chosen]
    sub = draw(st.sampled_from([LIVE, LIVE, FETCH, "elsewhere", 7, None]) | any_text)
    reason = reasons[0] if len(reasons) == 1 else None
    return Mutated(event, sub, draw(forms), reason, [m.__name__ for m in chosen])


def check_mutated(case: Mutated, known: set[str]) -> None:
    """Fast and detailed paths agree, and the answer is the oracle's (and the single mutation's reason)."""
    fast = parse_relay_frame(case.frame())
    slow = parse_relay_frame(case.frame(slow=True))
    assert type(fast) is type(slow), f"{case.mutations}: fast {fast!r:.200} != detailed {slow!r:.200}"
    if isinstance(fast, Rejection):
        assert isinstance(slow, Rejection)
        assert fast.reason is slow.reason, f"{case.mutations}: {fast} / {slow}"
    fast = parse_relay_frame(case.frame(), known=known)  # a copy of a known id skips the signature check
    clean = clean_json(["EVENT", case.sub, case.event])
    valid = verifies(case.event) and isinstance(case.sub, str) and clean
    if isinstance(fast, EventMessage):
        assert valid, f"{case.mutations}: accepted {case.event!r:.2000} (sub {case.sub!r}, {case.form}, clean {clean})"
    elif isinstance(fast, KnownEventMessage):
        assert verifies_but_sig(case.event), case.mutations
        assert case.event["id"] in known, case.mutations
    else:
        assert isinstance(fast, Rejection), fast
        assert not valid, f"{case.mutations}: refused a valid event ({fast.reason}: {fast.detail})"
        if case.reason is not None and isinstance(case.sub, str) and clean:
            assert fast.reason is case.reason, f"{case.mutations}: {fast.reason} ({fast.detail}), expected {case.reason}"


# --- the tests ------------------------------------------------------------------------------------


def test_garbage_frames_never_break_the_codec_or_the_connection(wire: Wire) -> None:
    """Frames of any text or bytes (lone surrogates, NUL, invalid UTF-8, near-JSON, nesting thousands deep)
    are answered by the codec with a typed message or a Rejection with a reason, and the connection
    counts exactly that, never raising or logging an exception."""
    tally: Counter[str] = Counter()
    examples, per_example = PARTS["garbage"]

    @_fuzz(examples)
    @given(st.lists(garbage_frames, min_size=per_example, max_size=per_example + 20))
    def fuzz(frames: list[str | bytes]) -> None:
        tally.update(wire.feed(frames))

    fuzz()
    assert tally["accepted"] == 0, "garbage was accepted as a signed event"
    finish("garbage", tally)


def test_relay_shaped_messages_of_any_values_are_handled(wire: Wire) -> None:
    """Arrays shaped like EVENT/OK/EOSE/CLOSED/NOTICE/AUTH (and unknown types) carrying any values are
    parsed or refused with a reason, and the connection acts on them (OK resolves a publisher, EOSE and
    CLOSED end a fetch, AUTH answers, events of unknown subscriptions are counted) without an exception."""
    tally: Counter[str] = Counter()
    examples, per_example = PARTS["shapes"]

    @_fuzz(examples)
    @given(st.lists(shaped_frames, min_size=per_example, max_size=per_example + 20))
    def fuzz(frames: list[str | bytes]) -> None:
        tally.update(wire.feed(frames))

    fuzz()
    assert tally["accepted"] == 0, "an unsigned event was accepted"
    assert tally["message"] > 0
    assert tally["rejected"] > 0
    finish("shapes", tally)


def test_mutated_signed_events_are_accepted_only_when_they_still_verify(wire: Wire) -> None:
    """Signed events mutated field by field (id, sig, pubkey, kind, created_at huge/negative/float, tags
    deep/non-string, content with NUL and lone surrogates, extra fields), sent in every JSON form, are
    accepted exactly when they are still an event signed so (nostr-sdk verifies each accepted one),
    refused otherwise with the reason of their one mutation, the same on the codec's fast and detailed
    paths; a relay's copy of a known event is only counted, never delivered twice."""
    tally: Counter[str] = Counter()
    examples, per_example = PARTS["mutations"]

    @_fuzz(examples)
    @given(st.lists(mutated_events(), min_size=per_example // 2, max_size=per_example // 2 + 6))
    def fuzz(cases: list[Mutated]) -> None:
        frames: list[str | bytes] = []
        for case in cases:
            check_mutated(case, wire.sink.known)
            frames += [case.frame(), case.frame(slow=True)]
        tally.update(wire.feed(frames))
        tally["single_mutation_reasons"] += sum(1 for c in cases if c.reason is not None)

    fuzz()
    assert tally["accepted"] > 0
    assert tally["rejected"] > 0
    assert tally["known_copy"] > 0
    finish("mutations", tally)


@dataclass
class Sized:
    """A frame built to sit just under or over one of the codec's limits."""

    frame: str | bytes
    over: bool
    reason: RejectReason


@st.composite
def sized_frames(draw: st.DrawFn) -> list[Sized]:
    """Three signed events a few characters under or over the frame, content and tag-count limits."""
    keys = draw(st.sampled_from(KEYS))
    wide = draw(st.sampled_from(["", "é", "😀"]))
    out: list[Sized] = []
    # the frame: padded in a tag so that its length is the limit plus delta
    delta = draw(st.integers(-3, 3) | st.integers(-2_000, 2_000))
    base = signed(keys, "x", 1111, [["pad", ""]], draw(past_dates))
    fixed = len(dump(["EVENT", LIVE, base], "compact"))  # its content "x" becomes one (maybe wide) character
    pad = DEFAULT_MAX_FRAME_CHARS + delta - fixed
    event = signed(keys, wide or "x", 1111, [["pad", "a" * pad]], base["created_at"])
    frame = dump(["EVENT", LIVE, event], "compact")
    assert len(frame) == DEFAULT_MAX_FRAME_CHARS + delta
    out.append(Sized(frame, delta > 0, RejectReason.OVERSIZED_FRAME))
    # the content, in UTF-8 bytes (a wide character counts 2 or 4)
    delta = draw(st.integers(-4, 4) | st.integers(-1_000, 1_000))
    size = DEFAULT_MAX_CONTENT_BYTES + delta
    unit = wide or "y"
    width = len(unit.encode("utf-8"))
    content = unit * (size // width) + "z" * (size % width)
    event = signed(keys, content, 1111, [], draw(past_dates))
    out.append(Sized(dump(["EVENT", LIVE, event], draw(forms)), delta > 0, RejectReason.OVERSIZED))
    # the number of tags
    delta = draw(st.integers(-2, 2))
    event = signed(keys, "tags", 1111, [["t", str(n)] for n in range(DEFAULT_MAX_TAGS + delta)], draw(past_dates))
    out.append(Sized(dump(["EVENT", LIVE, event], draw(forms)), delta > 0, RejectReason.TOO_MANY_TAGS))
    return out


def test_frames_at_the_size_limits_are_refused_exactly_past_them(wire: Wire) -> None:
    """Signed events a few characters under or over the frame limit (1 Mi characters), the content limit
    (256 KiB of UTF-8) and the tag limit (2,000) are accepted under and refused over, with the limit's
    reason, by the codec and by the connection."""
    tally: Counter[str] = Counter()
    examples, _ = PARTS["limits"]

    @_fuzz(examples)
    @given(sized_frames())
    def fuzz(cases: list[Sized]) -> None:
        for case in cases:
            result = parse_relay_frame(case.frame)
            if case.over:
                assert isinstance(result, Rejection), f"{result!r:.200}"
                assert result.reason is case.reason, f"{result!r:.200}"
            else:
                assert isinstance(result, EventMessage | KnownEventMessage), f"{result!r:.200}"
        tally.update(wire.feed([c.frame for c in cases]))
        tally["over"] += sum(c.over for c in cases)

    fuzz()
    assert tally["over"] > 0
    assert tally["accepted"] > 0
    finish("limits", tally)


def test_lone_surrogates_in_a_text_frame_are_refused_not_raised() -> None:
    """A text frame holding a lone surrogate (no UTF-8, so no JSON text) is refused as bad encoding; the
    codec once raised TypeError from pydantic-core here (found by this fuzzing)."""
    for frame in ['["NOTICE","\ud800"]', '["EVENT","live",{"content":"\udfff"}]', "\ud83d", '["EVENT"\ud800']:
        result = parse_relay_frame(frame)
        assert isinstance(result, Rejection), result
        assert result.reason is RejectReason.BAD_ENCODING, result


def test_fuzzed_frames_reach_the_target() -> None:
    """The module fuzzed at least 2,000 frames (reduced run) or 100,000 (full run), none of which crashed
    the codec or the connection (each part asserted that as it ran)."""
    if set(TALLY) != set(PARTS):
        pytest.skip("the total is only known when the whole module ran")
    total: Counter[str] = Counter()
    for tally in TALLY.values():
        total.update(tally)
    assert total["frames"] >= TOTAL_TARGET, f"only {total['frames']} frames fuzzed"
    record(
        "fuzz.frames",
        frames=total["frames"],
        accepted=total["accepted"],
        known_copies=total["known_copy"],
        rejected=total["rejected"],
        other_messages=total["message"],
        crashes=0,
    )
