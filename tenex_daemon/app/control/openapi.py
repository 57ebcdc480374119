"""The OpenAPI 3.0 document of the control API, served at ``GET /api/v1/openapi.json``.

Built from small helpers, one per path and one per component group, on the same path
constants the routes use, so the document and the routes cannot name different paths.
"""

from __future__ import annotations

from typing import Any, Final

from tenex_daemon import __version__
from tenex_daemon.app.control import paths
from tenex_daemon.app.control.parsing import MAX_LIMIT
from tenex_daemon.app.control.paths import MAX_BODY_BYTES
from tenex_daemon.core.phases import PHASE_NAME

Json = dict[str, Any]

_HEX_PATTERN: Final = "^[0-9a-f]{64}$"
_ERRORS: Final = {
    "400": {"$ref": "#/components/responses/BadRequest"},
    "404": {"$ref": "#/components/responses/NotFound"},
}
_CONFLICT: Final = {"$ref": "#/components/responses/Conflict"}
_ID_PARAM: Final = {
    "name": "id", "in": "path", "required": True,
    "description": "Conversation id: the root event's id (64 lowercase hex).",
    "schema": {"type": "string", "pattern": _HEX_PATTERN},
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _ok(description: str, schema: Json) -> Json:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _query(name: str, description: str, schema: Json) -> Json:
    return {"name": name, "in": "query", "required": False, "description": description, "schema": schema}


def _on_conversation(summary: str, operation_id: str, ok: Json, **extra: Any) -> Json:
    """An operation on ``{id}``: the id parameter, then ``extra``, then 200 and the 400/404 errors."""
    return {
        "summary": summary,
        "operationId": operation_id,
        "parameters": [_ID_PARAM],
        **extra,
        "responses": {"200": ok, **_ERRORS},
    }


# --- paths --------------------------------------------------------------------------------------


def _status_path() -> Json:
    return {"get": {
        "summary": "The daemon's status (the same data as the status file).",
        "operationId": "getStatus",
        "responses": {"200": _ok("Status.", _ref("Status"))},
    }}


def _conversations_path() -> Json:
    return {"get": {
        "summary": "Search conversations, newest update first.",
        "operationId": "listConversations",
        "parameters": [
            _query("id_prefix", "The id starts with these hex digits (the CLI's short ids).",
                   {"type": "string", "pattern": "^[0-9a-fA-F]{1,64}$"}),
            _query("title", "Case-insensitive, fuzzy title match.", {"type": "string"}),
            _query("phase", "Current phase (a built-in one or one the project added).",
                   {"type": "string", "pattern": f"^{PHASE_NAME.pattern}$"}),
            _query("archived", "true: archived only; false: active only.", {"type": "boolean"}),
            _query("date_from", "Created at/after (ISO 8601 or Unix seconds).", {"type": "string"}),
            _query("date_to", "Created at/before (ISO 8601 or Unix seconds; a date alone: to its end, UTC).",
                   {"type": "string"}),
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
    }}


def _rebuild_path() -> Json:
    return {"post": {
        "summary": (
            "Fetch conversations back from the relays (one by id, or all the agents took part in), "
            "verify every event (NIP-01 id, signature) and merge what the store lacks, in history "
            "order; a second rebuild adds nothing. No agent is run."
        ),
        "operationId": "rebuildConversations",
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": _HEX_PATTERN, "description": "One conversation."},
                "all": {"type": "boolean", "description": "Every conversation of the project's agents."},
                "since": {"type": "string",
                          "description": "Only events created at/after (ISO 8601 or Unix seconds)."},
            },
        }}}},
        "responses": {
            "200": _ok("What the rebuild did.", _ref("RebuildReport")),
            **_ERRORS,
            "503": _error_response("The daemon has no relay connections."),
        },
    }}


def _conversation_path() -> Json:
    return {
        "get": _on_conversation(
            "A conversation in full: summary, history, agent states, phase, transitions, turns.",
            "getConversation", _ok("The conversation.", _ref("Conversation")),
        ),
        "delete": _on_conversation(
            "Delete a conversation (its event ids stay processed, so relays cannot re-create it).",
            "deleteConversation", _ok("Deleted.", {"type": "object"}),
        ),
    }


def _reset_path() -> Json:
    operation = _on_conversation(
        (
            "Agents start fresh: each agent's session id is forgotten and its last processed index "
            "set to 0 (1 with keep_system_message: the root event counts as seen). "
            "History, phase, turns and metadata are kept."
        ),
        "resetConversation",
        _ok("The agents reset.", {"type": "object", "properties": {
            "id": {"type": "string"},
            "reset_agents": {"type": "array", "items": {"type": "string"}},
            "keep_system_message": {"type": "boolean"},
        }}),
        requestBody={"required": False, "content": {"application/json": {"schema": {
            "type": "object",
            "properties": {"keep_system_message": {"type": "boolean", "default": False}},
        }}}},
    )
    operation["responses"]["409"] = _CONFLICT
    return {"post": operation}


