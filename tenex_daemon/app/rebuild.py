"""Conversations fetched back from the relays, verified and merged into the store (``tenexd
conversations rebuild``): recovery of a home lost with its keys kept (docs/ARCHITECTURE.md, "Delivery").

What is fetched: a conversation's root (by id, whatever its date) and every event of kinds 1, 11,
1111 and 1934 that names it in an ``E`` or ``e`` tag; with ``--all``, first every event by the
agents' keys or p-tagging an agent or the project key, to learn which conversations exist.
``since`` limits the fetched events by ``created_at`` (a root is fetched whatever its date: a
conversation starts with it). Relays are read page by page (``until`` moved down) until a page
brings nothing new, so a relay's cap on results does not cut a conversation short.

What is merged, as the daemon takes events in: every event is verified (NIP-01 id and Schnorr
signature, the codec's own check), events by authors the daemon would not take in (anyone but the
owner, the whitelist and the agents) are skipped, and each conversation is merged in history
order (:func:`history_order`) through the :class:`ConversationManager`: a missing conversation is
created from its root (``create_conversation``: title and the rest derived as usual), then each
event is appended unless the conversation or the store's processed-id ledger already holds it,
so a second rebuild adds nothing. A conversation whose root no relay has starts with its first
event, as a reply with an unknown root does in the daemon. A missing conversation whose first event
the store holds in another conversation has its events merged into that one; one whose root id is in
the ledger but held by no conversation was deleted on purpose and stays deleted. No agent is run for
what is merged, and a merged event counts as written when it was (``backfill=True``): a conversation
created is dated by its first event (created, last active), then each event moves its last activity
forward to the event's time (never past now), so a rebuilt conversation is as idle as its events say and
the daemon's idle timeout ends it as it ends any (the retention sweep at the next start, or a channel's
next note); one older than a conversation's end leaves it ended.

A person's top-level kind-1 notes to an agent are a channel, as the daemon takes them in: a later note
joins the channel's conversation when it came within the idle timeout of that conversation's last event
(by the events' dates), else it starts the next one (:func:`plan_channels`); a note the store already
holds as a conversation of its own stays one, and one it holds in another conversation (the daemon joins a
note to the conversation whose run is still under way, however late it came) brings what the replay grouped
with it into that one. The newest conversation of each channel, public or private, becomes the channel's
current one when the channel has none (a home restored from the relays).
"""

from __future__ import annotations

import heapq
import sys
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import structlog

from tenex_daemon.adapters.nostr.classifier import classify_event
from tenex_daemon.adapters.nostr.codec import RejectReason, read_threading, verify_event
from tenex_daemon.adapters.nostr.private import GiftWraps
from tenex_daemon.adapters.nostr.relay_pool import Filter, PoolSettings, RelayPool
from tenex_daemon.adapters.nostr.signer import KeyFileError, Signer
from tenex_daemon.app.settings import Settings
from tenex_daemon.app.wiring import load_signers
from tenex_daemon.core.agents import AgentDirectory
from tenex_daemon.core.classify import EventClass
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.errors import ConversationNotFoundError, TenexError
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.vocabulary import (
    KIND_COMMENT,
    KIND_CONVERSATION_ROOT,
    KIND_GIFT_WRAP,
    KIND_NOTE,
    KIND_TASK,
    TAG_EVENT,
    TAG_ROOT_EVENT,
)
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.services.lifecycle import ConversationLifecycle, adopted_root_key, note_channel
from tenex_daemon.services.private_messages import Opened, WrapOpener, plan_private_conversations

log = structlog.get_logger(__name__)

