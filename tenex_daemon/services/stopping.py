"""Stopping agents: a person's stop request (kind 24134), ``tenexd conversations stop`` or the control API
cancels the runs of a conversation, running and waiting, and nothing half-written goes out
(docs/PROTOCOL.md).

A stopped run saves no reply and publishes nothing more (its partial texts and typing stop with it); it
leaves the run journal, so a restart does not redo it, and a run a dead daemon left journaled is not
redone either by the daemon that takes it over (the runner reads the record:
:func:`~tenex_daemon.core.stops.stopped_since`). A run whose answer is already being saved is let finish
(:func:`~tenex_daemon.services.runs.saving_reply`): its reply is whole, not half-written. The stop is
recorded in the conversation's metadata (``metadata.extra["stops"]``, :mod:`tenex_daemon.core.stops`:
who, when, which agents it named and stopped, the request's event id), a stopped agent that the
orchestrator's open turn waits for counts as having completed it (:data:`STOPPED_COMPLETION`: the turn
no longer waits), and, when runs were stopped, the stop is answered by a short notice ("Stopped:
Alice.") saved in history and published like a reply, tagged ``["error", "system"]`` and addressed to
the person only, so it runs nobody. The request event itself is not added to history (it is ephemeral
and says nothing to the agents); its id is remembered as processed like any handled event, but in
memory only when daemons share a database: each of them carries the request out for its own runs, and
the record gains the agents each stopped.

A stop through the CLI or the control API reaches one daemon. When daemons share a database it is told
to the others too (the project's stop channel, :func:`stop_channel`, through a
:class:`~tenex_daemon.core.ports.PeerMessages`): each stops its own runs, answers with the agents it
stopped, and adds them to the same record (the stop's ``stop_id``); the daemon asked reports the agents
every daemon stopped within ``daemon.stop_wait_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Awaitable, Collection, Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Protocol, TypeVar

import structlog

from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.errors import ConversationNotFoundError
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.ports import PeerMessages, ReplyComposer
from tenex_daemon.core.stops import STOPPED_COMPLETION, STOPS_KEY, with_stop
from tenex_daemon.core.targeting import SkipReason, may_join
from tenex_daemon.core.vocabulary import TAG_PUBKEY
from tenex_daemon.runtime.background import BackgroundTasks
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.services.lifecycle import adopted_root_key, task_meta_key
from tenex_daemon.services.locks import KeyedLock
from tenex_daemon.services.notices import compose_notice, store_notice
from tenex_daemon.services.outbox import Outbox
from tenex_daemon.services.runs import (
    PENDING_RUNS_KEY,
    SAVING_WAIT_S,
    ReplyBeingSaved,
    RunRequest,
    RunScheduler,
    forget_journaled,
)

T = TypeVar("T")
log = structlog.get_logger(__name__)

STOP_NOT_ALLOWED = "stop_not_allowed"
UNKNOWN_CONVERSATION = "unknown_conversation"
STOPPED = "stopped"
NOTHING_TO_STOP = "nothing_to_stop"

STOP_CHANNEL_PREFIX = "tenexd_stop_"
"""Where daemons sharing a database tell each other the stops made through the CLI or the API: this
prefix and the first 16 hex digits of the project's key (:func:`stop_channel`)."""
PEER_ANSWER_WAIT_S = 1.5
"""How long a stop through the CLI or the API waits for the other daemons' answers by default
(``daemon.stop_wait_s``; one that answers later still stops its runs and adds them to the record, the
report does not name them)."""


ANSWER_TELL_S = 5.0
"""How long a daemon that carried out another's stop tries to tell its answer."""


def stop_channel(project_pubkey: str | None) -> str:
    """The channel one project's daemons tell each other stops on (a database serves one project, but the
    server may hold other projects' databases; a channel name holds at most 63 bytes)."""
    return f"{STOP_CHANNEL_PREFIX}{(project_pubkey or '')[:16]}"


