"""Delegation: one agent asks another through ``send_message`` in their own thread (docs/ARCHITECTURE.md).

:class:`Delegation` lives as long as the runner; :meth:`Delegation.for_run` binds it to
one agent's run (the asker and the event it answers), giving the run's
:class:`~tenex_daemon.services.tools.Delegator`. An exchange:

1. the request is saved to the conversation (signed by the asker, p-tagging the asked
   agent, tagged ``["delegation", <thread id>]``) and published in the background;
2. the asked agent runs on its thread with the asker only (persona, the asker's
   messages as ``user``, its own as ``assistant``, the new request last), offered
   :data:`DELEGATED_TOOLS` and never ``send_message``;
3. its answer is saved and published the same way (signed by it, replying to the
   request, p-tagging the asker), its token usage added to its totals;
4. the thread gets the request and the answer as one pair and is saved (unless the conversation was
   deleted meanwhile: :meth:`Delegation._save_to_thread`); the answer is the tool's result.

Before the asked agent's context is built, the thread gets the exchanges saved in history under its id
that it lacks (:func:`_lost_pairs`): a process that died between saving an answer and saving the thread,
or a conversation rebuilt from its events, leaves both sides in history and the thread without them.

A failed answer (its backend failed) is still saved and published, as an error reply,
so the request is never left unanswered in the conversation; the thread is not
changed and the tool call is refused with what failed. Exchanges between the same pair
in the same conversation take turns (a lock per thread), so each answer sees the
previous exchange. Both sides are added to history without reopening a conversation its owner
ended meanwhile: they are part of a run under way, not a new message.

A run redone after a crash (or tried again after an error) whose model asks the same agent the same
message again takes the request an earlier try saved instead of making a new one (each request once,
in order: :meth:`Delegation.exchange`): its saved answer is the result and nothing is asked or saved
again; a request saved without an answer is answered, saving only the answer. A live run asking the same
thing twice asks twice (its first request is already taken), unless both requests are the same event (the
same second): then the second call gets the first one's answer, so history and thread agree.

While the asked agent answers, it counts as working in the conversation (its live status, told
the ``listener``), and a stop naming it (:meth:`Delegation.stop_answers`) cancels its answer: nothing
of it is saved or published, and the asker's tool call is refused with "<slug> was stopped". A stop that
lands before its answer can be cancelled (while the request is saved) is read once the answer is
registered, before the asked agent runs: the call is refused as one asking a stopped agent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import structlog

from tenex_daemon.core.agents import Agent
from tenex_daemon.core.budget import BudgetStrategy
from tenex_daemon.core.context import AgentContext, ChatMessage
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.llm import CompletionResult
from tenex_daemon.core.ports import ReplyComposer, ReplySpec
from tenex_daemon.core.stops import stopped_since
from tenex_daemon.core.targeting import reply_person
from tenex_daemon.core.thread_tags import read_threading
from tenex_daemon.core.threads import ConversationThread, ThreadPersistenceError
from tenex_daemon.core.vocabulary import ERROR_SYSTEM, KIND_NOTE, TAG_DELEGATION, TAG_ERROR
from tenex_daemon.services.answering import AgentProfile
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.services.locks import KeyedLock
from tenex_daemon.services.outbox import Outbox
from tenex_daemon.services.runs import RunListener, RunRequest
from tenex_daemon.services.threads import ThreadManager
from tenex_daemon.services.tools import NotAskedError, RunEffects, ToolContext, ToolRefusedError

log = structlog.get_logger(__name__)

DELEGATED_TOOLS = ("get_conversation",)
"""The tools an asked agent may use while it answers: only reading ones, never ``send_message``
(no recursion) nor those that end or steer the conversation (``complete``, ``end_conversation``,
``switch_phase``), which belong to the conversation's own runs."""