REBUILD_KINDS: Final = (KIND_NOTE, KIND_CONVERSATION_ROOT, KIND_COMMENT, KIND_TASK)
"""The kinds a conversation is made of (the daemon's subscription's kinds)."""
IDS_PER_FILTER: Final = 100
"""Conversation ids named in one filter (relays limit how long a filter may be)."""
MAX_PAGES: Final = 1000
"""Pages read for one request at most (a relay that keeps sending new events is cut off there)."""
INVALID_REASONS: Final = frozenset({
    RejectReason.BAD_ID, RejectReason.BAD_SIGNATURE, RejectReason.BAD_PUBKEY, RejectReason.BAD_SHAPE,
    RejectReason.BAD_FIELD, RejectReason.BAD_ENCODING, RejectReason.OVERSIZED, RejectReason.TOO_MANY_TAGS,
})
"""Why a relay's event frame is refused as an invalid event (not as a malformed frame)."""
CONNECT_WITHIN_S: Final = 10.0
"""How long a rebuild without the daemon waits for its first relay connection."""


class RebuildError(TenexError):
    """The relays cannot be read (none configured, none answering)."""


class NoRelayConfiguredError(RebuildError):
    """No relay to rebuild from is configured (a configuration error, not a failure of the relays)."""


class EventSource(Protocol):
    """Where events are fetched from: the relay pool
    (:class:`~tenex_daemon.adapters.nostr.relay_pool.RelayPool`) satisfies it."""

    async def fetch_each(
        self,
        filters: Sequence[Filter],
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - the pool's own per-relay deadline
    ) -> list[list[NostrEvent]]:
        """Return the verified events matching ``filters``, each readable relay's answer apart."""

    def rejects_by_reason(self) -> dict[str, int]:
        """How many frames the relays sent were refused so far, by reason (invalid events among them)."""


Progress = Callable[[int, int], None]
"""Told ``(conversations merged, conversations to merge)`` after each conversation."""


@dataclass(frozen=True, slots=True)
class RebuildRequest:
    """What to rebuild: one conversation (``conversation_id``) or all (``all_``), from ``since`` on."""

    conversation_id: str | None = None
    all_: bool = False
    since: int | None = None
    """Unix seconds: events created before are not fetched (roots excepted)."""

    def __post_init__(self) -> None:
        if (self.conversation_id is None) == (not self.all_):
            raise ValueError("name one conversation id or ask for all, not both and not neither")


@dataclass(slots=True)
class RebuildReport:
    """What a rebuild did: conversations found, created and updated; events by fate."""

    conversations_found: int = 0
    conversations_created: int = 0
    conversations_updated: int = 0
    events_fetched: int = 0
    events_added: int = 0
    events_present: int = 0
    """Already in the conversation, or in the store's processed-id ledger."""
    events_invalid: int = 0
    """Refused by the verification (NIP-01 id, signature, shape): by the relay pool, or here."""
    events_skipped: Counter[str] = field(default_factory=Counter)
    """Not merged, by reason (``author_not_allowed``, ``not_a_conversation_event``,
    ``conversation_deleted``, ``before_since``)."""

    def to_dict(self) -> dict[str, Any]:
        """Return the report as JSON-ready data (the control API's answer, the CLI's ``--json``)."""
        return {
            "conversations": {
                "found": self.conversations_found,
                "created": self.conversations_created,
                "updated": self.conversations_updated,
            },
            "events": {
                "fetched": self.events_fetched,
                "added": self.events_added,
                "already_present": self.events_present,
                "invalid": self.events_invalid,
                "skipped": dict(sorted(self.events_skipped.items())),
            },
        }


@dataclass(frozen=True, slots=True)
class ConversationPlan:
    """One conversation to merge: its id, its root when a relay had it, its other events in order."""

    conversation_id: str
    root: NostrEvent | None
    events: tuple[NostrEvent, ...]
    channel: str | None = None
    """A private conversation's channel (``dm:<agent slug>:<person>``), or a kind-1 channel's
    (``<agent slug>:<person>``)."""

    @property
    def in_order(self) -> list[NostrEvent]:
        """Every event to merge, the root first."""
        return ([self.root] if self.root is not None else []) + list(self.events)


