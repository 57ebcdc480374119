"""The local HTTP control API (aiohttp) on a Unix socket in the home, optionally on loopback TCP.

Endpoints (the OpenAPI 3 document is served at ``GET /api/v1/openapi.json``)::

    GET    /api/v1/status                          the daemon's status data (as in the status file)
    GET    /api/v1/conversations                   search: title, phase, archived, date_from, date_to,
                                                   participant, limit
    GET    /api/v1/conversations/{id}              summary, history, agent states, phase, transitions, turns
    DELETE /api/v1/conversations/{id}              remove it (its event ids stay processed)
    POST   /api/v1/conversations/{id}/reset        agents start fresh; body {"keep_system_message": bool}
    POST   /api/v1/conversations/{id}/archive      make it read-only
    POST   /api/v1/conversations/{id}/restore      make it writable again
    GET    /api/v1/conversations/{id}/context      ?agent=SLUG[&trigger=EVENT_ID]: what the agent gets
    GET    /api/v1/tasks/{id}/conversation         the conversation of a task (rooted at it, or holding it)
    GET    /metrics                                Prometheus text format

Errors are JSON ``{"error": "..."}``: 400 for a malformed id or parameter, 404 for an unknown
conversation, event or agent, 409 for a change to an archived conversation. The socket file
is created with mode 0600; TCP listens on a loopback address only.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import socket
import stat
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Protocol

import structlog
from aiohttp import web

from tenex_daemon import __version__
from tenex_daemon.app.home import parse_pubkey
from tenex_daemon.app.metrics import Metrics
from tenex_daemon.core.context import AgentContext
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.errors import (
    ConversationArchivedError,
    ConversationNotFoundError,
    TenexError,
    UnknownAgentError,
)
from tenex_daemon.core.phases import Phase
from tenex_daemon.core.search import ConversationSummary
from tenex_daemon.core.vocabulary import KIND_TASK
from tenex_daemon.services.conversation_manager import ConversationManager

log = structlog.get_logger(__name__)

API_PREFIX: Final = "/api/v1"
MAX_LIMIT: Final = 10_000
_HEX_ID = re.compile(r"^[0-9a-f]{64}$")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_LOOPBACK_NAMES = frozenset({"localhost"})
_UNIX_PATH_MAX = 107


class ControlTarget(Protocol):
    """What the control API serves: the daemon satisfies it (so does a test fake)."""

    @property
    def manager(self) -> ConversationManager:
        """The daemon's conversation manager."""

    @property
    def metrics(self) -> Metrics:
        """The daemon's metrics."""

    def status(self) -> Mapping[str, Any]:
        """A JSON-ready status snapshot (the status file's data)."""


class ApiError(TenexError):
    """An error answered as JSON ``{"error": message}`` with an HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class ControlSocketInUseError(TenexError):
    """Another process answers on the control socket (a daemon already runs on this home)."""


# --- JSON views shared with the CLI ------------------------------------------------------------


def summary_json(summary: ConversationSummary) -> dict[str, Any]:
    """Return a conversation's summary row as JSON-ready data."""
    return summary.model_dump(mode="json")


def conversation_json(conversation: Conversation, now_ms: int | None = None) -> dict[str, Any]:
    """Return a conversation in full: summary, metadata, history, agent states, phase, transitions, turns."""
    now = int(datetime.now(UTC).timestamp() * 1000) if now_ms is None else now_ms
    state = conversation.state_dict()
    return {
        "id": conversation.id,
        "title": conversation.title,
        "phase": conversation.phase.value,
        "archived": conversation.archived,
        "root_kind": conversation.root_kind,
        "is_task": conversation.root_kind == KIND_TASK,
        "created_at": conversation.created_at,
        "updated_at": conversation.updated_at,
        "phase_started_at": conversation.phase_started_at,
        "summary": summary_json(ConversationSummary.of(conversation)),
        "metadata": state["metadata"],
        "agent_states": state["agent_states"],
        "transitions": state["phase_transitions"],
        "turns": state["orchestrator_turns"],
        "execution_time": state["execution_time"],
        "execution_seconds": conversation.execution_time.total(now),
        "tokens": tokens_json(conversation),
        "history": [event.to_dict() for event in conversation.history],
    }


