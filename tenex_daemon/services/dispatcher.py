"""Incoming events: classified once, then one handler from a table; every outcome has a reason."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection
from contextlib import nullcontext
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, Protocol

import structlog

from tenex_daemon.core.agents import Agent
from tenex_daemon.core.classify import Classification, EventClass, EventClassifier
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.errors import (
    ConversationArchivedError,
    ConversationExistsError,
    ConversationNotFoundError,
)
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.phases import Phase, PhaseRules
from tenex_daemon.core.ports import EventFetcher, Peers
from tenex_daemon.core.stops import STOPPED_COMPLETION
from tenex_daemon.core.targeting import (
    SkipReason,
    agent_chain_length,
    choose_target,
    is_allowed_author,
    may_join,
    reply_person,
)
from tenex_daemon.core.vocabulary import KIND_PRIVATE_MESSAGE, KIND_TASK, TAG_TOOL, TOOL_COMPLETE
from tenex_daemon.runtime.lanes import outside_lane
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.services.lifecycle import ConversationLifecycle, adopted_root_key, task_meta_key
from tenex_daemon.services.locks import KeyedLock
from tenex_daemon.services.orchestrator import Orchestrator, RoutingDecision, RoutingStop
from tenex_daemon.services.private_messages import PrivateConversations
from tenex_daemon.services.routing_limits import DEFAULT_TURN_LIMIT, ROUTING_LIMITS_KEY, RoutingLimits
from tenex_daemon.services.runs import (
    PENDING_RUNS_KEY,
    RUN_RETRY_S,
    RunListener,
    RunRequest,
    RunScheduler,
)
from tenex_daemon.services.stopping import Routing, Stopper, StopReport

log = structlog.get_logger(__name__)

DISPATCH_RETRY_S = RUN_RETRY_S
"""Waits before each new try of targeting an accepted event that failed with an error."""
FAILED_KEPT = 4096
"""Events whose handling failed remembered at most (the relay pool keeps 1,000 for its retries)."""
ROUTING_OWED_KEPT = 4096
"""Replies journaled and not routed yet that this process remembers (``saved_reply_found``)."""


class Outcome(StrEnum):
    """What handling an event did."""

    SCHEDULED = "scheduled"
    """Accepted and at least one agent run scheduled."""
    STORED = "stored"
    """Accepted into a conversation; no agent runs (``reason`` says why)."""
    DUPLICATE = "duplicate"
    IGNORED = "ignored"
    """Not accepted (``reason`` says why)."""


@dataclass(frozen=True, slots=True)
class HandleResult:
    """The outcome of one event, for logs, metrics and tests."""

    outcome: Outcome
    reason: str | None = None
    conversation_id: str | None = None
    agents: tuple[str, ...] = ()


Handler = Callable[[NostrEvent, Classification], Awaitable[HandleResult]]


class ReplyObserver(Protocol):
    """Told how each saved agent reply was targeted (the tests' window on routing; metrics may listen)."""

    def reply_targeted(self, conversation_id: str, reply: NostrEvent, result: HandleResult) -> None:
        """``reply`` was saved and targeted with ``result``."""


class AgentRuns(Protocol):
    """Carries out one agent run and tells ``routing`` about its reply (the agent runner)."""

    async def run(self, request: RunRequest, routing: EventDispatcher | None = None) -> object:
        """Run the agent; the reply is told to ``routing`` before and after it is saved."""


class EventDispatcher:
    """Accepts events into conversations and decides which agent answers.

    An event is accepted (stored durably by the manager) before any run is scheduled. It is
    journaled as being dispatched first (:meth:`RunScheduler.accept`), so a crash before its
    runs are scheduled leaves it to :meth:`redispatch` at the next start.

    An event p-tagging an agent goes to that agent. One addressed to the orchestrator (p-tagged,
    or nobody / only the project p-tagged) is routed: each decision of ``orchestrator`` starts
    an orchestrator turn (changing the phase first when it names one the phase rules allow)
    and runs the agents it names. Their completions close the turn; a completion that arrives
    while the turn still waits for others is only recorded, the one that closes it is routed
    again. Routing stops on an END decision, after ``turn_limit`` turns without a new user
    message, and on a decision that repeats the one before it (:class:`RoutingLimits`, stored
    with the conversation: a restart keeps them).
    A whitelisted person writes only into conversations they started or the owner p-tagged them in
    (:func:`may_join`; ``not_a_participant``) unless ``whitelist_may_join``: the agents would read anyone
    else's conversation to them. The ``hop_limit`` bounds chains of agents p-tagging each other
    directly. With ``lifecycle``, a person's top-level kind-1 note joins their open channel
    conversation and an event for a task its current session (:class:`ConversationLifecycle`).

    The dispatcher owns the :class:`RunScheduler` (:attr:`scheduler`) that carries its runs out
    through ``runs`` (at most ``max_concurrent_runs`` at once, journaled under ``journal_key``; with
    ``peers``, daemons sharing the database, each run holds its conversation's run lease),
    and targets each saved reply of those runs in turn: that loop (events schedule runs, runs
    save replies, replies are targeted) is closed here, with nothing wired after construction.
    """

    def __init__(
        self,
        manager: ConversationManager,
        runs: AgentRuns,
        classify: EventClassifier,
        orchestrator: Orchestrator,
        *,
        owner: str | None,
        whitelist: Collection[str] = (),
        whitelist_may_join: bool = False,
        hop_limit: int = 6,
        turn_limit: int = DEFAULT_TURN_LIMIT,
        fetcher: EventFetcher | None = None,
        max_concurrent_runs: int = 8,
        journal_key: str = PENDING_RUNS_KEY,
        observer: ReplyObserver | None = None,
        peers: Peers | None = None,
        lifecycle: ConversationLifecycle | None = None,
        run_listener: RunListener | None = None,
        stopper: Stopper | None = None,
    ) -> None:
        self._manager = manager
        self._runs = runs
        self._observer = observer
        self.scheduler = RunScheduler(
            manager.store,
            self._execute,
            max_concurrent_runs,
            journal_key=journal_key,
            peers=peers,
            listener=run_listener,
            agents=[agent.slug for agent in manager.agents],
        )
        self._stopper = stopper
        self._scheduler = self.scheduler
        self._classify = classify
        self._orchestrator = orchestrator
        self._owner = owner
        self._whitelist = frozenset(whitelist)
        self._whitelist_may_join = whitelist_may_join
        self._hop_limit = hop_limit
        self._fetcher = fetcher
        self._limits = RoutingLimits(turn_limit)
        self._lifecycle = lifecycle
        self._private = None if lifecycle is None else PrivateConversations(manager, lifecycle)
        self._routing = KeyedLock()
        self._adopting = KeyedLock()
        """Per missing root: one reply at a time starts the thread's conversation (:meth:`_adopt_root`)."""
        self._failed: OrderedDict[str, None] = OrderedDict()
        """Events whose handling failed here once the dispatch began (the pool hands them over again)."""
        self._routing_owed: OrderedDict[str, None] = OrderedDict()
        """Replies journaled here (before_reply_saved) and not routed yet (:meth:`saved_reply_found`)."""
        self._handlers: dict[EventClass, Handler] = {
            EventClass.NEW_CONVERSATION: self._on_root,
            EventClass.TASK: self._on_root,
            EventClass.PRIVATE: self._on_private,
            EventClass.REPLY: self._on_reply,
            EventClass.STOP: self._on_stop,
            EventClass.IGNORED: self._on_ignored,
        }

    async def _execute(self, request: RunRequest) -> None:
        """One scheduled run; its reply comes back to :meth:`before_reply_saved` and :meth:`after_reply`."""
        await self._runs.run(request, self)

    def allows(self, author: str) -> bool:
        """Whether ``author`` may trigger agents: the owner, a whitelisted key or one of our agents."""
        return is_allowed_author(author, self._manager.agents, self._owner, self._whitelist)

    async def handle(self, event: NostrEvent) -> HandleResult:
        """Classify ``event`` once and run its handler."""
        if not self.allows(event.pubkey):
            return HandleResult(Outcome.IGNORED, SkipReason.AUTHOR_NOT_ALLOWED.value)
        classification = self._classify(event)
        if classification.kind in (EventClass.IGNORED, EventClass.STOP):  # nothing stored: no journal entry
            result = await self._handlers[classification.kind](event, classification)
        else:
            await self._scheduler.accept(event.id)
            result = await self._dispatch(event, classification)
        log.info(
            "event_handled",
            event_id=event.id,
            kind=event.kind,
            classified=classification.kind.value,
            outcome=result.outcome.value,
            reason=result.reason,
            conversation_id=result.conversation_id,
            agents=list(result.agents),
        )
        return result

    async def _dispatch(self, event: NostrEvent, classification: Classification) -> HandleResult:
        """Run the event's handler; raising leaves its entry journaled (the next start finishes the
        dispatch) and the pool hands the event over again. An event found stored when it comes again
        after a failure here was stored by that failed try (a commit whose answer a broken connection
        lost: PostgreSQL restarting) or by another daemon meanwhile: nobody else dispatches the first, so
        it is dispatched again as after a crash (:meth:`redispatch`: an agent that answered it already
        is not run again; another daemon's run, started a second or more earlier, holds its
        conversation's run lease until its answer is saved)."""
        failed_before = event.id in self._failed
        try:
            result = await self._handlers[classification.kind](event, classification)
            if failed_before and result.outcome is Outcome.DUPLICATE:
                log.info("dispatch_after_failure", event_id=event.id, conversation_id=result.conversation_id)
                result = await self.redispatch(event.id)  # marks it dispatched itself
            else:
                self._scheduler.dispatched(event.id, at_once=result.outcome is not Outcome.SCHEDULED)
        except Exception:  # remembered until a try succeeds: a redispatch that fails is tried again
            self._failed[event.id] = None
            while len(self._failed) > FAILED_KEPT:
                self._failed.popitem(last=False)
            raise
        self._failed.pop(event.id, None)
        return result

    async def _on_ignored(self, event: NostrEvent, classification: Classification) -> HandleResult:
        return HandleResult(Outcome.IGNORED, classification.reason or "unclassified")

    async def _on_stop(self, event: NostrEvent, classification: Classification) -> HandleResult:
        """A stop request (kind 24134): only the owner's or a whitelisted person's is carried out."""
        assert classification.conversation_id is not None
        if self._stopper is None:
            return HandleResult(Outcome.IGNORED, "stop_not_handled")
        report = await self._stopper.on_request(event, classification.conversation_id, self.scheduler)
        outcome = Outcome.STORED if report.accepted else Outcome.IGNORED
        return HandleResult(outcome, report.reason, report.conversation_id, report.agents)

    async def stop(self, conversation_id: str, agent_slug: str | None, *, by: str) -> StopReport:
        """Stop ``agent_slug``'s runs (every agent's when None) in a conversation, as ``by`` asks (the
        control API: the owner); raise ConversationNotFoundError or UnknownAgentError."""
        if self._stopper is None:
            raise RuntimeError("this pipeline has no stopper")
        agents = None if agent_slug is None else (self._manager.agents.get(agent_slug).slug,)
        return await self._stopper.stop_everywhere(self.scheduler, conversation_id, agents, by=by)

    async def _on_root(self, event: NostrEvent, classification: Classification) -> HandleResult:
        existing = await self._manager.get_conversation(event.id)
        if existing is not None:
            return HandleResult(Outcome.DUPLICATE, conversation_id=event.id)
        adopted = await self._manager.store.get_meta(adopted_root_key(event.id))
        if adopted is not None:
            return await self._late_root(adopted, event)
        lifecycle = self._lifecycle
        channel = None
        if lifecycle is not None and classification.kind is EventClass.NEW_CONVERSATION:
            channel = lifecycle.channel_of(event)
        try:
            if channel is not None:
                assert lifecycle is not None
                if await self._manager.store.is_processed(event.id):
                    holder = await self._manager.find_conversation_of_event(event.id)
                    return HandleResult(Outcome.DUPLICATE, conversation_id=holder)
                joined = await lifecycle.join_channel(channel, event, busy=self.scheduler.has_runs)
                if not joined.added:
                    return HandleResult(Outcome.DUPLICATE, conversation_id=joined.conversation.id)
                conversation = joined.conversation
            else:
                task_id = event.id if classification.kind is EventClass.TASK else None
                conversation = await self._manager.create_conversation(event, exclusive=True, task_id=task_id)
        except ConversationExistsError:  # another daemon on the shared database created it first
            return HandleResult(Outcome.DUPLICATE, conversation_id=event.id)
        return await self._target_accepted(conversation.id, event)

    async def _on_reply(self, event: NostrEvent, classification: Classification) -> HandleResult:
        cid = classification.conversation_id
        assert cid is not None
        cid, conversation = await self._conversation_of_root(cid)
        refused = self._refuse_joining(conversation, event)
        if refused is not None:
            return refused
        task_id = conversation.task_id if conversation is not None else None
        if conversation is None and await self._manager.store.get_meta(task_meta_key(cid)) is not None:
            task_id = cid  # a task whose first session was deleted (retention): its current one takes it
        if task_id is not None and self._lifecycle is not None:
            joined = await self._lifecycle.task_session(task_id, event, busy=self.scheduler.has_runs)
            if joined is not None:
                if not joined.added:
                    return HandleResult(Outcome.DUPLICATE, conversation_id=joined.conversation.id)
                return await self._target_accepted(joined.conversation.id, event)
        if conversation is None and await self._manager.store.is_processed(cid):
            # its root was accepted once and the conversation deleted since (retention, an operator):
            # a late reply does not bring it back
            await self._manager.store.mark_processed(event.id)
            return HandleResult(Outcome.IGNORED, "conversation_deleted", cid)
        if conversation is None:
            try:
                adopted = await self._adopt_root(cid, event, task=classification.is_task)
            except ConversationExistsError:  # another daemon on the shared database started it first
                found_again = await self._manager.get_conversation(cid)
                conversation = found_again or await self._manager.get_conversation(event.id)
                if conversation is None or conversation.id == event.id:
                    return HandleResult(Outcome.DUPLICATE, conversation_id=cid)
            else:
                if adopted is None:  # the thread's conversation, started meanwhile elsewhere, was deleted
                    await self._manager.store.mark_processed(event.id)
                    return HandleResult(Outcome.IGNORED, "conversation_deleted", cid)
                conversation = adopted
                if conversation.id == event.id:
                    return await self._target_accepted(conversation.id, event)
        if conversation.private:  # only the person's gift-wrapped messages join a private conversation
            return HandleResult(Outcome.IGNORED, "private_conversation", conversation.id)
        refused = self._refuse_joining(conversation, event)  # a root adopted just now
        if refused is not None:
            return refused
        if conversation.archived:
            await self._manager.restore_conversation(cid)
            log.info("conversation_restored", conversation_id=cid, reason="new_activity")
        if not await self._manager.add_event(conversation.id, event):
            return HandleResult(Outcome.DUPLICATE, conversation_id=conversation.id)
        return await self._target_accepted(conversation.id, event)

    def _refuse_joining(self, conversation: Conversation | None, event: NostrEvent) -> HandleResult | None:
        """Refuse a whitelisted person's event into a conversation they may not join (:func:`may_join`)."""
        if conversation is None or self._whitelist_may_join or event.pubkey not in self._whitelist:
            return None
        if self._manager.agents.by_pubkey(event.pubkey) is not None:  # agents are never refused
            return None
        if may_join(event.pubkey, conversation.history, self._owner):
            return None
        log.info(
            "join_refused",
            conversation_id=conversation.id,
            event_id=event.id,
            author=event.pubkey,
            reason=SkipReason.NOT_A_PARTICIPANT.value,
        )
        return HandleResult(Outcome.IGNORED, SkipReason.NOT_A_PARTICIPANT.value, conversation.id)

    async def _on_private(self, event: NostrEvent, classification: Classification) -> HandleResult:
        """A person's private message (an unwrapped kind-14 rumor): it joins their private conversation
        with the agent (:class:`PrivateConversations`)."""
        if self._private is None:
            return HandleResult(Outcome.IGNORED, "private_messages_off")
        if await self._manager.store.is_processed(event.id):  # the same rumor in another wrap
            holder = await self._manager.find_conversation_of_event(event.id)
            return HandleResult(Outcome.DUPLICATE, conversation_id=holder)
        joined = await self._private.join(event, busy=self.scheduler.has_runs)
        if joined is None:
            return HandleResult(Outcome.IGNORED, SkipReason.NOT_ADDRESSED.value)
        if not joined.added:
            return HandleResult(Outcome.DUPLICATE, conversation_id=joined.conversation.id)
        return await self._target_accepted(joined.conversation.id, event)

    async def _conversation_of_root(self, root_id: str) -> tuple[str, Conversation | None]:
        """The conversation a reply naming ``root_id`` as its root belongs to, and its id: the one of that
        root; the one holding that event (a kind-1 channel's later note named as root); the one an earlier
        reply in the thread started when that root could not be found (:meth:`_adopt_root`; its id even when
        it is gone, so that a deleted thread stays deleted); else ``root_id`` and None."""
        conversation = await self._manager.get_conversation(root_id)
        if conversation is not None:
            return root_id, conversation
        found = await self._manager.store.find_event(root_id)
        if found is not None:
            return found[0], await self._manager.get_conversation(found[0])
        adopted = await self._manager.store.get_meta(adopted_root_key(root_id))
        if adopted is None:
            return root_id, None
        return adopted, await self._manager.get_conversation(adopted)

    async def _adopt_root(
        self, root_id: str, reply: NostrEvent, *, task: bool = False
    ) -> Conversation | None:
        """Start the conversation of a reply with an unknown root: the fetched root, else the reply. A task's
        (the fetched root a kind 1934, or the reply naming its root's kind 1934) is the task's first session,
        as when the task itself came first. Without the root, the choice is made under a lock and the store's
        lease on the root (two daemons sharing a database, each with a reply of the thread, start one
        conversation): the one another reply started meanwhile is returned (None: it was deleted since)."""
        async with outside_lane():  # the relays' answer (up to their timeout): the lane is lent meanwhile
            root = await self._fetcher.fetch_event(root_id) if self._fetcher is not None else None
        if root is not None and root.id == root_id and root.has_valid_id():
            log.info("conversation_root_fetched", conversation_id=root_id)
            task_id = root_id if root.kind == KIND_TASK else None
            return await self._manager.create_conversation(root, exclusive=True, task_id=task_id)
        key = adopted_root_key(root_id)
        async with self._adopting.hold(key), self._manager.store.lease(key):
            adopted = await self._manager.store.get_meta(key)
            if adopted is not None:
                return await self._manager.get_conversation(adopted)
            log.warning(
                "conversation_root_missing",
                conversation_id=root_id,
                event_id=reply.id,
                action="reply starts the conversation",
            )
            conversation = await self._manager.create_conversation(
                reply, exclusive=True, task_id=root_id if task else None, missing_root=root_id
            )
            # the thread's later replies, which name the same missing root, join this conversation
            await self._manager.store.set_meta(key, conversation.id)
            if task:  # the task's current session, for its sessions to follow (TaskSessions)
                await self._manager.store.set_meta(task_meta_key(root_id), conversation.id)
            return conversation

    async def _late_root(self, conversation_id: str, root: NostrEvent) -> HandleResult:
        """The root of a thread whose conversation a reply started (:meth:`_adopt_root`) came at last: it
        joins that conversation, as written when it was (a second conversation of the thread would split
        it, and both would describe the thread to clients); it runs nothing (the thread was answered from
        the reply on). Into a deleted thread it does not bring the conversation back."""
        conversation = await self._manager.get_conversation(conversation_id)
        if conversation is None:
            await self._manager.store.mark_processed(root.id)
            return HandleResult(Outcome.IGNORED, "conversation_deleted", conversation_id)
        if conversation.contains_event(root.id):
            return HandleResult(Outcome.DUPLICATE, conversation_id=conversation_id)
        if conversation.archived:
            await self._manager.restore_conversation(conversation_id)
        if not await self._manager.add_event(conversation_id, root, backfill=True):
            return HandleResult(Outcome.DUPLICATE, conversation_id=conversation_id)
        log.info("conversation_root_arrived", conversation_id=conversation_id, event_id=root.id)
        return HandleResult(Outcome.STORED, "late_root", conversation_id)

    async def before_reply_saved(self, conversation_id: str, reply: NostrEvent) -> None:
        """Journal an agent's reply that targets an agent (or the orchestrator) as being
        dispatched, before the runner saves it: a crash before :meth:`after_reply` leaves it to
        :meth:`redispatch`. A reply that targets nobody (to the person) needs no entry."""
        target = choose_target(reply, self._manager.agents)
        routed = target.via_orchestrator or (target.agent is not None and target.agent.orchestrator)
        if routed or target.skip is None:
            await self._scheduler.accept(reply.id)
            self._scheduler.reply_journaled(reply.id)
            self._routing_owed[reply.id] = None
            while len(self._routing_owed) > ROUTING_OWED_KEPT:  # a reply never saved, a run dropped
                self._routing_owed.popitem(last=False)

    async def saved_reply_found(self, conversation_id: str, reply: NostrEvent) -> None:
        """A run tried again after an error found its reply saved (the error came after the save): the reply
        is routed now if that try had journaled it and never routed it; one a previous process journaled is
        the next start's to route (:meth:`redispatch`), not this run's."""
        if reply.id in self._routing_owed:  # one try per run: the run's own retries space them out
            await self.after_reply(conversation_id, reply, once=True)

    async def after_reply(
        self, conversation_id: str, reply: NostrEvent, *, once: bool = False
    ) -> HandleResult:
        """Target an agent's own saved reply (it may address another agent, or the orchestrator
        with a completion), ending its dispatch (:meth:`before_reply_saved`). An error is tried again as
        for a relay's event (:meth:`_target_accepted`); ``once``: a run redone found the reply saved
        (:meth:`saved_reply_found`): one try, as recovered, its own retries spacing the next ones."""
        if once:  # a run redone: a turn its first try started resumes
            result = await self._target(conversation_id, reply, recovered=True)
        else:
            result = await self._target_accepted(conversation_id, reply)
        self._routing_owed.pop(reply.id, None)
        self._scheduler.dispatched(reply.id, at_once=result.outcome is not Outcome.SCHEDULED)
        if self._observer is not None:
            self._observer.reply_targeted(conversation_id, reply, result)
        await self._answered_privately(conversation_id, reply)
        return result

    async def _answered_privately(self, conversation_id: str, reply: NostrEvent) -> None:
        """An agent's private reply, routed: its own chat with the person may lead here now
        (:meth:`PrivateConversations.answered`); best effort: a message in that chat finds a place anyway."""
        if reply.kind != KIND_PRIVATE_MESSAGE or self._private is None:
            return
        try:
            conversation = await self._manager.get_conversation(conversation_id)
            if conversation is not None:
                await self._private.answered(conversation, reply)
        except Exception as exc:
            log.warning("private_channel_not_pointed", conversation_id=conversation_id, error=repr(exc))

    async def stored_dispatches(self, event_ids: list[str]) -> list[str]:
        """Of the dispatches a crash interrupted, those whose event is stored (to :meth:`redispatch`);
        the others leave the journal: their events were never accepted, the relays deliver them
        again. A stored one that started its conversation has that conversation's pointer written now
        (:meth:`_repoint`), before the subscription brings the events that would look for it."""
        stored = []
        for event_id in event_ids:
            found = await self._manager.store.find_event(event_id)
            if found is not None:
                stored.append(event_id)
                self._scheduler.redoing(event_id, found[0])  # busy until dispatched: no sweep ends it
                started = await self._manager.get_conversation(event_id) if found[0] == event_id else None
                if started is not None:
                    await self._repoint(started)
            else:
                self._scheduler.dispatched(event_id, at_once=True)
                log.info("dispatch_dropped", event_id=event_id, reason="not stored")
        return stored

    async def redispatch(self, event_id: str) -> HandleResult:
        """Finish dispatching an event a previous process accepted but crashed before its runs
        were scheduled (:meth:`RunScheduler.dispatches_to_redo`).

        Runs are requested as recovered (an agent that already answered the event is not run
        again) and a routing whose turn was already started resumes that turn; an event that
        was never stored is left to the relays, which deliver it again.
        """
        found = await self._manager.store.find_event(event_id)
        conversation = None if found is None else await self._manager.get_conversation(found[0])
        if found is None or conversation is None:
            self._scheduler.dispatched(event_id, at_once=True)
            log.info("dispatch_dropped", event_id=event_id, reason="not stored")
            return HandleResult(Outcome.IGNORED, "not stored")
        event = found[1]
        if conversation.id == event_id:  # it started its conversation: a pointer to it may be missing
            await self._repoint(conversation)
        if conversation.is_ended and self._manager.agents.by_pubkey(event.pubkey) is not None:
            # an agent's reply that ended its conversation targets nobody
            result = HandleResult(Outcome.STORED, "conversation ended", conversation.id)
        elif event_id == conversation.missing_root:  # a root that came after its thread: it runs nothing
            result = HandleResult(Outcome.STORED, "late_root", conversation.id)
        else:
            result = await self._target(conversation.id, event, recovered=True)
            if self._manager.agents.by_pubkey(event.pubkey) is not None:
                await self._answered_privately(conversation.id, event)
        self._scheduler.dispatched(event_id, at_once=result.outcome is not Outcome.SCHEDULED)
        log.info(
            "dispatch_redone",
            event_id=event_id,
            conversation_id=conversation.id,
            outcome=result.outcome.value,
            reason=result.reason,
            agents=list(result.agents),
        )
        return result

    async def _repoint(self, conversation: Conversation) -> None:
        """A conversation whose starting event is dispatched again after a crash: the pointer written after
        creating it (a channel's, a task's, a missing root's) is written if the crash came before it."""
        if self._lifecycle is not None:
            await self._lifecycle.repoint(conversation)
        if conversation.missing_root is not None:
            key = adopted_root_key(conversation.missing_root)
            async with self._adopting.hold(key), self._manager.store.lease(key):
                if await self._manager.store.get_meta(key) is None:
                    await self._manager.store.set_meta(key, conversation.id)
                    log.warning("conversation_pointer_repaired", key=key, conversation_id=conversation.id)

    async def _target_accepted(self, conversation_id: str, event: NostrEvent) -> HandleResult:
        """Target an event the store has just accepted. An error (its store gone for a moment: a
        database restart) is tried again after each of ``DISPATCH_RETRY_S``, as recovered (a turn
        already started resumes, an agent that already answered is not run again), in its lane: the
        relays' copies of the event are duplicates from now on, so nothing else would dispatch it
        before the next start. The last try's error is raised; the event's entry stays journaled
        and the next start dispatches it."""
        for attempt, wait_s in enumerate(DISPATCH_RETRY_S, start=1):
            try:
                return await self._target(conversation_id, event, recovered=attempt > 1)
            except (ConversationNotFoundError, ConversationArchivedError) as gone:  # the owner's doing: final
                reason = "conversation_deleted" if isinstance(gone, LookupError) else "conversation_archived"
                log.info("dispatch_abandoned", event_id=event.id, conversation_id=conversation_id,
                         reason=reason)
                return HandleResult(Outcome.STORED, reason, conversation_id)
            except Exception:
                log.warning(
                    "dispatch_retry", event_id=event.id, conversation_id=conversation_id,
                    attempt=attempt, retry_in_s=wait_s, exc_info=True,
                )
                await asyncio.sleep(wait_s)
        return await self._target(conversation_id, event, recovered=True)

    async def _target(
        self, conversation_id: str, event: NostrEvent, *, recovered: bool = False
    ) -> HandleResult:
        directory = self._manager.agents
        target = choose_target(event, directory)
        routed = target.via_orchestrator or (target.agent is not None and target.agent.orchestrator)
        if target.skip is not None and not routed:
            return HandleResult(Outcome.STORED, target.skip.value, conversation_id)
        conversation = await self._manager.get_conversation(conversation_id)
        if conversation is None:  # deleted since the event was stored (the owner's delete, retention)
            raise ConversationNotFoundError(conversation_id)
        author = directory.by_pubkey(event.pubkey)
        completion = routed and event.has_tag(TAG_TOOL, TOOL_COMPLETE)
        if author is not None and not completion:
            # Completions to the orchestrator are bounded by the turn limit instead.
            history = conversation.history
            if recovered:  # what came after the event is not part of its chain
                index = conversation.index_of(event.id)
                history = history if index is None else history[: index + 1]
            chain = agent_chain_length(history, directory)
            if chain > self._hop_limit:
                log.warning(
                    "hop_limit_reached", conversation_id=conversation_id, chain=chain, limit=self._hop_limit
                )
                return HandleResult(Outcome.STORED, SkipReason.HOP_LIMIT.value, conversation_id)
        if routed:
            if target.skip is SkipReason.OWN_EVENT:
                return HandleResult(Outcome.STORED, target.skip.value, conversation_id)
            return await self._route(conversation, event, author, recovered)
        assert target.agent is not None
        person = reply_person(conversation, event, directory)
        request = RunRequest(conversation_id, event.id, target.agent.slug, recovered=recovered, person=person)
        await self._scheduler.submit(request)
        return HandleResult(Outcome.SCHEDULED, None, conversation_id, (target.agent.slug,))

    async def _route(
        self, conversation: Conversation, event: NostrEvent, author: Agent | None, recovered: bool = False
    ) -> HandleResult:
        """Ask the orchestrator and carry its decision out, within the loop limits.

        One routing at a time per conversation: a person's message and a completion that
        arrive together are routed one after the other, each on the conversation as the
        other left it.
        """
        # asked for before its turn comes: a stop meanwhile stops it too (it would skip the runs decided)
        asked = nullcontext(Routing(event.id)) if self._stopper is None else self._stopper.routing(
            conversation.id, event.id
        )
        with asked as routing:
            if recovered:  # a turn it started already stands decided: a stop reports those of its agents
                routing.decided = _resumed_agents(conversation, event)
            async with self._routing.hold(conversation.id):
                current = await self._manager.get_conversation(conversation.id) or conversation
                if recovered:
                    resumed = await self._resume_turn(current, event)
                    if resumed is not None:
                        return resumed
                if routing.stopped:  # stopped while it waited for its turn
                    return HandleResult(Outcome.STORED, RoutingStop.STOPPED.value, conversation.id)
                return await self._route_locked(current, event, author, routing)

    async def _resume_turn(self, conversation: Conversation, event: NostrEvent) -> HandleResult | None:
        """A recovered event whose routing had started its turn: run the turn's agents that have
        not completed (as recovered runs); None when no turn came from this event."""
        agents = _resumed_agents(conversation, event)
        if agents is None:
            return None
        person = reply_person(conversation, event, self._manager.agents)
        for slug in agents:
            request = RunRequest(
                conversation.id, event.id, slug, via_orchestrator=True, recovered=True, person=person
            )
            await self._scheduler.submit(request)
        if not agents:
            return HandleResult(Outcome.STORED, "turn completed", conversation.id)
        return HandleResult(Outcome.SCHEDULED, "turn resumed", conversation.id, agents)

    async def _route_locked(
        self, conversation: Conversation, event: NostrEvent, author: Agent | None, routing: Routing
    ) -> HandleResult:
        cid = conversation.id
        stored = self._limits.load(conversation)
        if author is None:
            self._limits.user_message(cid)
        else:
            turn = conversation.open_turn()
            if turn is not None:
                waiting = [a for a in turn.agents if not turn.has_completed(a)]
                log.info("turn_waiting", conversation_id=cid, agent=author.slug, waiting=waiting)
                return HandleResult(Outcome.STORED, RoutingStop.TURN_WAITING.value, cid)
            if not _closed_by(conversation, author.slug, event):
                # A person addressed this agent directly: its completion answers them.
                log.info("completion_not_routed", conversation_id=cid, agent=author.slug)
                return HandleResult(Outcome.STORED, RoutingStop.NOT_ROUTED.value, cid)
            if any(c.message == STOPPED_COMPLETION for c in conversation.orchestrator_turns[-1].completions):
                log.info("completion_after_stop_not_routed", conversation_id=cid, agent=author.slug)
                return HandleResult(Outcome.STORED, RoutingStop.STOPPED.value, cid)
            if self._limits.ended(cid):
                return HandleResult(Outcome.STORED, RoutingStop.ENDED.value, cid)
        stop = self._limits.check_turn_limit(cid)
        if stop is not None:
            log.warning(
                "routing_stopped",
                conversation_id=cid,
                reason=stop.value,
                turns=self._limits.turns(cid),
                limit=self._limits.turn_limit,
            )
            return HandleResult(Outcome.STORED, stop.value, cid)
        async with outside_lane():  # a model's answer: other people's events are taken in meanwhile
            decision = await routing.unless_stopped(self._orchestrator.route(conversation, event))
        if routing.stopped:  # a stop came while the orchestrator decided: nobody is run
            await self._save_limits(cid, stored)
            return HandleResult(Outcome.STORED, RoutingStop.STOPPED.value, cid)
        routing.decided = () if decision is None or decision.is_end else decision.agents  # (no await since)
        if decision is None:
            await self._save_limits(cid, stored)  # a user message's reset
            return HandleResult(Outcome.STORED, SkipReason.NO_AGENT.value, cid)
        # compared as it will run: a phase move the rules refuse keeps the turn in the current phase
        stop = self._limits.record(cid, _as_run(decision, conversation.phase, self._manager.phase_rules))
        if stop is not None:
            log.warning(
                "routing_stopped",
                conversation_id=cid,
                reason=stop.value,
                agents=list(decision.agents),
                phase=decision.phase,
            )
            return HandleResult(Outcome.STORED, stop.value, cid)
        # the model's words about a private conversation stay out of the logs
        # (docs/PROTOCOL.md, "Private conversations")
        reason = None if conversation.private else decision.reason
        log.info(
            "routing_decision",
            conversation_id=cid,
            trigger=event.id,
            agents=list(decision.agents),
            phase=decision.phase,
            reason=reason,
        )
        if decision.is_end:
            log.info("routing_ended", conversation_id=cid, reason=reason)
            await self._save_limits(cid, stored)
            return HandleResult(Outcome.STORED, RoutingStop.END.value, cid)
        phase = await self._apply_phase(conversation, decision)
        # the limits are saved with the turn: a crash before it leaves neither (redispatch decides again)
        await self._manager.start_orchestrator_turn(
            cid,
            phase,
            decision.agents,
            decision.reason,
            trigger_id=event.id,
            extra={ROUTING_LIMITS_KEY: self._limits.snapshot(cid)},
        )
        person = reply_person(conversation, event, self._manager.agents)
        for slug in decision.agents:
            request = RunRequest(cid, event.id, slug, via_orchestrator=True, person=person)
            await self._scheduler.submit(request)
        return HandleResult(Outcome.SCHEDULED, reason, cid, decision.agents)

    async def _save_limits(self, conversation_id: str, stored: dict[str, Any]) -> None:
        """Store the conversation's routing limits when they differ from ``stored`` (as loaded)."""
        limits = self._limits.snapshot(conversation_id)
        if limits != stored:
            await self._manager.update_extra(conversation_id, ROUTING_LIMITS_KEY, lambda _: limits)

    async def _apply_phase(self, conversation: Conversation, decision: RoutingDecision) -> Phase:
        """Move to the decision's phase when the rules allow it; return the phase the turn runs in."""
        current = conversation.phase
        if decision.phase is None or decision.phase == current.value:
            return current
        orchestrator = self._manager.agents.orchestrator
        by = orchestrator.slug if orchestrator is not None else decision.agents[0]
        try:
            transition = await self._manager.update_phase(
                conversation.id, decision.phase, decision.reason, by, reason=decision.reason
            )
        except ValueError as exc:  # PhaseTransitionError, or a phase the project does not know
            log.warning(
                "phase_change_refused",
                conversation_id=conversation.id,
                from_phase=current.value,
                to_phase=decision.phase,
                error=str(exc),
                action="turn stays in the current phase",
            )
            return current
        return transition.to_phase


def _as_run(decision: RoutingDecision, current: Phase, rules: PhaseRules) -> RoutingDecision:
    """``decision`` in the phase its turn will run in: its own when the rules allow the move, else ``current``
    (:meth:`EventDispatcher._apply_phase` keeps the current phase then)."""
    if decision.phase is not None:
        try:
            if rules.is_allowed(current, Phase(decision.phase)):
                return decision
        except ValueError:  # not a phase name
            pass
    return replace(decision, phase=current.value)


def _resumed_agents(conversation: Conversation, event: NostrEvent) -> tuple[str, ...] | None:
    """The agents of the turn ``event`` started that have not completed (None: it started none)."""
    turn = next((t for t in reversed(conversation.orchestrator_turns) if t.trigger_id == event.id), None)
    return None if turn is None else tuple(a for a in turn.agents if not turn.has_completed(a))


def _closed_by(conversation: Conversation, agent_slug: str, completion: NostrEvent) -> bool:
    """Whether the newest turn is closed, ``agent_slug`` completed in it and ``completion`` answers its
    trigger (this completion closed it: one answering a person who addressed the agent directly later
    is theirs, whatever turn came before)."""
    turns = conversation.orchestrator_turns
    if not turns:
        return False
    newest = turns[-1]
    return newest.is_completed and newest.has_completed(agent_slug) and newest.answered_by(completion)