def _archive_path() -> Json:
    operation = _on_conversation(
        "Archive: the conversation stays readable and becomes read-only (409 when it is archived already).",
        "archiveConversation", _ok("Archived.", {"type": "object"}),
    )
    operation["responses"]["409"] = _CONFLICT
    return {"post": operation}


def _end_path() -> Json:
    operation = _on_conversation(
        (
            "End the conversation: when, by whom (owner) and why are recorded in its metadata (409 when it "
            "is ended already); it stays writable and a new message reopens it."
        ),
        "endConversation",
        _ok("Ended.", {"type": "object", "properties": {
            "id": {"type": "string"}, "ended": {"type": "boolean"}, "ended_by": {"type": "string"},
            "reason": {"type": "string", "nullable": True},
        }}),
        requestBody={"required": False, "content": {"application/json": {"schema": {
            "type": "object", "properties": {"reason": {"type": "string"}},
        }}}},
    )
    operation["responses"]["409"] = _CONFLICT
    return {"post": operation}


def _stop_path() -> Json:
    operation = _on_conversation(
        (
            "Stop the agents working on the conversation (one agent with {\"agent\": slug}): their running "
            "and waiting runs are cancelled, nothing half-written is published, the stop is recorded and "
            "answered in the conversation with a notice (docs/PROTOCOL.md, kind 24134). Daemons sharing a "
            "PostgreSQL database: the others are told and stop their runs too."
        ),
        "stopConversation",
        _ok("Stopped (the agents whose runs were stopped, by every daemon that answered within "
            "daemon.stop_wait_s; none when nothing ran).", {
            "type": "object", "properties": {
                "id": {"type": "string"},
                "stopped": {"type": "array", "items": {"type": "string"}},
                "notice": {
                    "type": "string", "nullable": True,
                    "description": "The id of the notice this daemon published (another daemon that stopped "
                    "runs publishes its own).",
                },
            },
        }),
        requestBody={"required": False, "content": {"application/json": {"schema": {
            "type": "object", "properties": {"agent": {"type": "string", "description": "Agent slug."}},
        }}}},
    )
    operation["responses"]["503"] = {"description": "The daemon runs no agents."}
    return {"post": operation}


def _restore_path() -> Json:
    operation = _on_conversation(
        "Restore an archived conversation (409 when it is not archived).",
        "restoreConversation", _ok("Restored.", {"type": "object"}),
    )
    operation["responses"]["409"] = _CONFLICT
    return {"post": operation}


def _context_path() -> Json:
    return {"get": {
        "summary": (
            "Exactly the persona and the messages the agent would be sent if triggered now, without "
            "changing its state. The trigger defaults to the newest event the agent did not write (else the "
            "newest)."
        ),
        "operationId": "getAgentContext",
        "parameters": [
            _ID_PARAM,
            {"name": "agent", "in": "query", "required": True, "description": "Agent slug.",
             "schema": {"type": "string"}},
            _query("trigger", "The event the agent responds to (an event of the conversation).",
                   {"type": "string", "pattern": _HEX_PATTERN}),
        ],
        "responses": {
            "200": _ok("The context.", _ref("AgentContext")),
            **_ERRORS,
            "409": _error_response(
                "The conversation has no events, or the agent is sent nothing (it routes by rules here)."
            ),
        },
    }}


def _task_path() -> Json:
    return {"get": {
        "summary": "The conversation of a task: rooted at the kind-1934 event, or holding it.",
        "operationId": "getTaskConversation",
        "parameters": [{**_ID_PARAM, "description": "The task event's id (64 lowercase hex)."}],
        "responses": {"200": _ok("The conversation.", _ref("Conversation")), **_ERRORS},
    }}


def _metrics_path() -> Json:
    return {"get": {
        "summary": "Prometheus metrics (text exposition format).",
        "operationId": "getMetrics",
        "responses": {"200": {"description": "Metrics.", "content": {"text/plain": {
            "schema": {"type": "string"}}}}},
    }}


def _openapi_path() -> Json:
    return {"get": {
        "summary": "This document.",
        "operationId": "getOpenApi",
        "responses": {"200": _ok("OpenAPI 3 document.", {"type": "object"})},
    }}


def _paths() -> Json:
    return {
        paths.STATUS: _status_path(),
        paths.CONVERSATIONS: _conversations_path(),
        paths.CONVERSATIONS_REBUILD: _rebuild_path(),
        paths.CONVERSATION: _conversation_path(),
        paths.CONVERSATION_RESET: _reset_path(),
        paths.CONVERSATION_ARCHIVE: _archive_path(),
        paths.CONVERSATION_END: _end_path(),
        paths.CONVERSATION_STOP: _stop_path(),
        paths.CONVERSATION_RESTORE: _restore_path(),
        paths.CONVERSATION_CONTEXT: _context_path(),
        paths.TASK_CONVERSATION: _task_path(),
        paths.METRICS: _metrics_path(),
        paths.OPENAPI: _openapi_path(),
    }


