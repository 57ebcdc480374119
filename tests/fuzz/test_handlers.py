"""Hypothesis fuzzing of the handlers: signed events that pass the codec, from the owner, a whitelisted
person, strangers and the agents themselves, of any kind and with any tags, go through what the daemon
runs on each relay frame (a relay connection's reader, the relay pool's delivery with its dedupe and
lanes, the daemon's intake and the production pipeline of ``tests/pipeline.py``), and the pipeline
keeps its promises: nothing escapes, every event is stored, answered (alone, or with the later messages
that reached the busy agent: a burst is answered once) or refused with a reason, no trigger is answered
twice by an agent, nothing is stored twice (also when an event is handed over again
past the pool's dedupe, as a second daemon on the database would), and the pipeline still answers after.

``scale`` sizes it: a few dozen scenarios under ``scripts/test``, over a thousand under ``scripts/faults``
(``TENEX_FAULTS_FULL=1``); the test records its figures.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Final

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nostr_sdk import Keys, PublicKey, UnsignedEvent, nip59_make_gift_wrap

from tenex_daemon.adapters.nostr.classifier import conversation_lane
from tenex_daemon.adapters.nostr.codec import PublicKeyCache
from tenex_daemon.adapters.nostr.private import GiftWraps, PrivateReplyComposer
from tenex_daemon.adapters.nostr.relay_pool import PoolSettings, ReceivedEvent, RelaySpec, Remember
from tenex_daemon.adapters.nostr.relay_pool.connection import RelayConnection
from tenex_daemon.adapters.nostr.relay_pool.delivery import Delivery
from tenex_daemon.adapters.nostr.relay_pool.subscriptions import Subscription, Subscriptions
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.search import SearchQuery
from tenex_daemon.core.targeting import SkipReason
from tenex_daemon.services.dispatcher import HandleResult, Outcome
from tenex_daemon.services.private_messages import Intake
from tenex_daemon.testing import EventFactory, KeyPair, make_agent, sign_event
from tenex_daemon.testing.fakes import PlainComposer, signers_for
from tests.conftest import Cast
from tests.evidence import record, scale
from tests.pipeline import Rig, build_rig, cast_keys

pytestmark = [pytest.mark.slow]

SCENARIOS: Final = scale(40, 1_200)
URL: Final = "wss://fuzz.invalid"
SUB: Final = "mentions"
NOW: Final = int(time.time())
STRANGERS: Final = [KeyPair.from_seed(seed) for seed in (701, 702)]
UNKNOWN: Final = KeyPair.from_seed(703).pubkey
"""A key nobody here holds: p-tagging it addresses the event elsewhere."""


def _cast() -> Cast:
    alice, alice_keys = make_agent("alice", "Alice", 611)
    bob, bob_keys = make_agent("bob", "Bob", 612)
    orchestrator, orchestrator_keys = make_agent("orchestrator", "Orchestrator", 613, orchestrator=True)
    return Cast(
        user=KeyPair.from_seed(601), other_user=KeyPair.from_seed(602), project=KeyPair.from_seed(603),
        alice=alice, alice_keys=alice_keys, bob=bob, bob_keys=bob_keys,
        orchestrator=orchestrator, orchestrator_keys=orchestrator_keys, factory=EventFactory(),
    )


CAST: Final = _cast()
OWNER: Final = CAST.user
WHITELISTED: Final = CAST.other_user
AGENT_KEYS: Final = cast_keys(CAST)
AGENT_PUBKEYS: Final = frozenset(k.pubkey for k in AGENT_KEYS.values())
AUTHORS: Final = {
    "owner": OWNER, "whitelisted": WHITELISTED, "stranger": STRANGERS[0], "stranger2": STRANGERS[1],
    "alice": CAST.alice_keys, "bob": CAST.bob_keys, "orchestrator": CAST.orchestrator_keys,
    "project": CAST.project,
}
IGNORED: Final = HandleResult(Outcome.IGNORED, "not handed")


# --- the events -----------------------------------------------------------------------------------


@dataclass
class Plan:
    """One scenario: the events a relay sends, in order (some twice), and what the test expects of them."""

    events: list[NostrEvent] = field(default_factory=list)
    resend: list[int] = field(default_factory=list)
    """Indexes of events a relay sends again later (redelivery, a second relay)."""
    whitelist_may_join: bool = False


kinds = st.one_of(
    st.sampled_from([1, 11, 1111]),
    st.sampled_from([1, 11, 1111, 14, 24133, 24134, 513, 4199, 0, 1934, 7, 1059]),
    st.integers(0, 65535),
)
hex_ids = st.text("0123456789abcdef", min_size=64, max_size=64)
bad_values = st.sampled_from(["", "xyz", "A" * 64, "0" * 63, "0" * 65, "31933:", "npub1abc", " ", "\x00"])
contents = st.one_of(
    st.text(max_size=80),
    st.sampled_from(["", "\x00", "a\x00b", "@bob please", "@alice and @bob", "@nobody", "😀" * 50, "\u2028"]),
    st.integers(1_000, 30_000).map(lambda n: "long " * (n // 5)),
)
lookalike_numbers = st.text(st.sampled_from("0123456789²³¹⁰⁴⁹½٣١٠２５۵߀᠐Ⅻ"), min_size=1, max_size=4)
"""Digits of every script, superscripts and fractions: numbers to some readers, not to others."""
tag_names = st.sampled_from(["p", "e", "E", "a", "k", "K", "P", "phase", "claude-session", "tool", "title",
                             "delegation", "subject", "error", "t", "d", "q", ""])
phases = st.sampled_from(["chat", "plan", "execute", "verification", "chores", "reflection", "brainstorm", "nope", ""])


@st.composite
def a_tag(draw: st.DrawFn, earlier: list[NostrEvent]) -> list[str]:
    """One tag: p of agents, the project, people or unknown keys; e/E of earlier events (or bad values);
    k/K kinds; a project address; phase, claude-session, tool, title, delegation; or anything."""
    name = draw(st.sampled_from(["p", "e", "E"]) | tag_names)
    refs = st.sampled_from([e.id for e in earlier]) if earlier else hex_ids
    if name in ("p", "P"):
        value = draw(st.sampled_from([*AGENT_PUBKEYS, CAST.project.pubkey, OWNER.pubkey, WHITELISTED.pubkey,
                                      UNKNOWN, STRANGERS[0].pubkey]) | bad_values)
    elif name in ("e", "E", "q"):
        value = draw(refs | refs | hex_ids | bad_values)
    elif name in ("k", "K"):
        value = draw(st.sampled_from(["1", "11", "1111", "1934", "14", "-1", "abc", "", "99999999999"]) | lookalike_numbers)
    elif name == "a":
        value = draw(st.sampled_from([f"31933:{OWNER.pubkey}:project", f"30023:{OWNER.pubkey}:article"]) | bad_values)
    elif name == "phase":
        value = draw(phases)
    elif name == "tool":
        value = draw(st.sampled_from(["complete", "send_message", ""]))
    else:
        value = draw(st.text(max_size=20))
    extra = draw(st.lists(st.sampled_from(["", "root", "reply", "mention", "wss://r.example"]) | st.text(max_size=8), max_size=3))
    return draw(st.sampled_from([[name], [name, value], [name, value, *extra]]))


@st.composite
def gift_wrap(draw: st.DrawFn, at: int) -> NostrEvent:
    """A NIP-17 message gift-wrapped by nostr-sdk, from anyone to an agent, with any rumor kind and tags."""
    sender = AUTHORS[draw(st.sampled_from(sorted(AUTHORS)))]
    to = draw(st.sampled_from(sorted(AGENT_PUBKEYS)))
    tags = draw(st.sampled_from([[["p", to]], [["p", to], ["p", UNKNOWN]], [], [["p", to], ["e", "0" * 64]]]))
    rumor = {"pubkey": sender.pubkey, "created_at": at, "kind": draw(st.sampled_from([14, 14, 1, 11])),
             "content": draw(st.text(max_size=40)), "tags": tags}
    made = nip59_make_gift_wrap(Keys.parse(sender.secret), PublicKey.parse(to), UnsignedEvent.from_json(json.dumps(rumor)))
    return NostrEvent.model_validate_json(made.as_json())


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    """A scenario of 2 to 14 events, each signed by one of the cast (or a stranger) and dated from the
    past up to nearly a day ahead (the codec refuses later), some referring to earlier ones."""
    plan = Plan(whitelist_may_join=draw(st.booleans()))
    count = draw(st.integers(2, 14))
    at = NOW - draw(st.integers(0, 400_000))
    for _ in range(count):
        at += draw(st.integers(-3_600, 7_200))
        when = min(at, NOW + 80_000)
        kind = draw(kinds)
        if kind == 1059 and draw(st.booleans()):
            plan.events.append(draw(gift_wrap(when)))
            continue
        author = AUTHORS[draw(st.sampled_from(["owner", "whitelisted"]) | st.sampled_from(sorted(AUTHORS)))]
        tags = draw(st.lists(a_tag(plan.events), max_size=8))
        if draw(st.integers(0, 20)) == 0:  # a huge tag list
            tags += [["t", str(n)] for n in range(draw(st.integers(100, 1_999 - len(tags))))]
        plan.events.append(sign_event(author, draw(contents), kind=kind, tags=tags, created_at=max(0, when)))
    plan.resend = draw(st.lists(st.integers(0, count - 1), max_size=4))
    return plan


# --- the daemon's intake over the rig -------------------------------------------------------------


class LogSpy:
    """Stands in for the connection's logger: keeps every ``exception`` call."""

    def __init__(self) -> None:
        self.exceptions: list[str] = []

    def bind(self, **_: object) -> LogSpy:
        return self

    def info(self, *_: object, **__: object) -> None:
        pass

    def warning(self, *_: object, **__: object) -> None:
        pass

    def exception(self, message: str, **_: object) -> None:
        self.exceptions.append(f"{message}: {sys.exc_info()[1]!r}")


