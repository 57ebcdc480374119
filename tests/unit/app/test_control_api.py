"""The control API: every endpoint against a real ConversationManager over a MemoryStore, errors as JSON."""

from __future__ import annotations

import json
import os
import socket
import stat
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from tenex_daemon import ConversationManager, NostrEvent
from tenex_daemon.app.control.errors import ApiError
from tenex_daemon.app.control.parsing import parse_search
from tenex_daemon.app.control.views import preview_context
from tenex_daemon.app.control_api import ControlServer, ControlSocketInUseError, create_app, openapi_document
from tenex_daemon.app.metrics import Metrics
from tenex_daemon.core.budget import TokenBudget, estimate_tokens
from tenex_daemon.core.errors import StoreUnavailableError
from tenex_daemon.core.phases import Phase, PhaseRules
from tenex_daemon.core.routing_budget import ROUTING_NOTE_KEY, routing_note
from tenex_daemon.core.vocabulary import KIND_TASK
from tenex_daemon.services.lifecycle import task_meta_key
from tenex_daemon.services.persona import PersonaSpec
from tests.conftest import Cast


@dataclass
class FakeTarget:
    """A ControlTarget: the manager, metrics and a fixed status."""

    manager: ConversationManager
    metrics: Metrics = field(default_factory=Metrics)
    data: dict[str, Any] = field(default_factory=lambda: {"state": "running", "pid": 1, "relays": []})

    def status(self) -> dict[str, Any]:
        """Return the fixed status."""
        return self.data


@dataclass
class World:
    """Conversations the tests read: a chat with three events and a task with a reply."""

    root: NostrEvent
    alice_reply: NostrEvent
    bob_reply: NostrEvent
    task: NostrEvent
    task_reply: NostrEvent


@pytest.fixture
async def world(cast: Cast, manager: ConversationManager) -> World:
    """A chat conversation (user, Alice, Bob) and a task conversation."""
    root = cast.user_says("Plan the release", kind=11, tags=[["title", "Release plan"], ["p", cast.alice.pubkey]])
    await manager.create_conversation(root)
    alice_reply = cast.alice_says("Here is a plan", tags=[["E", root.id], ["K", "11"], ["p", cast.user.pubkey]])
    await manager.add_event(root.id, alice_reply)
    bob_reply = cast.user_says("Bob, check it", tags=[["E", root.id], ["K", "11"], ["p", cast.bob.pubkey]])
    await manager.add_event(root.id, bob_reply)
    task = cast.user_says("Write the changelog", kind=KIND_TASK, tags=[["p", cast.bob.pubkey]])
    await manager.create_conversation(task, task_id=task.id)
    task_reply = cast.bob_says("Done", tags=[["E", task.id], ["K", str(KIND_TASK)]])
    await manager.add_event(task.id, task_reply)
    return World(root, alice_reply, bob_reply, task, task_reply)


@pytest.fixture
def target(manager: ConversationManager) -> FakeTarget:
    """The fake daemon."""
    return FakeTarget(manager)


@pytest.fixture
async def client(target: FakeTarget) -> AsyncIterator[TestClient[Any, Any]]:
    """An HTTP client on the control API app (served on 127.0.0.1)."""
    async with TestClient(TestServer(create_app(target))) as test_client:
        yield test_client


async def get_json(client: TestClient[Any, Any], path: str, status: int = 200, **params: str) -> Any:
    """GET a path, assert the status and JSON content type, return the body."""
    response = await client.get(path, params=params)
    assert response.status == status, await response.text()
    assert response.content_type == "application/json"
    return await response.json()


async def test_openapi_document_lists_every_endpoint(client: TestClient[Any, Any]) -> None:
    """GET /api/v1/openapi.json is an OpenAPI 3 document naming every path."""
    doc = await get_json(client, "/api/v1/openapi.json")
    assert doc["openapi"].startswith("3.")
    assert set(doc["paths"]) >= {
        "/api/v1/status", "/api/v1/conversations", "/api/v1/conversations/{id}",
        "/api/v1/conversations/{id}/reset", "/api/v1/conversations/{id}/context",
        "/api/v1/tasks/{id}/conversation", "/metrics",
    }
    assert set(doc["paths"]["/api/v1/conversations/{id}"]) == {"get", "delete"}


