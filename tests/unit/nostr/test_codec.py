"""The codec: relay frames to typed messages, event validation with reason codes, threading, reply tags."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tenex_daemon.adapters.nostr.codec import (
    AuthMessage,
    ClosedMessage,
    EoseMessage,
    EventMessage,
    EventRejectedError,
    KnownEventMessage,
    Limits,
    NoticeMessage,
    OkMessage,
    PublicKeyCache,
    Rejection,
    RejectReason,
    ReplyDetails,
    ThreadRoot,
    ThreadStyle,
    build_reply_tags,
    conversation_id,
    encode_event,
    encode_req,
    parse_relay_frame,
    read_threading,
    validate_event_dict,
)
from tenex_daemon.core.events import compute_event_id
from tenex_daemon.testing import KeyPair, sign_event

USER = KeyPair.from_seed(301)
AGENT = KeyPair.from_seed(302)
OTHER = KeyPair.from_seed(303)


def frame(*parts: Any) -> str:
    """JSON text of a relay frame."""
    return json.dumps(list(parts))


def signed_dict(**changes: Any) -> dict[str, Any]:
    """A correctly signed event as a dict, with ``changes`` applied after signing."""
    return {**sign_event(USER, "hello", kind=1111, tags=[["p", AGENT.pubkey]]).to_dict(), **changes}


def test_event_frame_parses_to_a_validated_event() -> None:
    """A well-formed EVENT frame yields an EventMessage with the same event."""
    event = sign_event(USER, "hi ✨\u2028", kind=11, tags=[["title", "T"]])
    message = parse_relay_frame(frame("EVENT", "sub", event.to_dict()))
    assert message == EventMessage("sub", event)


def test_copy_of_a_known_event_skips_only_the_signature_check() -> None:
    """A frame whose id is already known comes back as KnownEventMessage; a wrong id is still refused."""
    event = sign_event(USER, "seen before", kind=1111)
    known = {event.id}
    message = parse_relay_frame(frame("EVENT", "sub", event.to_dict()), known=known)
    assert message == KnownEventMessage("sub", event)
    tampered = {**event.to_dict(), "content": "changed"}
    refused = parse_relay_frame(frame("EVENT", "sub", tampered), known=known)
    assert isinstance(refused, Rejection)
    assert refused.reason is RejectReason.BAD_ID
    fresh = sign_event(USER, "new", kind=1111)
    assert parse_relay_frame(frame("EVENT", "sub", fresh.to_dict()), known=known) == EventMessage("sub", fresh)


def test_every_relay_message_type_parses() -> None:
    """EOSE, OK (true, false, duplicate, empty id), NOTICE, CLOSED and AUTH become their typed messages."""
    event_id = "ab" * 32
    assert parse_relay_frame(frame("EOSE", "s")) == EoseMessage("s")
    ok = parse_relay_frame(frame("OK", event_id, True, ""))
    assert ok == OkMessage(event_id, True, "")
    dup = parse_relay_frame(frame("OK", event_id, False, "duplicate: have it"))
    assert isinstance(dup, OkMessage)
    assert dup.is_success
    assert dup.prefix == "duplicate"
    refused = parse_relay_frame(frame("OK", event_id, False, "blocked: no"))
    assert isinstance(refused, OkMessage)
    assert not refused.is_success
    assert parse_relay_frame(frame("OK", "", False, "invalid: Bad signature")) == OkMessage(
        "", False, "invalid: Bad signature")
    assert parse_relay_frame(frame("NOTICE", "slow down")) == NoticeMessage("slow down")
    closed = parse_relay_frame(frame("CLOSED", "s", "auth-required: please"))
    assert closed == ClosedMessage("s", "auth-required: please")
    assert isinstance(closed, ClosedMessage)
    assert closed.prefix == "auth-required"
    assert parse_relay_frame(frame("AUTH", "challenge")) == AuthMessage("challenge")


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("{not json", RejectReason.INVALID_JSON),
        ("", RejectReason.INVALID_JSON),
        ('"EVENT"', RejectReason.NOT_AN_ARRAY),
        ("[]", RejectReason.NOT_AN_ARRAY),
        (frame("EVENT", "s"), RejectReason.WRONG_ARITY),
        (frame("EVENT", "s", {}, {}), RejectReason.WRONG_ARITY),
        (frame("OK", "ab" * 32, True), RejectReason.WRONG_ARITY),
        (frame("EOSE"), RejectReason.WRONG_ARITY),
        (frame("NOTICE"), RejectReason.WRONG_ARITY),
        (frame("AUTH"), RejectReason.WRONG_ARITY),
        (frame("CLOSED"), RejectReason.WRONG_ARITY),
        (frame("COUNT", "s", {"count": 1}), RejectReason.UNKNOWN_TYPE),
        (frame(5, "x"), RejectReason.UNKNOWN_TYPE),
        (frame("EVENT", 5, {}), RejectReason.BAD_FIELD),
        (frame("OK", "xyz", True, ""), RejectReason.BAD_FIELD),
        (frame("OK", "ab" * 32, "yes", ""), RejectReason.BAD_FIELD),
        (frame("EOSE", 1), RejectReason.BAD_FIELD),
        (frame("AUTH", None), RejectReason.BAD_FIELD),
        (frame("EVENT", "s", "not an object"), RejectReason.BAD_SHAPE),
        ("[" * 100_000, RejectReason.INVALID_JSON),
    ],
)
def test_malformed_frames_are_rejected_with_their_reason(text: str, reason: RejectReason) -> None:
    """Each malformed frame becomes a Rejection with the expected reason code, without raising."""
    result = parse_relay_frame(text)
    assert isinstance(result, Rejection)
    assert result.reason is reason


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"content": "forged"}, RejectReason.BAD_ID),
        ({"id": "00" * 32}, RejectReason.BAD_ID),
        ({"sig": "00" * 64}, RejectReason.BAD_SIGNATURE),
        ({"pubkey": "ZZ" * 32}, RejectReason.BAD_SHAPE),
        ({"id": "not-hex"}, RejectReason.BAD_SHAPE),
        ({"sig": "ab"}, RejectReason.BAD_SHAPE),
        ({"created_at": "1700000000"}, RejectReason.BAD_SHAPE),
        ({"created_at": -1}, RejectReason.BAD_SHAPE),
        ({"kind": 70000}, RejectReason.BAD_SHAPE),
        ({"tags": [["p", 1]]}, RejectReason.BAD_SHAPE),
        ({"tags": "p"}, RejectReason.BAD_SHAPE),
        ({"tags": [None]}, RejectReason.BAD_SHAPE),
        ({"content": None}, RejectReason.BAD_SHAPE),
    ],
)
def test_bad_events_are_rejected_with_their_reason(changes: dict[str, Any], reason: RejectReason) -> None:
    """A forged id, a bad signature, non-hex fields or bad tags are each refused with the right reason."""
    result = parse_relay_frame(frame("EVENT", "s", signed_dict(**changes)))
    assert isinstance(result, Rejection)
    assert result.reason is reason
    assert result.subscription_id == "s"


def test_lone_surrogates_are_refused() -> None:
    """A lone surrogate is invalid JSON text in a frame, and bad_encoding in an already-parsed dict."""
    raw = signed_dict(content="\ud800 lone surrogate")
    result = parse_relay_frame(frame("EVENT", "s", raw))
    assert isinstance(result, Rejection)
    assert result.reason is RejectReason.INVALID_JSON
    with pytest.raises(EventRejectedError) as caught:
        validate_event_dict(raw)
    assert caught.value.reason is RejectReason.BAD_ENCODING


def test_signature_from_another_key_is_refused() -> None:
    """A valid signature by a different key over the same id does not verify for the claimed pubkey."""
    event = sign_event(USER, "mine")
    other = sign_event(OTHER, "mine", created_at=event.created_at)
    with pytest.raises(EventRejectedError) as caught:
        validate_event_dict({**event.to_dict(), "sig": other.sig})
    assert caught.value.reason is RejectReason.BAD_SIGNATURE


def test_pubkey_off_the_curve_is_refused() -> None:
    """A 64-hex pubkey that is not a curve point is refused as bad_pubkey (its id matching)."""
    pubkey = "ff" * 32
    content = "x"
    event_id = compute_event_id(pubkey, 1, 1, [], content)
    raw = {"id": event_id, "pubkey": pubkey, "created_at": 1, "kind": 1, "tags": [], "content": content,
           "sig": "00" * 64}
    with pytest.raises(EventRejectedError) as caught:
        validate_event_dict(raw)
    assert caught.value.reason is RejectReason.BAD_PUBKEY


def test_size_limits() -> None:
    """Content over the byte limit, too many tags and oversized frames are refused by size."""
    limits = Limits(max_frame_chars=10_000, max_content_bytes=1000, max_tags=5)
    big = sign_event(USER, "é" * 501).to_dict()  # 1002 bytes in UTF-8
    result = parse_relay_frame(frame("EVENT", "s", big), limits=limits)
    assert isinstance(result, Rejection)
    assert result.reason is RejectReason.OVERSIZED
    just_fits = sign_event(USER, "é" * 500).to_dict()
    assert isinstance(parse_relay_frame(frame("EVENT", "s", just_fits), limits=limits), EventMessage)
    tagged = sign_event(USER, "t", tags=[["t", str(i)] for i in range(6)]).to_dict()
    result = parse_relay_frame(frame("EVENT", "s", tagged), limits=limits)
    assert isinstance(result, Rejection)
    assert result.reason is RejectReason.TOO_MANY_TAGS
    result = parse_relay_frame(frame("NOTICE", "x" * 10_001), limits=limits)
    assert isinstance(result, Rejection)
    assert result.reason is RejectReason.OVERSIZED_FRAME


def test_default_content_limit_is_256_kib() -> None:
    """By default content of 256 KiB passes and one byte more is refused."""
    assert validate_event_dict(sign_event(USER, "a" * 256 * 1024).to_dict())
    with pytest.raises(EventRejectedError) as caught:
        validate_event_dict(sign_event(USER, "a" * (256 * 1024 + 1)).to_dict())
    assert caught.value.reason is RejectReason.OVERSIZED


def test_key_cache_is_an_lru() -> None:
    """The public-key cache keeps at most maxsize keys and reuses cached objects."""
    cache = PublicKeyCache(maxsize=2)
    first = cache.get(USER.pubkey)
    assert cache.get(USER.pubkey) is first
    cache.get(AGENT.pubkey)
    cache.get(OTHER.pubkey)
    assert len(cache) == 2


def test_outgoing_frames_round_trip() -> None:
    """REQ and EVENT frames we send are JSON the relay side can read back."""
    event = sign_event(USER, "out ✨")
    assert json.loads(encode_event(event)) == ["EVENT", event.to_dict()]
    assert json.loads(encode_req("s", [{"kinds": [1]}, {"#p": ["a"]}])) == ["REQ", "s", {"kinds": [1]},
                                                                            {"#p": ["a"]}]


# --- threading ------------------------------------------------------------------------------

ROOT_ID = "a1" * 32
PARENT_ID = "b2" * 32


def test_nip22_threading_reads_root_and_parent() -> None:
    """NIP-22 E/K/P give the root, e/k/p the parent."""
    event = sign_event(USER, "reply", tags=[
        ["E", ROOT_ID, "wss://r", OTHER.pubkey], ["K", "1934"], ["P", OTHER.pubkey],
        ["e", PARENT_ID, "", AGENT.pubkey], ["k", "1111"], ["p", AGENT.pubkey]])
    t = read_threading(event)
    assert t.style is ThreadStyle.NIP22
    assert (t.root_id, t.root_kind, t.root_author) == (ROOT_ID, 1934, OTHER.pubkey)
    assert (t.parent_id, t.parent_kind, t.parent_author) == (PARENT_ID, 1111, AGENT.pubkey)
    assert conversation_id(event) == ROOT_ID


def test_nip22_reply_to_the_root_without_lowercase_e() -> None:
    """A NIP-22 reply with only E/K/P has the root as its parent."""
    event = sign_event(USER, "reply", tags=[["E", ROOT_ID], ["K", "11"], ["P", OTHER.pubkey]])
    t = read_threading(event)
    assert (t.root_id, t.root_kind, t.parent_id, t.parent_kind) == (ROOT_ID, 11, ROOT_ID, 11)


def test_nip10_marked_threading() -> None:
    """NIP-10 markers: root and reply e-tags are read whatever their order; mentions are ignored."""
    event = sign_event(USER, "x", kind=1, tags=[
        ["e", "c3" * 32, "", "mention"], ["e", PARENT_ID, "", "reply", AGENT.pubkey],
        ["e", ROOT_ID, "", "root"]])
    t = read_threading(event)
    assert (t.style, t.root_id, t.parent_id, t.parent_author) == (
        ThreadStyle.NIP10_MARKED, ROOT_ID, PARENT_ID, AGENT.pubkey)
    only_root = read_threading(sign_event(USER, "x", kind=1, tags=[["e", ROOT_ID, "", "root"]]))
    assert (only_root.root_id, only_root.parent_id) == (ROOT_ID, ROOT_ID)


def test_nip10_positional_threading() -> None:
    """Positional e-tags: the first is the root, the last the parent; one tag is both."""
    event = sign_event(USER, "x", kind=1, tags=[["e", ROOT_ID], ["e", "c3" * 32], ["e", PARENT_ID]])
    t = read_threading(event)
    assert (t.style, t.root_id, t.parent_id) == (ThreadStyle.NIP10_POSITIONAL, ROOT_ID, PARENT_ID)
    single = read_threading(sign_event(USER, "x", kind=1, tags=[["e", ROOT_ID]]))
    assert (single.root_id, single.parent_id) == (ROOT_ID, ROOT_ID)


def test_nip10_a_missing_marker_beside_unmarked_tags_is_filled_positionally() -> None:
    """Mixed NIP-10 tags read as nostr-tools reads them: an unmarked root beside a marked reply is the root
    (it was taken for the parent's thread: the conversation split at the parent), and an unmarked tag beside
    a lone marked root is the parent."""
    unmarked_root = read_threading(sign_event(USER, "x", kind=1, tags=[
        ["e", ROOT_ID, "wss://relay.example"], ["e", PARENT_ID, "", "reply"]]))
    unmarked_parent = read_threading(sign_event(USER, "x", kind=1, tags=[
        ["e", ROOT_ID, "", "root"], ["e", "c3" * 32, "", "mention"], ["e", PARENT_ID]]))

    assert (unmarked_root.root_id, unmarked_root.parent_id) == (ROOT_ID, PARENT_ID)
    assert (unmarked_parent.root_id, unmarked_parent.parent_id) == (ROOT_ID, PARENT_ID)


def test_event_without_thread_tags_is_a_root() -> None:
    """A kind-11 event with no e/E tags (and junk e-tags) is its own conversation."""
    event = sign_event(USER, "new", kind=11, tags=[["e", "not-an-id"], ["E"], ["p", AGENT.pubkey]])
    t = read_threading(event)
    assert t.is_root
    assert t.style is ThreadStyle.NONE
    assert conversation_id(event) == event.id


def test_reply_tags_follow_protocol() -> None:
    """Reply tags: root E/K/P, parent e/k, one p per destination, then the optional tags in order."""
    root = sign_event(USER, "root", kind=11, tags=[["p", AGENT.pubkey]])
    trigger = sign_event(USER, "do it", tags=[
        ["E", root.id, "", USER.pubkey], ["K", "11"], ["P", USER.pubkey],
        ["e", root.id, "", USER.pubkey], ["k", "11"], ["p", AGENT.pubkey]])
    tags = build_reply_tags(trigger, [USER.pubkey, USER.pubkey], details=ReplyDetails(
        project=(OTHER.pubkey, "proj"), phase="chat", net_time_seconds=42, session_id="sess-1",
        complete=True, llm_model="m", prompt_tokens=10, completion_tokens=5, error=True,
    ))
    assert tags == [
        ["E", root.id, "", USER.pubkey], ["K", "11"], ["P", USER.pubkey],
        ["e", trigger.id, "", USER.pubkey], ["k", "1111"],
        ["p", USER.pubkey],
        ["a", f"31933:{OTHER.pubkey}:proj"], ["phase", "chat"], ["net-time", "42"],
        ["claude-session", "sess-1"], ["tool", "complete"], ["llm-model", "m"],
        ["llm-prompt-tokens", "10"], ["llm-completion-tokens", "5"], ["error", "system"],
    ]
    assert build_reply_tags(trigger, [USER.pubkey], root=root)[:5] == tags[:5]


def test_reply_to_a_root_and_to_a_task() -> None:
    """Replying to the root event itself copies it as root; a task root keeps K=1934; p tags are replaced."""
    task = sign_event(USER, "task", kind=1934, tags=[["p", AGENT.pubkey]])
    tags = build_reply_tags(task, [OTHER.pubkey])
    assert tags == [["E", task.id, "", USER.pubkey], ["K", "1934"], ["P", USER.pubkey],
                    ["e", task.id, "", USER.pubkey], ["k", "1934"], ["p", OTHER.pubkey]]
    assert build_reply_tags(task, [], root=ThreadRoot(ROOT_ID, 11, OTHER.pubkey))[0] == [
        "E", ROOT_ID, "", OTHER.pubkey]
    assert not [t for t in build_reply_tags(task, []) if t[0] == "p"]