Answered = tuple[CompletionResult, str | None]
"""An answer loop's result: the completion and the error kind (None when it succeeded)."""
Answer = Callable[[AgentProfile, AgentContext, ToolContext], Awaitable[Answered]]
"""The tool loop (:meth:`AnswerLoop.answer`): (profile, context, tools) -> (answer, error kind or None)."""


def delegation_note(asker: Agent) -> str:
    """The line added to the asked agent's persona: who asks and where the answer goes."""
    return (
        f"You are answering {asker.name} ({asker.slug}), another agent of this project, in your private "
        f"thread with them. Your answer goes back to {asker.name}."
    )


def thread_messages(thread: ConversationThread, responder: str) -> list[ChatMessage]:
    """The thread as the ``responder`` sees it: its own items ``assistant``, the other side's ``user``."""
    messages = []
    for item in thread.items:
        if not isinstance(item, dict) or not isinstance(item.get("content"), str):
            continue
        own = item.get("from") == responder
        messages.append(ChatMessage("assistant" if own else "user", item["content"]))
    return messages


@dataclass(slots=True)
class _Answering:
    """An asked agent answering: its run of the answer loop, and whether a stop cancelled it."""

    request: RunRequest
    """The conversation, the asking run's trigger and the asked agent (as a run of its would be named)."""
    task: asyncio.Future[Answered]
    stopped: bool = False


