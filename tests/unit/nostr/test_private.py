"""NIP-17 at the Nostr edge: gift wraps opened and made with nostr-sdk, rumors kept unsigned and never
taken for signed events, replies in private conversations composed as rumors and published only wrapped."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest
from nostr_sdk import (
    Event,
    EventBuilder,
    Keys,
    Kind,
    Nip44Version,
    PublicKey,
    Tag,
    UnsignedEvent,
    UnwrappedGift,
    nip44_encrypt,
    nip59_make_gift_wrap,
    nip59_make_seal,
)

from tenex_daemon.adapters.nostr import private
from tenex_daemon.adapters.nostr.codec import Rejection, RejectReason, parse_relay_frame, verify_event
from tenex_daemon.adapters.nostr.private import (
    DELIVERED_WRAPS_KEPT,
    WRAPS_KEY,
    GiftWrapError,
    GiftWrapPublisher,
    GiftWraps,
    OpenedWrap,
    PrivateReplyComposer,
    WrapRefusal,
    make_rumor,
    wrap_recipients,
)
from tenex_daemon.adapters.nostr.relay_pool.subscriptions import Subscription, Subscriptions
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.core.errors import EventRefusedError
from tenex_daemon.core.events import NostrEvent, compute_event_id
from tenex_daemon.core.ports import ReplySpec
from tenex_daemon.testing import KeyPair, sign_event
from tenex_daemon.testing.fakes import FakePublisher, PlainComposer, signers_for

PERSON = KeyPair.from_seed(601)
AGENT = KeyPair.from_seed(602)
OTHER = KeyPair.from_seed(603)
NOW = 1_790_000_000


def wraps() -> GiftWraps:
    """The agents' gift wraps (one agent)."""
    return GiftWraps(signers_for({"agent": AGENT}))


def rumor_dict(author: KeyPair, content: str, *, kind: int = 14, tags: list[list[str]] | None = None) -> dict[str, Any]:
    """A rumor's fields (no id, no signature)."""
    return {"pubkey": author.pubkey, "created_at": NOW, "kind": kind,
            "tags": tags if tags is not None else [["p", AGENT.pubkey]], "content": content}


def wrapped_by(sender: KeyPair, to: str, rumor: dict[str, Any]) -> NostrEvent:
    """A gift wrap made the way a NIP-17 client makes it (nostr-sdk), from ``sender`` to ``to``."""
    made = nip59_make_gift_wrap(Keys.parse(sender.secret), PublicKey.parse(to), UnsignedEvent.from_json(json.dumps(rumor)))
    return NostrEvent.model_validate_json(made.as_json())


def sdk_event(event: NostrEvent) -> Event:
    """The event as nostr-sdk's ``Event``."""
    return Event.from_json(json.dumps(event.to_dict()))


def forged_wrap(seal_signer: KeyPair, rumor: dict[str, Any], to: str) -> NostrEvent:
    """A wrap whose seal is signed by ``seal_signer`` around a rumor written by someone else."""
    seal = nip59_make_seal(Keys.parse(seal_signer.secret), PublicKey.parse(to), UnsignedEvent.from_json(json.dumps(rumor)))
    one_time = Keys.generate()
    content = nip44_encrypt(one_time.secret_key(), PublicKey.parse(to), seal.as_json(), Nip44Version.V2)
    wrap = EventBuilder(Kind(1059), content).tags([Tag.parse(["p", to])]).finalize(one_time)
    return NostrEvent.model_validate_json(wrap.as_json())


def test_a_persons_wrap_opens_to_its_rumor_unsigned_with_the_hash_as_id() -> None:
    """A wrap made by nostr-sdk for the agent opens with the agent's key: the kind-14 rumor, its ``sig``
    empty (never mistaken for a signed event), its id the NIP-01 hash of its fields, the recipient known."""
    opened = wraps().open(wrapped_by(PERSON, AGENT.pubkey, rumor_dict(PERSON, "secret plan ✓")))
    assert isinstance(opened, OpenedWrap)
    rumor = opened.rumor
    assert (rumor.kind, rumor.pubkey, rumor.content, rumor.sig) == (14, PERSON.pubkey, "secret plan ✓", "")
    assert rumor.has_valid_id()
    assert not rumor.is_signed
    assert not verify_event(rumor)
    assert opened.recipient == AGENT.pubkey


