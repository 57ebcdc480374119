"""Hypothesis fuzzing of the frame parser and the event validator: nothing escapes, every refusal has a reason."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenex_daemon.adapters.nostr.codec import (
    EventMessage,
    EventRejectedError,
    Rejection,
    RejectReason,
    encode_event,
    event_id_digest,
    parse_relay_frame,
    validate_event_dict,
)
from tenex_daemon.core.events import NostrEvent, compute_event_id
from tenex_daemon.testing import KeyPair, sign_event

USER = KeyPair.from_seed(401)
GOOD = sign_event(USER, "fuzz base", kind=1111, tags=[["p", "a" * 64]], created_at=1_700_000_000).to_dict()
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
message_types = st.sampled_from(["EVENT", "OK", "EOSE", "CLOSED", "NOTICE", "AUTH", "COUNT", "REQ", ""])


def _check(result: object) -> None:
    assert isinstance(result, Rejection | EventMessage) or type(result).__name__ in {
        "OkMessage", "EoseMessage", "ClosedMessage", "NoticeMessage", "AuthMessage"}
    if isinstance(result, Rejection):
        assert isinstance(result.reason, RejectReason)


@FUZZ
@given(st.text(max_size=200) | st.binary(max_size=200))
def test_arbitrary_text_never_raises(text: str | bytes) -> None:
    """Any text or bytes gives a typed message or a Rejection with a reason, never an exception."""
    _check(parse_relay_frame(text))


@FUZZ
@given(message_types, st.lists(json_values, max_size=4))
def test_json_arrays_of_any_shape_never_raise(kind: str, rest: list[Any]) -> None:
    """Arrays that start like relay messages but carry any JSON values never raise."""
    _check(parse_relay_frame(json.dumps([kind, *rest])))


event_fields = st.sampled_from(["id", "pubkey", "created_at", "kind", "tags", "content", "sig"])


@FUZZ
@given(st.dictionaries(event_fields, json_values, max_size=3), st.sets(event_fields, max_size=2))
def test_mutated_events_are_refused_with_a_reason(changes: dict[str, Any], removed: set[str]) -> None:
    """A signed event with fields replaced or removed is either still valid (unchanged) or refused with a reason."""
    raw = {**GOOD, **changes}
    for name in removed:
        raw.pop(name, None)
    reason: RejectReason | None = None
    try:
        event = validate_event_dict(raw)
    except EventRejectedError as exc:
        reason = exc.reason
    if reason is None:
        assert event.to_dict() == GOOD
    else:
        result = parse_relay_frame(json.dumps(["EVENT", "s", raw]))
        assert isinstance(result, Rejection)
        assert result.reason is reason


@FUZZ
@given(st.text(max_size=300), st.lists(st.lists(st.text(max_size=10), max_size=4), max_size=4))
def test_any_unicode_content_and_tags_validate_when_signed(content: str, tags: list[list[str]]) -> None:
    """Events with arbitrary (encodable) content and tags round-trip through the parser when signed."""
    try:
        content.encode("utf-8")
        for tag in tags:
            for item in tag:
                item.encode("utf-8")
    except UnicodeEncodeError:
        return
    event = sign_event(USER, content, tags=tags, created_at=1_700_000_000)
    result = parse_relay_frame(json.dumps(["EVENT", "s", event.to_dict()], ensure_ascii=False))
    assert result == EventMessage("s", event)


@FUZZ
@given(
    st.text(max_size=200),
    st.lists(st.lists(st.text(max_size=12), max_size=4), max_size=4),
    st.integers(min_value=0, max_value=2**70),
    st.integers(min_value=0, max_value=65535),
)
def test_fast_id_serializer_matches_the_reference(
    content: str, tags: list[list[str]], created_at: int, kind: int
) -> None:
    """The codec's id digest equals core's json.dumps-based compute_event_id for any fields (or both refuse)."""
    pubkey = "ab" * 32
    try:
        expected = compute_event_id(pubkey, created_at, kind, tags, content)
    except UnicodeEncodeError:
        with pytest.raises(UnicodeEncodeError):
            event_id_digest(pubkey, created_at, kind, tags, content)
        return
    assert event_id_digest(pubkey, created_at, kind, tags, content).hex() == expected


any_text = st.text(st.characters(exclude_categories=()), max_size=200)
"""Text of any code point, lone surrogates included."""


@FUZZ
@given(any_text, st.lists(st.lists(st.text(max_size=12), max_size=4), max_size=4))
def test_the_event_frame_is_the_text_json_writes(content: str, tags: list[list[str]]) -> None:
    """``encode_event`` writes exactly the text of ``json.dumps`` without spaces or ASCII escapes, for any
    content and tags (lone surrogates included: orjson refuses those, and json writes the frame)."""
    event = NostrEvent.model_construct(
        id="ab" * 32, pubkey="cd" * 32, created_at=1_700_000_000, kind=1111, tags=tags, content=content,
        sig="ef" * 64,
    )
    expected = json.dumps(["EVENT", event.to_dict()], ensure_ascii=False, separators=(",", ":"))
    assert encode_event(event) == expected