class Delegation:
    """Carries out ``send_message`` exchanges between the runner's agents."""

    def __init__(
        self,
        manager: ConversationManager,
        profiles: Mapping[str, AgentProfile],
        threads: ThreadManager,
        composer: ReplyComposer,
        *,
        answer: Answer,
        outbox: Outbox,
        listener: RunListener | None = None,
    ) -> None:
        self._manager = manager
        self._profiles = profiles
        self._threads = threads
        self._composer = composer
        self._answer = answer
        self._outbox = outbox
        self._locks = KeyedLock()
        self._listener = listener
        """Told when an asked agent starts and ends answering (the live status)."""
        self._answering: list[_Answering] = []

    def stop_answers(self, conversation_id: str, agent_slug: str | None) -> list[RunRequest]:
        """Cancel the answers ``agent_slug`` (None: any agent) is giving in the conversation to other agents'
        ``send_message``; return them, named as runs (the asking run's trigger, the asked agent). An answer
        already in (being saved) is no longer here: it finishes."""
        found = [
            each for each in self._answering
            if each.request.conversation_id == conversation_id
            and (agent_slug is None or each.request.agent_slug == agent_slug)
            and not each.task.done()  # its answer is in: the asker gets it, the stop does not name it
        ]
        for each in found:
            each.stopped = True
            each.task.cancel()
        return [each.request for each in found]

    async def _answer_stoppably(
        self, asker: Agent, asked: Agent, cid: str, trigger: NostrEvent,
        run: Callable[[], Awaitable[Answered]],
    ) -> Answered:
        """Run the asked agent's answer as a task a stop can cancel (:meth:`stop_answers`); a stop refuses
        the asker's tool call, a cancellation of the asker's own run goes on up.

        A stop records itself, then cancels what it finds: one recorded after :meth:`exchange` checked
        and before the answer was registered here (while the request was saved) found nothing to cancel,
        so the stops are read again once it is registered (a placeholder a stop meanwhile cancels), and
        the asked agent starts only then."""
        placeholder: asyncio.Future[Answered] = asyncio.get_running_loop().create_future()
        answering = _Answering(RunRequest(cid, trigger.id, asked.slug), placeholder)
        self._answering.append(answering)
        try:
            await self._refuse_if_stopped(asker, asked, cid, trigger)
            if answering.stopped:  # by a stop recorded after the stops were read
                raise _refused_stopped(cid, asker, asked)
        except BaseException:
            self._answering.remove(answering)
            raise
        answering.task = asyncio.ensure_future(run())
        if self._listener is not None:
            self._listener.run_started(answering.request)
        try:
            return await answering.task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if answering.stopped and (current is None or current.cancelling() == 0):
                log.info("delegation_stopped", conversation_id=cid, asked=asked.slug)
                message = f"{asked.slug} was stopped before answering (a person stopped it)"
                raise ToolRefusedError(message) from None
            answering.task.cancel()
            raise
        finally:
            self._answering.remove(answering)
            if self._listener is not None:
                self._listener.run_ended(answering.request)

    def askable(self, asker: Agent) -> list[Agent]:
        """The agents ``asker`` may ask: every other configured agent but the orchestrator."""
        return [
            p.agent
            for p in self._profiles.values()
            if p.agent.slug != asker.slug and not p.agent.orchestrator
        ]

    def can_delegate(self, asker: Agent) -> bool:
        """Whether ``send_message`` is offered to ``asker``: not the orchestrator, and someone to ask."""
        return not asker.orchestrator and bool(self.askable(asker))

    def for_run(
        self, asker: Agent, conversation_id: str, trigger: NostrEvent, burst: tuple[str, ...] = ()
    ) -> RunDelegator:
        """The delegator of one run of ``asker`` answering ``trigger`` (and the earlier messages of its
        ``burst``, ids)."""
        return RunDelegator(self, asker, conversation_id, trigger, burst)

    def _target(self, asker: Agent, slug: str) -> AgentProfile:
        """The profile of the agent asked; refuse oneself, the orchestrator and unknown
        slugs (:class:`NotAskedError`: nobody was asked)."""
        names = ", ".join(f"{a.slug} ({a.name})" for a in self.askable(asker)) or "nobody"
        if slug == asker.slug:
            raise NotAskedError(f"you cannot send a message to yourself; you can ask: {names}")
        profile = self._profiles.get(slug)
        if profile is None:
            raise NotAskedError(f"no agent {slug!r} in this project; you can ask: {names}")
        if profile.agent.orchestrator:
            raise NotAskedError(
                f"{slug} is the orchestrator: it routes the conversation and does not answer questions; "
                f"you can ask: {names}"
            )
        return profile

    async def exchange(
        self, asker: Agent, cid: str, trigger: NostrEvent, to: str, message: str,
        served: set[str] | None = None, burst: tuple[str, ...] = (),
    ) -> str:
        """Carry out one request and answer (see the module docstring); return the answer. An agent a stop
        named after this run's trigger came is not asked again in this run (the asker's model may try).

        ``served``: the requests this run's calls took so far. A request of an earlier try of this run (a run
        redone after a crash, or tried again after an error) that no call of this run took yet, the same
        message to the same agent, is taken instead of a new one: its saved answer is returned, nobody is
        asked and nothing is saved again; without a saved answer the agent is asked and only its answer is
        saved. An earlier try may have answered another message of the run's ``burst`` (ids: a retry takes in
        the messages that came meanwhile, the newest its trigger): its requests count too. A call refused
        before anyone is asked raises :class:`NotAskedError`."""
        served = set() if served is None else served
        target = self._target(asker, to)
        asked = target.agent
        await self._refuse_if_stopped(asker, asked, cid, trigger)
        thread_id = self._threads.key(cid, asker.slug, asked.slug)
        async with self._locks.hold(thread_id):
            try:
                thread = await self._threads.get_thread(cid, asker.slug, asked.slug)
            except ThreadPersistenceError as exc:
                raise NotAskedError(f"your thread with {asked.slug} could not be read: {exc}") from None
            conversation = await self._manager.get_conversation(cid)
            if conversation is None:
                raise NotAskedError("the conversation is gone")
            # in memory until this exchange saves the thread; lost with it, they are found again next time
            recovered = _lost_pairs(conversation, thread, asker, asked)
            if recovered:
                thread.add_items(recovered)
                log.info("delegation_thread_recovered", thread_id=thread_id, items=len(recovered))
            answering = (trigger.id, *burst)
            request, answer = await self._request(
                asker, asked, trigger, answering, message, thread_id, cid, conversation, served
            )
            if answer is None:
                answer = await self._ask(target, asker, request, thread, trigger, cid)
            else:
                log.info("delegation_reused", conversation_id=cid, asker=asker.slug, asked=asked.slug)
                if answer.has_tag(TAG_ERROR, ERROR_SYSTEM):
                    raise ToolRefusedError(f"{asked.slug} could not answer: {answer.content}")
            pair = []
            if not any(isinstance(i, dict) and i.get("event_id") == request.id for i in thread.items):
                pair = [_item(asker, asked, request), _item(asked, asker, answer)]
            if pair or recovered:
                await self._save_to_thread(cid, thread, pair)
            log.info("delegation_answered", conversation_id=cid, asker=asker.slug, asked=asked.slug)
            return answer.content

    async def _refuse_if_stopped(self, asker: Agent, asked: Agent, cid: str, trigger: NostrEvent) -> None:
        """Refuse (:class:`NotAskedError`) to ask an agent a stop named after the asking run's trigger."""
        conversation = await self._manager.get_conversation(cid)
        if conversation is not None and stopped_since(conversation, trigger, asked.slug, recovered=False):
            raise _refused_stopped(cid, asker, asked)

    async def _save_to_thread(
        self, cid: str, thread: ConversationThread, items: list[dict[str, Any]]
    ) -> None:
        """Add ``items`` to the thread and save it, unless the conversation was deleted meanwhile: its
        deletion erased its stored threads, and saving would store the exchange's text again, belonging to
        no conversation. The stored conversation is read just before, under the thread's lock, so every
        deletion counts: the API's, retention's, another daemon's sharing the store (which forgets nothing
        here: this daemon's cached threads of it go now). The read and the save are not one step: on a
        store whose writes wait (PostgreSQL's), a deletion landing between them still leaves the thread
        stored. A failed save keeps the items in the cached thread, saved with the next exchange (and found
        again in history if lost)."""
        if await self._manager.get_conversation(cid) is None:
            self._threads.forget_conversation(cid)
            log.info("delegation_thread_not_saved", thread_id=thread.thread_id, reason="deleted")
            return
        try:
            await self._threads.add_items_and_save(thread, items)
        except ThreadPersistenceError as exc:
            log.error("delegation_thread_not_saved", thread_id=thread.thread_id, error=str(exc))

    async def _request(
        self, asker: Agent, asked: Agent, trigger: NostrEvent, answering: tuple[str, ...], message: str,
        thread_id: str, cid: str, conversation: Conversation, served: set[str],
    ) -> tuple[NostrEvent, NostrEvent | None]:
        """The call's request and its saved answer, if any: an earlier try's request no call of this run took
        yet (see :meth:`exchange`; ``conversation`` as loaded under the thread's lock), else a new one, saved;
        a new request identical to one saved (the same message in the same second: the same event id) is
        that one."""
        request = _earlier_request(conversation, answering, asker.pubkey, thread_id, message, served)
        if request is None:
            request = await self._compose(asker, trigger, message, (asked.pubkey,), thread_id, cid)
            if await self._manager.add_event(cid, request, reopens=False):
                await self._outbox.add(cid, request, agent_slug=asker.slug)
                served.add(request.id)
                log.info("delegation_asked", conversation_id=cid, asker=asker.slug, asked=asked.slug)
                return request, None
            saved = await self._manager.get_conversation(cid)
            if saved is None:
                raise NotAskedError("the conversation is gone")
            conversation = saved
        served.add(request.id)
        return request, _saved_answer(conversation, request, asked.pubkey, thread_id)

    async def _ask(
        self, target: AgentProfile, asker: Agent, request: NostrEvent, thread: ConversationThread,
        trigger: NostrEvent, cid: str,
    ) -> NostrEvent:
        """Run the asked agent on the thread and the request; save and publish its answer (also a failed one,
        then refusing the call with what failed) and count its tokens."""
        asked = target.agent
        messages = [*thread_messages(thread, asked.slug), ChatMessage("user", request.content)]
        context = AgentContext(
            messages=messages,
            session_id=None,
            last_processed_index=0,
            protected=(len(messages) - 1,),  # the request is this run's trigger: never cut
        )
        note = delegation_note(asker)
        instructions = f"{target.instructions}\n\n{note}" if target.instructions else note
        tools = tuple(name for name in target.tools if name in DELEGATED_TOOLS)
        # The thread is not the conversation: the asked agent's conversation summary must not be
        # replaced by one of the thread, so a delegated run over budget slides its window.
        budget = target.budget
        if budget is not None and budget.strategy is not BudgetStrategy.SLIDING_WINDOW:
            budget = replace(budget, strategy=BudgetStrategy.SLIDING_WINDOW)
        # A thread's persona is the agent's, who asks, and the conversation's article: it recalls no
        # recent conversations (docs/CONTEXT.md, "The persona prompt").
        profile = replace(target, instructions=instructions, tools=tools, budget=budget, recent_in_persona=0)
        tool_context = ToolContext(
            self._manager, cid, asked, RunEffects(), trigger=trigger, budget=budget,
            list_recent=target.list_recent,
        )
        result, error_kind = await self._answer_stoppably(
            asker, asked, cid, trigger, lambda: self._answer(profile, context, tool_context)
        )
        answer = await self._compose(
            asked, request, result.text, (asker.pubkey,), thread.thread_id, cid, result, error_kind
        )
        # the tokens first: a crash after the answer is saved would lose them (a redo takes the saved answer,
        # nobody asks again), while one before it only counts a call the redo makes again, billed twice too
        used = (result.prompt_tokens or 0, result.completion_tokens or 0)
        if any(used):
            await self._manager.update_agent_state(cid, asked.slug, add_tokens=used)
        await self._manager.add_event(cid, answer, reopens=False)
        await self._outbox.add(cid, answer, agent_slug=asked.slug)
        if error_kind is not None:
            log.warning("delegation_failed", conversation_id=cid, asked=asked.slug, error=error_kind)
            raise ToolRefusedError(f"{asked.slug} could not answer ({error_kind}): {result.text}")
        return answer

    async def _compose(
        self,
        author: Agent,
        parent: NostrEvent,
        content: str,
        destinations: tuple[str, ...],
        thread_id: str,
        cid: str,
        result: CompletionResult | None = None,
        error_kind: str | None = None,
    ) -> NostrEvent:
        """Compose one side of the exchange (the caller adds it to history, without reopening an ended
        conversation: it is part of a run under way, then hands it to the outbox to publish)."""
        conversation = await self._manager.get_conversation(cid)
        if conversation is None:
            raise ToolRefusedError("the conversation is gone")
        if conversation.root_kind == KIND_NOTE:  # a kind-1 event p-tags the person too (docs/PROTOCOL.md)
            person = reply_person(conversation, parent, self._manager.agents)
            destinations = tuple(dict.fromkeys((person, *destinations)))
        spec = ReplySpec(
            agent_slug=author.slug,
            trigger=parent,
            root=conversation.root,
            task_id=conversation.task_id,
            missing_root=conversation.missing_root,
            subject=conversation.subject(),
            content=content,
            destinations=destinations,
            phase=conversation.phase.value,
            net_time_seconds=await self._manager.execution_seconds(cid),
            model=result.model if result is not None else None,
            prompt_tokens=result.prompt_tokens if result is not None else None,
            completion_tokens=result.completion_tokens if result is not None else None,
            error=error_kind is not None,
            delegation=thread_id,
            cost_usd=self._profiles[author.slug].cost_usd(result) if result is not None else None,
        )
        return self._composer.compose(spec)


