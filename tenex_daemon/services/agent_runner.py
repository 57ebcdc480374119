"""One agent run: build its view, ask its backend (running the tools it calls), save the reply, then
sign and publish it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

import structlog

from tenex_daemon.core.context import AgentContext
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.errors import ConversationArchivedError, ConversationNotFoundError
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.llm import CompletionResult
from tenex_daemon.core.ports import PartialTextPublisher, Publisher, ReplyComposer, ReplySpec
from tenex_daemon.core.stops import STOPPED_COMPLETION, stopped_since
from tenex_daemon.core.targeting import burst_people, reply_person
from tenex_daemon.core.thread_tags import read_threading
from tenex_daemon.core.vocabulary import TAG_DELEGATION
from tenex_daemon.runtime.background import BackgroundTasks
from tenex_daemon.services.answering import (
    DEFAULT_MAX_TOOL_ROUNDS,
    DEFAULT_TOOLS,
    TOOL_LOOP_ERROR,
    AgentProfile,
    AnswerLoop,
    PartialStreamer,
)
from tenex_daemon.services.conversation_changes import RunRecord
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.services.delegation import Delegation, RunDelegator
from tenex_daemon.services.outbox import Outbox
from tenex_daemon.services.runs import (
    SAVING_WAIT_S,
    RunListener,
    RunRequest,
    reply_saved,
    saving_reply,
    stops_recorded,
)
from tenex_daemon.services.threads import ThreadManager
from tenex_daemon.services.tools import (
    SEND_MESSAGE,
    RunEffects,
    ToolContext,
    ToolRegistry,
)

__all__ = [
    "DEFAULT_MAX_TOOL_ROUNDS",
    "DEFAULT_TOOLS",
    "TOOL_LOOP_ERROR",
    "AgentProfile",
    "AgentRunner",
    "PartialStreamer",
    "ReplyRouting",
    "RunObserver",
    "user_destination",
]

DEFAULT_PARTIAL_INTERVAL_S = 0.5
"""While a backend streams, the text so far is published at most this often (kind 21111)."""

log = structlog.get_logger(__name__)


class RunObserver(Protocol):
    """Told about runs (the app turns this into metrics)."""

    def run_finished(self, request: RunRequest, seconds: float, error: str | None) -> None:
        """A run ended; ``error`` names the failure kind, if any."""

    def reply_published(self, agent_slug: str, trigger_id: str, sent_at: float) -> None:
        """A reply to ``trigger_id`` reached at least one relay; ``sent_at``: when it was sent (epoch s)."""


class ReplyRouting(Protocol):
    """What a run tells about its reply (the dispatcher: it targets replies that address an agent)."""

    async def before_reply_saved(self, conversation_id: str, reply: NostrEvent) -> None:
        """Called just before a reply that :meth:`after_reply` will be told about is saved."""

    async def after_reply(self, conversation_id: str, reply: NostrEvent) -> object:
        """Called once the reply is saved (not for the last reply of an ended conversation)."""

    async def saved_reply_found(self, conversation_id: str, reply: NostrEvent) -> None:
        """Called when a run redone finds its reply saved already (it is routed if no one routed it)."""


def user_destination(conversation: Conversation, trigger: NostrEvent, manager: ConversationManager) -> str:
    """Return the person a reply goes to: the trigger's author if a user, else the newest user in history
    (:func:`~tenex_daemon.core.targeting.reply_person`)."""
    return reply_person(conversation, trigger, manager.agents)


def _newest_answered(conversation: Conversation, trigger: NostrEvent, burst: Iterable[str]) -> int:
    """The newest ``created_at`` of what a reply to ``trigger`` answers or follows besides it: the other
    messages of its ``burst`` and the ``send_message`` exchanges saved after it (its run's). The reply is
    dated after them (a person's clock ahead, an asked agent's answer dated a second after the question)."""
    history = conversation.history
    dates = [history[index].created_at for index in map(conversation.index_of, burst) if index is not None]
    start = conversation.index_of(trigger.id)
    if start is not None:
        dates += [e.created_at for e in history[start + 1 :] if e.tag_value(TAG_DELEGATION) is not None]
    return max(dates, default=0)


class AgentRunner:
    """Carries out :class:`RunRequest` s.

    The reply is added to history (accepted) before it is signed and published, so a
    crash after the model answered never loses it; the relay echo is then a duplicate.
    A backend failure becomes a reply tagged ``["error", "system"]`` saying what failed.
    Typing indicators and the publication of the saved reply run as tracked background
    tasks (:meth:`flush` waits for them), so a run does not hold its slot while relays
    acknowledge. Typing starts once a run has taken ``typing_delay_s`` (a reply faster
    than that shows no indicator, and costs the relays no start/stop pair); a stop is
    sent after the reply only when a start was.

    The agent's tools (``profile.tools``, from ``tools``) are offered to its backend; the
    calls it makes run and their results go back to it until it answers with text, at
    most ``max_tool_rounds`` backend calls per run (then the reply is an error saying so).
    A ``complete`` call makes the reply a completion (tagged ``["tool", "complete"]``,
    addressed to the orchestrator too); ``end_conversation`` archives the conversation
    once the reply is saved.

    With ``threads`` (a :class:`ThreadManager`), an agent other than the orchestrator is
    also offered ``send_message`` whenever another non-orchestrator agent is configured
    (see :mod:`~tenex_daemon.services.delegation`); without it, nobody is. ``run_listener`` (the live
    status) is told when an asked agent starts and ends answering, as the scheduler tells it of runs.

    A run redone after a crash (``recovered``) whose agent already answered its trigger saves nothing
    and publishes that answer again; with ``shared_store`` (daemons sharing a database) every run does,
    since two daemons may dispatch one event (:meth:`EventDispatcher.handle` after a lost commit answer).
    """

    def __init__(
        self,
        manager: ConversationManager,
        profiles: Mapping[str, AgentProfile],
        composer: ReplyComposer,
        publisher: Publisher,
        *,
        observer: RunObserver | None = None,
        typing_delay_s: float = 0.0,
        tools: ToolRegistry | None = None,
        max_tool_rounds: int = DEFAULT_MAX_TOOL_ROUNDS,
        partials: PartialTextPublisher | None = None,
        partial_interval_s: float = DEFAULT_PARTIAL_INTERVAL_S,
        threads: ThreadManager | None = None,
        outbox: Outbox | None = None,
        shared_store: bool = False,
        run_listener: RunListener | None = None,
    ) -> None:
        self._manager = manager
        self._shared_store = shared_store
        self._profiles = profiles
        self._composer = composer
        self._publisher = publisher
        self._observer = observer
        self._typing_delay = typing_delay_s
        self._tools = tools or ToolRegistry.default(manager.phase_rules.phases)
        self._loop = AnswerLoop(manager, self._tools, max_tool_rounds)
        if partial_interval_s <= 0:
            raise ValueError("partial_interval_s must be positive")
        self._partials = partials
        self._partial_interval = partial_interval_s
        for profile in profiles.values():
            unknown = set(profile.tools) - set(self._tools.names)
            if unknown:
                raise ValueError(f"agent {profile.agent.slug}: unknown tools {', '.join(sorted(unknown))}")
        self._tasks = BackgroundTasks("agent runner")
        self.outbox = outbox if outbox is not None else Outbox(manager.store, publisher, observer=observer)
        """Where replies go to be published (kept until a relay accepts them)."""
        self._delegation = (
            None
            if threads is None
            else Delegation(
                manager, profiles, threads, composer, answer=self._loop.answer, outbox=self.outbox,
                listener=run_listener,
            )
        )

    @property
    def delegation(self) -> Delegation | None:
        """The agents' ``send_message`` exchanges (None without threads): a stop cancels their answers."""
        return self._delegation

    @property
    def profiles(self) -> Mapping[str, AgentProfile]:
        """The agents' profiles by slug (the context preview builds their personas the way runs do)."""
        return self._profiles

    def offered_tools(self, slug: str) -> tuple[str, ...]:
        """The tools a run of ``slug`` is offered: its profile's, plus ``send_message`` if it may delegate."""
        profile = self._profiles[slug]
        delegation = self._delegation
        if delegation is None or SEND_MESSAGE in profile.tools or not delegation.can_delegate(profile.agent):
            return profile.tools
        return (*profile.tools, SEND_MESSAGE)

    def _delegating(
        self, profile: AgentProfile, cid: str, trigger: NostrEvent, burst: tuple[str, ...]
    ) -> tuple[AgentProfile, RunDelegator | None]:
        """The profile offered ``send_message`` too, and the run's delegator, when the agent may delegate."""
        delegation = self._delegation
        if delegation is None or not delegation.can_delegate(profile.agent):
            return profile, None
        tools = profile.tools if SEND_MESSAGE in profile.tools else (*profile.tools, SEND_MESSAGE)
        return replace(profile, tools=tools), delegation.for_run(profile.agent, cid, trigger, burst)

    async def run(self, request: RunRequest, routing: ReplyRouting | None = None) -> NostrEvent | None:
        """Run one agent for one trigger; return the reply event (None when the trigger is gone).

        ``routing`` is told about the reply before it is saved and once it is saved (unless it ended
        its conversation: an ended conversation is read-only, nobody is targeted by its last reply).
        """
        started = time.perf_counter()
        cid = request.conversation_id
        profile = self._profiles.get(request.agent_slug)
        if profile is None:  # a run journaled before the agent left the configuration
            slug = request.agent_slug
            log.error("run_agent_unknown", conversation_id=cid, event_id=request.trigger_id, agent=slug)
            return None
        conversation = await self._manager.get_conversation(cid)
        index = conversation.index_of(request.trigger_id) if conversation is not None else None
        if conversation is None or index is None:
            log.error("run_trigger_missing", conversation_id=cid, event_id=request.trigger_id)
            return None
        if conversation.archived:  # archived since the run was asked for: its answer could not be saved
            log.info("run_abandoned", conversation_id=cid, event_id=request.trigger_id, reason="archived")
            return None
        request, index = _newest_last(request, conversation, index)
        trigger = conversation.history[index]
        if await self._done_already(request, conversation, index, profile.agent.pubkey, routing):
            return None
        private = conversation.private  # nothing of a private conversation goes out in the clear
        thread = conversation.thread_id  # what clients showing the thread subscribe to
        typing_started: list[bool] = [self._typing_delay <= 0 and not private]  # no delay: as good as sent
        slug = profile.agent.slug
        delay = self._typing_delay
        typing = self._send(self._typing_after(delay, slug, thread, typing_started, private), "typing")
        effects = RunEffects()
        streamer: PartialStreamer | None = None
        if self._partials is not None and not private:
            interval = self._partial_interval
            streamer = PartialStreamer(profile.backend, self._partials, interval, slug, thread, trigger.id)
            profile = replace(profile, backend=streamer)
        started_ms = self._manager.run_clock_ms()
        try:
            # nothing is stored before the reply: what the agent saw is saved with it, in one write
            # a run's trigger goes last: what was saved after it while it waited (the agent's own answer
            # to an earlier message, others of a burst) is shown too (docs/CONTEXT.md, "Bursts")
            context = await self._manager.build_agent_messages(cid, slug, trigger, persist=False, burst=True)
            offered, delegator = self._delegating(profile, cid, trigger, request.burst)
            tool_context = ToolContext(
                self._manager,
                cid,
                profile.agent,
                effects,
                delegator,
                trigger=trigger,
                budget=profile.budget,
                list_recent=profile.list_recent,
            )
            result, error_kind = await self._loop.answer(offered, context, tool_context)
        except BaseException:  # a stop or a shutdown cancelled it: nothing is saved, typing stops
            await self._stop_typing(streamer, typing, typing_started)
            if typing_started[0]:
                self._send(self._typing(slug, thread, active=False), "typing stop")
            await self._count_run_time(cid, started_ms)
            raise
        saving_reply()  # from here a stop lets the run finish: its reply goes out whole
        await self._stop_typing(streamer, typing, typing_started)
        failed = error_kind is not None and result.session_id is None  # an empty answer's session took it in
        record = _run_record(slug, context, started_ms, result, effects, failed=failed)
        try:
            reply, made = await self._save_reply(
                request, profile, trigger, result, record, error_kind, effects, routing
            )
            reply_saved(reply.id)  # a stop that let it finish counts it as said before the stop
            if made or not private:  # another daemon's private answer goes out in its wraps, from its outbox
                await self.outbox.add(cid, reply, agent_slug=slug, trigger_id=request.trigger_id)
        except BaseException:
            await self._count_run_time(cid, started_ms)
            raise
        finally:  # the run is over here, whatever its save did: typing stops (a retry never sends a stop)
            if typing_started[0]:
                self._send(self._typing(slug, thread, active=False), "typing stop")
        if self._observer is not None:
            self._observer.run_finished(request, time.perf_counter() - started, error_kind)
        if routing is not None and not made:  # another daemon's answer: routed if it never was
            await routing.saved_reply_found(cid, reply)
        elif routing is not None and not effects.end_conversation:
            # An ended conversation is read-only: nobody is targeted by its last reply.
            await stops_recorded(SAVING_WAIT_S)  # a stop that let this run finish counts its reply first
            await routing.after_reply(cid, reply)
        return reply

    async def _done_already(
        self, request: RunRequest, conversation: Conversation, index: int, agent_pubkey: str,
        routing: ReplyRouting | None = None,
    ) -> bool:
        """Whether the run has nothing to do: its agent answered its trigger already (that answer goes
        out again), or a person stopped it since its trigger came."""
        cid = conversation.id
        trigger = conversation.history[index]
        if request.recovered:
            await self._republish_saved(conversation, request, agent_pubkey, routing)
        saved = None
        if request.recovered or self._shared_store:
            # with daemons sharing a database, any run: two may dispatch one event (one of them after its
            # store write's answer was lost); whichever runs second finds the first's answer
            saved = self._answer_to(conversation.history, index, agent_pubkey)
        if saved is not None:
            # Redone after a crash that came between the reply and the run's end: the reply is
            # saved, maybe never published. It goes out again (relays keep one copy per id).
            log.info("run_skipped", conversation_id=cid, event_id=trigger.id, reason="already answered")
            # not a private answer another daemon saved: new gift wraps of it would reach the person twice
            if request.recovered or not conversation.private:
                await self.outbox.add(cid, saved, agent_slug=request.agent_slug, trigger_id=trigger.id)
            if routing is not None:  # tried again after an error that came after the save: route it now
                await routing.saved_reply_found(cid, saved)
            return True
        state = conversation.agent_states.get(request.agent_slug)
        shown = state is not None and state.last_processed_index > index
        if self._shared_store and not request.via_orchestrator and shown and any(
            event.pubkey == agent_pubkey for event in conversation.history[index + 1:]
        ):
            # daemons sharing a database each take in part of a burst: a run of another daemon showed this
            # message to the agent already, in an answer saved since (docs/CONTEXT.md, "Bursts"); an index
            # past it with no answer after it answers nothing (an earlier tenexd saved the index as it built
            # the context: a run a crash cut short left it so)
            log.info("run_skipped", conversation_id=cid, event_id=trigger.id, reason="shown in a later run")
            return True
        if stopped_since(conversation, trigger, request.agent_slug, recovered=request.recovered):
            # stopped by a person since its trigger came: left journaled by a crash or a dead daemon, or
            # routed to by an orchestrator that was still deciding when the stop came
            log.info("run_skipped", conversation_id=cid, event_id=trigger.id, reason="stopped")
            if request.via_orchestrator:  # the orchestrator's open turn no longer waits for it
                await self._manager.add_completion_to_turn(cid, request.agent_slug, STOPPED_COMPLETION)
            return True
        return False

    async def _republish_saved(
        self, conversation: Conversation, request: RunRequest, agent_pubkey: str,
        routing: ReplyRouting | None = None,
    ) -> None:
        """A run redone after a crash: what the previous process saved for it but may never have
        published goes out again (the outbox keeps one entry per event; relays one copy per id): the
        agent's saved answers to the earlier messages of its burst, and both sides of the
        ``send_message`` exchanges saved after its trigger."""
        history = conversation.history
        cid = conversation.id
        for earlier in request.burst:
            index = conversation.index_of(earlier)
            answer = None if index is None else self._answer_to(history, index, agent_pubkey)
            if answer is not None:
                await self.outbox.add(cid, answer, agent_slug=request.agent_slug, trigger_id=earlier)
                if routing is not None:  # saved by a try that failed after it: routed if never routed
                    await routing.saved_reply_found(cid, answer)
        start = conversation.index_of(request.trigger_id)
        for event in history[(start or 0) + 1 :]:
            author = self._manager.agents.by_pubkey(event.pubkey)
            if author is not None and event.tag_value(TAG_DELEGATION) is not None:
                await self.outbox.add(cid, event, agent_slug=author.slug)

    def _answer_to(self, history: Sequence[NostrEvent], index: int, agent_pubkey: str) -> NostrEvent | None:
        """The agent's saved reply to ``history[index]``: a later event of its whose threading tags name it
        as the event answered (a kind-1 reply names the thread's root first), and not a ``send_message``
        request it made meanwhile (which carries a ``delegation`` tag)."""
        trigger_id = history[index].id
        for event in history[index + 1:]:
            if (
                event.pubkey == agent_pubkey
                and event.tag_value(TAG_DELEGATION) is None
                and read_threading(event).parent_id == trigger_id
            ):
                return event
        return None

    async def _count_run_time(self, conversation_id: str, started_ms: int) -> None:
        """A run that ends without a saved reply still worked: its time is counted (best effort)."""
        try:
            await self._manager.add_run_time(conversation_id, started_ms)
        except (ConversationNotFoundError, ConversationArchivedError):
            pass  # deleted or archived meanwhile: no time to count there (the run says why it ends)
        except Exception:
            log.exception("run_time_not_saved", conversation_id=conversation_id)

    async def _save_reply(
        self,
        request: RunRequest,
        profile: AgentProfile,
        trigger: NostrEvent,
        result: CompletionResult,
        record: RunRecord,
        error_kind: str | None,
        effects: RunEffects,
        routing: ReplyRouting | None,
    ) -> tuple[NostrEvent, bool]:
        """Compose, journal (when routed on) and save the reply with what the run changed: one write. The
        reply, and whether this run made it: with daemons sharing a database, one that took this run's
        lease over while the model worked (it thought this daemon dead) may have answered the trigger
        since; its answer, found under the conversation's lease, is kept instead (nothing is saved)."""
        cid = request.conversation_id
        found: list[NostrEvent] = []
        # a routed agent that could not answer completes its part with the error: the orchestrator's open
        # turn would wait for it for ever (docs/ARCHITECTURE.md, "Orchestrator turns")
        complete = effects.complete if error_kind is None else request.via_orchestrator
        orchestrator = self._manager.agents.orchestrator

        async def compose(conversation: Conversation, net_time_seconds: int) -> NostrEvent:
            index = conversation.index_of(trigger.id) if self._shared_store else None
            history = conversation.history
            saved = None if index is None else self._answer_to(history, index, profile.agent.pubkey)
            if saved is not None:  # the store takes it for the duplicate it is: the run changes nothing
                log.warning("run_answered_elsewhere", conversation_id=cid, event_id=trigger.id, by=saved.id)
                found.append(saved)
                return saved
            # a burst's reply answers each of its messages: their people are told (docs/CONTEXT.md, "Bursts")
            burst = () if conversation.private else request.burst
            destinations = burst_people(conversation, trigger, burst, self._manager.agents)
            # a private completion p-tags the person only: NIP-17 clients make a chat of the p-tags, and
            # the orchestrator is told by its completion tag (docs/PROTOCOL.md, "Private conversations")
            to_orchestrator = complete and not conversation.private
            if to_orchestrator and orchestrator is not None and orchestrator.slug != profile.agent.slug:
                destinations.append(orchestrator.pubkey)
            spec = ReplySpec(
                agent_slug=profile.agent.slug,
                trigger=trigger,
                root=conversation.root,
                task_id=conversation.task_id,
                missing_root=conversation.missing_root,
                subject=conversation.subject(),
                after=_newest_answered(conversation, trigger, request.burst),
                content=result.text,
                destinations=tuple(destinations),
                phase=conversation.phase.value,
                net_time_seconds=net_time_seconds,
                session_id=result.session_id or record.context.session_id,
                complete=complete,
                model=result.model,
                prompt_tokens=result.prompt_tokens,
                completion_tokens=result.completion_tokens,
                error=error_kind is not None,
                cost_usd=profile.cost_usd(result),
            )
            reply = self._composer.compose(spec)
            if routing is not None and not effects.end_conversation:
                await routing.before_reply_saved(cid, reply)
            return reply

        # A reply tagged ["tool", "complete"] is counted as the open turn's completion here, once.
        reply = await self._manager.append_reply(cid, compose, record)
        return reply, not found

    @staticmethod
    async def _stop_typing(
        streamer: PartialStreamer | None, typing: asyncio.Task[None], typing_started: list[bool]
    ) -> None:
        """The answer is in: wait for a partial still going out, cancel a typing start not yet sent."""
        if streamer is not None:
            await streamer.close()
        if not typing_started[0]:
            typing.cancel()  # still waiting out the delay: nothing was sent

    def _send(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        return self._tasks.spawn(coro, name)

    async def flush(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for pending publications (typing indicators included); return how
        many replies still wait for a relay (they stay in the outbox for the next start)."""
        await self._tasks.wait(timeout_s)
        return await self.outbox.flush(timeout_s)

    async def _typing_after(
        self, delay_s: float, agent_slug: str, conversation_id: str, started: list[bool], private: bool
    ) -> None:
        if private:
            return  # no typing indicator for a private conversation
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        started[0] = True
        await self._typing(agent_slug, conversation_id, active=True)

    async def _typing(self, agent_slug: str, conversation_id: str, *, active: bool) -> None:
        try:
            await self._publisher.typing(agent_slug, conversation_id, active)
        except Exception as exc:
            log.info("typing_not_published", agent=agent_slug, error=str(exc))


def _run_record(
    slug: str,
    context: AgentContext,
    started_ms: int,
    result: CompletionResult,
    effects: RunEffects,
    *,
    failed: bool,
) -> RunRecord:
    """What a run changes besides its reply. One that failed with no session of its own (its reply an error
    reply) forgets the agent's session: the session never took in the message that failed, and a resumed
    session is sent only what follows the agent's last reply, then the error reply; the next call starts a
    session with everything."""
    used = (result.prompt_tokens or 0, result.completion_tokens or 0)
    return RunRecord(
        slug,
        replace(context, session_id=None) if failed else context,
        started_ms,
        session_id=None if failed else result.session_id,
        add_tokens=used if any(used) else None,
        tools_used=tuple(effects.tools_used),
        ends=effects.end_conversation,
        end_reason=effects.end_reason,
    )


def _newest_last(request: RunRequest, conversation: Conversation, index: int) -> tuple[RunRequest, int]:
    """A burst's trigger is the newest of its messages in history (docs/CONTEXT.md, "Bursts"): a request
    taken in from a dead daemon's journal comes after this daemon's own, though its message may be older.
    Returns the request, its trigger swapped with the newest when needed, and the trigger's index."""
    newest_index, newest = index, request.trigger_id
    for earlier in request.burst:
        found = conversation.index_of(earlier)
        if found is not None and found > newest_index:
            newest_index, newest = found, earlier
    if newest == request.trigger_id:
        return request, index
    others = tuple(each for each in (*request.burst, request.trigger_id) if each != newest)
    return replace(request, trigger_id=newest, burst=others), newest_index