def test_openapi_document_is_3_0_and_names_every_status_a_route_answers() -> None:
    """The document declares 3.0.3, so no schema's type is a list (3.1's way of saying nullable); every
    operation names 401/403 (TCP) and 503 (the store unreachable), every POST 413, and the context its 409."""
    doc = openapi_document()

    def types(node: object) -> list[object]:
        if isinstance(node, dict):
            found = [node["type"]] if "type" in node else []
            return found + [t for value in node.values() for t in types(value)]
        if isinstance(node, list):
            return [t for value in node for t in types(value)]
        return []

    assert doc["openapi"] == "3.0.3"
    assert all(isinstance(t, str) for t in types(doc))
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            assert {"401", "403", "503"} <= set(operation["responses"]), (method, path)
            if method == "post":
                assert "413" in operation["responses"], path
    assert "409" in doc["paths"]["/api/v1/conversations/{id}/context"]["get"]["responses"]
    assert doc["security"] == [{}, {"tcpToken": []}]


def test_openapi_document_describes_exactly_the_served_routes(target: FakeTarget) -> None:
    """Every (method, path) the app routes is in the OpenAPI document, and the document names no other."""
    app = create_app(target)
    served = {
        (route.method.lower(), route.resource.canonical)
        for route in app.router.routes()
        if route.method != "HEAD" and route.resource is not None
    }
    documented = {
        (method, path) for path, operations in openapi_document()["paths"].items() for method in operations
    }

    assert served == documented


async def test_status_is_the_targets_snapshot(client: TestClient[Any, Any], target: FakeTarget) -> None:
    """GET /api/v1/status returns target.status()."""
    assert await get_json(client, "/api/v1/status") == target.data


async def test_list_and_filters(client: TestClient[Any, Any], world: World, cast: Cast) -> None:
    """GET /api/v1/conversations searches by id prefix (any case), title, phase, archived, participant
    (npub), dates and limit."""
    everything = await get_json(client, "/api/v1/conversations")
    assert everything["count"] == 2
    assert {row["id"] for row in everything["conversations"]} == {world.root.id, world.task.id}
    by_prefix = await get_json(client, "/api/v1/conversations", id_prefix=world.root.id[:5].upper())
    assert [row["id"] for row in by_prefix["conversations"]] == [world.root.id]
    by_title = await get_json(client, "/api/v1/conversations", title="release")
    assert [row["id"] for row in by_title["conversations"]] == [world.root.id]
    by_alice = await get_json(client, "/api/v1/conversations", participant=cast.alice_keys.npub)
    assert [row["id"] for row in by_alice["conversations"]] == [world.root.id]
    assert (await get_json(client, "/api/v1/conversations", phase="plan"))["count"] == 0
    assert (await get_json(client, "/api/v1/conversations", archived="true"))["count"] == 0
    assert (await get_json(client, "/api/v1/conversations", limit="1"))["count"] == 1
    assert (await get_json(client, "/api/v1/conversations", date_from="2000-01-01", date_to="2999-01-01"))[
        "count"
    ] == 2


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({"phase": "dancing"}, "phase must be one of"),
        ({"limit": "0"}, "limit"),
        ({"limit": "ten"}, "limit"),
        ({"archived": "maybe"}, "archived"),
        ({"date_from": "yesterday"}, "date_from"),
        ({"participant": "bob"}, "participant"),
        ({"colour": "red"}, "unknown parameter"),
        ({"id_prefix": "xyz"}, "id_prefix must be 1 to 64 hex characters"),
        ({"id_prefix": "a" * 65}, "id_prefix"),
    ],
)
async def test_bad_search_parameters_are_400_json(
    client: TestClient[Any, Any], params: dict[str, str], fragment: str
) -> None:
    """Each malformed search parameter gives 400 with a JSON error naming it."""
    body = await get_json(client, "/api/v1/conversations", 400, **params)
    assert fragment in body["error"]