class PeerOp(StrEnum):
    """What a stop told between daemons is: a request, or the answer naming the agents stopped."""

    STOP = "stop"
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class PeerStop:
    """A stop told between daemons: ``op`` ``stop`` asks, ``stopped`` answers with the agents stopped."""

    op: PeerOp
    sender: str
    stop_id: str
    conversation_id: str
    agents: tuple[str, ...] | None
    by: str = "owner"

    def encode(self) -> str:
        """The message as told on the project's stop channel (JSON)."""
        return json.dumps({
            "op": self.op.value, "from": self.sender, "id": self.stop_id,
            "conversation": self.conversation_id,
            "agents": None if self.agents is None else list(self.agents), "by": self.by,
        })

    @classmethod
    def decode(cls, message: str) -> PeerStop | None:
        """The message read back; None when it is not one (logged)."""
        try:
            data = json.loads(message)
            agents = data["agents"]
            return cls(
                op=PeerOp(data["op"]), sender=str(data["from"]), stop_id=str(data["id"]),
                conversation_id=str(data["conversation"]), by=str(data["by"]),
                agents=None if agents is None else tuple(str(slug) for slug in agents),
            )
        except (ValueError, TypeError, KeyError) as exc:  # a ValueError too for an op that is none
            log.warning("peer_stop_unreadable", error=repr(exc), size=len(message))
            return None


@dataclass
class _Answers:
    """The answers to one stop told to the other daemons: who answered and the agents they stopped."""

    expected: int
    """How many daemons heard the stop (the count when it was told)."""
    senders: set[str] = field(default_factory=set)
    agents: list[str] = field(default_factory=list)
    all_in: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, sender: str, agents: Sequence[str]) -> None:
        """One daemon's answer."""
        self.senders.add(sender)
        self.agents.extend(agents)
        if len(self.senders) >= self.expected:
            self.all_in.set()


