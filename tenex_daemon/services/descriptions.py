"""Titles and summaries of conversations, made off the request path, and their kind-513 publication
(docs/ARCHITECTURE.md, "Conversation lifecycle"; docs/PROTOCOL.md, kind 513).

A conversation needs describing when

- it is ended and was never described for its current content (``described_at`` differs from its
  last activity), or
- it is active, has no title yet (``title_source`` None), was never described, and has at least
  ``describe_after_exchanges`` exchanges: the smaller of how many events people wrote and how many
  the project's agents wrote (:func:`~tenex_daemon.services.description_text.count_exchanges`).

The conversation's own stored state is the journal: nothing else is written. A description stored
(:meth:`ConversationManager.describe`) is unpublished (``description_published`` False) until a relay
accepted its kind-513 event; then :meth:`ConversationManager.description_published` records it. At
start, :meth:`DescriptionJobs.recover` finds every conversation with work left by one search of the
index rows (ended and undescribed, titleless with enough events, or unpublished), so a crash at any
moment loses nothing: an interrupted job is done again, a description stored but not published is
composed anew and published (its event id then differs; relays keep both, clients show the newest).

One worker makes one description at a time, from a bounded queue where a conversation waits at most
once. It never delays a reply: it runs beside the pipeline, waits (up to :data:`IDLE_WAIT_MAX_S`)
until no agent run is in flight before asking a model (a local model is shared with the agents),
and a model call is cut at ``timeout_s``. It asks the summarizer backend when one is configured,
else the conversation's first agent's own backend, for JSON with a title of 5 to 8 words and a
summary of 2 or 3 sentences (:mod:`~tenex_daemon.services.description_text`); a model error, a
timeout or an answer it cannot read gives the fallback text (``TitleSource.FALLBACK``). A person's
``title`` tag is never replaced (the manager keeps it). Publishing is retried with a capped backoff
while the daemon lives, beside the worker, so a relay that is down holds up no other description.

A conversation brought in by an importer (``tenexd migrate``: it holds an import record in
``metadata.extra``, :data:`IMPORT_RECORDS`) came from a file, not from this daemon's relays: a SmartHole
one never was on Nostr, and a TENEX one had its descriptions published by the backend that held it then.
Its description may be made and stored, but no kind 513 goes out for it (an import of many old
conversations publishes nothing); it is marked published, as an expired task session's is, so no start
finds it waiting again. A TENEX one that goes on after its import (a new message) is described and
published as any conversation is; a SmartHole one never is.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, Protocol, TypeVar

import structlog

from tenex_daemon.core.context import ChatMessage
from tenex_daemon.core.conversation import TASK_SESSION_EXPIRED, Conversation, TitleSource
from tenex_daemon.core.errors import ConversationNotFoundError, EventRefusedError
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.llm import BackendError, CompletionRequest, LLMBackend
from tenex_daemon.core.search import ConversationSummary, SearchQuery
from tenex_daemon.runtime.background import BackgroundTasks
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.services.description_text import (
    DEFAULT_PROMPT_CHARS,
    NO_DESCRIPTION,
    QUESTION,
    SUMMARY_QUESTION,
    SUMMARY_SYSTEM_PROMPT,
    SYSTEM_PROMPT,
    Description,
    clean_summary,
    count_exchanges,
    fallback_summary,
    fallback_title,
    parse_description,
    user_prompt,
)
from tenex_daemon.services.locks import KeyedLock

log = structlog.get_logger(__name__)

T = TypeVar("T")

DEFAULT_DESCRIBE_AFTER_EXCHANGES = 3
DEFAULT_TIMEOUT_S = 120.0
"""A model that has not answered in this long gives the fallback text."""
DEFAULT_QUEUE_SIZE = 10_000
DEFAULT_MAX_TOKENS = 200
PUBLISH_RETRY_START_S = 1.0
PUBLISH_RETRY_CAP_S = 300.0
IDLE_POLL_S = 0.5
IDLE_WAIT_MAX_S = 60.0
"""The longest a description waits for agent runs to end before it asks its model anyway."""
SETTLED_MEMORY = 10_000
SUMMARIZER = "summarizer"
TENEX_RECORD = "tenex_import"
SMARTHOLE_RECORD = "smarthole_import"
IMPORT_RECORDS = (TENEX_RECORD, SMARTHOLE_RECORD)
"""The ``metadata.extra`` keys under which the importers keep each imported conversation's record
(tenex_daemon/adapters/storage/tenex_import.py, smarthole_import.py); the record is written at import and
never removed."""

Sleep = Callable[[float], Awaitable[None]]


class DescriptionComposer(Protocol):
    """Builds the signed kind-513 event of a conversation's title and summary (the project's key)."""

    def compose(self, conversation_id: str, title: str, summary: str, *, ended: bool) -> NostrEvent:
        """Return the signed event for the conversation rooted at ``conversation_id``."""


class EventPublisher(Protocol):
    """Sends an event to the relays."""

    async def publish(self, event: NostrEvent) -> None:
        """Publish; raise when no relay accepted it."""


def described_for_now(activity_at: int, described_at: int | None) -> bool:
    """Whether the description was made for the conversation's current content (its last activity).

    A conversation stored before its last activity was kept (``activity_at`` 0) counts as described
    once it has any description: new activity always sets ``activity_at``."""
    return described_at is not None and (activity_at == 0 or described_at == activity_at)


def needs_description(conversation: Conversation, exchanges: int, after_exchanges: int) -> bool:
    """Whether the conversation should get a (new) title and summary now (see the module docstring)."""
    if not conversation.history:
        return False
    if conversation.is_ended:
        return not described_for_now(conversation.activity_at, conversation.described_at)
    return (
        not conversation.archived
        and conversation.title_source is None
        and conversation.described_at is None
        and exchanges >= after_exchanges
    )


def is_imported(conversation: Conversation) -> bool:
    """Whether an importer brought the conversation in from a file and it has not gone on since: its title
    and summary stay local, no kind 513 is published for it. A SmartHole one never goes on as a Nostr
    conversation (it never was one); a TENEX one that gets a message after its import (its activity later
    than the record's ``imported_at``) is a conversation on Nostr again, described as any other."""
    extra = conversation.metadata.extra
    if SMARTHOLE_RECORD in extra:
        return True
    record = extra.get(TENEX_RECORD)
    if not isinstance(record, dict):
        return False
    imported_at = record.get("imported_at")
    return not isinstance(imported_at, int) or conversation.activity_at <= imported_at


def row_has_work(row: ConversationSummary, after_exchanges: int) -> bool:
    """Whether an index row may have description work left (the job decides on the loaded conversation):
    unpublished, ended and undescribed, or titleless with enough events for ``after_exchanges``."""
    if not row.description_published:
        return True
    if row.ended_at is not None:
        return not described_for_now(row.activity_at, row.described_at)
    return (
        not row.archived
        and row.title_source is None
        and row.described_at is None
        and row.event_count >= 2 * after_exchanges
    )


def _same_description(a: Conversation, b: Conversation) -> bool:
    def key(c: Conversation) -> tuple[object, ...]:
        return c.title, c.summary, c.described_at, c.is_ended

    return key(a) == key(b)


class DescriptionJobs:
    """The background service that describes conversations and publishes their kind-513 events.

    Made once per manager: it listens to the manager's ended conversations and saved replies.

    ``backends``: each agent's backend by slug (the fallback choice of model); ``summarizer``: the
    configured summarizer backend, used for every conversation when given. ``idle``: whether no agent
    run is in flight now (None: always idle). ``sleep``: how waits are made (tests pass a fake).
    ``on_described``: told the source (``model`` or ``fallback``) of each description made.
    """

    def __init__(
        self,
        manager: ConversationManager,
        composer: DescriptionComposer,
        publisher: EventPublisher,
        *,
        backends: Mapping[str, LLMBackend],
        summarizer: LLMBackend | None = None,
        describe_after_exchanges: int = DEFAULT_DESCRIBE_AFTER_EXCHANGES,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_prompt_chars: int = DEFAULT_PROMPT_CHARS,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        publish_retry_start_s: float = PUBLISH_RETRY_START_S,
        publish_retry_cap_s: float = PUBLISH_RETRY_CAP_S,
        idle: Callable[[], bool] | None = None,
        sleep: Sleep = asyncio.sleep,
        on_described: Callable[[str], None] | None = None,
    ) -> None:
        self._manager = manager
        self._composer = composer
        self._publisher = publisher
        self._backends = dict(backends)
        self._summarizer = summarizer
        self._after = describe_after_exchanges
        self._timeout = timeout_s
        self._max_prompt_chars = max_prompt_chars
        self._max_tokens = max_tokens
        self._retry_start = publish_retry_start_s
        self._retry_cap = publish_retry_cap_s
        self._idle = idle
        self._sleep = sleep
        self._reconnected = asyncio.Event()
        """Set (and replaced) when a relay (re)connects: a publication waiting out a retry goes at once."""
        self._on_described = on_described
        self._queue: asyncio.Queue[str] = asyncio.Queue(maxsize=queue_size)
        self._queued: set[str] = set()
        self._ended: set[str] = set()
        """Conversations woken because they just ended (a description made while active is re-stamped)."""
        self._settled: OrderedDict[str, None] = OrderedDict()
        """Active conversations that have a title: replies need not wake them (bounded)."""
        self._current: str | None = None
        self._rescan = False
        self._publishing: set[str] = set()
        self._marks = KeyedLock()
        """Orders a new description against the mark of an older one's publication, per conversation."""
        self._worker = BackgroundTasks("descriptions")
        self._publishes = BackgroundTasks("description publishing")
        self.described: Counter[str] = Counter()
        """Descriptions made since start, by title source (``model``, ``fallback``)."""
        self.published = 0
        self.retries = 0
        self.refused = 0
        """Descriptions every relay refused for good (for their size): not tried again."""
        manager.on_ended(self.ended)
        manager.on_reply(self.replied)

    # --- what status and metrics read -------------------------------------------------------

    @property
    def queued(self) -> int:
        """Conversations waiting for the worker, with the one it works on."""
        return self._queue.qsize() + (1 if self._current is not None else 0)

    @property
    def unpublished(self) -> int:
        """Descriptions stored whose kind-513 event no relay has accepted yet (being retried)."""
        return len(self._publishing)

    # --- running ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker (call from inside the event loop)."""
        if not self._worker:
            self._worker.spawn(self._work(), "worker")

    async def stop(self) -> None:
        """Stop the worker and the publications under way; what is left is found again at next start."""
        await self._worker.cancel_all()
        await self._publishes.cancel_all()

    def wake(self, conversation_id: str) -> None:
        """Look at the conversation soon (after each saved reply); never blocks. A conversation waits at
        most once; an overflowing queue is remembered and every conversation is looked at again later."""
        if conversation_id in self._queued or conversation_id in self._settled:
            return
        try:
            self._queue.put_nowait(conversation_id)
        except asyncio.QueueFull:
            if not self._rescan:
                log.warning("description_queue_full", conversation_id=conversation_id, action="rescan later")
            self._rescan = True
            return
        self._queued.add(conversation_id)

    def relay_connected(self) -> None:
        """A relay (re)connected: the publications waiting out a retry try again at once (as the outbox's)."""
        reconnected, self._reconnected = self._reconnected, asyncio.Event()
        reconnected.set()

    async def _wait_to_retry(self, delay: float) -> None:
        """Wait ``delay`` seconds, or until a relay (re)connects."""
        waits = {asyncio.ensure_future(self._sleep(delay)), asyncio.ensure_future(self._reconnected.wait())}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for each in waits:
                each.cancel()

    def replied(self, conversation_id: str, reopened: bool) -> None:
        """A reply was saved in the conversation, or a message reopened it (the manager's ``on_reply``
        listener): look at it soon. A reopened one is looked at even when it was settled here before
        (another daemon sharing the store ended it meanwhile): its kind 513 goes out again saying active."""
        if reopened:
            self._settled.pop(conversation_id, None)
        self.wake(conversation_id)

    def ended(self, conversation_id: str) -> None:
        """A conversation just ended: describe it (never blocks; the manager's ``on_ended`` listener)."""
        self._settled.pop(conversation_id, None)
        self._ended.add(conversation_id)
        self.wake(conversation_id)

    async def recover(self) -> int:
        """Queue every conversation with description work left (one search of the index rows); return
        how many were queued."""
        rows = await self._manager.store.search(SearchQuery())
        pending = [row.id for row in rows if row_has_work(row, self._after)]
        for conversation_id in pending:
            self.wake(conversation_id)
        if pending:
            log.info("descriptions_recovered", count=len(pending))
        return len(pending)

    async def _work(self) -> None:
        while True:
            conversation_id = await self._queue.get()
            self._queued.discard(conversation_id)
            self._current = conversation_id
            try:
                await self._job(conversation_id)
            except ConversationNotFoundError:
                log.info("description_skipped", conversation_id=conversation_id, reason="deleted meanwhile")
            except Exception:
                log.exception("description_job_failed", conversation_id=conversation_id)
            finally:
                self._current = None
            if self._rescan and self._queue.empty():
                self._rescan = False
                try:
                    await self.recover()
                except Exception:
                    log.exception("description_rescan_failed")

    # --- one job ----------------------------------------------------------------------------

    async def _job(self, conversation_id: str) -> None:
        just_ended = conversation_id in self._ended
        self._ended.discard(conversation_id)
        conversation = await self._manager.get_conversation(conversation_id)
        if conversation is None:
            return
        if conversation.private:  # no title, summary or kind 513 for a private conversation
            if conversation.is_ended:  # stamped, so no start finds it waiting again
                activity = conversation.last_activity
                async with self._marks.hold(conversation_id):
                    await self._manager.description_published(conversation_id, settled_for=activity)
            self._settle(conversation_id)
            return
        if self._needs(conversation):
            await self._wait_idle()
            conversation = await self._manager.get_conversation(conversation_id)
            if conversation is None or not self._needs(conversation):
                return
            conversation = await self._describe(conversation)
        elif just_ended and conversation.is_ended and conversation.summary:
            # an expired task session's 513 never goes out (the next session speaks for the task), nor
            # an imported conversation's
            if conversation.description_published and not _local_only(conversation):
                conversation = await self._restamp(conversation)
        elif not conversation.is_ended and (conversation.title_source or conversation.described_at):
            self._settle(conversation_id)
        if not conversation.description_published:
            self._publish_soon(conversation_id)

    def _needs(self, conversation: Conversation) -> bool:
        exchanges = count_exchanges(conversation, self._manager.agents)
        return needs_description(conversation, exchanges, self._after)

    def _settle(self, conversation_id: str) -> None:
        self._settled[conversation_id] = None
        self._settled.move_to_end(conversation_id)
        while len(self._settled) > SETTLED_MEMORY:
            self._settled.popitem(last=False)

    async def _wait_idle(self) -> None:
        """Let the agents' runs finish first (a shared local model answers one at a time), for a while."""
        waited = 0.0
        while self._idle is not None and not self._idle() and waited < IDLE_WAIT_MAX_S:
            await self._sleep(IDLE_POLL_S)
            waited += IDLE_POLL_S

    async def _describe(self, conversation: Conversation) -> Conversation:
        """Ask a model (or fall back), store the title and summary, count and log it."""
        cid = conversation.id
        started = time.monotonic()
        answer, failure = await self._ask(conversation)
        made = parse_description(answer) if answer is not None else NO_DESCRIPTION
        if answer is not None and made == NO_DESCRIPTION:
            failure = "unparseable"
        if made.title is not None and made.summary is None:  # one more try: the summary alone, in plain words
            plain, _ = await self._ask(conversation, SUMMARY_SYSTEM_PROMPT, SUMMARY_QUESTION)
            made = Description(made.title, clean_summary(parse_description(plain or "").summary or plain))
        agents = self._manager.agents
        title = made.title or fallback_title(conversation, agents)
        summary = made.summary or fallback_summary(conversation, agents)
        source = TitleSource.MODEL if made.title is not None else TitleSource.FALLBACK
        async with self._marks.hold(cid):
            stored = await self._manager.describe(
                cid, title=title, summary=summary, source=source, for_activity=conversation.last_activity
            )
        self.described[source.value] += 1
        if self._on_described is not None:
            self._on_described(source.value)
        log.info(
            "conversation_description_made",
            conversation_id=cid,
            source=source.value,
            summary_source=TitleSource.MODEL.value if made.summary else TitleSource.FALLBACK.value,
            failure=failure,
            ended=conversation.is_ended,
            seconds=round(time.monotonic() - started, 3),
        )
        return stored

    async def _restamp(self, conversation: Conversation) -> Conversation:
        """A conversation described while active ended with no activity since: the same title and
        summary are stored again so that a kind-513 event with status ``ended`` goes out."""
        async with self._marks.hold(conversation.id):
            return await self._manager.describe(
                conversation.id,
                title=None,
                summary=conversation.summary or "",
                source=conversation.title_source or TitleSource.FALLBACK,
                for_activity=conversation.described_at or conversation.last_activity,
            )

    def _backend_for(self, conversation: Conversation) -> tuple[str, str, LLMBackend] | None:
        """(slug, name, backend) to ask: the summarizer, else the first agent that wrote in the
        conversation, else the first agent its root addresses, else the first configured agent."""
        if self._summarizer is not None:
            return SUMMARIZER, "Summarizer", self._summarizer
        agents = self._manager.agents
        authors = [event.pubkey for event in conversation.history]
        addressed = conversation.root.tag_values("p") if conversation.root is not None else []
        for pubkey in [*authors, *addressed]:
            agent = agents.by_pubkey(pubkey)
            if agent is not None and agent.slug in self._backends:
                return agent.slug, agent.name, self._backends[agent.slug]
        slug = next(iter(self._backends), None)
        return None if slug is None else (slug, agents.get(slug).name, self._backends[slug])

    async def _ask(
        self, conversation: Conversation, system: str = SYSTEM_PROMPT, question: str = QUESTION
    ) -> tuple[str | None, str | None]:
        """The model's answer, or None with why there is none (``no_backend``, ``timeout``, an error)."""
        chosen = self._backend_for(conversation)
        if chosen is None:
            return None, "no_backend"
        slug, name, backend = chosen
        prompt = user_prompt(conversation, self._manager.agents, self._max_prompt_chars, question)
        request = CompletionRequest(
            agent_slug=slug,
            agent_name=name,
            system_prompt=system,
            messages=(ChatMessage("user", prompt),),
            max_tokens=self._max_tokens,
        )
        try:
            result = await self._within_timeout(backend.complete(request))
        except TimeoutError:
            failure = "timeout"
        except BackendError as exc:
            failure = f"backend_{exc.kind.value}"
        except Exception as exc:
            failure = type(exc).__name__
        else:
            return (result.text, None) if result.text.strip() else (None, "empty")
        log.warning(
            "description_model_failed", conversation_id=conversation.id, backend=backend.name, error=failure
        )
        return None, failure

    async def _within_timeout(self, call: Coroutine[Any, Any, T]) -> T:
        """Await ``call``; raise TimeoutError when ``self._sleep(timeout)`` ends first (it is cancelled)."""
        task = asyncio.ensure_future(call)
        timer = asyncio.ensure_future(self._sleep(self._timeout))
        try:
            await asyncio.wait({task, timer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            timer.cancel()
            if not task.done():
                task.cancel()
                task.add_done_callback(_retrieve)
        if task.done() and not task.cancelled():
            return task.result()
        raise TimeoutError

    # --- publishing -------------------------------------------------------------------------

    def _publish_soon(self, conversation_id: str) -> None:
        """Publish the conversation's stored description until a relay accepts it (one task each)."""
        if conversation_id in self._publishing:
            return  # the running task reloads before each try: it publishes the newest description
        self._publishing.add(conversation_id)
        self._publishes.spawn(self._publish(conversation_id), f"publish {conversation_id[:12]}")

    async def _publish(self, conversation_id: str) -> None:
        delay = self._retry_start
        try:
            while True:
                try:
                    if await self._publish_once(conversation_id):
                        return
                    continue  # a newer description was stored meanwhile: publish that one
                except EventRefusedError as exc:
                    self.refused += 1
                    log.error(
                        "description_refused",
                        conversation_id=conversation_id,
                        error=str(exc),
                        action="not tried again until it changes or the daemon starts again",
                    )
                    return
                except Exception as exc:
                    self.retries += 1
                    log.info(
                        "description_publish_retry",
                        conversation_id=conversation_id,
                        retry_in=delay,
                        error=str(exc) or type(exc).__name__,
                    )
                await self._wait_to_retry(delay)
                delay = min(delay * 2, self._retry_cap)
        finally:
            self._publishing.discard(conversation_id)

    async def _publish_once(self, conversation_id: str) -> bool:
        """One try: compose from the stored description and publish; True when nothing is left to do."""
        conversation = await self._manager.get_conversation(conversation_id)
        if conversation is None or conversation.description_published or not conversation.summary:
            return True
        if conversation.private:  # never published in the clear
            return True
        if _local_only(conversation):
            # an expired task session: the task's thread goes on in the next session, whose description
            # speaks for it: this one's, published late (it waits for that session's runs), must not
            # replace it; an imported conversation: never on Nostr, its title and summary stay here.
            # Marked as if published, so no start finds it waiting again
            with contextlib.suppress(ConversationNotFoundError):
                async with self._marks.hold(conversation_id):
                    await self._manager.description_published(conversation_id)
            return True
        # named by the thread clients show (a task's session: the task)
        title, summary = conversation.title, conversation.summary
        event = self._composer.compose(conversation.thread_id, title, summary, ended=conversation.is_ended)
        await self._publisher.publish(event)
        async with self._marks.hold(conversation_id):
            now = await self._manager.get_conversation(conversation_id)
            if now is None:
                return True
            if not _same_description(now, conversation):
                return False
            try:
                await self._manager.description_published(conversation_id)
            except ConversationNotFoundError:
                return True
        self.published += 1
        log.info(
            "conversation_description_published",
            conversation_id=conversation_id,
            event_id=event.id,
            status="ended" if conversation.is_ended else "active",
        )
        return True


def _local_only(conversation: Conversation) -> bool:
    """Whether the conversation's description is never published: an expired task session's, an imported
    conversation's."""
    return conversation.end_reason == TASK_SESSION_EXPIRED or is_imported(conversation)


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Read a cancelled model call's outcome so an error it raised while stopping is not reported."""
    if not task.cancelled():
        task.exception()
