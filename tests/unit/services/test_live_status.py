"""The live status (kind 24133, docs/PROTOCOL.md): told by the scheduler as runs start and end, it says
which agents work on a conversation now, for its root and its person; best effort, never in a run's way."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from tenex_daemon import MemoryStore
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.llm import CompletionRequest, CompletionResult
from tenex_daemon.services import runs
from tenex_daemon.services.live_status import LiveStatus
from tenex_daemon.services.runs import RunRequest
from tests import pipeline
from tests.conftest import Cast
from tests.unit.services.test_run_retries import outbox_fails_once_for


class GatedBackend:
    """Holds every answer until released; records the requests."""

    name = "gated"

    def __init__(self) -> None:
        self.requests: list[CompletionRequest] = []
        self.asked = asyncio.Event()
        self.release = asyncio.Event()

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Answer once released."""
        self.requests.append(request)
        self.asked.set()
        await self.release.wait()
        return CompletionResult(text=f"answer {len(self.requests)}", model="gated")


@dataclass
class StatusLog:
    """Records each status as (conversation, root, person, agent pubkeys); fails while ``fail`` is set."""

    sent: list[tuple[str, str, str | None, tuple[str, ...]]] = field(default_factory=list)
    fail: bool = False
    gate: asyncio.Event | None = None

    async def working(
        self, conversation_id: str, root_id: str, person: str | None, agents: tuple[str, ...]
    ) -> None:
        """Record the status (after ``gate`` opens, when set)."""
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise RuntimeError("no relay took it")
        self.sent.append((conversation_id, root_id, person, agents))


