"""The control API's aiohttp application: one handler per endpoint and errors answered as JSON.

Errors are JSON ``{"error": "..."}``: 400 for a malformed id or parameter, 404 for an unknown
conversation, event or agent, 409 for a change to an archived conversation, 500 for anything
else (logged). On the TCP port a guard answers 401 (no or wrong token) and 403 (another Host, another
origin) first (:mod:`tenex_daemon.app.control.guard`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Final, Protocol, runtime_checkable

import structlog
from aiohttp import web
from aiohttp.typedefs import Middleware

from tenex_daemon.app.control import paths
from tenex_daemon.app.control.errors import ApiError
from tenex_daemon.app.control.openapi import openapi_document
from tenex_daemon.app.control.parsing import (
    check_id,
    parse_context_query,
    parse_end_body,
    parse_rebuild_body,
    parse_reset_body,
    parse_search,
    parse_stop_body,
)
from tenex_daemon.app.control.views import conversation_json, preview_context, summary_json
from tenex_daemon.app.metrics import Metrics
from tenex_daemon.app.rebuild import EventSource, Rebuilder, private_rebuild
from tenex_daemon.app.settings import Settings
from tenex_daemon.core.errors import (
    ConversationArchivedError,
    ConversationNotFoundError,
    StoreUnavailableError,
    UnknownAgentError,
)
from tenex_daemon.runtime.log_budget import LineBudget
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.services.lifecycle import ConversationLifecycle, task_meta_key
from tenex_daemon.services.orchestrator import LLMOrchestrator
from tenex_daemon.services.persona import PersonaSpec

if TYPE_CHECKING:
    from tenex_daemon.app.wiring import Pipeline

log = structlog.get_logger(__name__)


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


@runtime_checkable
class RelayTarget(Protocol):
    """A target that also reaches the relays and has its settings (the daemon): what a rebuild needs.

    Kept apart from :class:`ControlTarget` so that a target without relays serves every other endpoint.
    """

    @property
    def pool(self) -> EventSource | None:
        """The relay pool (None until the daemon has started)."""

    @property
    def settings(self) -> Settings:
        """The home's settings (the whitelist: whose events are taken in)."""


@runtime_checkable
class PipelineTarget(Protocol):
    """A target that runs the pipeline (the daemon): the context preview builds an agent's persona from
    the profile its runs use, so it shows what the model is sent."""

    @property
    def pipeline(self) -> Pipeline | None:
        """Manager, runner, dispatcher (None until the daemon has started)."""


TARGET_KEY: Final[web.AppKey[ControlTarget]] = web.AppKey("target")
FAILED_LINES_KEY: Final[web.AppKey[LineBudget]] = web.AppKey("failed_lines")
FAILED_LINES: Final = 5
"""Requests answered with an error logged per status per :data:`FAILED_EVERY_S`; every one is counted."""
FAILED_EVERY_S: Final = 10.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, dumps=lambda obj: json.dumps(obj, ensure_ascii=False))


def _error(status: int, message: str) -> web.Response:
    return _json({"error": message}, status=status)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer every error as JSON ``{"error": ...}``; each is counted by its status
    (``tenexd_control_errors_total{status}``) and logged (``control_request_failed``), at most
    :data:`FAILED_LINES` lines per status per :data:`FAILED_EVERY_S` (a client repeats itself at no cost)."""
    try:
        return await handler(request)
    except ApiError as exc:
        status, message = exc.status, exc.message
    except (ConversationNotFoundError, UnknownAgentError) as exc:
        status, message = 404, str(exc)
    except ConversationArchivedError as exc:
        status, message = 409, str(exc)
    except StoreUnavailableError as exc:  # the database is down: try again once it answers
        log.warning("control_api_store_unavailable", method=request.method, path=request.path, error=str(exc))
        status, message = 503, str(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        status, message = exc.status, exc.reason
    except Exception:
        log.exception("control_api_error", method=request.method, path=request.path)
        status, message = 500, "internal error (see the daemon's log)"
    _target(request).metrics.control_error(status)
    not_logged = request.app[FAILED_LINES_KEY].take(str(status))
    if not_logged is not None:
        log.info("control_request_failed", status=status, method=request.method, path=request.path[:200],
                 error=message[:200], **({"not_logged": not_logged} if not_logged else {}))
    return _error(status, message)


def _target(request: web.Request) -> ControlTarget:
    return request.app[TARGET_KEY]


def _conversation_id(request: web.Request) -> str:
    return check_id(request.match_info["id"])


async def _json_body(request: web.Request, shape: str = '{"keep_system_message": true|false}') -> object:
    """The request's decoded JSON body, or None when it has none (400 naming ``shape`` if not JSON)."""
    if not request.can_read_body:
        return None
    try:
        body = await request.json()
        # JSON may escape half a UTF-16 pair ("\udcff"): text no store or event can hold
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except RecursionError:  # nested deeper than the decoder recurses: malformed input, not a fault
        raise ApiError(400, f"the body must be JSON nested less deeply: {shape}") from None
    except UnicodeEncodeError:
        raise ApiError(400, f"the body's text must be valid Unicode (no lone surrogate): {shape}") from None
    except (json.JSONDecodeError, UnicodeDecodeError, LookupError):  # LookupError: a charset Python lacks
        raise ApiError(400, f"the body must be JSON: {shape}") from None
    except ValueError:  # an integer of more digits than Python reads (sys.get_int_max_str_digits)
        digits = sys.get_int_max_str_digits()
        raise ApiError(400, f"the body's numbers must have at most {digits} digits: {shape}") from None
    return body