def _earlier_request(
    conversation: Conversation, answering: tuple[str, ...], asker: str, thread_id: str, message: str,
    served: set[str],
) -> NostrEvent | None:
    """The first request of ``asker`` (a public key) answering one of the run's messages (``answering``: its
    trigger and burst) in the thread with ``message`` that no call of this run took (``served``), saved since
    the asker's last reply to one of them (an earlier, finished run's exchanges are never taken)."""
    indexes = [i for i in map(conversation.index_of, answering) if i is not None]
    if not indexes:
        return None
    found: list[NostrEvent] = []
    for event in conversation.history[min(indexes) + 1 :]:
        if event.pubkey != asker or read_threading(event).parent_id not in answering:
            continue
        delegation = event.tag_value(TAG_DELEGATION)
        if delegation is None:  # the asker's reply: a finished run
            found.clear()
        elif delegation == thread_id and event.content == message and event.id not in served:
            found.append(event)
    return found[0] if found else None


def _saved_answer(
    conversation: Conversation, request: NostrEvent, asked: str, thread_id: str
) -> NostrEvent | None:
    """The answer of ``asked`` (a public key) to ``request`` saved in the thread, if any."""
    start = conversation.index_of(request.id)
    for event in conversation.history[(start or 0) + 1 :]:
        if (
            event.pubkey == asked
            and event.tag_value(TAG_DELEGATION) == thread_id
            and read_threading(event).parent_id == request.id
        ):
            return event
    return None


