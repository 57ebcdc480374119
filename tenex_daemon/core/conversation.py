"""The conversation aggregate: history, per-agent views, phase, turns, execution time."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field, PrivateAttr

from tenex_daemon.core.agents import claims_agent
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.execution_time import ExecutionTime
from tenex_daemon.core.phases import Phase, PhaseTransition
from tenex_daemon.core.references import find_event_references
from tenex_daemon.core.thread_tags import read_threading
from tenex_daemon.core.turns import OrchestratorTurn
from tenex_daemon.core.vocabulary import KIND_COMMENT, KIND_PRIVATE_MESSAGE, TAG_SUBJECT

UNTITLED = "Untitled Conversation"
ARCHIVED = "archived"
"""The end reason of an active conversation ended by the owner's archive."""
TASK_SESSION_EXPIRED = "task_session_expired"
"""``end_reason`` of a task session that expired: the task goes on in its next session."""


class TitleSource(StrEnum):
    """Where a conversation's title came from; a person's ``title`` tag is never overwritten."""

    TAG = "tag"
    MODEL = "model"
    FALLBACK = "fallback"
    IMPORT = "import"


class AgentState(BaseModel):
    """One agent's view of one conversation."""

    last_processed_index: int = 0
    """How much of history the agent has been shown (the LPI of docs/CONTEXT.md)."""
    session_id: str | None = None
    """The backend session to resume (the ``claude-session`` tag), if any."""
    transitions_seen: int = 0
    """How many phase transitions existed when the agent was last built for (handoff summaries)."""
    prompt_tokens: int = 0
    """Prompt tokens the agent's backend reported for this conversation, in total."""
    completion_tokens: int = 0
    """Completion tokens the agent's backend reported for this conversation, in total."""
    summary: str | None = None
    """The ``summarize`` budget's summary of the agent's older history messages (extended, never redone)."""
    summary_covers: int = 0
    """How many of the agent's leading history messages ``summary`` stands for."""


class ReferencedArticle(BaseModel):
    """A long-form article (kind 30023) the conversation root points at."""

    title: str
    content: str
    identifier: str
    author: str


class ConversationMetadata(BaseModel):
    """Facts about a conversation kept beside its history."""

    summary: str | None = None
    requirements: str | None = None
    plan: str | None = None
    read_files: list[str] = Field(default_factory=list)
    last_user_message: str | None = None
    referenced_article: ReferencedArticle | None = None
    extra: dict[str, Any] = Field(default_factory=dict)


