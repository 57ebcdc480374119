"""Where the control API's endpoints live, and the largest body it takes: shared by its routes, its OpenAPI
document and the CLI."""

from __future__ import annotations

from typing import Final

API_PREFIX: Final = "/api/v1"

OPENAPI: Final = f"{API_PREFIX}/openapi.json"
STATUS: Final = f"{API_PREFIX}/status"
CONVERSATIONS: Final = f"{API_PREFIX}/conversations"
CONVERSATIONS_REBUILD: Final = f"{CONVERSATIONS}/rebuild"
CONVERSATION: Final = f"{CONVERSATIONS}/{{id}}"
CONVERSATION_RESET: Final = f"{CONVERSATION}/reset"
CONVERSATION_ARCHIVE: Final = f"{CONVERSATION}/archive"
CONVERSATION_END: Final = f"{CONVERSATION}/end"
CONVERSATION_STOP: Final = f"{CONVERSATION}/stop"
CONVERSATION_RESTORE: Final = f"{CONVERSATION}/restore"
CONVERSATION_CONTEXT: Final = f"{CONVERSATION}/context"
TASK_CONVERSATION: Final = f"{API_PREFIX}/tasks/{{id}}/conversation"
METRICS: Final = "/metrics"

MAX_BODY_BYTES: Final = 64 * 1024
"""The largest request body served (413 beyond)."""