def tokens_json(conversation: Conversation) -> dict[str, Any]:
    """Tokens the agents' backends reported for the conversation: totals and per agent."""
    by_agent = {
        slug: {"prompt": state.prompt_tokens, "completion": state.completion_tokens}
        for slug, state in sorted(conversation.agent_states.items())
        if state.prompt_tokens or state.completion_tokens
    }
    return {
        "prompt": sum(t["prompt"] for t in by_agent.values()),
        "completion": sum(t["completion"] for t in by_agent.values()),
        "by_agent": by_agent,
    }


def context_json(
    conversation_id: str, agent_slug: str, trigger_id: str, context: AgentContext, stored_index: int
) -> dict[str, Any]:
    """Return a context preview: the messages, in order, exactly as the agent would be sent them."""
    return {
        "conversation_id": conversation_id,
        "agent": agent_slug,
        "trigger": trigger_id,
        "messages": [{"role": m.role, "content": m.content} for m in context.messages],
        "session_id": context.session_id,
        "last_processed_index": stored_index,
        "next_last_processed_index": context.last_processed_index,
    }


async def preview_context(
    manager: ConversationManager, conversation_id: str, agent_slug: str, trigger_id: str | None = None
) -> dict[str, Any]:
    """Build an agent's context without changing its state (the trigger defaults to the newest event).

    Raises :class:`ConversationNotFoundError`, :class:`UnknownAgentError`, or :class:`ApiError`
    (404) for a trigger that is not in the conversation.
    """
    manager.agents.get(agent_slug)
    conversation = await manager.get_conversation(conversation_id)
    if conversation is None:
        raise ConversationNotFoundError(conversation_id)
    if not conversation.history:
        raise ApiError(409, f"conversation {conversation_id} has no events")
    if trigger_id is None:
        trigger = conversation.history[-1]
    else:
        index = conversation.index_of(trigger_id)
        if index is None:
            raise ApiError(404, f"event {trigger_id} is not in conversation {conversation_id}")
        trigger = conversation.history[index]
    context = await manager.preview_agent_messages(conversation_id, agent_slug, trigger)
    state = conversation.agent_states.get(agent_slug)
    stored_index = state.last_processed_index if state is not None else 0
    return context_json(conversation_id, agent_slug, trigger.id, context, stored_index)


# --- request parsing --------------------------------------------------------------------------


def check_id(value: str, what: str = "conversation id") -> str:
    """Return ``value`` if it is 64 lowercase hex characters, else raise :class:`ApiError` 400."""
    if not _HEX_ID.match(value):
        raise ApiError(400, f"{what} must be 64 lowercase hex characters, got {value[:80]!r}")
    return value


