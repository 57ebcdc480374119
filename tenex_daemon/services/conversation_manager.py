"""ConversationManager: the one place that changes conversations.

Every change runs under the conversation's lock as load -> change -> save, so
concurrent handlers never interleave on one conversation.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

import structlog

from tenex_daemon.core.agents import Agent, AgentDirectory
from tenex_daemon.core.context import (
    AgentContext,
    HistoryView,
    build_agent_messages,
    build_routing_context,
    conversation_event_references,
    distinct_names,
    is_person_message,
    people_who_wrote,
)
from tenex_daemon.core.conversation import ARCHIVED, UNTITLED, Conversation, TitleSource
from tenex_daemon.core.errors import (
    ConversationArchivedError,
    ConversationExistsError,
    ConversationNotFoundError,
)
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.phases import Phase, PhaseRules, PhaseTransition
from tenex_daemon.core.ports import Clock, EventResolver, ProfileNames, Store, SystemClock
from tenex_daemon.core.search import ConversationSummary, SearchQuery
from tenex_daemon.core.text import shortened
from tenex_daemon.core.turns import OrchestratorTurn
from tenex_daemon.core.vocabulary import TAG_TITLE, TAG_TOOL, TOOL_COMPLETE
from tenex_daemon.services.backfill import is_newest_person_message, written_at
from tenex_daemon.services.conversation_changes import (
    LifecycleBefore,
    RunRecord,
    StateBeforeReply,
    clear_end,
    mark_ended,
    record_context,
    record_end,
    record_run,
)
from tenex_daemon.services.locks import KeyedLock
from tenex_daemon.services.references import DEFAULT_RESOLVE_TIMEOUT_S, References

log = structlog.get_logger(__name__)

LOGGED_TITLE_CHARS = 120
"""The most of a title a log line carries (a person's title tag may be any length)."""

DEFAULT_TASK_SESSION_TTL_H = 24.0
HISTORY_VIEW_CACHE_SIZE = 256


class ConversationManager:
    """Creates conversations, accepts events, builds each agent's view and tracks phases and turns.

    ``store`` is any :class:`~tenex_daemon.core.ports.Store`; ``agents`` the
    project's agents (an iterable of :class:`Agent` or an :class:`AgentDirectory`);
    ``owner_pubkey`` the owner, whose events (like the agents') may name an agent's session.
    ``resolver`` finds events referenced by ``nostr:`` URIs and articles (none: references
    are left as written). Resolution never takes longer than ``resolve_timeout`` seconds.
    """

    def __init__(
        self,
        store: Store,
        agents: Iterable[Agent] | AgentDirectory,
        project_pubkey: str | None = None,
        *,
        resolver: EventResolver | None = None,
        names: ProfileNames | None = None,
        phase_rules: PhaseRules | None = None,
        clock: Clock | None = None,
        resolve_timeout: float = DEFAULT_RESOLVE_TIMEOUT_S,
        owner_pubkey: str | None = None,
        task_session_ttl_h: float = DEFAULT_TASK_SESSION_TTL_H,
    ) -> None:
        self._store = store
        self.agents = AgentDirectory.of(agents, project_pubkey, owner_pubkey)
        self._references = References(resolver, resolve_timeout)
        self._names = names
        """People's profile names (none: people are labelled by short npub)."""
        self.phase_rules = phase_rules or PhaseRules()
        self._clock: Clock = clock or SystemClock()
        # a clock of before monotonic_ms (now_ms alone): runs are timed on the system's monotonic clock
        self._run_clock = getattr(self._clock, "monotonic_ms", None) or SystemClock().monotonic_ms
        self._locks = KeyedLock()
        self._views: OrderedDict[tuple[str, str], HistoryView] = OrderedDict()
        self._on_ended: list[Callable[[str], None]] = []
        self.task_session_ttl_ms = int(task_session_ttl_h * 3_600_000)
        """How long a task session lives after its last activity (docs/ARCHITECTURE.md)."""
        self._on_reply: list[Callable[[str, bool], None]] = []

    @property
    def store(self) -> Store:
        """The store this manager persists through."""
        return self._store

    # --- loading --------------------------------------------------------------------------

    @asynccontextmanager
    async def _locked(self, conversation_id: str) -> AsyncIterator[Conversation]:
        """Hold the conversation's lock (and the store's lease) and yield it loaded."""
        async with self._locks.hold(conversation_id), self._store.lease(conversation_id):
            yield await self._load_required(conversation_id)

    async def _load_required(self, conversation_id: str) -> Conversation:
        conversation = await self._load(conversation_id)
        if conversation is None:
            raise ConversationNotFoundError(conversation_id)
        return conversation

    async def _load(self, conversation_id: str) -> Conversation | None:
        """Load (caller holds the lock); an execution session orphaned by a crash is reset."""
        conversation = await self._store.load(conversation_id)
        if conversation is not None and conversation.execution_time.reset_if_stale(self._clock.now_ms()):
            log.warning("execution_session_reset", conversation_id=conversation_id, reason="stale")
            await self._store.save_state(conversation)
        return conversation

    async def get_conversation(self, conversation_id: str) -> Conversation | None:
        """Return the conversation, or None when it is not stored."""
        async with self._locks.hold(conversation_id):
            return await self._load(conversation_id)

    async def _save(self, conversation: Conversation) -> None:
        conversation.updated_at = self._clock.now_ms()
        await self._store.save_state(conversation)

    # --- events ---------------------------------------------------------------------------

    async def create_conversation(
        self,
        event: NostrEvent,
        *,
        exclusive: bool = False,
        channel: str | None = None,
        task_id: str | None = None,
        previous_session: str | None = None,
        missing_root: str | None = None,
        title: str | None = None,
        backfill: bool = False,
    ) -> Conversation:
        """Create a conversation whose root (and id) is ``event``; idempotent by id.

        Title: ``title`` (a task's title carried to its later session), else the ``title`` tag (either
        never replaced by a model's), else "Untitled Conversation". An ``a``
        tag ``30023:<pubkey>:<d>`` makes the article the referenced article. ``exclusive``: raise
        :class:`ConversationExistsError` when it exists (another daemon created it) instead of
        returning it. ``channel``, ``task_id``, ``previous_session``, ``missing_root``: see Conversation.
        ``backfill`` (a rebuild): created, updated and last active when ``event`` was written (not past now).
        """
        event.require_valid_id()
        async with self._locks.hold(event.id):
            existing = await self._load(event.id)
            if existing is not None:
                if exclusive:
                    raise ConversationExistsError(event.id)
                return existing
            now = self._clock.now_ms()
            started = written_at(event, now) if backfill else now
            title = title or event.tag_value(TAG_TITLE)
            conversation = Conversation(
                id=event.id,
                title=title or UNTITLED,
                title_source=TitleSource.TAG if title else None,
                root_kind=event.kind,
                phase=Phase.CHAT,
                phase_started_at=started,
                created_at=started,
                updated_at=started,
                activity_at=started,
                channel=channel,
                task_id=task_id,
                previous_session=previous_session,
                missing_root=missing_root,
            )
            conversation.append(event)
            self._note_user_message(conversation, event)
            conversation.metadata.referenced_article = await self._references.article(event)
            await self._store.create(conversation)
            title_shown = None if conversation.private else shortened(conversation.title, LOGGED_TITLE_CHARS)
            log.info("conversation_created", conversation_id=event.id, title=title_shown)
            return conversation

    async def add_event(
        self, conversation_id: str, event: NostrEvent, *, backfill: bool = False, reopens: bool = True
    ) -> bool:
        """Append ``event`` to the conversation; return False for a duplicate id.

        The event is accepted (durable) when this returns True, with the conversation's new last activity in
        the same write. An ended conversation is reopened by it (docs/ARCHITECTURE.md, "Conversation
        lifecycle"), but by a daemon's notice (``reopens=False``: nobody wrote anything new). An agent event
        tagged ``["tool", "complete"]`` also counts as that agent's completion of the open turn. ``backfill``
        (a rebuild merging what the relays kept): the event counts as written when it was (``created_at``,
        never past now): it reopens an ended conversation only when written after the end, moves the last
        activity and update only forward, and is the person's latest message only when nothing in history is
        newer."""
        event.require_valid_id()
        async with self._locked(conversation_id) as conversation:
            if conversation.archived:
                raise ConversationArchivedError(conversation_id)
            if conversation.contains_event(event.id) or await self._store.is_processed(event.id):
                return False
            now = self._clock.now_ms()
            written = written_at(event, now) if backfill else now
            newest = not backfill or is_newest_person_message(conversation, self.agents, event)
            before = LifecycleBefore.of(conversation)
            ended_at = conversation.ended_at
            reopened = reopens and ended_at is not None and (not backfill or written > ended_at)
            if reopened:
                clear_end(conversation)
            if backfill:
                conversation.updated_at = max(conversation.updated_at, written)
                conversation.activity_at = max(conversation.activity_at, written)
            else:
                conversation.updated_at = conversation.activity_at = now
            if newest and is_person_message(conversation, self.agents, event):
                conversation.metadata.last_user_message = event.content
            agent = self.agents.by_pubkey(event.pubkey)
            turn = conversation.open_turn()
            kept_turn = None if turn is None else turn.model_copy(deep=True)
            completes = agent is not None and event.has_tag(TAG_TOOL, TOOL_COMPLETE)
            late = conversation.count_completion(agent.slug, event, now) if agent and completes else None
            appended = False
            try:  # a store of the port before it said whether the event was new returns None: new
                answer = await self._store.append_event(conversation_id, event, state=conversation)
                appended = answer is not False
            finally:
                if not appended:  # failed, or another daemon sharing the store took the id in meanwhile
                    before.restore(conversation)
                    if kept_turn is not None:
                        conversation.orchestrator_turns[-1] = kept_turn
                    if late is not None:
                        late.completions.pop()
            if not appended:
                return False
            conversation.append(event)
        if reopened:
            log.info("conversation_reopened", conversation_id=conversation_id, event_id=event.id)
            for listener in self._on_reply:  # its description is published again, saying active
                listener(conversation_id, True)
        return True

    def _note_user_message(self, conversation: Conversation, event: NostrEvent) -> bool:
        if is_person_message(conversation, self.agents, event):  # after append: its tags are counted
            conversation.metadata.last_user_message = event.content
            return True
        return False

    # --- what an agent sees -------------------------------------------------------------

    async def build_agent_messages(
        self,
        conversation_id: str,
        agent_slug: str,
        trigger: NostrEvent,
        *,
        start_execution: bool = False,
        persist: bool = True,
        burst: bool = False,
    ) -> AgentContext:
        """Return the messages ``agent_slug`` is sent to respond to ``trigger`` (docs/CONTEXT.md).

        The agent's last processed index and session id are persisted before this returns.
        ``start_execution`` also starts timing work on the conversation, in the same save.
        ``persist=False`` (an agent run) changes nothing stored: the run's reply records what the
        agent saw, with itself, in one durable write (:meth:`append_reply`); a run lost to a crash
        is built again from the state before it. ``burst``: the trigger is the newest of several
        messages answered by one run (docs/CONTEXT.md, "Bursts").
        """
        agent = self.agents.get(agent_slug)
        async with self._locks.hold(conversation_id):
            loaded = await self._load_required(conversation_id)
            references = conversation_event_references(loaded, trigger)
        resolved = await self._references.contents(references)
        names = await self._people_names(loaded, trigger, self._history_view(conversation_id, agent.slug))
        if not persist:
            async with self._locks.hold(conversation_id):
                conversation = await self._load_required(conversation_id)
                view = self._history_view(conversation_id, agent.slug)
                return build_agent_messages(
                    conversation, agent, trigger, self.agents, resolved, view, burst=burst, names=names
                )
        async with self._locked(conversation_id) as conversation:
            view = self._history_view(conversation_id, agent.slug)
            context = build_agent_messages(
                conversation, agent, trigger, self.agents, resolved, view, burst=burst, names=names
            )
            record_context(conversation.agent_state(agent.slug), context)
            if start_execution:
                conversation.execution_time.start(self._clock.now_ms())
            await self._save(conversation)
            return context

    async def append_reply(
        self,
        conversation_id: str,
        compose: Callable[[Conversation, int], Awaitable[NostrEvent]],
        run: RunRecord,
    ) -> NostrEvent:
        """Save an agent run's reply and what the run changed, in one durable write (under the conversation's
        lock, loaded once): ``compose`` builds the signed reply from it and the working time with this run
        (seconds; it may journal the reply first); the agent's last processed index, session, transitions
        seen, token usage, working time and end of the conversation go with it. A reply tagged ``["tool",
        "complete"]`` is counted in its turn (:meth:`Conversation.count_completion`); nothing changes (in
        memory either) when composing or saving fails."""
        agent = self.agents.get(run.agent_slug)
        async with self._locked(conversation_id) as conversation:
            if conversation.archived:
                raise ConversationArchivedError(conversation_id)
            now = self._clock.now_ms()
            with_run = conversation.execution_time.model_copy()
            with_run.add_run(self._run_clock() - run.started_ms, now)
            reply = await compose(conversation, with_run.total(now))
            reply.require_valid_id()
            kept = StateBeforeReply.of(conversation, agent.slug)
            conversation.execution_time = with_run
            state = conversation.agent_state(agent.slug)
            fresh = record_context(state, run.context, conversation.agent_resets)  # no reset since its build
            record_run(state, run.session_id if fresh else None, run.add_tokens)
            completes = reply.has_tag(TAG_TOOL, TOOL_COMPLETE)
            late = conversation.count_completion(agent.slug, reply, now) if completes else None
            conversation.updated_at = now
            kept_activity = conversation.activity_at
            conversation.activity_at = now
            if run.tools_used:
                conversation.tools_used[reply.id] = list(run.tools_used)
            ended = record_end(conversation, run, now, self.agents)
            saved = False
            try:  # False from the store: this reply was saved already (nothing of the run changes then)
                answer = await self._store.append_event(conversation_id, reply, state=conversation)
                saved = answer is not False
            finally:
                if not saved:
                    if ended is not None:
                        ended.restore(conversation)
                    kept.restore(conversation, agent.slug)
                    if late is not None:
                        late.completions.pop()
                    conversation.activity_at = kept_activity
                    conversation.tools_used.pop(reply.id, None)
            if not saved:
                return reply
            conversation.append(reply)
        if ended is not None:
            self._ended(conversation_id, agent.slug, run.end_reason)
        for listener in self._on_reply:
            listener(conversation_id, False)
        return reply

    async def add_run_time(self, conversation_id: str, started_ms: int) -> None:
        """Count a run that ended without a reply (it failed; ``started_ms``: :meth:`run_clock_ms`)."""
        async with self._locked(conversation_id) as conversation:
            conversation.execution_time.add_run(self._run_clock() - started_ms, self._clock.now_ms())
            await self._save(conversation)

    def now_ms(self) -> int:
        """The manager's wall clock."""
        return self._clock.now_ms()

    def run_clock_ms(self) -> int:
        """A run's start (:attr:`RunRecord.started_ms`), on a clock no step of the wall clock moves."""
        return self._run_clock()

    def _history_view(self, conversation_id: str, agent_slug: str) -> HistoryView:
        """Return the memo of this agent's history messages (bounded LRU)."""
        key = (conversation_id, agent_slug)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = HistoryView()
            while len(self._views) > HISTORY_VIEW_CACHE_SIZE:
                self._views.popitem(last=False)
        else:
            self._views.move_to_end(key)
        return view

    async def update_agent_state(
        self,
        conversation_id: str,
        agent_slug: str,
        *,
        last_processed_index: int | None = None,
        session_id: str | None = None,
        add_tokens: tuple[int, int] | None = None,
        summary: tuple[str, int] | None = None,
    ) -> None:
        """Set an agent's last processed index and/or session id (None leaves a field as is).

        ``add_tokens`` (prompt, completion) adds a run's token usage to the agent's totals.
        ``summary`` (text, covers) stores the ``summarize`` budget's summary of the agent's first
        ``covers`` history messages; one covering fewer than the stored one is ignored (a
        concurrent run extended it further already).
        """
        agent = self.agents.get(agent_slug)
        async with self._locked(conversation_id) as conversation:
            state = conversation.agent_state(agent.slug)
            if last_processed_index is not None:
                if not 0 <= last_processed_index <= len(conversation.history):
                    raise ValueError(
                        f"last_processed_index {last_processed_index} is outside history "
                        f"(0..{len(conversation.history)})"
                    )
                state.last_processed_index = last_processed_index
            record_run(state, session_id, add_tokens)
            if summary is not None:
                text, covers = summary
                if covers < 0:
                    raise ValueError(f"a summary cannot cover {covers} messages")
                if covers >= state.summary_covers:
                    state.summary, state.summary_covers = text, covers
            await self._save(conversation)

    # --- phases ---------------------------------------------------------------------------

    async def update_phase(
        self,
        conversation_id: str,
        phase: Phase | str,
        message: str,
        agent_slug: str,
        reason: str | None = None,
        summary: str | None = None,
    ) -> PhaseTransition:
        """Move the conversation to ``phase`` (a same-phase handoff is recorded too).

        Raises :class:`~tenex_daemon.core.errors.PhaseTransitionError` when the phase
        rules forbid it. Leaving reflection for chat clears the read-files set.
        """
        target = Phase(phase)
        agent = self.agents.get(agent_slug)
        async with self._locked(conversation_id) as conversation:
            if conversation.archived:
                raise ConversationArchivedError(conversation_id)
            self.phase_rules.check(conversation.phase, target)
            now = self._clock.now_ms()
            transition = PhaseTransition(
                from_phase=conversation.phase,
                to_phase=target,
                message=message,
                timestamp=now,
                agent_slug=agent.slug,
                agent_pubkey=agent.pubkey,
                agent_name=agent.name,
                reason=reason,
                summary=summary,
                history_index=len(conversation.history),
            )
            conversation.phase_transitions.append(transition)
            if conversation.phase is Phase.REFLECTION and target is Phase.CHAT:
                conversation.metadata.read_files.clear()
            if target != conversation.phase:
                conversation.phase = target
                conversation.phase_started_at = now
            await self._save(conversation)
            log.info(
                "phase_changed",
                conversation_id=conversation_id,
                from_phase=transition.from_phase.value,
                to_phase=target.value,
                agent=agent.slug,
            )
            return transition

    async def update_metadata(self, conversation_id: str, **fields: Any) -> None:
        """Set metadata fields (summary, requirements, plan, read_files, ...)."""
        async with self._locked(conversation_id) as conversation:
            for name, value in fields.items():
                if name not in type(conversation.metadata).model_fields:
                    raise ValueError(f"unknown metadata field {name!r}")
                setattr(conversation.metadata, name, value)
            await self._save(conversation)

    # --- orchestrator turns ---------------------------------------------------------------

    async def start_orchestrator_turn(
        self,
        conversation_id: str,
        phase: Phase | str,
        agents: Sequence[str],
        reason: str | None = None,
        *,
        trigger_id: str | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """Record a routing decision and return its turn id.

        A turn still open is closed first (superseded) so its partial completions stay
        visible in the routing history. ``trigger_id``: the event the routed agents answer
        (only completions replying to it count for the turn). ``extra``: values set in the
        conversation's ``metadata.extra`` in the same save (the routing limits).
        """
        if not agents:
            raise ValueError("a turn routes to at least one agent")
        for slug in agents:
            self.agents.get(slug)
        async with self._locked(conversation_id) as conversation:
            previous = conversation.open_turn()
            if previous is not None:
                previous.is_completed = True
            turn = OrchestratorTurn(
                turn_id=uuid.uuid4().hex,
                timestamp=self._clock.now_ms(),
                phase=Phase(phase),
                agents=list(agents),
                reason=reason,
                trigger_id=trigger_id,
            )
            conversation.orchestrator_turns.append(turn)
            conversation.metadata.extra.update(extra or {})
            await self._save(conversation)
            return turn.turn_id

    async def update_extra(self, conversation_id: str, key: str, update: Callable[[Any], Any]) -> None:
        """Set ``metadata.extra[key]`` to ``update(its value, None if unset)`` under the lock and lease."""
        async with self._locked(conversation_id) as conversation:
            conversation.metadata.extra[key] = update(conversation.metadata.extra.get(key))
            await self._save(conversation)

    async def add_completion_to_turn(self, conversation_id: str, agent_slug: str, message: str) -> bool:
        """Record ``agent_slug``'s completion of the open turn; False if none is open or it already did."""
        async with self._locked(conversation_id) as conversation:
            turn = conversation.open_turn()
            if turn is None or not turn.add_completion(agent_slug, message, self._clock.now_ms()):
                return False
            await self._save(conversation)
            return True

    async def build_orchestrator_routing_context(
        self, conversation_id: str, trigger: NostrEvent | None = None
    ) -> dict[str, Any]:
        """Return the orchestrator's routing context JSON object (docs/CONTEXT.md).

        A ``trigger`` that is a completion not yet recorded shows in ``current_routing``.
        """
        async with self._locks.hold(conversation_id):
            conversation = await self._load_required(conversation_id)
        preview: tuple[str, str, int] | None = None
        if trigger is not None and trigger.has_tag(TAG_TOOL, TOOL_COMPLETE):
            agent = self.agents.by_pubkey(trigger.pubkey)
            if agent is not None:
                preview = (agent.slug, trigger.content, trigger.created_at * 1000)
        return build_routing_context(conversation, self.agents, trigger, preview)

    # --- execution time -------------------------------------------------------------------

    async def start_execution(self, conversation_id: str) -> None:
        """Start timing work on the conversation (a no-op when already timing)."""
        async with self._locked(conversation_id) as conversation:
            conversation.execution_time.start(self._clock.now_ms())
            await self._save(conversation)

    async def stop_execution(self, conversation_id: str) -> int:
        """Stop timing and return the seconds added (0 when not timing)."""
        async with self._locked(conversation_id) as conversation:
            added = conversation.execution_time.stop(self._clock.now_ms())
            await self._save(conversation)
            return added

    async def execution_seconds(self, conversation_id: str) -> int:
        """Return total execution seconds, including a live session."""
        async with self._locks.hold(conversation_id):
            conversation = await self._load_required(conversation_id)
        return conversation.execution_time.total(self._clock.now_ms())

    # --- lifecycle and search -------------------------------------------------------------

    async def end_conversation(
        self, conversation_id: str, *, by: str, reason: str | None = None, idle_before: int | None = None
    ) -> bool:
        """End the conversation: record when, by whom (``idle``, an agent's slug, ``owner``...) and why.
        It stays writable (a new message reopens it). False when it is ended already, or (``idle_before``,
        the idle timeout's check) when it had activity at or after that moment."""
        async with self._locked(conversation_id) as conversation:
            if conversation.is_ended:
                return False
            if idle_before is not None and conversation.last_activity >= idle_before:
                return False
            await self._end_locked(conversation, by, reason)
        self._ended(conversation_id, by, reason)
        return True

    async def _end_locked(self, conversation: Conversation, by: str, reason: str | None) -> None:
        """Record the end and save it (the caller holds the lock); on failure nothing is changed."""
        before = LifecycleBefore.of(conversation)
        mark_ended(conversation, by, reason, self._clock.now_ms())
        try:
            await self._save(conversation)
        except BaseException:
            before.restore(conversation)
            raise

    def _ended(self, conversation_id: str, by: str, reason: str | None) -> None:
        """Log an end made and tell the listeners (outside the conversation's lock)."""
        # a code (idle_timeout, archived) is logged, free text (an agent's or the owner's words) is not
        logged = reason if reason is None or reason.isidentifier() else "(given)"
        log.info("conversation_ended", conversation_id=conversation_id, by=by, reason=logged)
        for listener in self._on_ended:
            listener(conversation_id)

    def on_ended(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(conversation_id)`` after each conversation this manager ends (must not block)."""
        self._on_ended.append(listener)

    def expires_at(self, conversation: Conversation) -> int | None:
        """When a task session expires (ms since the epoch); None for a conversation that is no task's."""
        return None if conversation.task_id is None else conversation.last_activity + self.task_session_ttl_ms

    def on_reply(self, listener: Callable[[str, bool], None]) -> None:
        """Call ``listener(conversation_id, reopened)`` after each agent reply saved here (False) and each
        message that reopens a conversation (True: ended here or by another daemon) (must not block)."""
        self._on_reply.append(listener)

    async def describe(
        self, conversation_id: str, *, title: str | None, summary: str, source: TitleSource, for_activity: int
    ) -> Conversation:
        """Store a title and summary made for the conversation as it was at ``for_activity`` (its last
        activity then). A title from the person's ``title`` tag is kept; ``title=None`` keeps the
        title. The description is marked unpublished until :meth:`description_published`."""
        async with self._locked(conversation_id) as conversation:
            before = LifecycleBefore.of(conversation)
            if title and conversation.title_source is not TitleSource.TAG:
                conversation.title = title
                conversation.title_source = source
            conversation.summary = summary
            conversation.described_at = for_activity
            conversation.description_published = False
            try:
                await self._save(conversation)
            except BaseException:
                before.restore(conversation)
                raise
            shown = None if conversation.private else shortened(conversation.title, LOGGED_TITLE_CHARS)
            log.info("conversation_described", conversation_id=conversation_id, title=shown,
                     source=conversation.title_source)
            return conversation

    async def description_published(self, conversation_id: str, *, settled_for: int | None = None) -> None:
        """Record that the kind-513 event of the conversation's title and summary is in the outbox; with
        ``settled_for`` (a private one's last activity), that it needs no description until it changes."""
        async with self._locked(conversation_id) as conversation:
            if conversation.description_published and settled_for in (None, conversation.described_at):
                return
            conversation.description_published = True
            conversation.described_at = conversation.described_at if settled_for is None else settled_for
            await self._store.save_state(conversation)

    async def archive_conversation(
        self, conversation_id: str, *, ending_by: str | None = None, ended_before: int | None = None
    ) -> bool:
        """Archive the conversation: it stays readable and becomes read-only. False: archived already.
        ``ending_by`` (the owner's archive): one still active is ended first, by them, for the reason
        :data:`ARCHIVED`, so an archived conversation counts as ended, as the retention sweeper's do.
        ``ended_before`` (retention): only one still ended and idle since then (one step) is archived."""
        if ending_by is None:
            return await self._set_archived(conversation_id, True, ended_before=ended_before)
        ended = False
        async with self._locked(conversation_id) as conversation:  # one step: no message comes between
            if conversation.archived:
                return False
            if not conversation.is_ended:
                await self._end_locked(conversation, ending_by, ARCHIVED)
                ended = True
            await self._store.set_archived(conversation_id, True)
            conversation.archived = True
        if ended:
            self._ended(conversation_id, ending_by, ARCHIVED)
        log.info("conversation_archived", conversation_id=conversation_id)
        return True

    async def restore_conversation(self, conversation_id: str) -> bool:
        """Restore an archived conversation so it accepts events again. False: it was not archived."""
        return await self._set_archived(conversation_id, False)

    async def _set_archived(self, cid: str, archived: bool, ended_before: int | None = None) -> bool:
        async with self._locked(cid) as conversation:
            active = not conversation.is_ended or conversation.last_activity >= (ended_before or 0)
            if conversation.archived is archived or (ended_before is not None and active):
                return False
            await self._store.set_archived(cid, archived)
            conversation.archived = archived
        log.info("conversation_" + ("archived" if archived else "restored"), conversation_id=cid)
        return True

    async def search_conversations(
        self, title: str | None = None, phase: Phase | str | None = None, date_from: datetime | None = None,
        date_to: datetime | None = None, archived: bool | None = None, participant: str | None = None,
        limit: int | None = None, id_prefix: str | None = None,
    ) -> list[ConversationSummary]:
        """Return summary rows matching every given filter, newest update first."""
        query = SearchQuery(
            title=title, phase=Phase(phase) if phase is not None else None, date_from=date_from,
            date_to=date_to, archived=archived, participant=participant, limit=limit, id_prefix=id_prefix,
        )
        return await self._store.search(query)

    # --- operator actions (control API) ---------------------------------------------------

    async def delete_conversation(
        self, conversation_id: str, *, only_ended: bool = False, activity: int | None = None
    ) -> bool:
        """Remove a conversation from the store; return whether it existed (and was deleted).

        An operator's explicit request (``DELETE /api/v1/conversations/{id}``), or retention: its event
        ids stay processed, so a relay replaying them never re-creates it or triggers agents.
        ``only_ended`` (retention): checked under the lock, one reopened meanwhile is kept, as is one whose
        last activity is no longer ``activity`` (retention's: a reply saved since does not reopen it).
        """
        async with self._locks.hold(conversation_id), self._store.lease(conversation_id):
            if only_ended:
                current = await self._store.load(conversation_id)
                if current is None or not current.is_ended or activity not in (None, current.last_activity):
                    return False
            deleted = await self._store.delete(conversation_id)
        for key in [key for key in self._views if key[0] == conversation_id]:
            del self._views[key]
        if deleted:
            log.info("conversation_deleted", conversation_id=conversation_id)
        return deleted

    async def reset_agent_states(
        self, conversation_id: str, *, keep_system_message: bool = False
    ) -> list[str]:
        """Make every agent of the conversation start fresh; return the slugs reset.

        Each agent's backend session id is forgotten, its phase-transition count cleared and its last
        processed index set back to 0, as if it had never been built for: its next context shows everything
        others said in the while-away block. With ``keep_system_message`` the index is set to 1 instead, so
        the conversation's root (the opening request) counts as already seen and stays only in the history
        part. History, phase, turns, metadata and token totals are untouched: nothing said is lost."""
        async with self._locked(conversation_id) as conversation:
            if conversation.archived:
                raise ConversationArchivedError(conversation_id)
            start = 1 if keep_system_message and conversation.history else 0
            for state in conversation.agent_states.values():
                state.last_processed_index = start
                state.session_id = None
                state.transitions_seen = 0
            conversation.agent_resets += 1  # a run under way saves no context over this
            await self._save(conversation)
            slugs = sorted(conversation.agent_states)
        log.info("agent_states_reset", conversation_id=conversation_id, agents=slugs,
                 keep_system_message=keep_system_message)
        return slugs

    async def save_upgraded(self, conversation_id: str) -> bool:
        """Save the conversation when an earlier tenexd stored it (brought up to date as it loads,
        :attr:`~tenex_daemon.core.conversation.Conversation.upgraded`), its dates as they were; return
        whether it was one."""
        async with self._locked(conversation_id) as conversation:
            if not conversation.upgraded:
                return False
            conversation.upgrade_saved()  # before the save: a store's cache keeps a copy of what it saves
            await self._store.save_state(conversation)
            return True

    async def find_conversation_of_event(self, event_id: str) -> str | None:
        """Return the id of the conversation holding ``event_id`` (its root or any event), or None."""
        if await self.get_conversation(event_id) is not None:
            return event_id
        found = await self._store.find_event(event_id)
        return None if found is None else found[0]

    async def preview_agent_messages(
        self, conversation_id: str, agent_slug: str, trigger: NostrEvent | None = None
    ) -> AgentContext:
        """Return what a run for ``trigger`` would be built now (``burst``, as runs are), persisting nothing:
        the same pure :func:`~tenex_daemon.core.context.build_agent_messages` on the stored conversation,
        references resolved the same way. ``trigger`` defaults to the newest event in history."""
        agent = self.agents.get(agent_slug)
        async with self._locks.hold(conversation_id):
            conversation = await self._load_required(conversation_id)
        if trigger is None:
            if not conversation.history:
                raise ValueError(f"conversation {conversation_id} has no events")
            trigger = conversation.history[-1]
        resolved = await self._references.contents(conversation_event_references(conversation, trigger))
        names = await self._people_names(conversation, trigger, HistoryView())
        return build_agent_messages(
            conversation, agent, trigger, self.agents, resolved, burst=True, names=names
        )

    async def _people_names(self, conv: Conversation, last: NostrEvent, view: HistoryView) -> dict[str, str]:
        """The profile names of the people who wrote (``last``: the trigger) when several did; else none."""
        if self._names is None:
            return {}
        people = people_who_wrote(conv, last, self.agents, view)
        return distinct_names(people, await self._names.names(people)) if len(people) > 1 else {}