async def _status(request: web.Request) -> web.Response:
    return _json(dict(_target(request).status()))


async def _list(request: web.Request) -> web.Response:
    manager = _target(request).manager
    args = parse_search(request.query, manager.phase_rules.phases)
    rows = await manager.search_conversations(**args)
    return _json({"count": len(rows), "conversations": [summary_json(r) for r in rows]})


async def _get(request: web.Request) -> web.Response:
    conversation_id = _conversation_id(request)
    conversation = await _target(request).manager.get_conversation(conversation_id)
    if conversation is None:
        raise ConversationNotFoundError(conversation_id)
    manager = _target(request).manager
    return _json(conversation_json(conversation, expires_at=manager.expires_at(conversation)))


async def _delete(request: web.Request) -> web.Response:
    conversation_id = _conversation_id(request)
    target = _target(request)
    if not await target.manager.delete_conversation(conversation_id):
        raise ConversationNotFoundError(conversation_id)
    if isinstance(target, PipelineTarget) and target.pipeline is not None:  # as retention does
        target.pipeline.threads.forget_conversation(conversation_id)  # a later save would store them again
    return _json({"id": conversation_id, "deleted": True})


async def _reset(request: web.Request) -> web.Response:
    conversation_id = _conversation_id(request)
    keep = parse_reset_body(await _json_body(request))
    slugs = await _target(request).manager.reset_agent_states(conversation_id, keep_system_message=keep)
    return _json({"id": conversation_id, "reset_agents": slugs, "keep_system_message": keep})


async def _archive(request: web.Request) -> web.Response:
    conversation_id = _conversation_id(request)
    target = _target(request)
    pipeline = target.pipeline if isinstance(target, PipelineTarget) else None
    if pipeline is not None and pipeline.scheduler.holds(conversation_id):  # answers it could not save
        await pipeline.dispatcher.stop(conversation_id, None, by="owner")
    if not await target.manager.archive_conversation(conversation_id, ending_by="owner"):
        raise ApiError(409, f"conversation {conversation_id} is archived already")
    return _json({"id": conversation_id, "archived": True})


async def _end(request: web.Request) -> web.Response:
    conversation_id = _conversation_id(request)
    reason = parse_end_body(await _json_body(request, '{"reason": "<why>"}'))
    ended = await _target(request).manager.end_conversation(conversation_id, by="owner", reason=reason)
    if not ended:
        raise ApiError(409, f"conversation {conversation_id} is ended already")
    return _json({"id": conversation_id, "ended": True, "ended_by": "owner", "reason": reason})


async def _stop(request: web.Request) -> web.Response:
    conversation_id = _conversation_id(request)
    agent = parse_stop_body(await _json_body(request, '{"agent": "<slug>"}'))
    target = _target(request)
    if not isinstance(target, PipelineTarget) or target.pipeline is None:
        raise ApiError(503, "the daemon runs no agents here: there is nothing to stop")
    report = await target.pipeline.dispatcher.stop(conversation_id, agent, by="owner")
    notice = report.notice.id if report.notice is not None else None
    return _json({"id": conversation_id, "stopped": list(report.agents), "notice": notice})