# --- components ---------------------------------------------------------------------------------


def _status_schema() -> Json:
    return {"type": "object", "properties": {
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
    }}


def _conversation_schemas() -> Json:
    return {
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
            "private": {"type": "boolean"},
            "summary": _ref("ConversationSummary"),
            "metadata": {"type": "object"},
            "agent_states": {"type": "object", "additionalProperties": _ref("AgentState")},
            "transitions": {"type": "array", "items": {"type": "object"}},
            "turns": {"type": "array", "items": {"type": "object"}},
            "execution_seconds": {"type": "integer"},
            "history": {"type": "array", "items": _ref("Event")},
        }},
    }


def _agent_schemas() -> Json:
    return {
        "AgentState": {"type": "object", "properties": {
            "last_processed_index": {"type": "integer"},
            "session_id": {"type": "string", "nullable": True},
            "transitions_seen": {"type": "integer"},
        }},
        "AgentContext": {"type": "object", "properties": {
            "conversation_id": {"type": "string"}, "agent": {"type": "string"},
            "trigger": {"type": "string"},
            "persona": {"type": "string", "description": "The persona: the system message sent first."},
            "messages": {"type": "array", "items": {"type": "object", "properties": {
                "role": {"type": "string", "enum": ["system", "user", "assistant"]},
                "content": {"type": "string"}}}},
            "session_id": {"type": "string", "nullable": True},
            "last_processed_index": {"type": "integer"},
            "next_last_processed_index": {"type": "integer"},
            "budget": {
                "type": "object", "nullable": True,
                "description": "What the agent's token budget did to the messages (null: it has none).",
                "properties": {
                    "limit": {"type": "integer"}, "strategy": {"type": "string"},
                    "tokens": {"type": "integer", "description": "Persona plus messages before any cut."},
                    "dropped": {"type": "integer", "description": "Messages left out."},
                    "to_summarize": {"type": "integer", "description":
                        "Of those, the ones the run first adds to the summary (shown as truncated)."},
                }},
        }},
    }


def _rebuild_schema() -> Json:
    count = {"type": "integer"}
    return {"type": "object", "properties": {
        "conversations": {"type": "object", "properties": {
            "found": count, "created": count, "updated": count}},
        "events": {"type": "object", "properties": {
            "fetched": count, "added": count, "already_present": count, "invalid": count,
            "skipped": {"type": "object", "additionalProperties": count,
                        "description": "Events not merged, by reason."}}},
    }}


def _error_response(description: str) -> Json:
    return {"description": description, "content": {"application/json": {"schema": _ref("Error")}}}


def _components() -> Json:
    return {
        "schemas": {
            "Error": {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}},
            "Status": _status_schema(),
            **_conversation_schemas(),
            **_agent_schemas(),
            "RebuildReport": _rebuild_schema(),
        },
        "securitySchemes": {
            "tcpToken": {
                "type": "http",
                "scheme": "bearer",
                "description": "On the TCP port only: the token in the home's run/control.token (401 "
                "without it); a Host other than 127.0.0.1:PORT or localhost:PORT, or another origin, "
                "is refused (403).",
            },
        },
        "responses": {
            "BadRequest": _error_response("A malformed id or parameter."),
            "NotFound": _error_response("No such conversation, event or agent."),
            "Conflict": _error_response(
                "The conversation is not in a state the change applies to: archived (read-only), archived or "
                "ended already, or not archived."
            ),
            "Unauthorized": _error_response("TCP only: no token, or another one (securitySchemes.tcpToken)."),
            "Forbidden": _error_response("TCP only: a Host or an origin other than the server's own."),
            "Unavailable": _error_response("The store cannot be reached now (its database down): try again."),
            "TooLarge": _error_response(f"The body is larger than {MAX_BODY_BYTES} bytes."),
        },
    }


def _with_common_responses(paths_: Json) -> Json:
    """Every operation may also answer 401 and 403 (TCP), 503 (the store unreachable) and, taking a body,
    413: the statuses any route answers, whatever it does."""
    for operations in paths_.values():
        for method, operation in operations.items():
            responses = operation["responses"]
            for status, name in (("401", "Unauthorized"), ("403", "Forbidden"), ("503", "Unavailable")):
                responses.setdefault(status, {"$ref": f"#/components/responses/{name}"})
            if method in ("post", "put", "patch"):
                responses.setdefault("413", {"$ref": "#/components/responses/TooLarge"})
    return paths_


def openapi_document() -> Json:
    """Return the OpenAPI 3.0 description of the control API."""
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "tenexd control API",
            "version": __version__,
            "description": "Local control of a tenexd daemon, on a Unix socket (mode 0600) in its home, "
            "and optionally a loopback TCP port that asks for a bearer token (securitySchemes.tcpToken).",
        },
        "paths": _with_common_responses(_paths()),
        "components": _components(),
        "security": [{}, {"tcpToken": []}],  # the socket asks for nothing; TCP for the token
    }