def _parse_bool(name: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ApiError(400, f"{name} must be true or false, got {value!r}")


def parse_datetime(name: str, value: str) -> datetime:
    """Parse ISO 8601 (date or date-time; naive means UTC) or Unix seconds; raise ApiError 400."""
    text = value.strip()
    try:
        if re.fullmatch(r"\d+(\.\d+)?", text):
            return datetime.fromtimestamp(float(text), UTC)
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except (ValueError, OverflowError, OSError):
        raise ApiError(400, f"{name} must be an ISO 8601 date or Unix seconds, got {value!r}") from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def parse_search(query: Mapping[str, str]) -> dict[str, Any]:
    """Turn query parameters into keyword arguments of ``search_conversations``; raise ApiError 400."""
    known = {"title", "phase", "archived", "date_from", "date_to", "participant", "limit"}
    unknown = sorted(set(query) - known)
    if unknown:
        raise ApiError(400, f"unknown parameter(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    args: dict[str, Any] = {}
    if query.get("title"):
        args["title"] = query["title"]
    if query.get("phase"):
        try:
            args["phase"] = Phase(query["phase"].strip().lower())
        except ValueError:
            names = ", ".join(p.value for p in Phase)
            raise ApiError(400, f"phase must be one of {names}, got {query['phase']!r}") from None
    if query.get("archived"):
        args["archived"] = _parse_bool("archived", query["archived"])
    for name in ("date_from", "date_to"):
        if query.get(name):
            args[name] = parse_datetime(name, query[name])
    if query.get("participant"):
        try:
            args["participant"] = parse_pubkey(query["participant"])
        except ValueError as exc:
            raise ApiError(400, f"participant: {exc}") from None
    if query.get("limit"):
        raw = query["limit"]
        if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIMIT:
            raise ApiError(400, f"limit must be an integer from 1 to {MAX_LIMIT}, got {raw!r}")
        args["limit"] = int(raw)
    return args


# --- the application --------------------------------------------------------------------------

TARGET_KEY: Final[web.AppKey[ControlTarget]] = web.AppKey("target")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, dumps=lambda obj: json.dumps(obj, ensure_ascii=False))


def _error(status: int, message: str) -> web.Response:
    return _json({"error": message}, status=status)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer every error as JSON ``{"error": ...}``."""
    try:
        return await handler(request)
    except ApiError as exc:
        return _error(exc.status, exc.message)
    except (ConversationNotFoundError, UnknownAgentError) as exc:
        return _error(404, str(exc))
    except ConversationArchivedError as exc:
        return _error(409, str(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.status, exc.reason)
    except Exception:
        log.exception("control_api_error", method=request.method, path=request.path)
        return _error(500, "internal error (see the daemon's log)")


def _target(request: web.Request) -> ControlTarget:
    return request.app[TARGET_KEY]


def _conversation_id(request: web.Request) -> str:
    return check_id(request.match_info["id"])


async def _status(request: web.Request) -> web.Response:
    return _json(dict(_target(request).status()))


async def _list(request: web.Request) -> web.Response:
    args = parse_search(request.query)
    rows = await _target(request).manager.search_conversations(**args)
    return _json({"count": len(rows), "conversations": [summary_json(r) for r in rows]})


async def _get(request: web.Request) -> web.Response:
    conversation_id = _conversation_id(request)
    conversation = await _target(request).manager.get_conversation(conversation_id)
    if conversation is None:
        raise ConversationNotFoundError(conversation_id)
    return _json(conversation_json(conversation))


async def _delete(request: web.Request) -> web.Response:
    conversation_id = _conversation_id(request)
    if not await _target(request).manager.delete_conversation(conversation_id):
        raise ConversationNotFoundError(conversation_id)
    return _json({"id": conversation_id, "deleted": True})


async def _reset(request: web.Request) -> web.Response:
    conversation_id = _conversation_id(request)
    keep = False
    if request.can_read_body:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "the body must be JSON: {\"keep_system_message\": true|false}") from None
        if body is not None:
            if not isinstance(body, dict):
                raise ApiError(400, "the body must be a JSON object")
            value = body.get("keep_system_message", False)
            if not isinstance(value, bool):
                raise ApiError(400, "keep_system_message must be true or false")
            keep = value
    slugs = await _target(request).manager.reset_agent_states(conversation_id, keep_system_message=keep)
    return _json({"id": conversation_id, "reset_agents": slugs, "keep_system_message": keep})


async def _archive(request: web.Request) -> web.Response:
    conversation_id = _conversation_id(request)
    await _target(request).manager.archive_conversation(conversation_id)
    return _json({"id": conversation_id, "archived": True})


async def _restore(request: web.Request) -> web.Response:
    conversation_id = _conversation_id(request)
    await _target(request).manager.restore_conversation(conversation_id)
    return _json({"id": conversation_id, "archived": False})


async def _context(request: web.Request) -> web.Response:
    conversation_id = _conversation_id(request)
    agent = request.query.get("agent")
    if not agent:
        raise ApiError(400, "the agent query parameter is required (?agent=SLUG)")
    trigger = request.query.get("trigger")
    if trigger is not None:
        check_id(trigger, "trigger event id")
    return _json(await preview_context(_target(request).manager, conversation_id, agent, trigger))


async def _task(request: web.Request) -> web.Response:
    task_id = check_id(request.match_info["id"], "task id")
    manager = _target(request).manager
    conversation_id = await manager.find_conversation_of_event(task_id)
    conversation = None if conversation_id is None else await manager.get_conversation(conversation_id)
    if conversation is None:
        raise ApiError(404, f"no conversation holds task {task_id}")
    return _json(conversation_json(conversation))


async def _metrics(request: web.Request) -> web.Response:
    metrics = _target(request).metrics
    return web.Response(body=metrics.render(), headers={"Content-Type": metrics.content_type})


async def _openapi(request: web.Request) -> web.Response:
    return _json(openapi_document())


def create_app(target: ControlTarget) -> web.Application:
    """Return the aiohttp application serving ``target``."""
    app = web.Application(middlewares=[_errors], client_max_size=64 * 1024)
    app[TARGET_KEY] = target
    app.router.add_get(f"{API_PREFIX}/openapi.json", _openapi)
    app.router.add_get(f"{API_PREFIX}/status", _status)
    app.router.add_get(f"{API_PREFIX}/conversations", _list)
    app.router.add_get(f"{API_PREFIX}/conversations/{{id}}", _get)
    app.router.add_delete(f"{API_PREFIX}/conversations/{{id}}", _delete)
    app.router.add_post(f"{API_PREFIX}/conversations/{{id}}/reset", _reset)
    app.router.add_post(f"{API_PREFIX}/conversations/{{id}}/archive", _archive)
    app.router.add_post(f"{API_PREFIX}/conversations/{{id}}/restore", _restore)
    app.router.add_get(f"{API_PREFIX}/conversations/{{id}}/context", _context)
    app.router.add_get(f"{API_PREFIX}/tasks/{{id}}/conversation", _task)
    app.router.add_get("/metrics", _metrics)
    return app


# --- the server -------------------------------------------------------------------------------


def _is_loopback(host: str) -> bool:
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _clear_stale_socket(path: Path) -> None:
    """Remove a socket file nobody answers on; refuse when a process still listens there."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise ControlSocketInUseError(f"{path} exists and is not a socket; move it away")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink(missing_ok=True)
        log.info("control_socket_stale_removed", path=str(path))
        return
    finally:
        probe.close()
    raise ControlSocketInUseError(
        f"another process answers on {path}: is a daemon already running on this home?"
    )


class ControlServer:
    """Serves :func:`create_app` on a Unix socket (mode 0600) and, optionally, loopback TCP.

    ``tcp_port=0`` picks a free port (see :attr:`tcp_address`). Use ``await start()`` and
    ``await stop()``, or ``async with``.
    """

    def __init__(
        self,
        target: ControlTarget,
        socket_path: str | os.PathLike[str] | None,
        tcp_port: int | None = None,
        *,
        tcp_host: str = "127.0.0.1",
    ) -> None:
        """Describe the server; nothing listens until :meth:`start`."""
        if socket_path is None and tcp_port is None:
            raise ValueError("the control API needs a Unix socket path, a TCP port, or both")
        if tcp_port is not None and not _is_loopback(tcp_host):
            raise ValueError(f"the control API listens on loopback only, not {tcp_host!r}")
        self.target = target
        self.socket_path = Path(socket_path) if socket_path is not None else None
        self.tcp_port = tcp_port
        self.tcp_host = tcp_host
        self.tcp_address: tuple[str, int] | None = None
        """The bound TCP (host, port) once started."""
        self._runner: web.AppRunner | None = None
        self._socket_inode: tuple[int, int] | None = None

    async def __aenter__(self) -> ControlServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Bind the socket (0600) and the TCP port, and start serving."""
        if self._runner is not None:
            return
        runner = web.AppRunner(create_app(self.target), access_log=None, handle_signals=False)
        await runner.setup()
        try:
            if self.socket_path is not None:
                await web.SockSite(runner, self._bind_unix(self.socket_path)).start()
            if self.tcp_port is not None:
                site = web.TCPSite(runner, self.tcp_host, self.tcp_port, reuse_address=True)
                await site.start()
                for address in runner.addresses:
                    if isinstance(address, tuple):
                        self.tcp_address = (str(address[0]), int(address[1]))
        except BaseException:
            await runner.cleanup()
            self._remove_socket()
            raise
        self._runner = runner
        log.info(
            "control_api_started",
            socket=str(self.socket_path) if self.socket_path else None,
            tcp=f"{self.tcp_address[0]}:{self.tcp_address[1]}" if self.tcp_address else None,
        )

    def _bind_unix(self, path: Path) -> socket.socket:
        if len(os.fsencode(path)) > _UNIX_PATH_MAX:
            raise ValueError(
                f"control socket path {path} is longer than {_UNIX_PATH_MAX} bytes; "
                "set control.socket to a shorter path"
            )
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        _clear_stale_socket(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            old_umask = os.umask(0o177)
            try:
                sock.bind(str(path))
            finally:
                os.umask(old_umask)
            os.chmod(path, 0o600)
            info = path.stat()
            self._socket_inode = (info.st_dev, info.st_ino)
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock

    def _remove_socket(self) -> None:
        if self.socket_path is None or self._socket_inode is None:
            return
        with contextlib.suppress(OSError):
            info = self.socket_path.stat()
            if (info.st_dev, info.st_ino) == self._socket_inode:
                self.socket_path.unlink()
        self._socket_inode = None

    async def stop(self) -> None:
        """Stop serving and remove the socket file. Safe to call twice."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        self._remove_socket()
        self.tcp_address = None


# --- OpenAPI ----------------------------------------------------------------------------------


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _ok(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_ERRORS: Final = {
    "400": {"$ref": "#/components/responses/BadRequest"},
    "404": {"$ref": "#/components/responses/NotFound"},
}
_ID_PARAM: Final = {
    "name": "id", "in": "path", "required": True,
    "description": "Conversation id: the root event's id (64 lowercase hex).",
    "schema": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
}


def _query(name: str, description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "description": description, "schema": schema}


def openapi_document() -> dict[str, Any]:
    """Return the OpenAPI 3.0 description of the control API."""
    conversation_ops = {
        "get": {
            "summary": "A conversation in full: summary, history, agent states, phase, transitions, turns.",
            "operationId": "getConversation",
            "parameters": [_ID_PARAM],
            "responses": {"200": _ok("The conversation.", _ref("Conversation")), **_ERRORS},
        },
        "delete": {
            "summary": "Delete a conversation (its event ids stay processed, so relays cannot re-create it).",
            "operationId": "deleteConversation",
            "parameters": [_ID_PARAM],
            "responses": {"200": _ok("Deleted.", {"type": "object"}), **_ERRORS},
        },
    }
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "tenexd control API",
            "version": __version__,
            "description": "Local control of a tenexd daemon, on a Unix socket (mode 0600) in its home.",
        },
        "paths": {
            f"{API_PREFIX}/status": {"get": {
                "summary": "The daemon's status (the same data as the status file).",
                "operationId": "getStatus",
                "responses": {"200": _ok("Status.", _ref("Status"))},
            }},
            f"{API_PREFIX}/conversations": {"get": {
                "summary": "Search conversations, newest update first.",
                "operationId": "listConversations",
                "parameters": [
                    _query("title", "Case-insensitive, fuzzy title match.", {"type": "string"}),
                    _query("phase", "Current phase.", {"type": "string", "enum": [p.value for p in Phase]}),
                    _query("archived", "true: archived only; false: active only.", {"type": "boolean"}),
                    _query("date_from", "Created at/after (ISO 8601 or Unix seconds).", {"type": "string"}),
                    _query("date_to", "Created at/before (ISO 8601 or Unix seconds).", {"type": "string"}),
                    _query("participant", "An author (npub or hex).", {"type": "string"}),
                    _query("limit", "At most this many rows.",
                           {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT}),
                ],
                "responses": {
                    "200": _ok("Matching conversations.", {
                        "type": "object",
                        "properties": {
                            "count": {"type": "integer"},
                            "conversations": {"type": "array", "items": _ref("ConversationSummary")},
                        },
                    }),
                    "400": _ERRORS["400"],
                },
            }},
            f"{API_PREFIX}/conversations/{{id}}": conversation_ops,
            f"{API_PREFIX}/conversations/{{id}}/reset": {"post": {
                "summary": (
                    "Agents start fresh: each agent's session id is forgotten and its last processed index "
                    "set to 0 (1 with keep_system_message: the root event counts as seen). "
                    "History, phase, turns and metadata are kept."
                ),
                "operationId": "resetConversation",
                "parameters": [_ID_PARAM],
                "requestBody": {"required": False, "content": {"application/json": {"schema": {
                    "type": "object",
                    "properties": {"keep_system_message": {"type": "boolean", "default": False}},
                }}}},
                "responses": {
                    "200": _ok("The agents reset.", {"type": "object", "properties": {
                        "id": {"type": "string"},
                        "reset_agents": {"type": "array", "items": {"type": "string"}},
                        "keep_system_message": {"type": "boolean"},
                    }}),
                    **_ERRORS,
                    "409": {"$ref": "#/components/responses/Conflict"},
                },
            }},
            f"{API_PREFIX}/conversations/{{id}}/archive": {"post": {
                "summary": "Archive: the conversation stays readable and becomes read-only.",
                "operationId": "archiveConversation",
                "parameters": [_ID_PARAM],
                "responses": {"200": _ok("Archived.", {"type": "object"}), **_ERRORS},
            }},
            f"{API_PREFIX}/conversations/{{id}}/restore": {"post": {
                "summary": "Restore an archived conversation.",
                "operationId": "restoreConversation",
                "parameters": [_ID_PARAM],
                "responses": {"200": _ok("Restored.", {"type": "object"}), **_ERRORS},
            }},
            f"{API_PREFIX}/conversations/{{id}}/context": {"get": {
                "summary": (
                    "Exactly the messages the agent would be sent if triggered now, without changing its "
                    "state. The trigger defaults to the newest event of the conversation."
                ),
                "operationId": "getAgentContext",
                "parameters": [
                    _ID_PARAM,
                    {"name": "agent", "in": "query", "required": True, "description": "Agent slug.",
                     "schema": {"type": "string"}},
                    _query("trigger", "The event the agent responds to (an event of the conversation).",
                           {"type": "string", "pattern": "^[0-9a-f]{64}$"}),
                ],
                "responses": {"200": _ok("The context.", _ref("AgentContext")), **_ERRORS},
            }},
            f"{API_PREFIX}/tasks/{{id}}/conversation": {"get": {
                "summary": "The conversation of a task: rooted at the kind-1934 event, or holding it.",
                "operationId": "getTaskConversation",
                "parameters": [{**_ID_PARAM, "description": "The task event's id (64 lowercase hex)."}],
                "responses": {"200": _ok("The conversation.", _ref("Conversation")), **_ERRORS},
            }},
            "/metrics": {"get": {
                "summary": "Prometheus metrics (text exposition format).",
                "operationId": "getMetrics",
                "responses": {"200": {"description": "Metrics.", "content": {"text/plain": {
                    "schema": {"type": "string"}}}}},
            }},
            f"{API_PREFIX}/openapi.json": {"get": {
                "summary": "This document.",
                "operationId": "getOpenApi",
                "responses": {"200": _ok("OpenAPI 3 document.", {"type": "object"})},
            }},
        },
        "components": {
            "schemas": {
                "Error": {
                    "type": "object", "required": ["error"], "properties": {"error": {"type": "string"}},
                },
                "Status": {"type": "object", "properties": {
                    "version": {"type": "string"}, "pid": {"type": "integer"},
                    "started_at": {"type": "number"}, "updated_at": {"type": "number"},
                    "uptime_s": {"type": "number"},
                    "state": {"type": "string", "enum": ["starting", "running", "stopping", "stopped"]},
                    "relays": {"type": "array", "items": {"type": "object", "properties": {
                        "url": {"type": "string"}, "state": {"type": "string"}}}},
                    "conversations": {"type": "object", "properties": {
                        "total": {"type": "integer"}, "by_phase": {"type": "object"}}},
                    "runs_in_flight": {"type": "integer"},
                    "last_event_at": {"type": "number", "nullable": True},
                    "errors": {"type": "object"},
                    "events": {"type": "object", "properties": {
                        "accepted": {"type": "integer"}, "rejected": {"type": "object"}}},
                    "replies": {"type": "integer"},
                }},
                "ConversationSummary": {"type": "object", "properties": {
                    "id": {"type": "string"}, "title": {"type": "string"}, "phase": {"type": "string"},
                    "created_at": {"type": "integer", "description": "ms since the epoch"},
                    "updated_at": {"type": "integer"}, "event_count": {"type": "integer"},
                    "agent_count": {"type": "integer"}, "archived": {"type": "boolean"},
                    "participants": {"type": "array", "items": {"type": "string"}},
                }},
                "Event": {"type": "object", "description": "A NIP-01 event.", "properties": {
                    "id": {"type": "string"}, "pubkey": {"type": "string"}, "created_at": {"type": "integer"},
                    "kind": {"type": "integer"},
                    "tags": {"type": "array", "items": {"type": "array", "items": {"type": "string"}}},
                    "content": {"type": "string"}, "sig": {"type": "string"},
                }},
                "Conversation": {"type": "object", "properties": {
                    "id": {"type": "string"}, "title": {"type": "string"}, "phase": {"type": "string"},
                    "archived": {"type": "boolean"}, "root_kind": {"type": "integer"},
                    "is_task": {"type": "boolean"},
                    "summary": _ref("ConversationSummary"),
                    "metadata": {"type": "object"},
                    "agent_states": {"type": "object", "additionalProperties": _ref("AgentState")},
                    "transitions": {"type": "array", "items": {"type": "object"}},
                    "turns": {"type": "array", "items": {"type": "object"}},
                    "execution_seconds": {"type": "integer"},
                    "history": {"type": "array", "items": _ref("Event")},
                }},
                "AgentState": {"type": "object", "properties": {
                    "last_processed_index": {"type": "integer"},
                    "session_id": {"type": "string", "nullable": True},
                    "transitions_seen": {"type": "integer"},
                }},
                "AgentContext": {"type": "object", "properties": {
                    "conversation_id": {"type": "string"}, "agent": {"type": "string"},
                    "trigger": {"type": "string"},
                    "messages": {"type": "array", "items": {"type": "object", "properties": {
                        "role": {"type": "string", "enum": ["system", "user", "assistant"]},
                        "content": {"type": "string"}}}},
                    "session_id": {"type": "string", "nullable": True},
                    "last_processed_index": {"type": "integer"},
                    "next_last_processed_index": {"type": "integer"},
                }},
            },
            "responses": {
                "BadRequest": {"description": "A malformed id or parameter.",
                               "content": {"application/json": {"schema": _ref("Error")}}},
                "NotFound": {"description": "No such conversation, event or agent.",
                             "content": {"application/json": {"schema": _ref("Error")}}},
                "Conflict": {"description": "The conversation is archived (read-only).",
                             "content": {"application/json": {"schema": _ref("Error")}}},
            },
        },
    }
