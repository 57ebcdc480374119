"""``POST /api/v1/conversations/{id}/stop``: the owner stops the agents working on a conversation through
the control API (the daemon's pipeline, with a model that holds its answer)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tenex_daemon import ConversationManager
from tenex_daemon.app.control_api import create_app
from tenex_daemon.app.metrics import Metrics
from tenex_daemon.app.wiring import Pipeline
from tenex_daemon.core.stops import STOPS_KEY
from tenex_daemon.testing.fakes import StuckBackend
from tests import pipeline
from tests.conftest import Cast


@dataclass
class DaemonTarget:
    """A ControlTarget that runs a pipeline, as the daemon does."""

    pipeline: Pipeline
    metrics: Metrics = field(default_factory=Metrics)

    @property
    def manager(self) -> ConversationManager:
        """The pipeline's manager."""
        return self.pipeline.manager

    def status(self) -> dict[str, Any]:
        """A fixed status."""
        return {"state": "running"}


@dataclass
class Running:
    """A rig whose Alice is stuck answering the root of a conversation, and a client on its API."""

    rig: pipeline.Rig
    client: TestClient[Any, Any]
    root_id: str


@pytest.fixture
async def running(cast: Cast) -> AsyncIterator[Running]:
    """Alice thinks (forever) about a new conversation; the control API serves the pipeline."""
    backend = StuckBackend()
    rig = pipeline.build_rig(cast, backend=backend)
    root = cast.user_says("Write the report", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.dispatcher.handle(root)
    await asyncio.wait_for(backend.asked.wait(), 5)
    async with TestClient(TestServer(create_app(DaemonTarget(rig.pipeline)))) as client:
        yield Running(rig, client, root.id)
    await rig.settle(0.5)


async def test_stop_cancels_the_runs_and_answers_with_the_agents_and_the_notice(
    running: Running, cast: Cast
) -> None:
    """POST stop cancels Alice's run and answers with the agents stopped and the notice's id; the stop is
    recorded as the owner's; a second stop finds nothing to stop."""
    response = await running.client.post(f"/api/v1/conversations/{running.root_id}/stop")
    body = await response.json()
    again = await (await running.client.post(f"/api/v1/conversations/{running.root_id}/stop")).json()

    assert response.status == 200
    assert body["stopped"] == ["alice"]
    await running.rig.quiet()
    assert [e.id for e in running.rig.publisher.published] == [body["notice"]]
    assert again == {"id": running.root_id, "stopped": [], "notice": None}
    conversation = await running.rig.manager.get_conversation(running.root_id)
    assert conversation is not None
    assert [s["by"] for s in conversation.metadata.extra[STOPS_KEY]] == ["owner", "owner"]


async def test_stop_of_another_agent_leaves_the_run_alone(running: Running) -> None:
    """A stop naming Bob (who does not run) stops nothing: Alice's run goes on."""
    response = await running.client.post(
        f"/api/v1/conversations/{running.root_id}/stop", json={"agent": "bob"}
    )

    assert (await response.json())["stopped"] == []
    assert running.rig.scheduler.in_flight == 1


async def test_stop_errors_are_json(running: Running) -> None:
    """An unknown agent or conversation is 404, a malformed body 400, a target without agents 503."""
    path = f"/api/v1/conversations/{running.root_id}/stop"
    unknown_agent = await running.client.post(path, json={"agent": "nobody"})
    unknown = await running.client.post(f"/api/v1/conversations/{'f' * 64}/stop")
    malformed = await running.client.post(path, json={"agent": 7})

    assert unknown_agent.status == 404
    assert unknown.status == 404
    assert malformed.status == 400
    assert "error" in await malformed.json()
    assert running.rig.scheduler.in_flight == 1


async def test_stop_without_a_pipeline_is_503(manager: ConversationManager) -> None:
    """A target that runs no agents answers 503 to a stop."""

    @dataclass
    class Plain:
        manager: ConversationManager
        metrics: Metrics = field(default_factory=Metrics)

        def status(self) -> dict[str, Any]:
            return {}

    async with TestClient(TestServer(create_app(Plain(manager)))) as client:
        response = await client.post(f"/api/v1/conversations/{'a' * 64}/stop")

    assert response.status == 503


async def test_the_owners_archive_stops_the_conversations_runs_first(running: Running, cast: Cast) -> None:
    """POST archive while Alice thinks stops her run first (as a stop: recorded, one notice, saved before the
    archive), then archives: no run is left to fail saving its answer into a read-only conversation."""
    response = await running.client.post(f"/api/v1/conversations/{running.root_id}/archive")
    await running.rig.quiet()

    assert response.status == 200
    assert running.rig.scheduler.in_flight == 0
    conversation = await running.rig.manager.get_conversation(running.root_id)
    assert conversation is not None
    assert conversation.archived
    assert [e.content for e in conversation.history[1:]] == ["Stopped: Alice."]
    assert [s["agents"] for s in conversation.metadata.extra[STOPS_KEY]] == [["alice"]]


async def test_delete_forgets_the_conversations_agent_threads_held_in_memory(running: Running, cast: Cast) -> None:
    """DELETE drops the conversation's cached agent-to-agent threads too (as retention's deletion does):
    what was said in a deleted conversation is not kept in memory, nor saved again by a later write."""
    threads = running.rig.pipeline.threads
    thread = await threads.get_thread(running.root_id, "alice", "bob")
    await threads.add_items_and_save(thread, [{"role": "user", "content": "between us"}])
    await running.client.post(f"/api/v1/conversations/{running.root_id}/stop")

    response = await running.client.delete(f"/api/v1/conversations/{running.root_id}")

    assert response.status == 200
    assert thread.thread_id not in threads.cached()
