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
is created with mode 0600; TCP listens on a loopback address only and asks for a bearer token,
its own Host and no other origin (:mod:`tenex_daemon.app.control.guard`).

The pieces live in :mod:`tenex_daemon.app.control` (paths, errors, parsing, views, routes,
openapi, server); this module names what callers use.
"""

from __future__ import annotations

from tenex_daemon.app.control.errors import ApiError, ControlSocketInUseError
from tenex_daemon.app.control.openapi import openapi_document
from tenex_daemon.app.control.parsing import MAX_LIMIT, check_id, parse_datetime, parse_search
from tenex_daemon.app.control.paths import API_PREFIX
from tenex_daemon.app.control.routes import TARGET_KEY, ControlTarget, create_app
from tenex_daemon.app.control.server import ControlServer
from tenex_daemon.app.control.views import (
    context_json,
    conversation_json,
    preview_context,
    summary_json,
    tokens_json,
)

__all__ = [
    "API_PREFIX",
    "MAX_LIMIT",
    "TARGET_KEY",
    "ApiError",
    "ControlServer",
    "ControlSocketInUseError",
    "ControlTarget",
    "check_id",
    "context_json",
    "conversation_json",
    "create_app",
    "openapi_document",
    "parse_datetime",
    "parse_search",
    "preview_context",
    "summary_json",
    "tokens_json",
]