def test_a_forged_seal_is_refused() -> None:
    """A seal signed by one key around a rumor that names another author (impersonation) opens to nothing:
    nostr-sdk refuses it, and the rumor's author must equal the seal's anyway."""
    forged = forged_wrap(OTHER, rumor_dict(PERSON, "I am the owner"), AGENT.pubkey)
    assert wraps().open(forged) in (WrapRefusal.UNREADABLE, WrapRefusal.SEAL_AUTHOR_MISMATCH)
    honest = forged_wrap(PERSON, rumor_dict(PERSON, "I am the owner"), AGENT.pubkey)
    assert isinstance(wraps().open(honest), OpenedWrap)  # the same construction, sealed by the author, opens


def test_wraps_that_cannot_be_used_are_refused_with_a_reason_never_raised() -> None:
    """A wrap for a key that is no agent's, one encrypted to another key, one whose content is garbage, one
    that is no wrap, a rumor whose id is not its hash, and a rumor of another kind each give their reason."""
    gifts = wraps()
    assert gifts.open(wrapped_by(PERSON, OTHER.pubkey, rumor_dict(PERSON, "x"))) is WrapRefusal.NOT_FOR_AN_AGENT
    misaddressed = wrapped_by(PERSON, OTHER.pubkey, rumor_dict(PERSON, "x"))
    retagged = sign_event(OTHER, misaddressed.content, kind=1059, tags=[["p", AGENT.pubkey]])
    assert gifts.open(retagged) is WrapRefusal.UNREADABLE
    garbage = sign_event(OTHER, "not encrypted at all", kind=1059, tags=[["p", AGENT.pubkey]])
    assert gifts.open(garbage) is WrapRefusal.UNREADABLE
    assert gifts.open(sign_event(PERSON, "hi", kind=1, tags=[["p", AGENT.pubkey]])) is WrapRefusal.NOT_A_WRAP
    lying = {**rumor_dict(PERSON, "x"), "id": "0" * 64}
    assert gifts.open(wrapped_by(PERSON, AGENT.pubkey, lying)) is WrapRefusal.BAD_RUMOR
    reaction = rumor_dict(PERSON, "+", kind=7)
    assert gifts.open(wrapped_by(PERSON, AGENT.pubkey, reaction)) is WrapRefusal.UNSUPPORTED_KIND


def test_an_agents_rumor_wrapped_here_opens_for_its_recipient_with_nostr_sdk() -> None:
    """The agent's rumor wrapped for the person is a valid kind-1059 event by a one-time key, p-tagging the
    person, that nostr-sdk opens with the person's key to the very rumor, sealed by the agent."""
    rumor = make_rumor(AGENT.pubkey, "the answer", [["p", PERSON.pubkey]], NOW)
    wrap = wraps().wrap(rumor, PERSON.pubkey)
    assert wrap.kind == 1059
    assert wrap.tags == [["p", PERSON.pubkey]]
    assert wrap.pubkey not in (AGENT.pubkey, PERSON.pubkey)
    assert verify_event(wrap)
    assert "the answer" not in wrap.content
    opened = UnwrappedGift.from_gift_wrap(Keys.parse(PERSON.secret), sdk_event(wrap))
    assert opened.sender().to_hex() == AGENT.pubkey
    assert json.loads(opened.rumor().as_json())["id"] == rumor.id
    with pytest.raises(GiftWrapError):
        wraps().wrap(make_rumor(OTHER.pubkey, "not ours", [], NOW), PERSON.pubkey)


def test_an_unsigned_event_from_a_relay_is_refused_and_a_rumor_stays_a_valid_stored_event() -> None:
    """An event with an empty ``sig`` sent by a relay is refused as a bad signature (a rumor is only ever
    taken from a wrap), while the rumor itself validates as a stored event whose id is checked."""
    rumor = make_rumor(PERSON.pubkey, "hello", [["p", AGENT.pubkey]], NOW)
    frame = json.dumps(["EVENT", "sub", rumor.to_dict()])
    refused = parse_relay_frame(frame)
    assert isinstance(refused, Rejection)
    assert refused.reason is RejectReason.BAD_SIGNATURE
    assert NostrEvent.model_validate_json(rumor.model_dump_json()) == rumor
    assert rumor.id == compute_event_id(PERSON.pubkey, NOW, 14, [["p", AGENT.pubkey]], "hello")