class Conversation(BaseModel):
    """A conversation: every accepted event in append order and the state derived around it.

    ``history`` is append-only: an event is never reordered or removed, so stored
    indices (agent states, transitions) stay valid.
    """

    id: str
    title: str = UNTITLED
    root_kind: int = 11
    phase: Phase = Phase.CHAT
    phase_started_at: int = 0
    created_at: int = 0
    """Milliseconds since the epoch when tenexd created the conversation."""
    updated_at: int = 0
    history: list[NostrEvent] = Field(default_factory=list)
    agent_states: dict[str, AgentState] = Field(default_factory=dict)
    metadata: ConversationMetadata = Field(default_factory=ConversationMetadata)
    phase_transitions: list[PhaseTransition] = Field(default_factory=list)
    orchestrator_turns: list[OrchestratorTurn] = Field(default_factory=list)
    execution_time: ExecutionTime = Field(default_factory=ExecutionTime)
    archived: bool = False
    # --- lifecycle (docs/ARCHITECTURE.md, "Conversation lifecycle") ---------------------------
    activity_at: int = 0
    """Milliseconds since the epoch when the conversation last accepted an event (its idle clock;
    0 for conversations stored before it was kept: their ``updated_at`` stands in)."""
    ended_at: int | None = None
    """When it was ended (idle timeout, the agent's tool, the CLI or the API); None while active.
    A new message reopens it (clears the three end fields)."""
    ended_by: str | None = None
    """Who ended it: ``idle``, an agent's slug, or ``owner`` (the CLI and the API)."""
    end_reason: str | None = None
    summary: str | None = None
    """A model's summary of the conversation (2-3 sentences), or the fallback text."""
    title_source: TitleSource | None = None
    """Where ``title`` came from; None: still "Untitled Conversation"."""
    described_at: int | None = None
    """The ``activity_at`` the title and summary were made for (None: never made)."""
    description_published: bool = True
    """False until a relay has accepted the kind-513 event of the newest title and summary."""
    channel: str | None = None
    """A kind-1 channel's key (``<agent slug>:<person pubkey>``): top-level notes from that person
    to that agent continue this conversation while it is younger than the idle timeout."""
    task_id: str | None = None
    """The kind-1934 task this conversation is a session of (its id, for every session)."""
    previous_session: str | None = None
    """The task session this one follows (that one expired and was archived)."""
    missing_root: str | None = None
    """The thread root its first event (a reply) names, which no relay gave: that reply started the
    conversation, and its replies, typing, live status and metadata name this root (docs/PROTOCOL.md)."""
    tools_used: dict[str, list[str]] = Field(default_factory=dict)
    """The tools an agent called for each of its replies (reply event id -> tool names, in call order);
    replies that called none are not listed."""
    agent_resets: int = 0
    """Times the owner reset the agents' states (``reset_agent_states``): a run built before the last one
    (its agent's first run too, whose state did not exist yet) saves no index, session or transitions."""

    _event_index: dict[str, int] = PrivateAttr(default_factory=dict)
    _agent_claimants: set[str] = PrivateAttr(default_factory=set)
    _references: dict[str, None] = PrivateAttr(default_factory=dict)
    _upgraded: bool = PrivateAttr(default=False)

    def model_post_init(self, context: Any, /) -> None:
        history, self.history = self.history, []
        for event in history:
            self.append(event)

    @property
    def root(self) -> NostrEvent | None:
        """The conversation's first event."""
        return self.history[0] if self.history else None

    @property
    def thread_id(self) -> str:
        """The Nostr thread the conversation lives in, which its typing indicators, partial replies and
        live status name: its task for a task's session (a later session's root is the person's comment
        in the task's thread); the thread its root comment names when that comment started the
        conversation (:attr:`named_root`); else its own id, its root's."""
        if self.task_id:
            return self.task_id
        return self.named_root or self.id

    @property
    def named_root(self) -> str | None:
        """The thread root named by the conversation's first event when that event is a reply that started
        the conversation: :attr:`missing_root`; or a comment (kind 1111) as first event, whose ``E`` names
        its thread's root (NIP-22 has a comment's replies keep it). None when the first event is a root."""
        if self.missing_root:
            return self.missing_root
        root = self.root
        if root is None or root.kind != KIND_COMMENT:
            return None
        named = read_threading(root).root_id
        return named if named and named != root.id else None

    def contains_event(self, event_id: str) -> bool:
        """Return whether an event with this id is in history."""
        return event_id in self._event_index

    def index_of(self, event_id: str) -> int | None:
        """Return the event's position in history, or None."""
        return self._event_index.get(event_id)

    def append(self, event: NostrEvent) -> bool:
        """Append ``event`` to history; return False (and change nothing) for a duplicate id."""
        if event.id in self._event_index:
            return False
        self._event_index[event.id] = len(self.history)
        self.history.append(event)
        if claims_agent(event.tags):
            self._agent_claimants.add(event.pubkey)
        if "nostr:" in event.content:
            for uri in find_event_references(event.content):
                self._references[uri] = None
        return True

    def event_references(self) -> list[str]:
        """Return the ``nostr:`` event references found in history, in first-seen order."""
        return list(self._references)

    def claimant_count(self) -> int:
        """Return how many unknown authors wrote agent-only tags (it only grows)."""
        return len(self._agent_claimants)

    def claims_agent(self, pubkey: str) -> bool:
        """Return whether this author wrote agent-only tags in this conversation."""
        return pubkey in self._agent_claimants

    def agent_state(self, slug: str) -> AgentState:
        """Return the agent's state, creating it at index 0 on first use."""
        state = self.agent_states.get(slug)
        if state is None:
            state = self.agent_states[slug] = AgentState()
        return state

    def open_turn(self) -> OrchestratorTurn | None:
        """Return the newest turn if it is still open."""
        if self.orchestrator_turns and not self.orchestrator_turns[-1].is_completed:
            return self.orchestrator_turns[-1]
        return None

    def count_completion(self, agent_slug: str, event: NostrEvent, now: int) -> OrchestratorTurn | None:
        """Count ``event``, a completion by ``agent_slug``, once, in the turn whose trigger it answers: the
        open turn (which it may close), else a turn a newer one superseded while the agent worked (a
        message routed meanwhile), which stays closed but shows the agent's result in the orchestrator's
        routing history. Returns that superseded turn (a failed save takes the completion back out of it:
        ``turn.completions.pop()``), None otherwise."""
        turn = self.open_turn()
        if turn is not None and turn.answered_by(event):
            turn.add_completion(agent_slug, event.content, now)
            return None
        for turn in reversed(self.orchestrator_turns):
            if turn.trigger_id is not None and turn.is_completed and turn.answered_by(event):
                return turn if turn.add_late_completion(agent_slug, event.content, now) else None
        return None

    @property
    def private(self) -> bool:
        """Whether it is a NIP-17 private conversation (its root a kind-14 rumor): its history is stored
        decrypted, and nothing of it is published in the clear (replies go out gift-wrapped)."""
        return self.root_kind == KIND_PRIVATE_MESSAGE

    def subject(self) -> str | None:
        """A private conversation's subject: its newest ``subject`` tag (NIP-17: a chat's subject is the
        newest one given, so a reply carrying an older one would rename the chat back); None when public."""
        if not self.private:
            return None
        for event in reversed(self.history):
            for tag in event.tags:
                if len(tag) > 1 and tag[0] == TAG_SUBJECT:
                    return tag[1]
        return None

    @property
    def is_ended(self) -> bool:
        """Whether the conversation is ended (and not reopened since)."""
        return self.ended_at is not None

    @property
    def last_activity(self) -> int:
        """When it last accepted an event (ms; ``updated_at`` for data stored before that was kept)."""
        return self.activity_at or self.updated_at

    def token_count(self) -> int:
        """Every token its agents' backends reported for it (prompt and completion, all agents)."""
        return sum(s.prompt_tokens + s.completion_tokens for s in self.agent_states.values())

    def participants(self) -> set[str]:
        """Return the public keys of every author in history."""
        return {event.pubkey for event in self.history}

    def state_dict(self) -> dict[str, Any]:
        """Return everything but history as JSON-ready data (what a snapshot stores)."""
        return self.model_dump(mode="json", exclude={"history"})

    @classmethod
    def from_state(cls, state: dict[str, Any], history: list[NostrEvent]) -> Conversation:
        """Rebuild a conversation from a snapshot and its event log; a snapshot an earlier tenexd stored,
        before the lifecycle's fields (no ``activity_at``), is brought up to date (:attr:`upgraded`)."""
        conversation = cls.model_validate({**state, "history": []})
        for event in history:
            conversation.append(event)
        if "activity_at" not in state:
            conversation._upgrade_from_before_lifecycle()
        return conversation

    @classmethod
    def from_state_continuing(cls, state: dict[str, Any], previous: Conversation) -> Conversation:
        """Rebuild a conversation from a snapshot whose history is ``previous``'s (copied with what is derived
        from it, not appended again event by event): a store's cached copy whose state another writer
        replaced."""
        conversation = cls.model_validate({**state, "history": []})
        conversation.history = list(previous.history)
        conversation._event_index = dict(previous._event_index)
        conversation._agent_claimants = set(previous._agent_claimants)
        conversation._references = dict(previous._references)
        if "activity_at" not in state:
            conversation._upgrade_from_before_lifecycle()
        return conversation

    @property
    def upgraded(self) -> bool:
        """Whether it was loaded from a snapshot stored before the lifecycle's fields and brought up to
        date as it loaded (the caller saves it so, :meth:`upgrade_saved`; docs/ARCHITECTURE.md,
        "Conversation lifecycle": Upgrading)."""
        return self._upgraded

    def upgrade_saved(self) -> None:
        """Say it is saved as brought up to date (:attr:`upgraded` is False from now on, in copies too). The
        caller has set :attr:`archived` as stored, which says whether it is still ended: the agent's
        ``end_conversation`` then recorded its end in ``metadata.extra`` and archived it, and a new message
        restored it (leaving those keys); an archived one is ended by that end, else by its owner's archive
        (the only other archiving there was) at its last activity, as one archived now is."""
        extra = self.metadata.extra
        if self._upgraded and self.archived and self.ended_at is None:
            ended_at, by, reason = extra.get("ended_at"), extra.get("ended_by"), extra.get("end_reason")
            if isinstance(ended_at, int) and not isinstance(ended_at, bool):
                self.ended_at = ended_at
                self.ended_by = by if isinstance(by, str) else None
                self.end_reason = reason if isinstance(reason, str) else None
            else:
                self.ended_at, self.ended_by, self.end_reason = self.last_activity, "owner", ARCHIVED
        if self._upgraded:
            for key in ("ended_at", "ended_by", "end_reason"):  # an end of then: recorded, or undone
                extra.pop(key, None)
        self._upgraded = False

    def _upgrade_from_before_lifecycle(self) -> None:
        """A snapshot stored before the lifecycle's fields: its last activity is its last update (not the
        first save of today's daemon); an end its agent recorded in ``metadata.extra`` is its end while it
        is still archived (:meth:`upgrade_saved`, which knows); a title
        other than "Untitled Conversation" is the person's ``title`` tag (the only title it could have then),
        never replaced; it counts as described for that activity (no model is asked for a title and summary
        of a conversation nobody writes in again, nothing published for it: one that goes on is described as
        any other); an execution session a crash left open is dropped (the daemon no longer opens any)."""
        self._upgraded = True
        self.activity_at = self.updated_at or self.created_at
        if self.title_source is None and self.title != UNTITLED:
            self.title_source = TitleSource.TAG
        if self.described_at is None:
            self.described_at = self.activity_at
            self.description_published = True
        if self.execution_time.is_active:
            self.execution_time.is_active = False
            self.execution_time.current_session_start = None