def history_order(events: Iterable[NostrEvent]) -> list[NostrEvent]:
    """Return ``events`` in history order: each after the event it replies to (when that is among
    them), else by ``created_at``, then by id. Deterministic: the same events give the same order."""
    by_id = {event.id: event for event in events}
    children: dict[str, list[str]] = {event_id: [] for event_id in by_id}
    waiting: dict[str, int] = dict.fromkeys(by_id, 0)
    for event in by_id.values():
        parent = read_threading(event).parent_id
        if parent is not None and parent != event.id and parent in by_id:
            children[parent].append(event.id)
            waiting[event.id] += 1
    ready = [(e.created_at, e.id) for e in by_id.values() if waiting[e.id] == 0]
    heapq.heapify(ready)
    ordered: list[NostrEvent] = []
    while ready:
        _, event_id = heapq.heappop(ready)
        ordered.append(by_id[event_id])
        for child in children[event_id]:
            waiting[child] -= 1
            if waiting[child] == 0:
                heapq.heappush(ready, (by_id[child].created_at, child))
    if len(ordered) < len(by_id):  # a cycle cannot be signed, but nothing is dropped if one came
        placed = {event.id for event in ordered}
        rest = (e for e in by_id.values() if e.id not in placed)
        ordered += sorted(rest, key=lambda e: (e.created_at, e.id))
    return ordered


def conversation_of(event: NostrEvent) -> str | None:
    """The conversation ``event`` belongs to (as the daemon classifies it), or None when it is none's."""
    if event.kind not in REBUILD_KINDS:
        return None
    classification = classify_event(event)
    return None if classification.kind is EventClass.IGNORED else classification.conversation_id


def plan_conversations(
    events: Iterable[NostrEvent],
    wanted: Collection[str],
    allowed_authors: Collection[str],
    report: RebuildReport,
    since: int | None = None,
) -> list[ConversationPlan]:
    """Group verified events into the ``wanted`` conversations, each in history order.

    A root (an event whose id is a wanted conversation's) is kept whoever wrote it, as the daemon
    adopts the root of a reply it takes in; any other event needs an allowed author, a kind and
    threading that put it in a wanted conversation, and ``created_at`` at or after ``since``.
    A conversation none of whose events has an allowed author is left out. Skips are counted
    in ``report``.
    """
    roots: dict[str, NostrEvent] = {}
    members: dict[str, list[NostrEvent]] = {}
    for event in {e.id: e for e in events}.values():
        if event.id in wanted:
            roots[event.id] = event
            continue
        cid = conversation_of(event)
        if cid is None or cid not in wanted:
            report.events_skipped["not_a_conversation_event"] += 1
        elif event.pubkey not in allowed_authors:
            report.events_skipped["author_not_allowed"] += 1
        elif since is not None and event.created_at < since:
            report.events_skipped["before_since"] += 1
        else:
            members.setdefault(cid, []).append(event)
    plans = []
    for cid in sorted(set(roots) | set(members)):
        root = roots.get(cid)
        if root is not None and conversation_of(root) != cid and cid not in members:
            continue  # a reply fetched by its id: no conversation is rooted at it
        if root is None or root.pubkey in allowed_authors or cid in members:
            plans.append(ConversationPlan(cid, root, tuple(history_order(members.get(cid, [])))))
        else:
            report.events_skipped["author_not_allowed"] += 1
    return plans


def plan_channels(
    plans: Iterable[ConversationPlan],
    directory: AgentDirectory,
    idle_timeout_ms: int,
    stored: Collection[str] = (),
) -> list[ConversationPlan]:
    """Replay the kind-1 channels in ``plans`` (see the module's doc): each conversation rooted at a
    person's top-level note to an agent gets its channel, and one whose note came within ``idle_timeout_ms``
    of the channel's current conversation's last event before it joins that one (its note and events
    merged in history order). A conversation whose id is in ``stored`` (the store holds it as one) is
    never merged into another."""
    channels: dict[str, list[ConversationPlan]] = {}
    kept: list[ConversationPlan] = []
    for plan in plans:
        root = plan.root
        channel = None if root is None or root.id != plan.conversation_id else note_channel(root, directory)
        if channel is None or plan.channel is not None:
            kept.append(plan)
        else:
            channels.setdefault(channel, []).append(plan)
    for channel, found in channels.items():
        found.sort(key=lambda plan: (plan.in_order[0].created_at, plan.conversation_id))
        current: list[ConversationPlan] = []
        for plan in found:
            first = plan.in_order[0]
            alone = plan.conversation_id in stored
            if current and not alone and _within(current, first, idle_timeout_ms):
                current.append(plan)
            else:
                if current:
                    kept.append(_channel_plan(channel, current))
                current = [plan]
        kept.append(_channel_plan(channel, current))
    return kept