@dataclass
class Daemonish:
    """What ``Daemon`` runs per relay frame, over the rig: connection -> delivery -> intake -> dispatcher."""

    rig: Rig
    intake: Intake
    handed: Counter[str] = field(default_factory=Counter)
    """Event id -> how many times the delivery handed it to the consumer."""
    results: dict[str, HandleResult] = field(default_factory=dict)
    """Dispatched event id (a wrap's rumor in its place) -> its result."""
    rumors: dict[str, str] = field(default_factory=dict)
    """Gift wrap id -> the id of the rumor the intake admitted in its place."""
    errors: list[str] = field(default_factory=list)
    spy: LogSpy = field(default_factory=LogSpy)
    delivery: Delivery | None = None
    conn: RelayConnection | None = None

    async def start(self) -> None:
        settings = PoolSettings(delivery_lanes=16, drain_timeout=30.0, retry_base=60.0)
        subscriptions = Subscriptions(settings.since_window)
        await subscriptions.add(Subscription(SUB, [{"kinds": [1, 11, 1111, 1934]}]), [URL], None)
        self.delivery = Delivery(
            settings, subscriptions.advance, on_event=self.on_event, store=self.rig.store, lane_key=conversation_lane
        )
        self.delivery.start()
        self.conn = RelayConnection(
            RelaySpec(URL), settings, subscriptions=subscriptions, sink=self.delivery,
            key_cache=PublicKeyCache(), auth_signer=None, spawn=lambda coro, name: None,
        )
        self.conn.log = self.spy

    async def on_event(self, received: ReceivedEvent) -> Remember | None:
        """``Daemon._on_event``: the intake admits (a wrap's rumor in its place), the dispatcher handles."""
        event = received.event
        self.handed[event.id] += 1
        admitted = self.intake.admit(event)
        if isinstance(admitted, str):  # refused by the intake (a wrap that does not open, a rumor in the clear)
            self.results[event.id] = HandleResult(Outcome.IGNORED, admitted)
            return None
        if admitted is not event:
            self.rumors[event.id] = admitted.id
        try:
            result = await self.rig.dispatcher.handle(admitted)
        except Exception as exc:  # the daemon counts it and the pool retries: here it is a failure
            self.errors.append(f"{type(exc).__name__}: {exc}")
            raise
        self.results[admitted.id] = result
        if result.outcome is Outcome.IGNORED and result.reason == SkipReason.AUTHOR_NOT_ALLOWED.value:
            return Remember.IN_MEMORY
        return None

    async def redeliver(self, event: NostrEvent) -> HandleResult:
        """The event handed over again past the pool's dedupe (another daemon on the database, a lost
        ledger): the intake, then the dispatcher."""
        admitted = self.intake.admit(event)
        if isinstance(admitted, str):
            return HandleResult(Outcome.IGNORED, admitted)
        try:
            return await self.rig.dispatcher.handle(admitted)
        except Exception as exc:
            self.errors.append(f"{type(exc).__name__} (redelivered): {exc}")
            raise

    async def send(self, events: list[NostrEvent]) -> None:
        """Each event as a relay's EVENT frame, then wait until the delivery handed every one over."""
        assert self.conn is not None
        assert self.delivery is not None
        for event in events:
            await self.conn._on_frame(json.dumps(["EVENT", SUB, event.to_dict()], ensure_ascii=False))
        await self._delivered()

    async def _delivered(self) -> None:
        assert self.delivery is not None
        queue = self.delivery._queue
        assert queue is not None
        async with asyncio.timeout(30):
            await queue.join()

    async def stop(self) -> None:
        assert self.delivery is not None
        await self.delivery.stop()