async def test_a_run_publishes_its_agent_at_start_and_nobody_at_its_end(cast: Cast) -> None:
    """While Alice answers, the conversation's status names the root, the person and Alice; once her
    reply is out it names nobody."""
    backend = GatedBackend()
    status = StatusLog()
    rig = pipeline.build_rig(cast, backend=backend, status=status)
    live = rig.pipeline.live_status
    assert live is not None
    root = cast.user_says("Write the report", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(backend.asked.wait(), 5)
    await live.flush(5)

    assert status.sent == [(root.id, root.id, cast.user.pubkey, (cast.alice.pubkey,))]
    assert live.working(root.id) == ("alice",)

    backend.release.set()
    await rig.settle()
    await live.flush(5)

    assert status.sent[-1] == (root.id, root.id, cast.user.pubkey, ())
    assert len(status.sent) == 2
    assert live.working(root.id) == ()


async def test_the_root_is_named_never_the_trigger_and_a_stop_publishes_idle(cast: Cast) -> None:
    """A run for a reply deep in a conversation names the conversation's root (not the reply); when the
    owner stops it, the status names nobody."""
    backend = GatedBackend()
    status = StatusLog()
    rig = pipeline.build_rig(cast, backend=backend, status=status)
    live = rig.pipeline.live_status
    assert live is not None
    root = cast.user_says("Write the report", kind=11, tags=[["p", cast.bob.pubkey]])
    await rig.manager.create_conversation(root)
    reply = cast.user_says(
        "Alice, you do it", tags=[["E", root.id, "", root.pubkey], ["K", "11"], ["p", cast.alice.pubkey]]
    )
    await rig.dispatcher.handle(reply)
    await asyncio.wait_for(backend.asked.wait(), 5)
    stop = cast.factory.event(cast.user, "", kind=24134, tags=[["e", root.id]])

    await rig.dispatcher.handle(stop)
    await rig.settle()
    await live.flush(5)

    assert [(s[1], s[3]) for s in status.sent] == [(root.id, (cast.alice.pubkey,)), (root.id, ())]


async def test_a_status_that_cannot_be_published_never_touches_the_run(cast: Cast) -> None:
    """When every status publication fails, the run still answers and nothing waits for the status."""
    backend = GatedBackend()
    backend.release.set()
    status = StatusLog(fail=True)
    rig = pipeline.build_rig(cast, backend=backend, status=status)
    root = cast.user_says("Write the report", kind=11, tags=[["p", cast.alice.pubkey]])

    await rig.dispatcher.handle(root)
    await rig.settle()

    assert [e.content for e in rig.publisher.published] == ["answer 1"]
    assert status.sent == []


async def test_changes_made_while_a_status_is_in_flight_go_out_together_and_in_order(cast: Cast) -> None:
    """Statuses of one conversation go out one at a time: the changes made while one is in flight are sent
    together by the next, so the last status sent is the current one."""
    gate = asyncio.Event()
    status = StatusLog(gate=gate)
    rig = pipeline.build_rig(cast, status=status)
    root = cast.user_says("Write the report", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.manager.create_conversation(root)
    live = LiveStatus(rig.manager, status)
    alice, bob = RunRequest(root.id, root.id, "alice"), RunRequest(root.id, root.id, "bob")

    live.run_started(alice)
    await asyncio.sleep(0.01)  # the first status is in flight, held by the gate
    live.run_started(bob)
    live.run_ended(alice)
    live.run_ended(bob)
    gate.set()
    await live.flush(5)

    assert [s[3] for s in status.sent] == [(cast.alice.pubkey,), ()]
    await rig.settle()


async def test_a_private_conversations_status_is_never_published(cast: Cast) -> None:
    """Nothing of a private conversation (NIP-17) goes out in the clear: its runs publish no status."""
    status = StatusLog()
    rig = pipeline.build_rig(cast, status=status)
    rumor = cast.user_says("Just between us", kind=14, tags=[["p", cast.alice.pubkey]])
    await rig.manager.create_conversation(rumor)
    live = LiveStatus(rig.manager, status)
    request = RunRequest(rumor.id, rumor.id, "alice")

    live.run_started(request)
    live.run_ended(request)
    await live.flush(5)

    assert status.sent == []
    assert live.published == 0
    await rig.settle()


async def test_closing_cancels_a_status_that_hangs(cast: Cast) -> None:
    """On stop, a status publication that never ends is waited for a moment, then cancelled: no task is
    left behind."""
    status = StatusLog(gate=asyncio.Event())  # never opened
    rig = pipeline.build_rig(cast, status=status)
    root = cast.user_says("Write the report", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.manager.create_conversation(root)
    live = LiveStatus(rig.manager, status)
    live.run_started(RunRequest(root.id, root.id, "alice"))

    await live.close(0.05)

    assert await live.flush(0) == 0
    assert status.sent == []
    await rig.settle()


class SlowSaveStore(MemoryStore):
    """A store whose saves of an agent's reply wait for ``release`` (a commit taking its time)."""

    def __init__(self, agent_pubkey: str) -> None:
        super().__init__()
        self.agent_pubkey = agent_pubkey
        self.saving = asyncio.Event()
        self.release = asyncio.Event()

    async def append_event(
        self, conversation_id: str, event: NostrEvent, *, state: Conversation | None = None
    ) -> bool:
        """Hold the agent's reply until released."""
        if event.pubkey == self.agent_pubkey:
            self.saving.set()
            await self.release.wait()
        return await super().append_event(conversation_id, event, state=state)


async def test_the_working_status_does_not_wait_for_the_reply_to_be_saved(cast: Cast) -> None:
    """A run whose answer comes at once reaches its reply's save before anything else runs; the status
    saying its agent works goes out while that save is under way (it does not wait for the lock the
    save holds), so it comes before the reply rather than with it."""
    store = SlowSaveStore(cast.alice.pubkey)
    status = StatusLog()
    rig = pipeline.build_rig(cast, store=store, status=status)
    live = rig.pipeline.live_status
    assert live is not None
    root = cast.user_says("Write the report", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(store.saving.wait(), 5)

    await asyncio.wait_for(live.flush(5), 5)
    assert status.sent == [(root.id, root.id, cast.user.pubkey, (cast.alice.pubkey,))]

    store.release.set()
    await rig.settle()
    await live.flush(5)
    assert status.sent[-1] == (root.id, root.id, cast.user.pubkey, ())


def retrying_rig(
    cast: Cast, monkeypatch: pytest.MonkeyPatch, retry_s: float
) -> tuple[pipeline.Rig, LiveStatus, StatusLog]:
    """The pipeline, its live status and the statuses published, with runs tried again after ``retry_s``
    and a backend that answers at once."""
    monkeypatch.setattr(runs, "RUN_RETRY_S", (retry_s, retry_s))
    backend = GatedBackend()
    backend.release.set()
    status = StatusLog()
    rig = pipeline.build_rig(cast, backend=backend, status=status)
    live = rig.pipeline.live_status
    assert live is not None
    return rig, live, status


async def test_a_run_waiting_to_try_again_still_works_and_ends_after_its_last_try(
    cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alice's first try fails (her reply's outbox write: the store gone for a moment) and waits to try again:
    the status keeps naming her through the wait, with no idle status between the tries, and names nobody
    once the second try has answered."""
    rig, live, status = retrying_rig(cast, monkeypatch, 0.3)
    failed = outbox_fails_once_for(rig, "answer 1", monkeypatch)
    root = cast.user_says("Write the report", kind=11, tags=[["p", cast.alice.pubkey]])

    await rig.dispatcher.handle(root)
    await asyncio.wait_for(failed.wait(), 5)
    await asyncio.sleep(0.1)
    await live.flush(5)
    assert live.working(root.id) == ("alice",)

    await rig.settle()
    await live.flush(5)

    assert [e.content for e in rig.publisher.published] == ["answer 1"]
    assert [s[3] for s in status.sent] == [(cast.alice.pubkey,), ()]


async def test_a_stop_while_a_run_waits_to_try_again_publishes_idle(
    cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alice's try fails before saving anything and waits 30 s to try again; the owner's stop then ends her
    run, and the status names nobody at once."""
    rig, live, status = retrying_rig(cast, monkeypatch, 30.0)
    failing = asyncio.Event()

    async def gone(*args: object, **kwargs: object) -> None:
        failing.set()
        raise ConnectionResetError("the store went away for a moment")

    monkeypatch.setattr(rig.manager, "append_reply", gone)
    root = cast.user_says("Write the report", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(failing.wait(), 5)
    await asyncio.sleep(0.1)
    await live.flush(5)
    assert live.working(root.id) == ("alice",)

    await rig.dispatcher.stop(root.id, None, by="owner")
    await live.flush(5)

    assert live.working(root.id) == ()
    assert [s[3] for s in status.sent] == [(cast.alice.pubkey,), ()]


async def test_a_burst_that_answers_a_run_waiting_to_try_again_leaves_nobody_working(
    cast: Cast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alice's first try fails before saving and waits 30 s to try again; a second message's run answers both
    in a burst: once it has answered, the status names nobody, without waiting for the first run's turn."""
    rig, live, status = retrying_rig(cast, monkeypatch, 30.0)
    append_reply = rig.manager.append_reply
    failing = asyncio.Event()

    async def gone_once(*args: Any, **kwargs: Any) -> Any:
        if not failing.is_set():
            failing.set()
            raise ConnectionResetError("the store went away for a moment")
        return await append_reply(*args, **kwargs)

    monkeypatch.setattr(rig.manager, "append_reply", gone_once)
    root = cast.user_says("Write the report", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(failing.wait(), 5)
    second = cast.user_says(
        "and the summary", tags=[["E", root.id, "", root.pubkey], ["K", "11"], ["p", cast.alice.pubkey]]
    )
    await rig.dispatcher.handle(second)
    for _ in range(100):
        if rig.publisher.published:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.1)
    await live.flush(5)

    assert [e.content for e in rig.publisher.published] == ["answer 2"]
    assert live.working(root.id) == ()
    assert status.sent[-1][3] == ()
    await rig.dispatcher.stop(root.id, None, by="owner")