async def test_get_conversation_in_full(client: TestClient[Any, Any], world: World, cast: Cast) -> None:
    """GET /api/v1/conversations/{id} has summary, history, agent states, phase, transitions and turns."""
    data = await get_json(client, f"/api/v1/conversations/{world.root.id}")
    assert data["id"] == world.root.id
    assert data["title"] == "Release plan"
    assert data["phase"] == "chat"
    assert [e["id"] for e in data["history"]] == [world.root.id, world.alice_reply.id, world.bob_reply.id]
    assert data["history"][0] == world.root.to_dict()
    assert data["summary"]["event_count"] == 3
    assert data["transitions"] == []
    assert data["turns"] == []
    assert data["agent_states"] == {}
    assert data["is_task"] is False
    assert data["private"] is False


async def test_bad_and_unknown_ids_are_400_and_404(client: TestClient[Any, Any]) -> None:
    """A malformed id gives 400, an unknown one 404, both as JSON errors; so does an unknown route."""
    for path in ("/api/v1/conversations/xyz", "/api/v1/conversations/" + "A" * 64, "/api/v1/tasks/12/conversation"):
        body = await get_json(client, path, 400)
        assert "64 lowercase hex" in body["error"]
    for path in ("/api/v1/conversations/" + "0" * 64, "/api/v1/tasks/" + "0" * 64 + "/conversation"):
        assert "error" in await get_json(client, path, 404)
    response = await client.delete("/api/v1/conversations/" + "0" * 64)
    assert response.status == 404
    assert "not found" in (await response.json())["error"]
    assert "error" in await get_json(client, "/api/v1/nothing", 404)


async def test_delete_removes_but_keeps_event_ids_processed(
    client: TestClient[Any, Any], world: World, manager: ConversationManager
) -> None:
    """DELETE removes the conversation; its events stay processed so relays cannot bring it back."""
    response = await client.delete(f"/api/v1/conversations/{world.root.id}")
    assert response.status == 200
    assert await response.json() == {"id": world.root.id, "deleted": True}
    await get_json(client, f"/api/v1/conversations/{world.root.id}", 404)
    assert await manager.store.is_processed(world.alice_reply.id)


async def test_reset_clears_agent_states_and_keeps_history(
    client: TestClient[Any, Any], world: World, manager: ConversationManager, cast: Cast
) -> None:
    """POST reset forgets sessions and indexes (0, or 1 with keep_system_message); history stays whole."""
    trigger = world.bob_reply.model_copy()
    await manager.update_agent_state(world.root.id, "alice", last_processed_index=2, session_id="s-1")
    await manager.build_agent_messages(world.root.id, "bob", trigger)
    response = await client.post(f"/api/v1/conversations/{world.root.id}/reset", json={"keep_system_message": False})
    assert response.status == 200
    assert await response.json() == {"id": world.root.id, "reset_agents": ["alice", "bob"], "keep_system_message": False}
    data = await get_json(client, f"/api/v1/conversations/{world.root.id}")
    assert data["agent_states"]["alice"] == {
        "last_processed_index": 0, "session_id": None, "transitions_seen": 0, "prompt_tokens": 0, "completion_tokens": 0,
        "summary": None, "summary_covers": 0,
    }
    assert len(data["history"]) == 3
    response = await client.post(f"/api/v1/conversations/{world.root.id}/reset", json={"keep_system_message": True})
    assert (await response.json())["keep_system_message"] is True
    data = await get_json(client, f"/api/v1/conversations/{world.root.id}")
    assert {s["last_processed_index"] for s in data["agent_states"].values()} == {1}
    empty_body = await client.post(f"/api/v1/conversations/{world.root.id}/reset")
    assert empty_body.status == 200
    bad = await client.post(f"/api/v1/conversations/{world.root.id}/reset", json={"keep_system_message": "yes"})
    assert bad.status == 400
    not_json = await client.post(f"/api/v1/conversations/{world.root.id}/reset", data=b"{oops")
    assert not_json.status == 400