@dataclass
class Routing:
    """A routing under way (:meth:`Stopper.routing`): its trigger, and whether a stop stopped it."""

    trigger_id: str
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    decided: tuple[str, ...] | None = None
    """The agents the decision runs, once made (set with no await after the last look at :attr:`stopped`):
    a stop then no longer stops the routing, it names those agents it stops (their runs skip its trigger)."""

    @property
    def stopped(self) -> bool:
        """Whether a stop stopped it."""
        return self._stop.is_set()

    def stop(self) -> None:
        """Stop it: :meth:`unless_stopped` gives up waiting."""
        self._stop.set()

    async def unless_stopped(self, work: Awaitable[T]) -> T | None:
        """``work``'s result; None once a stop stops the routing first (``work`` is cancelled: a model's call
        for a decision nobody will carry out, which the conversation's next message would wait behind)."""
        task = asyncio.ensure_future(work)
        stopped = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait((task, stopped), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not task.done():
                task.cancel()
                await asyncio.wait((task,))  # a cancellation of the caller's own still goes on up
        if task.cancelled() or (self.stopped and task.exception() is not None):
            return None
        return task.result()


@dataclass(frozen=True, slots=True)
class StopReport:
    """What a stop did: the conversation, the agents whose runs it stopped, and the notice it published."""

    conversation_id: str | None
    agents: tuple[str, ...] = ()
    accepted: bool = True
    """False for a request that was not carried out (``reason`` says why)."""
    reason: str | None = None
    notice: NostrEvent | None = None


class AnswerStops(Protocol):
    """Answers agents give each other (``send_message``) that a stop cancels too."""

    def stop_answers(self, conversation_id: str, agent_slug: str | None) -> list[RunRequest]:
        """Cancel ``agent_slug``'s (None: any agent's) answers in the conversation; return them as runs."""


class Stopper:
    """Carries out stops for the owner and the whitelisted people (agents cannot stop anyone).

    One stop at a time per conversation (its lock is taken before any run's: a stop waits under it for
    the runs it cancels to end, and no run ever takes it).
    """

    def __init__(
        self,
        manager: ConversationManager,
        composer: ReplyComposer,
        outbox: Outbox,
        *,
        owner: str | None,
        whitelist: Collection[str] = (),
        whitelist_may_join: bool = False,
        messages: PeerMessages | None = None,
        instance: str = "",
        wait_s: float = PEER_ANSWER_WAIT_S,
        answers: AnswerStops | None = None,
    ) -> None:
        self._manager = manager
        self._answers_given = answers
        """The asked agents' answers to ``send_message`` (a stop naming such an agent cancels its answer)."""
        self._composer = composer
        self._outbox = outbox
        self._owner = owner
        self._whitelist = frozenset(whitelist)
        self._whitelist_may_join = whitelist_may_join
        """Off: a whitelisted person stops only where they may write (:func:`may_join`)."""
        self._locks = KeyedLock()
        self._messages = messages
        """Messages to the other daemons sharing the database (None: this daemon is alone with its store)."""
        self._channel = stop_channel(manager.agents.project_pubkey)
        self._instance = instance
        self._wait_s = wait_s
        self._answers: dict[str, _Answers] = {}
        """Stop id -> what the other daemons answered, while this daemon waits."""
        self._tasks = BackgroundTasks("peer stops")
        self._closed = False
        self._routings: dict[str, list[Routing]] = {}
        """The routings under way (the orchestrator deciding), by conversation: a stop stops them too."""

    @contextlib.contextmanager
    def routing(self, conversation_id: str, trigger_id: str) -> Iterator[Routing]:
        """A routing of ``trigger_id`` asked for in the conversation (the dispatcher's: they go one at a time
        per conversation, and one waiting for its turn counts too): a stop meanwhile, whichever agents it
        names, stops it (:attr:`Routing.stopped`: the dispatcher gives up the decision and starts no turn)
        and counts it as the orchestrator's run."""
        routing = Routing(trigger_id)
        self._routings.setdefault(conversation_id, []).append(routing)
        try:
            yield routing
        finally:
            waiting = self._routings.get(conversation_id, [])
            if routing in waiting:
                waiting.remove(routing)
            if not waiting:
                self._routings.pop(conversation_id, None)

    def _stop_routing(
        self,
        conversation_id: str,
        agents: Sequence[str] | None,
        conversation: Conversation | None,
        held: object,
    ) -> list[RunRequest]:
        """The routings under way or waiting in the conversation, stopped, as the orchestrator's runs (none
        when there is none): whichever ``agents`` a stop names, the orchestrator may be about to run them,
        and a run skipped for the stop after the decision would leave the message unanswered without a
        word. One decided goes on; the agents it runs that the stop names are returned, stopped (their runs
        skip its trigger). A routing of a message the stop did not come after (not among the ``held`` first
        messages of ``conversation`` when the stop was recorded) is left alone: the person wrote after it."""
        orchestrator = self._manager.agents.orchestrator
        if orchestrator is None:
            return []
        stopped: list[RunRequest] = []
        for routing in list(self._routings.get(conversation_id, ())):
            if routing.stopped or not _came_before_stop(routing.trigger_id, conversation, held):
                continue
            if routing.decided is not None:  # its agents' runs skip the trigger: the report names them
                named = [slug for slug in routing.decided if agents is None or slug in agents]
                stopped += [RunRequest(conversation_id, routing.trigger_id, slug) for slug in named]
                continue
            routing.stop()
            log.info("routing_stopped_by_stop", conversation_id=conversation_id, trigger=routing.trigger_id)
            stopped.append(RunRequest(conversation_id, routing.trigger_id, orchestrator.slug))
        return stopped

    def may_stop(self, pubkey: str) -> bool:
        """Whether ``pubkey`` may stop runs: the owner or a whitelisted person, never an agent."""
        if self._manager.agents.by_pubkey(pubkey) is not None:
            return False
        return pubkey == self._owner or pubkey in self._whitelist

    async def _may_stop_in(self, pubkey: str, conversation_id: str) -> bool:
        """Whether ``pubkey`` (who may stop) may stop the runs of this conversation: the owner anywhere; a
        whitelisted person where they may write, as the dispatcher lets them in: their own conversations,
        those the owner p-tagged them in, any public one with ``whitelist_may_join``."""
        if pubkey == self._owner:
            return True
        conversation = await self._manager.get_conversation(conversation_id)
        if conversation is None or not conversation.history:
            return False
        if conversation.private:  # only its person writes into a private conversation
            return conversation.history[0].pubkey == pubkey
        if self._whitelist_may_join:
            return True
        if conversation.task_id is not None and conversation.task_id != conversation.id:
            # a task's later session: who may write is decided by the task's thread, as the dispatcher does
            first = await self._manager.get_conversation(conversation.task_id)
            conversation = first if first is not None else conversation
        return may_join(pubkey, conversation.history, self._owner)

    async def on_request(
        self, event: NostrEvent, conversation_id: str, scheduler: RunScheduler
    ) -> StopReport:
        """Carry out a kind-24134 request naming ``conversation_id`` (its root; an event inside a
        conversation is taken for that conversation): the agents it p-tags, else (nobody or the project
        p-tagged) every agent; p-tags naming none of ours and not the project stop nothing."""
        if not self.may_stop(event.pubkey):
            log.warning("stop_refused", event_id=event.id, author=event.pubkey, reason=STOP_NOT_ALLOWED)
            return StopReport(conversation_id, accepted=False, reason=STOP_NOT_ALLOWED)
        cid = await self._conversation_of(conversation_id)
        if cid is None:
            reason = UNKNOWN_CONVERSATION
            log.info("stop_ignored", event_id=event.id, conversation_id=conversation_id, reason=reason)
            return StopReport(conversation_id, accepted=False, reason=UNKNOWN_CONVERSATION)
        if not await self._may_stop_in(event.pubkey, cid):
            reason = SkipReason.NOT_A_PARTICIPANT.value
            log.warning(
                "stop_refused", event_id=event.id, author=event.pubkey, conversation_id=cid, reason=reason
            )
            return StopReport(cid, accepted=False, reason=reason)
        agents = self._named_agents(event)
        if agents == ():
            reason = SkipReason.ADDRESSED_ELSEWHERE.value
            log.info("stop_ignored", event_id=event.id, conversation_id=cid, reason=reason)
            return StopReport(cid, accepted=False, reason=reason)
        return await self.stop(scheduler, cid, agents, by=event.pubkey, request=event)

    async def stop(
        self,
        scheduler: RunScheduler,
        conversation_id: str,
        agents: Sequence[str] | None,
        *,
        by: str,
        request: NostrEvent | None = None,
        stop_id: str | None = None,
    ) -> StopReport:
        """Stop the runs of ``agents`` (slugs; None: every agent) in a conversation, record the stop (by
        ``by``: a pubkey, or ``owner`` from the CLI and the API; ``stop_id``: the stop told between
        daemons) and, when runs were stopped, save and publish the notice; raise
        ConversationNotFoundError for an unknown conversation."""
        if await self._manager.get_conversation(conversation_id) is None:
            raise ConversationNotFoundError(conversation_id)
        async with self._locks.hold(conversation_id):
            named = None if agents is None else list(agents)
            # recorded before any run is cancelled: a run a dead daemon left, taken over meanwhile, reads
            # the stop before it starts, or is among the runs cancelled here
            recorded = await _record(self._manager, conversation_id, by, ((), named), request, stop_id)
            # read only when a routing is asked for (without this await none can be asked for meanwhile; with
            # it, ``held`` tells one asked for since apart)
            asked = self._routings.get(conversation_id)
            current = await self._manager.get_conversation(conversation_id) if asked else None
            held = recorded.get("history") if recorded is not None else None
            stopped: list[RunRequest] = self._stop_routing(conversation_id, named, current, held)
            for slug in agents if agents is not None else (None,):
                stopped.extend(await scheduler.cancel(conversation_id, slug))
                if self._answers_given is not None:  # an answer to another agent, inside its run
                    stopped.extend(self._answers_given.stop_answers(conversation_id, slug))
            saving = scheduler.replies_being_saved(conversation_id)
            try:
                finished = await _replies_saved(saving)
                slugs = tuple(dict.fromkeys(r.agent_slug for r in stopped))
                for routed in dict.fromkeys(r.agent_slug for r in stopped if r.via_orchestrator):
                    # the orchestrator's open turn no longer waits for an agent that will not answer
                    await self._manager.add_completion_to_turn(conversation_id, routed, STOPPED_COMPLETION)
                if (slugs or finished) and recorded is not None:  # the record gains what it stopped
                    completed = {**recorded, "agents": list(slugs)}
                    if finished:
                        completed["finished"] = finished
                    await _update_record(self._manager, conversation_id, completed, replacing=recorded)
            finally:
                for being_saved in saving:  # those runs route their replies now
                    being_saved.recorded.set()
            notice = await self._notify(conversation_id, stopped) if stopped else None
        log.info(
            "conversation_stopped",
            conversation_id=conversation_id,
            by=by,
            agents=list(slugs),
            runs=len(stopped),
            request=request.id if request is not None else None,
            notice=notice.id if notice is not None else None,
        )
        return StopReport(conversation_id, slugs, reason=STOPPED if slugs else NOTHING_TO_STOP, notice=notice)

    async def stop_everywhere(
        self, scheduler: RunScheduler, conversation_id: str, agents: Sequence[str] | None, *, by: str
    ) -> StopReport:
        """A stop through the CLI or the API: this daemon's runs and, when daemons share the database,
        every other daemon's (told on the project's stop channel); the report names the agents stopped
        here and those the others answered within ``wait_s``."""
        if self._messages is None:
            return await self.stop(scheduler, conversation_id, agents, by=by)
        if await self._manager.get_conversation(conversation_id) is None:
            raise ConversationNotFoundError(conversation_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._wait_s
        stop_id = uuid.uuid4().hex
        answers = self._answers[stop_id] = _Answers(await self._others_hearing())
        try:
            asked = PeerStop(PeerOp.STOP, self._instance, stop_id, conversation_id, _slugs(agents), by)
            told = answers.expected > 0 and await self._tell(asked, self._wait_s)
            report = await self.stop(scheduler, conversation_id, agents, by=by, stop_id=stop_id)
            if told:  # until every daemon hearing has answered, or the wait is over
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(answers.all_in.wait(), max(0.0, deadline - loop.time()))
        finally:
            del self._answers[stop_id]
        if answers.expected > len(answers.senders):
            log.info("peer_stop_answers_missing", conversation_id=conversation_id, expected=answers.expected,
                     answered=len(answers.senders))
        everywhere = tuple(dict.fromkeys([*report.agents, *answers.agents]))
        return replace(report, agents=everywhere, reason=STOPPED if everywhere else NOTHING_TO_STOP)

    async def _others_hearing(self) -> int:
        """How many other daemons hear this project's stops now (their answers are waited for); when the
        database cannot say, one is assumed, so the stop is told and answers waited for all the same."""
        assert self._messages is not None
        hearing = await _hearing(self._messages, self._channel, self._wait_s)
        return 1 if hearing is None else max(0, hearing - 1)  # this daemon hears its own channel too

    async def _tell(self, told: PeerStop, within_s: float) -> bool:
        """Tell the other daemons ``told``; False (logged) when the database did not take it in time."""
        assert self._messages is not None
        try:
            await asyncio.wait_for(self._messages.tell(self._channel, told.encode()), max(within_s, 0.1))
        except Exception as exc:  # the database is unreachable or busy: this daemon's part goes on
            cid = told.conversation_id
            log.warning("peer_stop_not_told", conversation_id=cid, op=told.op.value, error=repr(exc))
            return False
        return True

    def hearing(self, scheduler: RunScheduler) -> AbstractAsyncContextManager[None]:
        """Hear, while the block runs, the stops the other daemons sharing the database tell (and their
        answers): each carried out for ``scheduler``'s runs. Nothing to hear for a daemon alone."""
        if self._messages is None:
            return contextlib.nullcontext()
        return self._messages.hear(self._channel, lambda message: self.heard(message, scheduler))

    def heard(self, message: str, scheduler: RunScheduler) -> None:
        """A message another daemon told on the project's stop channel: its stop is carried out for this
        daemon's runs (in the background) and answered; its answer is kept for the stop waiting for it."""
        told = PeerStop.decode(message)
        if told is None or told.sender == self._instance or self._messages is None:
            return
        if told.op is PeerOp.STOPPED:
            answers = self._answers.get(told.stop_id)
            if answers is not None:
                answers.add(told.sender, told.agents or ())
        elif not self._closed:
            self._tasks.spawn(self._stop_for_peer(told, scheduler), f"stop {told.conversation_id[:8]}")

    async def _stop_for_peer(self, told: PeerStop, scheduler: RunScheduler) -> None:
        """Carry out another daemon's stop for this daemon's runs, then answer with the agents stopped."""
        cid = told.conversation_id
        try:
            report = await self.stop(scheduler, cid, told.agents, by=told.by, stop_id=told.stop_id)
        except ConversationNotFoundError:  # deleted meanwhile
            log.info("peer_stop_ignored", conversation_id=cid, reason=UNKNOWN_CONVERSATION)
            return
        answer = PeerStop(PeerOp.STOPPED, self._instance, told.stop_id, cid, report.agents, told.by)
        await self._tell(answer, ANSWER_TELL_S)

    async def close(self) -> None:
        """Carry out no more stops heard from other daemons; cancel those still being carried out (at
        shutdown, once the runs are drained: a run cancelled by the drain stays journaled, and a stop
        heard from now on does not remove it, so the next start redoes it)."""
        self._closed = True
        await self._tasks.cancel_all()

    async def _conversation_of(self, event_id: str) -> str | None:
        """The conversation a request's ``e`` names: a task's current session for a task (clients name
        the task's thread), the conversation rooted at it, the one holding it, else the one a comment
        started in its thread when it could not be found (clients name the thread's root)."""
        session = await self._manager.store.get_meta(task_meta_key(event_id))
        if session is not None and await self._manager.get_conversation(session) is not None:
            return session
        if await self._manager.get_conversation(event_id) is not None:
            return event_id
        holding = await self._manager.find_conversation_of_event(event_id)
        if holding is not None:
            return holding
        adopted = await self._manager.store.get_meta(adopted_root_key(event_id))
        found = await self._manager.get_conversation(adopted) if adopted is not None else None
        return found.id if found is not None else None

    def _named_agents(self, event: NostrEvent) -> tuple[str, ...] | None:
        """The agents a request p-tags; None (every agent) when it p-tags nobody (its author aside) or the
        project. A request whose p-tags name neither our agents nor the project is for someone else's: ()."""
        directory = self._manager.agents
        tagged = [p for p in event.tag_values(TAG_PUBKEY) if p != event.pubkey]  # the author's own: no one
        if not tagged or directory.project_pubkey in tagged:
            return None
        named = (directory.by_pubkey(p) for p in tagged)
        return tuple(dict.fromkeys(agent.slug for agent in named if agent is not None))

    async def _notify(self, conversation_id: str, stopped: list[RunRequest]) -> NostrEvent | None:
        """Save and publish the notice of a stop ("Stopped: <names>."), a reply to the newest stopped
        trigger from the stopped agent (several: the orchestrator, else the first of them)."""
        conversation = await self._manager.get_conversation(conversation_id)
        if conversation is None:
            return None
        trigger = _newest_trigger(conversation, stopped)
        if trigger is None:
            return None
        directory = self._manager.agents
        slugs = list(dict.fromkeys(r.agent_slug for r in stopped))
        orchestrator = directory.orchestrator
        author = slugs[0] if len(slugs) == 1 or orchestrator is None else orchestrator.slug
        names = ", ".join(directory.get(slug).name for slug in slugs)
        content = f"Stopped: {names}."
        notice = compose_notice(self._manager, self._composer, conversation, trigger, author, content)

        async def save() -> bool:
            return await store_notice(self._manager, conversation_id, notice, kind_of="stop")

        # no run journal covers a notice: its outbox entry holds it until it is saved (a crash loses neither);
        # no trigger: a notice is no reply, nor its wait a reply's latency (the person's wait before the stop)
        saved = await self._outbox.add_saving(conversation_id, notice, save, agent_slug=author)
        return notice if saved else None


async def stop_without_daemon(
    manager: ConversationManager,
    conversation_id: str,
    agent_slug: str | None,
    *,
    by: str,
    journal_key: str = PENDING_RUNS_KEY,
    messages: PeerMessages | None = None,
    wait_s: float = PEER_ANSWER_WAIT_S,
) -> StopReport:
    """A stop while this home's daemon does not run (the CLI on the store): the runs a crashed daemon
    journaled for the conversation (``agent_slug``'s only, when given) are removed, so its next start
    does not redo them, and the stop is recorded. With ``messages`` (a database other daemons share) it
    is also told to the daemons running on it, as a stop through a daemon is, and the agents they answer
    within ``wait_s`` that they stopped are reported. No notice from here: nothing is published without a
    daemon (each daemon that stopped runs publishes its own)."""
    if await manager.get_conversation(conversation_id) is None:
        raise ConversationNotFoundError(conversation_id)
    if agent_slug is not None:
        manager.agents.get(agent_slug)  # UnknownAgentError for a slug that names no agent
    dropped = await forget_journaled(manager.store, conversation_id, agent_slug, journal_key=journal_key)
    slugs = tuple(dict.fromkeys(r.agent_slug for r in dropped))
    named = None if agent_slug is None else [agent_slug]
    stop_id = uuid.uuid4().hex if messages is not None else None
    await _record(manager, conversation_id, by, (slugs, named), None, stop_id)
    if messages is not None and stop_id is not None:
        asked = PeerStop(PeerOp.STOP, f"cli-{stop_id[:8]}", stop_id, conversation_id, _slugs(named), by)
        stopped = await _tell_and_wait(messages, stop_channel(manager.agents.project_pubkey), asked, wait_s)
        slugs = tuple(dict.fromkeys([*slugs, *stopped]))
    log.info("conversation_stopped", conversation_id=conversation_id, by=by, agents=list(slugs), daemon=False)
    return StopReport(conversation_id, slugs, reason=STOPPED if slugs else NOTHING_TO_STOP)


async def _hearing(messages: PeerMessages, channel: str, wait_s: float) -> int | None:
    """How many hear ``channel`` now; None (logged) when the database cannot say within ``wait_s``."""
    try:
        return await asyncio.wait_for(messages.hearers(channel), max(wait_s, 0.1))
    except Exception as exc:
        log.warning("peer_count_unknown", error=repr(exc))
        return None


async def _tell_and_wait(
    messages: PeerMessages, channel: str, asked: PeerStop, wait_s: float
) -> tuple[str, ...]:
    """Tell ``asked`` to the daemons hearing ``channel`` and return the agents they answer they stopped,
    within ``wait_s`` (a database that cannot say who hears is told all the same, and waited for)."""
    hearing = await _hearing(messages, channel, wait_s)
    expected = 1 if hearing is None else hearing  # the database cannot say: told all the same
    if expected == 0:
        return ()
    answers = _Answers(expected)

    def heard(message: str) -> None:
        told = PeerStop.decode(message)
        if told is not None and told.op is PeerOp.STOPPED and told.stop_id == asked.stop_id:
            answers.add(told.sender, told.agents or ())

    try:
        async with messages.hear(channel, heard):
            await asyncio.wait_for(messages.tell(channel, asked.encode()), max(wait_s, 0.1))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(answers.all_in.wait(), wait_s)
    except Exception as exc:  # the database went away meanwhile: the record stands, the journals redo nothing
        cid = asked.conversation_id
        log.warning("peer_stop_not_told", conversation_id=cid, op=asked.op.value, error=repr(exc))
    return tuple(dict.fromkeys(answers.agents))


async def _replies_saved(saving: Sequence[ReplyBeingSaved]) -> list[str]:
    """Wait (at most ``SAVING_WAIT_S``) until the replies of the runs a stop let finish (``saving``)
    are saved, and return the ids of those in history then: they were said before the stop, which the
    record counts (``finished``), so the agents the orchestrator routes them to do not run (each such
    run routes its reply only once the record says so). By id, not by position: a person's message
    that comes meanwhile stands before them in history, and was said after the stop."""
    if not saving:
        return []
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.gather(*(r.saved.wait() for r in saving)), SAVING_WAIT_S)
    return [r.reply_id for r in saving if r.reply_id is not None]


async def _record(
    manager: ConversationManager,
    conversation_id: str,
    by: str,
    agents: tuple[tuple[str, ...], list[str] | None],
    request: NostrEvent | None,
    stop_id: str | None,
) -> dict[str, Any] | None:
    """Add a stop to the conversation's record (``metadata.extra["stops"]``, :mod:`tenex_daemon.core.stops`):
    ``agents`` is (the slugs stopped, the slugs the stop named or None for every agent). A request or a
    told stop (``stop_id``) already recorded (daemons sharing a database each carry it out for their own
    runs) gains the agents stopped here instead. Return the entry written (None: the conversation was
    deleted meanwhile)."""
    stopped, named = agents
    conversation = await manager.get_conversation(conversation_id)
    held = None if conversation is None else len(conversation.history)  # the messages the stop came after
    entry: dict[str, Any] = {
        "by": by, "at": manager.now_ms(), "history": held, "agents": list(stopped), "named": named,
        "event_id": request.id if request else None,
    }
    if stop_id is not None:
        entry["stop_id"] = stop_id
    return entry if await _update_record(manager, conversation_id, entry) else None


async def _update_record(
    manager: ConversationManager,
    conversation_id: str,
    entry: dict[str, Any],
    *,
    replacing: dict[str, Any] | None = None,
) -> bool:
    """Write ``entry`` into the conversation's stops record (:func:`with_stop`); False when the conversation
    was deleted meanwhile."""
    try:
        await manager.update_extra(
            conversation_id, STOPS_KEY, lambda kept: with_stop(kept, entry, replacing=replacing)
        )
    except ConversationNotFoundError:
        return False
    return True


def _came_before_stop(trigger_id: str, conversation: Conversation | None, held: object) -> bool:
    """Whether ``trigger_id`` stands among the ``held`` first messages of ``conversation`` (the stop came
    after it); True when either is unknown."""
    if conversation is None or not isinstance(held, int) or isinstance(held, bool):
        return True
    index = conversation.index_of(trigger_id)
    return index is not None and index < held


def _newest_trigger(conversation: Conversation, stopped: list[RunRequest]) -> NostrEvent | None:
    """The stopped request's trigger that stands last in history."""
    indexes = [conversation.index_of(r.trigger_id) for r in stopped]
    found = [i for i in indexes if i is not None]
    return conversation.history[max(found)] if found else None


def _slugs(agents: Sequence[str] | None) -> tuple[str, ...] | None:
    """The agents as a tuple (None: every agent)."""
    return None if agents is None else tuple(agents)