def make_rig(plan: Plan) -> tuple[Rig, Intake]:
    """The production pipeline for the cast (the owner, one whitelisted person), with the daemon's private
    composer and gift-wrap intake over the agents' real keys."""
    composer = PrivateReplyComposer(PlainComposer(AGENT_KEYS), {a.slug: a.pubkey for a in CAST.agents})
    rig = build_rig(
        CAST, composer=composer, whitelist=[WHITELISTED.pubkey], whitelist_may_join=plan.whitelist_may_join,
        hop_limit=3,
    )
    return rig, Intake(GiftWraps(signers_for(AGENT_KEYS)), rig.manager.agents)


# --- the invariants -------------------------------------------------------------------------------


async def stored_events(rig: Rig) -> tuple[Counter[str], dict[str, tuple[str, int]]]:
    """Event id -> in how many conversations' histories (counting repeats within one) it is; and event id ->
    (its conversation, its place in that history)."""
    counts: Counter[str] = Counter()
    places: dict[str, tuple[str, int]] = {}
    for row in await rig.store.search(SearchQuery()):
        conversation = await rig.store.load(row.id)
        assert conversation is not None
        counts.update(event.id for event in conversation.history)
        places.update((event.id, (row.id, index)) for index, event in enumerate(conversation.history))
    return counts, places