def _refused_stopped(cid: str, asker: Agent, asked: Agent) -> NotAskedError:
    """The refusal of a call asking an agent a person stopped (logged): it is not asked."""
    log.info("delegation_refused_stopped", conversation_id=cid, asker=asker.slug, asked=asked.slug)
    return NotAskedError(f"{asked.slug} was stopped (a person stopped it): ask it nothing more now")


def _lost_pairs(
    conversation: Conversation, thread: ConversationThread, asker: Agent, asked: Agent
) -> list[dict[str, Any]]:
    """The items of the exchanges saved in history under the thread that it lacks, in history order: each
    request (by either agent of the pair) with its answer, the first reply of the other agent to it (as
    :func:`_saved_answer` finds it). A request without one (stopped, being answered) or whose answer is an
    error (a failed answer never enters the thread) gives none."""
    held = {item.get("event_id") for item in thread.items if isinstance(item, dict)} - {None}
    sides = {asker.pubkey: (asker, asked), asked.pubkey: (asked, asker)}
    requests: dict[str, NostrEvent] = {}
    answers: dict[str, NostrEvent] = {}
    for event in conversation.history:
        if event.tag_value(TAG_DELEGATION) != thread.thread_id or event.pubkey not in sides:
            continue
        parent = read_threading(event).parent_id
        request = requests.get(parent) if parent is not None else None
        if request is None:
            requests[event.id] = event
        elif event.pubkey != request.pubkey:
            answers.setdefault(request.id, event)
    items: list[dict[str, Any]] = []
    for request in requests.values():
        answer = answers.get(request.id)
        if request.id in held or answer is None or answer.has_tag(TAG_ERROR, ERROR_SYSTEM):
            continue
        author, other = sides[request.pubkey]
        items += [_item(author, other, request), _item(other, author, answer)]
    return items


def _item(author: Agent, other: Agent, event: NostrEvent) -> dict[str, Any]:
    """One thread item (a JSON value): who said what to whom, and the event that carried it."""
    return {"from": author.slug, "to": other.slug, "content": event.content, "event_id": event.id}


class RunDelegator:
    """The :class:`~tenex_daemon.services.tools.Delegator` of one agent's run."""

    def __init__(
        self, delegation: Delegation, asker: Agent, conversation_id: str, trigger: NostrEvent,
        burst: tuple[str, ...] = (),
    ) -> None:
        self._delegation = delegation
        self._asker = asker
        self._conversation_id = conversation_id
        self._trigger = trigger
        self._burst = burst
        self._served: set[str] = set()
        """The requests this run's calls took (made, or taken from an earlier try of the run)."""

    async def send(self, to: str, message: str) -> str:
        """Ask the agent ``to`` and return its answer (refusals raise ToolRefusedError)."""
        return await self._delegation.exchange(
            self._asker, self._conversation_id, self._trigger, to, message, self._served, self._burst
        )