def _within(plans: Sequence[ConversationPlan], note: NostrEvent, idle_timeout_ms: int) -> bool:
    """Whether ``note`` came within the idle timeout of the last event ``plans`` hold from before it."""
    before = [e.created_at for plan in plans for e in plan.in_order if e.created_at <= note.created_at]
    return bool(before) and (note.created_at - max(before)) * 1000 <= idle_timeout_ms


def _channel_plan(channel: str, plans: Sequence[ConversationPlan]) -> ConversationPlan:
    """One conversation of ``channel`` made of ``plans``: the first one's root, then the rest in history
    order."""
    first, *rest = plans
    events = [*first.events, *(e for plan in rest for e in plan.in_order)]
    return ConversationPlan(first.conversation_id, first.root, tuple(history_order(events)), channel)


def _chunks(ids: Sequence[str]) -> list[list[str]]:
    return [list(ids[i : i + IDS_PER_FILTER]) for i in range(0, len(ids), IDS_PER_FILTER)]


def _since(filters: Iterable[Filter], since: int | None) -> list[Filter]:
    return [dict(f) if since is None else {**f, "since": since} for f in filters]


@dataclass(frozen=True, slots=True)
class PrivateRebuild:
    """How private conversations (NIP-17) are found again: every gift wrap p-tagging an agent, opened with
    that agent's key (the person's messages, and the copy of each answer the daemon wrapped for the agent
    itself), replayed into conversations with the idle timeout (:func:`plan_private_conversations`)."""

    opener: WrapOpener
    idle_timeout_ms: int


def private_rebuild(settings: Settings) -> PrivateRebuild | None:
    """The home's :class:`PrivateRebuild` (its agents' keys, its idle timeout); None, logged, when the
    keys cannot be read: public conversations are rebuilt all the same."""
    try:
        signers, _ = load_signers(settings)
    except KeyFileError as exc:
        log.warning("rebuild_without_private_conversations", reason=str(exc))
        return None
    return PrivateRebuild(GiftWraps(signers), int(settings.conversations.idle_timeout_min * 60_000))