async def test_archive_restore_and_archived_reset_conflict(client: TestClient[Any, Any], world: World) -> None:
    """archive makes a conversation read-only (reset answers 409), restore undoes it."""
    assert (await client.post(f"/api/v1/conversations/{world.root.id}/archive")).status == 200
    assert (await get_json(client, "/api/v1/conversations", archived="true"))["count"] == 1
    conflict = await client.post(f"/api/v1/conversations/{world.root.id}/reset")
    assert conflict.status == 409
    assert "archived" in (await conflict.json())["error"]
    assert (await client.post(f"/api/v1/conversations/{world.root.id}/restore")).status == 200
    assert (await get_json(client, "/api/v1/conversations", archived="true"))["count"] == 0


async def test_a_repeated_archive_or_restore_answers_409_and_changes_nothing(
    client: TestClient[Any, Any], world: World, manager: ConversationManager
) -> None:
    """Archiving an archived conversation, or restoring one that is not archived, answers 409 saying which,
    as a second end does, and leaves the conversation as it was."""
    path = f"/api/v1/conversations/{world.root.id}"
    not_archived = await client.post(f"{path}/restore")
    assert not_archived.status == 409
    assert "is not archived" in (await not_archived.json())["error"]
    assert (await client.post(f"{path}/archive")).status == 200
    again = await client.post(f"{path}/archive")
    assert again.status == 409
    assert "is archived already" in (await again.json())["error"]
    conversation = await manager.get_conversation(world.root.id)
    assert conversation is not None
    assert conversation.archived


async def test_the_owners_archive_ends_an_active_conversation_first(
    client: TestClient[Any, Any], world: World, manager: ConversationManager
) -> None:
    """Archiving an active conversation ends it first, by the owner for the reason ``archived``, so an
    archived conversation counts as ended (retention may delete it, its description says ended)."""
    assert (await client.post(f"/api/v1/conversations/{world.root.id}/archive")).status == 200

    conversation = await manager.get_conversation(world.root.id)
    assert conversation is not None
    assert conversation.archived
    assert (conversation.is_ended, conversation.ended_by, conversation.end_reason) == (True, "owner", "archived")


async def test_context_is_what_the_agent_would_get_and_changes_nothing(
    client: TestClient[Any, Any], world: World, manager: ConversationManager
) -> None:
    """GET context equals the next build_agent_messages for that trigger, and leaves the agent's state alone."""
    preview = await get_json(client, f"/api/v1/conversations/{world.root.id}/context", agent="bob")
    assert preview["trigger"] == world.bob_reply.id
    assert preview["last_processed_index"] == 0
    conversation = await manager.get_conversation(world.root.id)
    assert conversation is not None
    assert "bob" not in conversation.agent_states
    again = await get_json(client, f"/api/v1/conversations/{world.root.id}/context", agent="bob")
    assert again == preview
    built = await manager.build_agent_messages(world.root.id, "bob", world.bob_reply)
    assert preview["messages"] == [{"role": m.role, "content": m.content} for m in built.messages]
    assert preview["next_last_processed_index"] == built.last_processed_index
    contents = [m["content"] for m in preview["messages"]]
    assert any("=== MESSAGES WHILE YOU WERE AWAY ===" in c for c in contents)
    assert "=== NEW INTERACTION ===" in contents


def test_a_date_alone_given_to_date_to_is_the_whole_day() -> None:
    """`date_to=2026-11-25` (or `to=`) reaches the end of that UTC day, the last day there is too (no
    overflow); a moment given is kept as is."""
    end_of_day = datetime(2026, 11, 25, 23, 59, 59, 999_000, tzinfo=UTC)
    assert parse_search({"to": "2026-11-25"})["date_to"] == end_of_day
    assert parse_search({"date_to": " 2026-11-25 "})["date_to"] == end_of_day
    assert parse_search({"date_to": "2026-11-25T10:00:00Z"})["date_to"] == datetime(2026, 11, 25, 10, tzinfo=UTC)
    assert parse_search({"date_from": "2026-11-25"})["date_from"] == datetime(2026, 11, 25, tzinfo=UTC)
    assert parse_search({"to": "9999-12-31"})["date_to"] == datetime(9999, 12, 31, 23, 59, 59, 999_000, tzinfo=UTC)