def answered_in_burst(
    agent: str, event_id: str, answered: set[tuple[str, str]], places: dict[str, tuple[str, int]]
) -> bool:
    """Whether ``agent`` answered a later message of ``event_id``'s conversation: messages that reach a busy
    agent are answered once, as a burst, by its reply to the newest (docs/CONTEXT.md, "Bursts")."""
    conversation_id, index = places[event_id]
    return any(
        who == agent and trigger in places and places[trigger][0] == conversation_id and places[trigger][1] > index
        for who, trigger in answered
    )


def answers(rig: Rig) -> Counter[tuple[str, str, bool]]:
    """(agent, the event it answers, is an error notice) -> replies published."""
    counts: Counter[tuple[str, str, bool]] = Counter()
    for event in rig.publisher.published:
        trigger = event.tag_value("e")
        if event.pubkey in AGENT_PUBKEYS and trigger is not None:
            counts[(event.pubkey, trigger, event.has_tag("error", "system"))] += 1
    return counts


async def check(plan: Plan, daemon: Daemonish, again: dict[str, HandleResult], tally: Counter[str]) -> None:
    """The invariants of one scenario (see the test's docstring); ``again``: the results of the events
    handed over a second time past the pool's dedupe."""
    rig = daemon.rig
    assert not daemon.errors, f"the dispatcher raised: {daemon.errors[:3]}"
    assert not daemon.spy.exceptions, f"the connection logged exceptions: {daemon.spy.exceptions[:3]}"
    assert daemon.delivery is not None
    assert daemon.delivery.consumer_errors == 0
    assert daemon.delivery.retrying == 0
    assert max(daemon.handed.values(), default=0) <= 1, "the delivery handed an event over twice"
    stored, places = await stored_events(rig)
    assert max(stored.values(), default=0) <= 1, f"stored twice: {[i for i, n in stored.items() if n > 1][:3]}"
    for event in plan.events:
        if event.id not in daemon.handed:
            continue  # a copy the codec or the delivery dropped (counted there)
        event_id = daemon.rumors.get(event.id, event.id)
        result = daemon.results[event_id]
        tally[result.outcome.value] += 1
        if result.outcome is Outcome.IGNORED:
            assert result.reason, f"ignored without a reason: {event!r:.300}"
            tally[f"ignored:{result.reason.split(':')[0]}"] += 1
            assert event_id not in stored, f"ignored ({result.reason}) but stored: {event!r:.300}"
        elif result.outcome is Outcome.DUPLICATE:
            pass
        elif event.kind != 24134:  # a stop request is recorded in its conversation, not added to history
            assert event_id in stored, f"{result} but not stored: {event!r:.300}"
            if event.id in again:
                second = again[event.id]
                assert second.outcome is Outcome.DUPLICATE, f"handed over again: {second} for {event!r:.300}"
                tally["redelivered_duplicate"] += 1
        if result.reason == SkipReason.AUTHOR_NOT_ALLOWED.value:
            assert not await rig.store.is_processed(event.id), "a stranger's event was written to the store"
    replies = answers(rig)
    twice = [key for key, n in replies.items() if n > 1]
    assert not twice, f"answered twice: {twice[:3]}"
    stopped = any(e.kind == 24134 and daemon.results.get(e.id, IGNORED).outcome is Outcome.STORED for e in plan.events)
    answered = {(agent, trigger) for agent, trigger, _ in replies}
    for event_id, result in daemon.results.items():
        if result.outcome is Outcome.SCHEDULED and not stopped:  # a stop may cancel a run before its reply
            for slug in result.agents:
                agent = AGENT_KEYS[slug].pubkey
                if (agent, event_id) not in answered:
                    assert answered_in_burst(agent, event_id, answered, places), f"{slug} never answered {event_id}"
                    tally["answered_in_burst"] += 1
    published = [e for e in rig.publisher.published if e.pubkey in AGENT_PUBKEYS and e.kind != 14]
    for reply in published:
        assert reply.id in stored, "a published reply that was never saved"
    tally["replies"] += len(replies)