class Rebuilder:
    """Rebuilds conversations from ``source`` into ``manager``'s store (see the module's doc).

    ``allowed_authors`` are the keys whose events the daemon takes in besides its agents': the
    owner and the whitelist. One rebuild at a time per manager is the caller's affair (the
    manager's locks keep each event's merge safe beside the daemon's own intake).
    """

    def __init__(
        self,
        manager: ConversationManager,
        source: EventSource,
        *,
        allowed_authors: Collection[str] = (),
        fetch_timeout: float | None = None,
        private: PrivateRebuild | None = None,
        lifecycle: ConversationLifecycle | None = None,
    ) -> None:
        """Merge through ``manager``, fetch from ``source`` (each round within ``fetch_timeout`` s); with
        ``private``, private conversations too (for ``--all``, or an id no public event has).
        ``lifecycle``: the daemon's (its idle timeout groups the kind-1 channels; it keeps the channels'
        pointers), else one over ``manager`` with the default timeout."""
        self._manager = manager
        self._lifecycle = lifecycle if lifecycle is not None else ConversationLifecycle(manager)
        self._private = private
        self._source = source
        self._fetch_timeout = fetch_timeout
        agents = manager.agents
        self._agent_keys = sorted(agent.pubkey for agent in agents)
        self._project = agents.project_pubkey
        owner = [agents.owner_pubkey] if agents.owner_pubkey else []
        self._allowed = frozenset([*allowed_authors, *owner, *self._agent_keys])

    async def rebuild(self, request: RebuildRequest, progress: Progress | None = None) -> RebuildReport:
        """Fetch, verify and merge; return what was done.

        Raises :class:`ConversationNotFoundError` when one conversation is asked for and no relay
        has any event of it.
        """
        report = RebuildReport()
        invalid_before = self._invalid_so_far()
        if request.conversation_id is not None:
            wanted = [request.conversation_id]
            found: list[NostrEvent] = []
        else:
            found = await self._discover(request.since)
            wanted = sorted({cid for e in found if (cid := conversation_of(e)) is not None})
        fetched = found + await self._fetch_conversations(wanted, request.since)
        verified = self._verified(fetched, report)
        report.events_fetched = len({e.id for e in fetched})
        plans = plan_conversations(verified, set(wanted), self._allowed, report, request.since)
        if self._private is not None and (request.all_ or not plans):
            plans += await self._private_plans(self._private, request, report)
        plans = plan_channels(
            plans, self._manager.agents, self._lifecycle.idle_timeout_ms, await self._stored_notes(plans)
        )
        report.events_invalid += max(0, self._invalid_so_far() - invalid_before)
        report.conversations_found = len(plans)
        if request.conversation_id is not None and not plans:
            raise ConversationNotFoundError(request.conversation_id)
        merged_into: dict[str, str] = {}
        for done, plan in enumerate(plans, start=1):
            if (stored_id := await self._merge(plan, report)) is not None:
                merged_into[plan.conversation_id] = stored_id
            if progress is not None:
                progress(done, len(plans))
        await self._adopt_channels(plans, merged_into)
        log.info("conversations_rebuilt", **report.to_dict())
        return report

    async def _stored_notes(self, plans: Sequence[ConversationPlan]) -> set[str]:
        """The plans rooted at a kind-1 note that the store holds as conversations of their own."""
        notes = [plan.conversation_id for plan in plans if plan.root and plan.root.kind == KIND_NOTE]
        return {cid for cid in notes if await self._manager.get_conversation(cid) is not None}

    async def _adopt_channels(
        self, plans: Sequence[ConversationPlan], merged_into: Mapping[str, str]
    ) -> None:
        """Each channel's newest conversation (by its events' dates; a plan merged into a stored conversation
        counts as that one) becomes the channel's current one when the channel has none
        (:meth:`ConversationLifecycle.adopt_channel`)."""
        newest: dict[str, tuple[int, str]] = {}
        for plan in plans:
            if plan.channel is not None:
                stored_id = merged_into.get(plan.conversation_id, plan.conversation_id)
                latest = (max(e.created_at for e in plan.in_order), stored_id)
                newest[plan.channel] = max(newest.get(plan.channel, latest), latest)
        for _, conversation_id in newest.values():
            conversation = await self._manager.get_conversation(conversation_id)
            if conversation is not None:
                await self._lifecycle.adopt_channel(conversation)

    # --- fetching -----------------------------------------------------------------------------

    async def _discover(self, since: int | None) -> list[NostrEvent]:
        """Events by the agents or p-tagging an agent or the project: which conversations exist."""
        tagged = [*self._agent_keys, *([self._project] if self._project else [])]
        filters: list[Filter] = []
        if self._agent_keys:
            filters.append({"kinds": list(REBUILD_KINDS), "authors": self._agent_keys})
        if tagged:
            filters.append({"kinds": list(REBUILD_KINDS), "#p": tagged})
        return await self._fetch_pages(_since(filters, since)) if filters else []

    async def _fetch_conversations(
        self, conversation_ids: Sequence[str], since: int | None
    ) -> list[NostrEvent]:
        """The roots (by id) and every event naming one of them in an ``E`` or ``e`` tag."""
        events: list[NostrEvent] = []
        for chunk in _chunks(conversation_ids):
            events += await self._fetch_pages([{"ids": chunk}])
            references: list[Filter] = [
                {"kinds": list(REBUILD_KINDS), f"#{TAG_ROOT_EVENT}": chunk},
                {"kinds": list(REBUILD_KINDS), f"#{TAG_EVENT}": chunk},
            ]
            events += await self._fetch_pages(_since(references, since))
        return events

    async def _fetch_pages(self, filters: list[Filter]) -> list[NostrEvent]:
        """Every event matching any of ``filters``, each filter paged on its own (a relay caps each filter's
        answer: the oldest event of two filters' answers together can lie below what the other filter
        reached, and a page moved down to it would skip that filter's events in between)."""
        seen: dict[str, NostrEvent] = {}
        for one in filters:
            seen.update((e.id, e) for e in await self._fetch_filter_pages(one))
        return list(seen.values())

    async def _fetch_filter_pages(self, query: Filter) -> list[NostrEvent]:
        """Every event matching ``query``: pages with ``until`` moved down until a page brings nothing new,
        to the newest of the relays' oldest answered events: each relay caps its answer its own way, and a
        relay whose answer reached less far back is asked again from where its answer ended."""
        seen: dict[str, NostrEvent] = {}
        until: int | None = None
        for _ in range(MAX_PAGES):
            page_filter = query if until is None else {**query, "until": until}
            answers = await self._source.fetch_each([page_filter], timeout=self._fetch_timeout)
            new = {e.id: e for answer in answers for e in answer if e.id not in seen}
            if not new:
                break
            seen.update(new)
            until = max(min(e.created_at for e in answer) for answer in answers if answer)
        return list(seen.values())

    async def _private_plans(
        self, private: PrivateRebuild, request: RebuildRequest, report: RebuildReport
    ) -> list[ConversationPlan]:
        """The private conversations in the agents' gift wraps (all of them: a wrap's date is random)."""
        if not self._agent_keys:
            return []
        wraps = await self._fetch_pages([{"kinds": [KIND_GIFT_WRAP], "#p": self._agent_keys}])
        report.events_fetched += len(wraps)
        opened: list[Opened] = []
        for wrap in self._verified(wraps, report):
            result = private.opener.open(wrap)
            if isinstance(result, str):
                report.events_skipped[result] += 1
            else:
                opened.append(result)
        directory = self._manager.agents
        threads = plan_private_conversations(
            opened, directory, self._allowed, private.idle_timeout_ms, report.events_skipped
        )
        plans = []
        for thread in threads:
            root, *rest = thread.events
            if request.conversation_id not in (None, root.id):
                continue
            kept = tuple(e for e in rest if request.since is None or e.created_at >= request.since)
            report.events_skipped["before_since"] += len(rest) - len(kept)
            plans.append(ConversationPlan(root.id, root, kept, thread.channel))
        return plans

    def _invalid_so_far(self) -> int:
        rejects = self._source.rejects_by_reason()
        return sum(n for reason, n in rejects.items() if reason in INVALID_REASONS)

    @staticmethod
    def _verified(events: Iterable[NostrEvent], report: RebuildReport) -> list[NostrEvent]:
        """The events whose id and signature verify (a source other than the pool may pass anything)."""
        verified: dict[str, NostrEvent] = {}
        refused: set[str] = set()
        for event in events:
            if event.id in verified or event.id in refused:
                continue
            if verify_event(event):
                verified[event.id] = event
            else:
                refused.add(event.id)
                report.events_invalid += 1
                log.warning("rebuild_event_invalid", event_id=event.id[:64])
        return list(verified.values())

    # --- merging ------------------------------------------------------------------------------

    async def _merge(self, plan: ConversationPlan, report: RebuildReport) -> str | None:
        """Create the conversation when it is missing, then append each event it does not hold; return the
        id of the stored conversation merged into (None for one deleted on purpose)."""
        events = plan.in_order
        conversation = await self._existing(plan, events[0])
        created = conversation is None
        if conversation is None:
            if await self._manager.store.is_processed(events[0].id):
                report.events_skipped["conversation_deleted"] += len(events)
                log.info("rebuild_conversation_deleted", conversation_id=plan.conversation_id)
                return None
            started_at_reply = plan.root is None and events[0].id != plan.conversation_id
            missing_root = plan.conversation_id if started_at_reply else None
            conversation = await self._manager.create_conversation(
                events[0], channel=plan.channel, missing_root=missing_root, backfill=True
            )
            report.conversations_created += 1
            report.events_added += 1
            events = events[1:]
            if plan.root is None:
                log.warning("rebuild_root_missing", conversation_id=plan.conversation_id,
                            action="its first event starts the conversation")
                if conversation.id != plan.conversation_id:  # the thread's later replies find it there
                    alias = adopted_root_key(plan.conversation_id)
                    await self._manager.store.set_meta(alias, conversation.id)
        missing = [e for e in events if not conversation.contains_event(e.id)]
        added = await self._append(conversation, missing)
        report.events_added += added
        report.events_present += len(events) - added
        if added and not created:
            report.conversations_updated += 1
        return conversation.id

    async def _existing(self, plan: ConversationPlan, first: NostrEvent) -> Conversation | None:
        """The stored conversation of the plan: by its id, else the one holding its first event (a note the
        daemon took into the channel's conversation whose run was still under way, however late it came; or,
        no root on the relays, the first reply)."""
        conversation = await self._manager.get_conversation(plan.conversation_id)
        if conversation is None:
            holder = await self._manager.find_conversation_of_event(first.id)
            if holder is not None:
                conversation = await self._manager.get_conversation(holder)
        return conversation

    async def _append(self, conversation: Conversation, events: Sequence[NostrEvent]) -> int:
        """Append ``events`` in order; return how many were new to the store. An archived conversation (so
        ended) is restored for the merge and archived again while it is still ended: a message that came
        meanwhile reopened it, and it stays restored, as a new message restores an archived conversation
        (archived again, it would leave that message unanswered and its run unable to save)."""
        if not events:
            return 0
        # ended_before past any activity: the one condition left is "still ended" (checked in the archive's
        # step); one archived without an end (a store before the lifecycle) is archived again as it was
        still_ended = sys.maxsize if conversation.is_ended else None
        archived = conversation.archived and await self._manager.restore_conversation(conversation.id)
        added = 0
        try:
            for event in events:
                added += await self._manager.add_event(conversation.id, event, backfill=True)
        finally:
            manager, cid = self._manager, conversation.id
            if archived and not await manager.archive_conversation(cid, ended_before=still_ended):
                log.info("rebuild_left_restored", conversation_id=cid, reason="reopened during the merge")
        return added