def spec(root: NostrEvent, trigger: NostrEvent, **extra: Any) -> ReplySpec:
    """The agent's reply to ``trigger`` in the conversation rooted at ``root``."""
    return ReplySpec(agent_slug="agent", trigger=trigger, root=root, content="the answer",
                     destinations=(PERSON.pubkey,), phase="chat", net_time_seconds=3, **extra)


def test_a_reply_in_a_private_conversation_is_an_unsigned_rumor_and_others_are_the_inner_composers() -> None:
    """In a conversation rooted at a kind-14 rumor the reply is a kind-14 rumor (p the person, e the
    trigger, the subject, the completion tag; no public threading or project tags); elsewhere it is
    whatever the inner composer makes."""
    composer = PrivateReplyComposer(PlainComposer({"agent": AGENT}), {"agent": AGENT.pubkey}, clock=lambda: NOW)
    root = make_rumor(PERSON.pubkey, "hi", [["p", AGENT.pubkey], ["subject", "Launch"]], NOW - 5)
    reply = composer.compose(spec(root, root, complete=True))
    assert (reply.kind, reply.pubkey, reply.sig, reply.created_at) == (14, AGENT.pubkey, "", NOW)
    assert reply.tags == [["p", PERSON.pubkey], ["e", root.id, "", "reply"], ["subject", "Launch"],
                          ["tool", "complete"]]
    assert reply.has_valid_id()
    public_root = sign_event(PERSON, "hi", kind=11, tags=[["p", AGENT.pubkey]])
    public = composer.compose(spec(public_root, public_root))
    assert public.kind == 1111
    assert verify_event(public)


async def test_a_rumor_is_published_only_as_gift_wraps_each_kept_until_a_relay_took_it() -> None:
    """A rumor goes out as one wrap per recipient (the person and the agent's own copy), never itself; a
    signed event goes out as it is; a wrap a relay refused is sent again unchanged on the next try, and
    the one already accepted is not sent twice."""
    inner = FakePublisher()
    publisher = GiftWrapPublisher(inner, wraps())
    signed = sign_event(AGENT, "public", kind=1111)
    await publisher.publish(signed)
    assert inner.published == [signed]
    rumor = make_rumor(AGENT.pubkey, "private answer", [["p", PERSON.pubkey]], NOW)
    assert wrap_recipients(rumor) == [PERSON.pubkey, AGENT.pubkey]

    class FlakyPublisher(FakePublisher):
        """Refuses the first wrap for the agent, like a relay that blinked."""

        blinked = False
        refused: ClassVar[list[str]] = []

        async def publish(self, event: NostrEvent) -> None:
            if event.tag_value("p") == AGENT.pubkey and not self.blinked:
                self.refused.append(event.id)
                self.blinked = True
                raise RuntimeError("relay blinked")
            await super().publish(event)

    flaky = FlakyPublisher()
    publisher = GiftWrapPublisher(flaky, wraps())
    with pytest.raises(GiftWrapError):
        await publisher.publish(rumor)
    await publisher.publish(rumor)
    sent = flaky.published
    assert [w.tag_value("p") for w in sent] == [PERSON.pubkey, AGENT.pubkey]
    assert all(w.kind == 1059 and "private answer" not in w.content for w in sent)
    assert publisher.wraps_published == 2
    assert flaky.refused == [sent[1].id]  # the wrap tried again is the one refused, not a new one
    for recipient, wrap in zip((PERSON, AGENT), sent, strict=True):
        opened = UnwrappedGift.from_gift_wrap(Keys.parse(recipient.secret), sdk_event(wrap))
        assert json.loads(opened.rumor().as_json())["id"] == rumor.id


@dataclass
class RefusingPublisher(FakePublisher):
    """A relay that takes nothing while ``down``; records what it was offered."""

    down: bool = True
    offered: list[str] = field(default_factory=list)

    async def publish(self, event: NostrEvent) -> None:
        """Refuse while down, else take it."""
        self.offered.append(event.id)
        if self.down:
            raise RuntimeError("relay down")
        await super().publish(event)