def test_a_search_by_phase_accepts_the_projects_phases_only() -> None:
    """A phase the project added is a filter like a built-in one, and the seven built in stay filters (stored
    conversations may be in one the project's table leaves out); another name is a 400 naming those there are."""
    phases = PhaseRules({"chat": ["review"], "review": ["chat"]}).phases
    assert parse_search({"phase": " Review "}, phases) == {"phase": Phase("review")}
    assert parse_search({"phase": "plan"}, phases) == {"phase": Phase.PLAN}
    with pytest.raises(ApiError) as refused:
        parse_search({"phase": "dance"}, phases)
    assert refused.value.message == (
        "phase must be one of chat, brainstorm, plan, execute, verification, chores, reflection, review, "
        "got 'dance'"
    )


async def test_context_by_default_answers_the_newest_event_the_agent_did_not_write(
    client: TestClient[Any, Any], world: World
) -> None:
    """Without trigger=, the preview answers the newest event the agent did not write: an agent's own reply
    never triggers it (Bob's "Done" is the task's newest event; Bob is shown the task)."""
    preview = await get_json(client, f"/api/v1/conversations/{world.task.id}/context", agent="bob")
    assert preview["trigger"] == world.task.id


async def test_context_with_an_explicit_trigger_and_its_errors(client: TestClient[Any, Any], world: World) -> None:
    """trigger= picks the event responded to; a missing agent is 400, unknown agent or trigger 404."""
    path = f"/api/v1/conversations/{world.root.id}/context"
    first = await get_json(client, path, agent="alice", trigger=world.root.id)
    assert first["trigger"] == world.root.id
    assert first["messages"][-1] == {"role": "user", "content": "Plan the release"}
    assert [m["content"] for m in first["messages"]].count("Plan the release") == 1
    assert "agent" in (await get_json(client, path, 400))["error"]
    assert "unknown agent" in (await get_json(client, path, 404, agent="zed"))["error"]
    assert "not in conversation" in (await get_json(client, path, 404, agent="alice", trigger=world.task.id))["error"]
    assert "64 lowercase hex" in (await get_json(client, path, 400, agent="alice", trigger="nope"))["error"]


async def test_task_conversation_by_task_id_or_any_event_in_it(client: TestClient[Any, Any], world: World) -> None:
    """GET /api/v1/tasks/{id}/conversation finds the task's conversation by its root or by a reply in it."""
    by_root = await get_json(client, f"/api/v1/tasks/{world.task.id}/conversation")
    assert by_root["id"] == world.task.id
    assert by_root["is_task"] is True
    by_reply = await get_json(client, f"/api/v1/tasks/{world.task_reply.id}/conversation")
    assert by_reply["id"] == world.task.id


async def test_a_task_conversation_shows_its_expiry_token_count_and_current_session(
    client: TestClient[Any, Any], world: World, manager: ConversationManager, cast: Cast
) -> None:
    """The task's conversation carries expires_at (last activity + the 24 h TTL) and token_count; once a
    newer session is current (the task.<id> small value), the task's URL serves that session."""
    shown = await get_json(client, f"/api/v1/tasks/{world.task.id}/conversation")
    task = await manager.get_conversation(world.task.id)
    assert task is not None
    assert shown["expires_at"] == task.last_activity + 24 * 3_600_000
    assert shown["token_count"] == 0
    assert shown["task_id"] == world.task.id
    later = cast.user_says("Again, please", tags=[["E", world.task.id], ["K", str(KIND_TASK)]])
    await manager.create_conversation(later, task_id=world.task.id, previous_session=world.task.id)
    await manager.store.set_meta(task_meta_key(world.task.id), later.id)

    current = await get_json(client, f"/api/v1/tasks/{world.task.id}/conversation")

    assert current["id"] == later.id
    assert current["previous_session"] == world.task.id


async def test_metrics_endpoint_serves_prometheus_text(client: TestClient[Any, Any], target: FakeTarget) -> None:
    """GET /metrics returns the target's metrics in the text exposition format."""
    target.metrics.event_accepted(11)
    response = await client.get("/metrics")
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/plain")
    assert 'tenexd_events_accepted_total{kind="11"} 1.0' in await response.text()