async def rebuild_from_relays(
    settings: Settings,
    manager: ConversationManager,
    request: RebuildRequest,
    progress: Progress | None = None,
) -> RebuildReport:
    """Rebuild without the daemon: through a relay pool of the home's ``relays.urls`` opened for it
    (no subscription; the project key answers NIP-42 challenges) and ``manager`` over the store."""
    urls = list(settings.relays.urls)
    if not urls:
        raise NoRelayConfiguredError(
            "no relay to rebuild from: set relays.urls in config.toml "
            "(with the daemon running, the command goes through it and its relays)"
        )
    signer = Signer.from_file(settings.project_key_path, label="project")
    pool = RelayPool(
        urls, auth_signer=signer, settings=PoolSettings(open_timeout=5.0, backoff_base=0.2, backoff_cap=2.0)
    )
    await pool.start()
    try:
        if not await pool.wait_connected(1, CONNECT_WITHIN_S):
            raise RebuildError(f"no relay answered within {CONNECT_WITHIN_S:g} s: {', '.join(urls)}")
        lifecycle = ConversationLifecycle(manager, idle_timeout_min=settings.conversations.idle_timeout_min)
        rebuilder = Rebuilder(
            manager, pool, allowed_authors=settings.whitelist, private=private_rebuild(settings),
            lifecycle=lifecycle,
        )
        return await rebuilder.rebuild(request, progress)
    finally:
        await pool.stop()


def report_rows(report: Mapping[str, Any]) -> list[tuple[str, int]]:
    """The (label, count) rows of a report's JSON (:meth:`RebuildReport.to_dict`), for a table."""
    conversations, events = report["conversations"], report["events"]
    rows = [
        ("conversations found on the relays", conversations["found"]),
        ("conversations created", conversations["created"]),
        ("conversations updated", conversations["updated"]),
        ("events fetched", events["fetched"]),
        ("events added", events["added"]),
        ("events already present", events["already_present"]),
        ("events invalid", events["invalid"]),
    ]
    rows += [(f"events skipped: {reason}", n) for reason, n in events["skipped"].items()]
    return rows