async def test_wraps_not_accepted_before_a_restart_are_sent_again_unchanged_after_it() -> None:
    """A rumor's wraps are stored before the first is sent: after a restart (a new publisher over the same
    store) the outbox's retry sends the very same wraps, so a person whose relay took one before the crash
    gets the answer once; once all are accepted they stay stored (a publication again sends them too). A
    daemon taken over hands its wraps to the one that takes over (stored under that one's key from then on)."""
    store = MemoryStore()
    rumor = make_rumor(AGENT.pubkey, "private answer", [["p", PERSON.pubkey]], NOW)
    down = RefusingPublisher()
    before = GiftWrapPublisher(down, wraps(), store)
    with pytest.raises(GiftWrapError):
        await before.publish(rumor)
    first_tried = list(down.offered)

    up = RefusingPublisher(down=False)
    after = GiftWrapPublisher(up, wraps(), store)
    assert await after.recover() == 1
    await after.publish(rumor)

    assert [w.id for w in up.published] == first_tried
    assert list(json.loads(await store.get_meta(WRAPS_KEY) or "null")) == [rumor.id]
    elsewhere = GiftWrapPublisher(RefusingPublisher(), wraps(), store, key="outbox.wraps.gone")
    with pytest.raises(GiftWrapError):
        await elsewhere.publish(rumor)
    taker = GiftWrapPublisher(RefusingPublisher(), wraps(), store)
    assert await taker.recover(key="outbox.wraps.gone") == 1
    assert list(json.loads(await store.get_meta(WRAPS_KEY) or "{}")) == [rumor.id]


async def test_a_delivered_rumor_published_again_after_a_restart_goes_out_in_the_same_wraps() -> None:
    """A private answer delivered right before a crash (its outbox entry, or its run's journal entry, not yet
    forgotten) is published again after the restart: it goes out in the very wraps the relay took, which the
    relay keeps once, so the person sees the answer once; only the newest DELIVERED_WRAPS_KEPT delivered
    rumors keep their wraps."""
    store = MemoryStore()
    rumor = make_rumor(AGENT.pubkey, "private answer", [["p", PERSON.pubkey]], NOW)
    first = RefusingPublisher(down=False)
    await GiftWrapPublisher(first, wraps(), store).publish(rumor)

    again = RefusingPublisher(down=False)
    restarted = GiftWrapPublisher(again, wraps(), store)
    await restarted.recover()
    await restarted.keep_only(())  # the outbox forgot it before the crash: the run journal publishes it again
    await restarted.publish(rumor)

    assert [w.id for w in again.published] == [w.id for w in first.published]
    later = [make_rumor(AGENT.pubkey, f"answer {n}", [["p", PERSON.pubkey]], NOW) for n in range(DELIVERED_WRAPS_KEPT)]
    for each in later:
        await restarted.publish(each)
    await restarted.publish(rumor)  # forgotten by now: wrapped anew
    assert len(json.loads(await store.get_meta(WRAPS_KEY) or "null")) == DELIVERED_WRAPS_KEPT + 1
    assert {w.id for w in again.published[-2:]}.isdisjoint(w.id for w in first.published)


async def test_the_answer_a_crash_left_waiting_is_the_newest_delivered_after_a_restart() -> None:
    """In a home that delivered DELIVERED_WRAPS_KEPT answers before, the one delivered right before a crash (the
    outbox let it go, its run's journal entry not) counts as the newest delivered after the restart: it keeps
    its wraps and goes out in them again, while the oldest earlier answer's wraps are the ones let go."""
    store = MemoryStore()
    first = RefusingPublisher(down=False)
    before = GiftWrapPublisher(first, wraps(), store)
    earlier = [make_rumor(AGENT.pubkey, f"earlier {n}", [["p", PERSON.pubkey]], NOW + n) for n in range(DELIVERED_WRAPS_KEPT)]
    for each in earlier:
        await before.publish(each)
    last = make_rumor(AGENT.pubkey, "delivered before the crash", [["p", PERSON.pubkey]], NOW + 999)
    await before.publish(last)
    last_wraps = [w.id for w in first.published[-2:]]

    again = RefusingPublisher(down=False)
    restarted = GiftWrapPublisher(again, wraps(), store)
    await restarted.recover()
    await restarted.keep_only(())
    await restarted.publish(last)
    await restarted.publish(earlier[0])

    assert [w.id for w in again.published[:2]] == last_wraps
    assert {w.id for w in again.published[2:]}.isdisjoint(w.id for w in first.published)


class FailingOnce(MemoryStore):
    """A store whose first small-value write fails (the database blinked)."""

    failed = False

    async def set_meta(self, key: str, value: str) -> None:
        """Fail once, then store."""
        if not self.failed:
            self.failed = True
            raise OSError("store unavailable")
        await super().set_meta(key, value)


