"""NIP-17 private messages at the Nostr edge: gift wraps opened and made by nostr-sdk (NIP-44 encryption,
NIP-59 seal and gift wrap), never by hand-written crypto (docs/PROTOCOL.md, "Private conversations").

- :class:`GiftWraps` opens a kind-1059 wrap addressed to one of the agents with that agent's key and
  returns its kind-14 rumor as a :class:`~tenex_daemon.core.events.NostrEvent` with an empty ``sig``
  (a rumor is unsigned: its authenticity is the seal's signature, which nostr-sdk checks, and the seal's
  author must be the rumor's: checked here too). Its id must be the NIP-01 hash of its fields. It
  also wraps an agent's rumor for one recipient (sealed by the agent, wrapped by a one-time key).
- :class:`PrivateReplyComposer` composes an agent's reply in a private conversation (its root a kind-14
  rumor) as an unsigned kind-14 rumor; every other reply is the inner composer's.
- :class:`GiftWrapPublisher` never puts a rumor on a relay: it publishes one gift wrap per recipient
  (the rumor's ``p`` tags and its author, so the agent's own copy survives a rebuild), made once per
  rumor and kept, in the store too, until a relay accepted each and for the newest delivered rumors
  after that (a restart, or a saved reply published again, sends the same wraps, so a person never gets
  an answer twice); signed events go to the inner publisher unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

import structlog
from nostr_sdk import (
    Event,
    Keys,
    NostrSdkError,
    PublicKey,
    UnsignedEvent,
    UnwrappedGift,
    nip59_make_gift_wrap,
)
from pydantic import ValidationError

from tenex_daemon.core.errors import EventRefusedError
from tenex_daemon.core.events import NostrEvent, compute_event_id
from tenex_daemon.core.ports import Publisher, ReplyComposer, ReplySpec, SmallValues
from tenex_daemon.core.vocabulary import (
    KIND_GIFT_WRAP,
    KIND_PRIVATE_MESSAGE,
    TAG_PUBKEY,
)

from .codec import private_reply_tags
from .composer import reply_created_at
from .signer import Signer

log = structlog.get_logger(__name__)

PENDING_WRAPS_MEMORY: Final = 10_000
"""Rumors whose wraps are kept for a retry (a rumor leaves once a relay accepted each of its wraps)."""
DELIVERED_WRAPS_KEPT: Final = 32
"""Rumors whose wraps were all accepted that keep them (the newest): a saved reply published again (a
crash before its outbox entry or its run's journal entry left) goes out in the same wraps."""
WRAPS_KEY: Final = "outbox.wraps"
"""Where a home keeps the wraps it made (daemons sharing a database: one key each)."""
STORED_WRAPS_BYTES: Final = 1 << 20
"""The most the stored wraps take (a long relay outage must not make each save rewrite megabytes)."""


class WrapRefusal(StrEnum):
    """Why a gift wrap gives no private message (counted and logged by the daemon)."""

    NOT_A_WRAP = "not_a_gift_wrap"
    NOT_FOR_AN_AGENT = "wrap_not_for_an_agent"
    UNREADABLE = "wrap_unreadable"
    """It does not decrypt with the agent's key, or its seal does not verify (nostr-sdk refused it)."""
    SEAL_AUTHOR_MISMATCH = "seal_author_mismatch"
    BAD_RUMOR = "bad_rumor"
    """The rumor is not a NIP-01 event (shape), or its id is not the hash of its fields."""
    UNSUPPORTED_KIND = "private_kind_unsupported"
    """A rumor of another kind than 14 (a file message, a reaction...)."""


@dataclass(frozen=True, slots=True)
class OpenedWrap:
    """A gift wrap's rumor and the agent it was addressed to (its public key)."""

    rumor: NostrEvent
    recipient: str


class GiftWrapError(RuntimeError):
    """A rumor could not be wrapped, or not every wrap of it reached a relay (the outbox tries again)."""


def _keys_of(signer: Signer) -> Keys:
    return Keys.parse(signer.secret_hex())


def rumor_from_json(text: str) -> NostrEvent:
    """The rumor in ``text`` (NIP-01 fields, no signature) as an event with an empty ``sig``; raise
    ValueError when a field is missing or malformed, or when a given id is not the hash of the fields."""
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError("a rumor is a JSON object")
    try:
        fields = (data["pubkey"], data["created_at"], data["kind"], data["tags"], data["content"])
        computed = compute_event_id(*fields)
        given = data.get("id") or computed
        if given != computed:
            raise ValueError(f"rumor id {given} is not the hash of its fields ({computed})")
        return NostrEvent.model_validate({**data, "id": computed, "sig": ""})
    except (KeyError, TypeError, ValidationError) as exc:
        raise ValueError(f"malformed rumor: {exc}") from None


def rumor_json(rumor: NostrEvent) -> str:
    """The rumor's NIP-01 fields as JSON, without any signature (what is sealed)."""
    data = rumor.to_dict()
    del data["sig"]
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


class GiftWraps:
    """Opens the gift wraps addressed to the agents and wraps the agents' rumors (nostr-sdk, NIP-59)."""

    def __init__(self, signers: Mapping[str, Signer]) -> None:
        """Use ``signers`` (the agents' keys, by slug)."""
        self._keys = {signer.pubkey: _keys_of(signer) for signer in signers.values()}

    def open(self, wrap: NostrEvent) -> OpenedWrap | WrapRefusal:
        """Open a kind-1059 wrap (its id and signature were checked at intake): its rumor, or why not."""
        if wrap.kind != KIND_GIFT_WRAP:
            return WrapRefusal.NOT_A_WRAP
        recipient = wrap.tag_value(TAG_PUBKEY)
        keys = self._keys.get(recipient) if recipient is not None else None
        if keys is None or recipient is None:
            return WrapRefusal.NOT_FOR_AN_AGENT
        try:
            unwrapped = UnwrappedGift.from_gift_wrap(keys, Event.from_json(json.dumps(wrap.to_dict())))
            sender = unwrapped.sender().to_hex()
            rumor_text = unwrapped.rumor().as_json()
        except NostrSdkError as exc:  # not for this key (HMAC), bad padding, a seal that does not verify...
            return _refused(wrap, WrapRefusal.UNREADABLE, str(exc))
        try:
            rumor = rumor_from_json(rumor_text)
        except ValueError as exc:
            return _refused(wrap, WrapRefusal.BAD_RUMOR, str(exc))
        if rumor.pubkey != sender:  # nostr-sdk refuses this too ("sender mismatch"); checked again here
            detail = f"sealed by {sender}, written by {rumor.pubkey}"
            return _refused(wrap, WrapRefusal.SEAL_AUTHOR_MISMATCH, detail)
        if rumor.kind != KIND_PRIVATE_MESSAGE:
            return WrapRefusal.UNSUPPORTED_KIND
        return OpenedWrap(rumor, recipient)

    def wrap(self, rumor: NostrEvent, recipient: str) -> NostrEvent:
        """Seal ``rumor`` with its author's key (one of the agents) and gift-wrap it for ``recipient``."""
        keys = self._keys.get(rumor.pubkey)
        if keys is None:
            raise GiftWrapError(f"no key for the rumor's author {rumor.pubkey}")
        try:
            unsigned = UnsignedEvent.from_json(rumor_json(rumor))
            wrapped = nip59_make_gift_wrap(keys, PublicKey.parse(recipient), unsigned)
            return NostrEvent.model_validate_json(wrapped.as_json())
        except Exception as exc:  # NostrSdkError: a malformed recipient key...
            # whom for stays out of the message: it is logged, and quoted in the notice to the person
            whose = "its author's own copy" if recipient == rumor.pubkey else "its recipient"
            raise GiftWrapError(f"rumor {rumor.id} cannot be wrapped for {whose}: {exc}") from None


def _refused(wrap: NostrEvent, reason: WrapRefusal, error: str) -> WrapRefusal:
    # debug: anyone can send wraps that do not open; the daemon logs them once a minute per reason
    log.debug("gift_wrap_refused", event_id=wrap.id, reason=reason.value, error=error)
    return reason


def wrap_recipients(rumor: NostrEvent) -> list[str]:
    """Who gets a wrap of ``rumor``: every ``p`` it tags, then its author (their own copy), once each."""
    return list(dict.fromkeys([*rumor.tag_values(TAG_PUBKEY), rumor.pubkey]))


def make_rumor(pubkey: str, content: str, tags: list[list[str]], created_at: int) -> NostrEvent:
    """An unsigned kind-14 rumor by ``pubkey`` (its id the NIP-01 hash, its ``sig`` empty)."""
    event_id = compute_event_id(pubkey, created_at, KIND_PRIVATE_MESSAGE, tags, content)
    return NostrEvent(
        id=event_id, pubkey=pubkey, created_at=created_at, kind=KIND_PRIVATE_MESSAGE, tags=tags,
        content=content, sig="",
    )


class PrivateReplyComposer:
    """Replies in a private conversation are kind-14 rumors (:func:`private_reply_tags`); the others are
    composed by ``inner``."""

    def __init__(
        self, inner: ReplyComposer, pubkeys: Mapping[str, str], *, clock: Callable[[], float] = time.time
    ) -> None:
        """``pubkeys``: each agent's public key by slug."""
        self._inner = inner
        self._pubkeys = pubkeys
        self._clock = clock

    def compose(self, spec: ReplySpec) -> NostrEvent:
        """Return the rumor of a reply in a private conversation, else the inner composer's event."""
        if spec.root is None or spec.root.kind != KIND_PRIVATE_MESSAGE:
            return self._inner.compose(spec)
        tags = private_reply_tags(spec)
        created_at = reply_created_at(spec.trigger, self._clock(), spec.after)
        return make_rumor(self._pubkeys[spec.agent_slug], spec.content, tags, created_at)


class GiftWrapPublisher:
    """Publishes through ``inner``, except that a kind-14 rumor is never published itself: each recipient
    (:func:`wrap_recipients`) gets a gift wrap, made once and kept, so that a retry (the outbox's) or a saved
    reply published again sends the same wraps and a person sees one message, not one per try. The wraps
    of a rumor waiting for a relay are kept until it is delivered or refused for good; those of the newest
    :data:`DELIVERED_WRAPS_KEPT` delivered rumors too (a crash can come before the outbox or the run journal
    forgets one: the restart publishes it again)."""

    def __init__(
        self, inner: Publisher, wraps: GiftWraps, values: SmallValues | None = None, key: str = WRAPS_KEY
    ) -> None:
        """Wrap with ``wraps``, publish through ``inner``; the wraps are kept in ``values`` under ``key``
        (none: in memory only)."""
        self._inner = inner
        self._wraps = wraps
        self._values = values
        self._key = key
        self._made: OrderedDict[str, dict[str, NostrEvent]] = OrderedDict()
        """Each rumor's wraps, by recipient: those waiting for a relay and those delivered."""
        self._delivered: OrderedDict[str, None] = OrderedDict()
        """The rumors of ``_made`` whose wraps were all accepted, oldest first."""
        self._unsent: dict[str, set[str]] = {}
        """Per rumor being published: the recipients whose wraps no relay accepted yet (retries send them)."""
        self._saving = asyncio.Lock()
        self.wraps_published = 0

    async def recover(self, key: str | None = None) -> int:
        """Take up the wraps a previous process made (stored under ``key``, by default this publisher's own;
        another's, a daemon taken over, are kept under its own from then on); return how many rumors they
        are for. Until :meth:`keep_only` says which still wait for a relay, they count as waiting."""
        if self._values is None:
            return 0
        raw = await self._values.get_meta(key or self._key)
        if not raw:
            return 0
        try:
            stored = json.loads(raw)
            found = {
                rumor_id: {recipient: NostrEvent.model_validate(wrap) for recipient, wrap in wraps.items()}
                for rumor_id, wraps in stored.items()
            }
        except (ValueError, AttributeError, ValidationError) as exc:
            log.warning("stored_gift_wraps_unreadable", key=key or self._key, error=str(exc)[:200])
            return 0
        for rumor_id, wraps in found.items():
            self._made.setdefault(rumor_id, wraps)
        self._bound()
        if key is not None and key != self._key:
            await self._save()
        return len(found)

    async def keep_only(self, rumor_ids: Collection[str]) -> None:
        """Say which rumors still wait for a relay (``rumor_ids``: those the outbox holds): the others were
        delivered (a crash came between the last wrap's acceptance and the outbox's forgetting it) or
        dropped (an outbox entry dropped at recovery); the newest of them keep their wraps, as delivered
        ones do."""
        for rumor_id in self._made:
            if rumor_id not in rumor_ids and rumor_id not in self._delivered:
                self._delivered[rumor_id] = None
        if self._bound():
            await self._save()

    def _bound(self) -> bool:
        """Forget the oldest delivered rumors past :data:`DELIVERED_WRAPS_KEPT`, and the oldest rumors past
        :data:`PENDING_WRAPS_MEMORY`; return whether any was forgotten."""
        forgot = False
        while len(self._delivered) > DELIVERED_WRAPS_KEPT:
            self._made.pop(self._delivered.popitem(last=False)[0], None)
            forgot = True
        while len(self._made) > PENDING_WRAPS_MEMORY + len(self._delivered):
            rumor_id = self._made.popitem(last=False)[0]
            self._delivered.pop(rumor_id, None)
            self._unsent.pop(rumor_id, None)
            forgot = True
        return forgot

    async def _save(self) -> None:
        """Store the wraps up to :data:`STORED_WRAPS_BYTES` (those past it stay in memory only, as they would
        without a store: each save rewrites the whole value): those waiting for a relay are kept first,
        oldest first, then the delivered ones, newest first. They are written delivered first, oldest
        first, then the waiting ones: read back at a start, that is the order :meth:`keep_only` counts them
        delivered in, the ones a crash left waiting (and the outbox let go) as the newest."""
        if self._values is None:
            return
        async with self._saving:
            waiting = [rumor_id for rumor_id in self._made if rumor_id not in self._delivered]
            kept: dict[str, str] = {}
            size = 0
            for rumor_id in [*waiting, *reversed(self._delivered)]:
                wraps = self._made.get(rumor_id)
                if wraps is None:
                    continue
                part = json.dumps(rumor_id) + ":" + json.dumps(
                    {r: w.to_dict() for r, w in wraps.items()}, separators=(",", ":")
                )
                if size + len(part) > STORED_WRAPS_BYTES:
                    log.debug("gift_wraps_kept_in_memory", left_out=len(self._made) - len(kept))
                    break
                kept[rumor_id] = part
                size += len(part) + 1
            order = [*(r for r in self._delivered if r in kept), *(r for r in waiting if r in kept)]
            await self._values.set_meta(self._key, "{" + ",".join(kept[r] for r in order) + "}")

    async def publish(self, event: NostrEvent) -> None:
        """Publish a signed event as it is; a rumor as its gift wraps (raise unless each reached a relay).

        A rumor's wraps are stored before the first goes out: one that reached a relay before a crash is
        sent again unchanged after it, and relays keep one copy of it. A rumor published again after its
        wraps were delivered (a saved reply a restart publishes again) sends them again unchanged too."""
        if event.kind != KIND_PRIVATE_MESSAGE and event.is_signed:
            await self._inner.publish(event)
            return
        made = self._made.get(event.id)
        if made is None:
            try:
                made = {to: self._wraps.wrap(event, to) for to in wrap_recipients(event)}
            except Exception as exc:  # over NIP-44's size, say: the same rumor never wraps
                reason = f"invalid: cannot be gift-wrapped: {exc}"
                raise EventRefusedError(f"rumor {event.id} cannot be gift-wrapped: {exc}", (reason,)) from exc
            self._made[event.id] = made
            self._bound()
            try:
                await self._save()
            except BaseException:  # nothing sent yet: the retry makes and stores them again
                self._made.pop(event.id, None)
                raise
        self._delivered.pop(event.id, None)
        # a retry sends the wraps not accepted yet; a publication again (after a restart: not known) all
        unsent = self._unsent.setdefault(event.id, set(made))
        failed: list[str] = []
        refused: list[EventRefusedError] = []
        for recipient, wrap in list(made.items()):
            if recipient not in unsent:
                continue
            try:
                await self._inner.publish(wrap)  # one a relay accepted before a crash: it answers duplicate
            except Exception as exc:  # named by role: a person's key stays out of the logs
                failed.append(f"{'own copy' if recipient == event.pubkey else 'recipient'}: {exc}")
                if isinstance(exc, EventRefusedError):
                    refused.append(exc)
                continue
            unsent.discard(recipient)
            self.wraps_published += 1
        if failed and len(refused) == len(failed):  # every wrap left was refused for good: never again
            self._made.pop(event.id, None)
            self._unsent.pop(event.id, None)
            with contextlib.suppress(Exception):
                await self._save()
            reasons = tuple(dict.fromkeys(reason for each in refused for reason in each.reasons))
            raise EventRefusedError(f"wraps of {event.id} refused for good ({'; '.join(failed)})", reasons)
        if failed:
            raise GiftWrapError(f"wraps of {event.id} not accepted by any relay ({'; '.join(failed)})")
        del self._unsent[event.id]
        if event.id in self._made:  # kept for a publication again; no save needed: stored already
            self._delivered[event.id] = None
            self._bound()

    async def typing(self, agent_slug: str, conversation_id: str, active: bool) -> None:
        """Typing indicators go to the inner publisher (the runner sends none for private conversations)."""
        await self._inner.typing(agent_slug, conversation_id, active)