async def scenario(plan: Plan, tally: Counter[str]) -> None:
    """The plan's events (and their copies, then the relay's echo of every reply) go in; the invariants
    hold; then a new message of the owner is still answered."""
    rig, intake = make_rig(plan)
    daemon = Daemonish(rig, intake)
    await daemon.start()
    try:
        await daemon.send(plan.events + [plan.events[i] for i in plan.resend])
        await rig.quiet(30)
        await daemon.send(list(rig.publisher.published))  # the relays echo the replies: duplicates
        await rig.quiet(30)
        again = {plan.events[i].id: await daemon.redeliver(plan.events[i]) for i in sorted(set(plan.resend))}
        await rig.quiet(30)
        await check(plan, daemon, again, tally)
        # still running: the owner's new conversation with alice is answered once
        probe = sign_event(OWNER, "still there?", kind=11, tags=[["p", CAST.alice.pubkey]], created_at=NOW)
        await daemon.send([probe])
        await rig.settle(30)
        assert daemon.results[probe.id].outcome is Outcome.SCHEDULED, daemon.results[probe.id]
        assert answers(rig)[(CAST.alice.pubkey, probe.id, False)] == 1, "the pipeline stopped answering"
    finally:
        await daemon.stop()
    tally["events"] += len(plan.events)
    tally["frames"] += len(plan.events) + len(plan.resend)
    tally["handed"] += len(daemon.handed)
    tally["scenarios"] += 1


def test_fuzzed_events_are_stored_answered_once_or_refused_with_a_reason() -> None:
    """Events of any kind and tags from the owner, a whitelisted person, strangers, the agents and the
    project, fed as relay frames through the connection, the pool's delivery and the daemon's intake into
    the production pipeline, never raise; each is stored (and its scheduled agents answer) or refused with
    a reason, no agent answers an event twice, no event is stored twice (one handed over again past the
    pool's dedupe is a duplicate), strangers leave nothing in the store, and the pipeline still answers a
    new message afterwards."""
    tally: Counter[str] = Counter()

    @settings(
        max_examples=SCENARIOS, deadline=None, derandomize=True, database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(plans())
    def fuzz(plan: Plan) -> None:
        asyncio.run(scenario(plan, tally))

    fuzz()
    assert tally["scenarios"] >= SCENARIOS
    assert tally[Outcome.SCHEDULED.value] > 0
    assert tally[Outcome.IGNORED.value] > 0
    record(
        "fuzz.handlers",
        scenarios=tally["scenarios"],
        events=tally["events"],
        frames=tally["frames"],
        handed=tally["handed"],
        scheduled=tally[Outcome.SCHEDULED.value],
        stored=tally[Outcome.STORED.value],
        ignored=tally[Outcome.IGNORED.value],
        redelivered_duplicates=tally["redelivered_duplicate"],
        replies=tally["replies"],
        reasons=len([k for k in tally if k.startswith("ignored:")]),
        crashes=0,
    )



async def test_a_kind_tag_of_digits_int_cannot_read_is_no_kind_not_a_crash() -> None:
    """A reply whose ``K``/``k`` tag holds characters that are digits to ``str.isdigit`` but not to ``int``
    (superscripts; found by this fuzzing as a ValueError escaping the dispatcher, so the pool retried the
    event forever) is handled like a reply naming no kind: stored in its thread and answered."""
    rig, _ = make_rig(Plan())
    root = sign_event(OWNER, "root", kind=11, tags=[["p", CAST.alice.pubkey]], created_at=NOW)
    assert (await rig.dispatcher.handle(root)).outcome is Outcome.SCHEDULED
    for value in ("²", "1⁹³⁴", "᠐⁴2³"):
        tags = [["E", root.id, "", OWNER.pubkey], ["K", value], ["e", root.id], ["k", value], ["p", CAST.alice.pubkey]]
        reply = sign_event(OWNER, value, kind=1111, tags=tags, created_at=NOW)
        result = await rig.dispatcher.handle(reply)
        assert result.outcome is Outcome.SCHEDULED, result
        assert result.conversation_id == root.id
    await rig.settle()