async def _restore(request: web.Request) -> web.Response:
    conversation_id = _conversation_id(request)
    if not await _target(request).manager.restore_conversation(conversation_id):
        raise ApiError(409, f"conversation {conversation_id} is not archived")
    return _json({"id": conversation_id, "archived": False})


async def _rebuild(request: web.Request) -> web.Response:
    wanted = parse_rebuild_body(await _json_body(request, '{"id": "<conversation id>"} or {"all": true}'))
    target = _target(request)
    if not isinstance(target, RelayTarget) or target.pool is None:
        raise ApiError(503, "the daemon has no relay connections to rebuild from")
    settings = target.settings
    pipeline = target.pipeline if isinstance(target, PipelineTarget) else None
    idle_timeout_min = settings.conversations.idle_timeout_min
    rebuilder = Rebuilder(
        target.manager, target.pool, allowed_authors=settings.whitelist, private=private_rebuild(settings),
        lifecycle=pipeline.lifecycle if pipeline is not None else ConversationLifecycle(
            target.manager, idle_timeout_min=idle_timeout_min
        ),
    )
    try:
        report = await rebuilder.rebuild(wanted)
    except ConversationNotFoundError:
        raise ApiError(404, f"no relay has conversation {wanted.conversation_id}") from None
    return _json(report.to_dict())


async def _context(request: web.Request) -> web.Response:
    conversation_id = _conversation_id(request)
    agent, trigger = parse_context_query(request.query)
    target = _target(request)
    personas = _personas(target)
    routing = target.pipeline.orchestrator if isinstance(target, PipelineTarget) and target.pipeline else None
    prompt = routing.system_prompt if isinstance(routing, LLMOrchestrator) else None
    return _json(await preview_context(target.manager, conversation_id, agent, trigger, personas, prompt))


def _personas(target: ControlTarget) -> Mapping[str, PersonaSpec] | None:
    """The persona specs of a daemon's agents, from the profiles its runs use (None for other targets)."""
    if isinstance(target, PipelineTarget) and target.pipeline is not None:
        return {slug: p.persona_spec for slug, p in target.pipeline.runner.profiles.items()}
    return None


async def _task(request: web.Request) -> web.Response:
    task_id = check_id(request.match_info["id"], "task id")
    manager = _target(request).manager
    conversation_id = await manager.store.get_meta(task_meta_key(task_id))  # its current session
    if conversation_id is None:
        conversation_id = await manager.find_conversation_of_event(task_id)
    conversation = None if conversation_id is None else await manager.get_conversation(conversation_id)
    if conversation is None:
        raise ApiError(404, f"no conversation holds task {task_id}")
    return _json(conversation_json(conversation, expires_at=manager.expires_at(conversation)))


async def _metrics(request: web.Request) -> web.Response:
    metrics = _target(request).metrics
    return web.Response(body=metrics.render(), headers={"Content-Type": metrics.content_type})


async def _openapi(request: web.Request) -> web.Response:
    return _json(openapi_document())


def create_app(target: ControlTarget, *, guard: Middleware | None = None) -> web.Application:
    """Return the aiohttp application serving ``target``; ``guard`` (the TCP port's checks, see
    :mod:`tenex_daemon.app.control.guard`) runs before anything else."""
    middlewares = [_errors] if guard is None else [guard, _errors]
    app = web.Application(middlewares=middlewares, client_max_size=paths.MAX_BODY_BYTES)
    app[TARGET_KEY] = target
    app[FAILED_LINES_KEY] = LineBudget(FAILED_LINES, FAILED_EVERY_S)
    app.router.add_get(paths.OPENAPI, _openapi)
    app.router.add_get(paths.STATUS, _status)
    app.router.add_get(paths.CONVERSATIONS, _list)
    app.router.add_post(paths.CONVERSATIONS_REBUILD, _rebuild)
    app.router.add_get(paths.CONVERSATION, _get)
    app.router.add_delete(paths.CONVERSATION, _delete)
    app.router.add_post(paths.CONVERSATION_RESET, _reset)
    app.router.add_post(paths.CONVERSATION_ARCHIVE, _archive)
    app.router.add_post(paths.CONVERSATION_END, _end)
    app.router.add_post(paths.CONVERSATION_STOP, _stop)
    app.router.add_post(paths.CONVERSATION_RESTORE, _restore)
    app.router.add_get(paths.CONVERSATION_CONTEXT, _context)
    app.router.add_get(paths.TASK_CONVERSATION, _task)
    app.router.add_get(paths.METRICS, _metrics)
    return app