async def test_requests_answered_with_an_error_are_counted_by_status_and_logged_rationed(
    client: TestClient[Any, Any], target: FakeTarget
) -> None:
    """A request answered with an error (a malformed id, a body that is not JSON, a path that does not exist)
    is counted by its status in ``tenexd_control_errors_total`` and logged (``control_request_failed``) with
    its status and why; a client repeating a bad request logs five lines per status in ten seconds, every one
    counted."""
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        for _ in range(8):
            assert (await client.get("/api/v1/conversations/not-an-id")).status == 400
        assert (await client.post("/api/v1/conversations/rebuild", data=b"{not json")).status == 400
        assert (await client.get("/api/v1/no/such/path")).status == 404
    text = target.metrics.render().decode()
    assert 'tenexd_control_errors_total{status="400"} 9.0' in text
    assert 'tenexd_control_errors_total{status="404"} 1.0' in text
    failed = [entry for entry in logs if entry["event"] == "control_request_failed"]
    assert [entry["status"] for entry in failed] == [400] * 5 + [404]
    assert failed[0]["path"] == "/api/v1/conversations/not-an-id"
    assert failed[0]["error"]


async def test_unix_socket_is_0600_and_serves_the_api(tmp_path: Path, target: FakeTarget) -> None:
    """ControlServer binds a 0600 socket, answers over it, refuses a second server and removes it on stop."""
    path = tmp_path / "run" / "control.sock"
    server = ControlServer(target, path)
    await server.start()
    try:
        assert stat.S_ISSOCK(path.stat().st_mode)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        connector = aiohttp.UnixConnector(path=str(path))
        async with aiohttp.ClientSession(connector=connector) as session, session.get(
            "http://tenexd/api/v1/status"
        ) as response:
            assert response.status == 200
            assert (await response.json())["state"] == "running"
        with pytest.raises(ControlSocketInUseError):
            await ControlServer(target, path).start()
    finally:
        await server.stop()
    assert not path.exists()



async def test_a_stop_cuts_off_a_request_still_being_answered(
    tmp_path: Path, target: FakeTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request whose answer never comes (a rebuild of minutes) does not hold the stop: it is cancelled
    after the few seconds the server gives requests at a stop (aiohttp's default waited 60 s, then 60 more,
    past systemd's stop timeout)."""
    import asyncio

    from tenex_daemon.app.control.server import REQUESTS_AT_STOP_S

    asked = asyncio.Event()

    async def never(**_: object) -> list[object]:
        asked.set()
        await asyncio.Event().wait()
        return []

    monkeypatch.setattr(target.manager, "search_conversations", never)
    path = tmp_path / "control.sock"
    server = ControlServer(target, path)
    await server.start()
    session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(path)))
    request = asyncio.ensure_future(session.get("http://tenexd/api/v1/conversations"))
    try:
        await asyncio.wait_for(asked.wait(), 5)
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.wait_for(server.stop(), 4 * REQUESTS_AT_STOP_S)
        assert loop.time() - started < 4 * REQUESTS_AT_STOP_S
    finally:
        request.cancel()
        await session.close()

async def test_stale_socket_file_is_replaced(tmp_path: Path, target: FakeTarget) -> None:
    """A socket file left by a killed daemon (nobody listening) is removed and bound again."""
    path = tmp_path / "control.sock"
    leftover = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    leftover.bind(str(path))
    leftover.close()
    async with ControlServer(target, path):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


async def test_tcp_is_loopback_only(target: FakeTarget) -> None:
    """tcp_port=0 serves on a free 127.0.0.1 port (with its token); a non-loopback host is refused."""
    async with ControlServer(target, None, tcp_port=0) as server:
        assert server.tcp_address is not None
        host, port = server.tcp_address
        assert host == "127.0.0.1"
        headers = {"Authorization": f"Bearer {server.token}"}
        async with aiohttp.ClientSession(headers=headers) as session, session.get(
            f"http://127.0.0.1:{port}/metrics"
        ) as response:
            assert response.status == 200
    with pytest.raises(ValueError, match="loopback"):
        ControlServer(target, None, tcp_port=0, tcp_host="0.0.0.0")