async def test_wraps_are_sent_only_once_stored_and_those_waiting_for_a_relay_stored_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rumor whose wraps could not be stored sends none (the outbox's retry makes and stores them); wraps
    of rumors the outbox no longer holds are kept as a delivered rumor's are; past the byte limit, the wraps
    of rumors waiting for a relay are kept first, the delivered ones' after them, and what does not fit is
    kept in memory only (written delivered first, oldest first, then the waiting ones)."""
    store = FailingOnce()
    relay = RefusingPublisher(down=False)
    publisher = GiftWrapPublisher(relay, wraps(), store)
    rumor = make_rumor(AGENT.pubkey, "private answer", [["p", PERSON.pubkey]], NOW)
    with pytest.raises(OSError, match="store unavailable"):
        await publisher.publish(rumor)
    assert relay.offered == []
    relay.down = True
    with pytest.raises(GiftWrapError):
        await publisher.publish(rumor)
    assert list(json.loads(await store.get_meta(WRAPS_KEY) or "{}")) == [rumor.id]

    await publisher.keep_only(set())  # no longer in the outbox: delivered before a crash, say
    assert list(json.loads(await store.get_meta(WRAPS_KEY) or "{}")) == [rumor.id]

    one = len(await store.get_meta(WRAPS_KEY) or "")
    monkeypatch.setattr(private, "STORED_WRAPS_BYTES", one + 10)  # room for one rumor's wraps, not two
    later = make_rumor(AGENT.pubkey, "another answer", [["p", PERSON.pubkey]], NOW + 1)
    with pytest.raises(GiftWrapError):
        await publisher.publish(later)
    assert list(json.loads(await store.get_meta(WRAPS_KEY) or "{}")) == [later.id]
    monkeypatch.setattr(private, "STORED_WRAPS_BYTES", 4 * one)
    third = make_rumor(AGENT.pubkey, "a third answer", [["p", PERSON.pubkey]], NOW + 2)
    with pytest.raises(GiftWrapError):
        await publisher.publish(third)
    assert list(json.loads(await store.get_meta(WRAPS_KEY) or "{}")) == [rumor.id, later.id, third.id]


def test_a_resubscription_looks_further_back_by_its_lookback() -> None:
    """A subscription with a lookback (gift wraps are dated up to two days back) asks from its cursor minus
    the window and the lookback; one without asks from the cursor minus the window."""
    subs = Subscriptions(since_window=120)
    wrapped, plain = Subscription("w", [{"kinds": [1059]}], 172_800), Subscription("p", [{"kinds": [1]}])
    for sub in (wrapped, plain):
        subs.advance(sub.sub_id, "ws://r", NOW)
    assert subs.filters_for(wrapped, "ws://r") == [{"kinds": [1059], "since": NOW - 120 - 172_800}]
    assert subs.filters_for(plain, "ws://r") == [{"kinds": [1], "since": NOW - 120}]


async def test_a_rumor_whose_wraps_every_relay_refuses_for_good_is_refused_for_good() -> None:
    """When every wrap still owed was refused for good (over a relay's size limit: ``blocked:``), the
    publish raises EventRefusedError with the relays' words, each once (both wraps were refused alike: the
    person's notice quotes it once), and the wraps are forgotten (the outbox then tells the person, as for a
    public reply); a rumor that cannot even be wrapped is refused the same way."""
    rumor = make_rumor(AGENT.pubkey, "x" * 500, [["p", PERSON.pubkey]], NOW)
    publisher = GiftWrapPublisher(FakePublisher(refuse_over=100), wraps())

    with pytest.raises(EventRefusedError) as caught:
        await publisher.publish(rumor)

    assert len(caught.value.reasons) == 1  # the person's wrap and the agent's own copy: the same words
    assert caught.value.reasons[0].startswith("blocked: event size")
    assert rumor.id not in publisher._made

    class Unwrappable:
        def wrap(self, rumor: NostrEvent, recipient: str) -> NostrEvent:
            raise ValueError("message too long")

    with pytest.raises(EventRefusedError, match="cannot be gift-wrapped: message too long"):
        await GiftWrapPublisher(FakePublisher(), Unwrappable()).publish(rumor)  # type: ignore[arg-type]