async def test_end_records_who_and_why_and_refuses_a_second_end(
    client: TestClient[Any, Any], world: World, manager: ConversationManager
) -> None:
    """POST end records ended_at, ended_by owner and the reason (not archived: it stays writable); a second end
    answers 409, a reason that is not a string 400, an unknown conversation 404."""
    ended = await client.post(f"/api/v1/conversations/{world.root.id}/end", json={"reason": "done for today"})

    assert ended.status == 200
    assert (await ended.json())["ended_by"] == "owner"
    conversation = await manager.get_conversation(world.root.id)
    assert conversation is not None
    assert conversation.is_ended
    assert not conversation.archived
    assert conversation.ended_by == "owner"
    assert conversation.end_reason == "done for today"
    assert isinstance(conversation.ended_at, int)
    assert (await client.post(f"/api/v1/conversations/{world.root.id}/end")).status == 409
    bad = await client.post(f"/api/v1/conversations/{world.root.id}/end", json={"reason": 7})
    assert bad.status == 400
    assert (await client.post(f"/api/v1/conversations/{'f' * 64}/end")).status == 404


async def test_a_body_with_a_lone_surrogate_is_400_and_changes_nothing(
    client: TestClient[Any, Any], world: World, manager: ConversationManager
) -> None:
    """A reason JSON escapes as half a UTF-16 pair ("\\udcff", what a client makes of undecodable bytes)
    answers 400 saying so, and the conversation is not ended (it was a 500 after a traceback)."""
    body = b'{"reason": "bad \\udcff"}'
    headers = {"Content-Type": "application/json"}
    answer = await client.post(f"/api/v1/conversations/{world.root.id}/end", data=body, headers=headers)

    assert answer.status == 400
    assert "lone surrogate" in (await answer.json())["error"]
    conversation = await manager.get_conversation(world.root.id)
    assert conversation is not None
    assert not conversation.is_ended


async def test_a_store_that_does_not_answer_is_a_503_saying_so(
    client: TestClient[Any, Any], manager: ConversationManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the store's database is down (StoreUnavailableError), the API answers 503 with the store's own
    words, so the CLI prints why; not 500 "internal error"."""

    async def down(*args: object, **kwargs: object) -> object:
        raise StoreUnavailableError("the PostgreSQL store does not answer: [Errno 111] Connect call failed")

    monkeypatch.setattr(manager, "search_conversations", down)
    response = await client.get("/api/v1/conversations")

    assert response.status == 503
    assert (await response.json())["error"] == (
        "the PostgreSQL store does not answer: [Errno 111] Connect call failed"
    )


async def test_the_orchestrators_preview_is_fitted_to_its_budget_as_it_is_sent(
    manager: ConversationManager, cast: Cast
) -> None:
    """`context --agent <orchestrator>` (preview_context) shows the routing context fitted to the orchestrator's
    budget, as LLMOrchestrator sends it: older turns left out with the note, the newest kept, and the budget's
    figures (tokens before cuts, turns left out)."""
    root = cast.user_says("Build it", kind=11)
    await manager.create_conversation(root)
    done = root
    for step in range(4):
        await manager.start_orchestrator_turn(root.id, "chat", ["alice"], f"step {step}")
        done = cast.alice_says(f"{step} " + "x" * 4_000, tags=[["E", root.id], ["e", root.id], ["tool", "complete"]])
        await manager.add_event(root.id, done)
    budget = TokenBudget(2_500)
    personas = {"orchestrator": PersonaSpec(cast.orchestrator, "", budget)}

    preview = await preview_context(manager, root.id, "orchestrator", done.id, personas, routing_prompt="Route.")

    [message] = preview["messages"]
    sent = json.loads(message["content"])
    kept = len(sent["routing_history"])
    assert 1 <= kept < 4
    assert sent["routing_history"][-1]["completions"][0]["message"].startswith("3 ")
    assert sent[ROUTING_NOTE_KEY] == routing_note(4 - kept)
    assert preview["budget"]["dropped"] == 4 - kept
    assert preview["budget"]["limit"] == 2_500
    assert preview["budget"]["tokens"] > 4_000  # before cuts
    assert estimate_tokens("Route.") + estimate_tokens(message["content"]) <= 2_500
