"""The Nostr kinds and tag names tenexd speaks (docs/PROTOCOL.md).

This is the one place that names these numbers and tag shapes; the codec and the
core both read them from here.
"""

from __future__ import annotations

import re
from typing import Final, TypeGuard

KIND_PROFILE: Final = 0
KIND_NOTE: Final = 1
KIND_CONVERSATION_ROOT: Final = 11
KIND_COMMENT: Final = 1111
KIND_TASK: Final = 1934
KIND_CONVERSATION_METADATA: Final = 513
"""A conversation's title and summary, published by the project key (docs/PROTOCOL.md)."""
KIND_STREAMING: Final = 21111
KIND_PROJECT_STATUS: Final = 24010
KIND_TYPING_START: Final = 24111
KIND_TYPING_STOP: Final = 24112
KIND_OPERATIONS_STATUS: Final = 24133
"""Which agents work on a conversation now (ephemeral), signed by the project key (docs/PROTOCOL.md)."""
KIND_STOP: Final = 24134
"""A person's request to stop the agents working on a conversation (docs/PROTOCOL.md)."""
KIND_ARTICLE: Final = 30023
KIND_PROJECT: Final = 31933
KIND_RELAY_AUTH: Final = 22242
# NIP-17 private messages: a kind-14 rumor (unsigned), sealed (kind 13, NIP-44), gift-wrapped (kind 1059).
KIND_PRIVATE_MESSAGE: Final = 14
KIND_SEAL: Final = 13
KIND_GIFT_WRAP: Final = 1059
KIND_DM_RELAYS: Final = 10050
"""Where a key receives private messages (NIP-17): ``["relay", <url>]`` tags."""
KIND_AGENT_DEFINITION: Final = 4199
"""An agent definition (NIP-AE draft): ``tenexd agents add --from`` installs one."""

TAG_TITLE: Final = "title"
TAG_ADDRESS: Final = "a"
TAG_SESSION: Final = "claude-session"
SESSION_ID_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,63}")
"""A well-formed backend session id (docs/CONTEXT.md step 5): UUID-like, letters, digits and ``-``,
at most 64 characters, never starting with ``-`` (so it can never read as an option)."""
TAG_TOOL: Final = "tool"
TOOL_COMPLETE: Final = "complete"
TAG_PHASE: Final = "phase"
TAG_PUBKEY: Final = "p"
TAG_EVENT: Final = "e"
TAG_IDENTIFIER: Final = "d"
TAG_SUMMARY: Final = "summary"
TAG_STATUS: Final = "status"
TAG_SUBJECT: Final = "subject"
"""A NIP-17 private conversation's topic."""

# NIP-22 threading: upper case names the root, lower case the parent.
TAG_ROOT_EVENT: Final = "E"
TAG_ROOT_KIND: Final = "K"
TAG_ROOT_AUTHOR: Final = "P"
TAG_PARENT_KIND: Final = "k"

# Tags on an agent reply (docs/PROTOCOL.md, "Tags tenexd writes on an agent reply").
TAG_NET_TIME: Final = "net-time"
TAG_LLM_MODEL: Final = "llm-model"
TAG_LLM_PROMPT_TOKENS: Final = "llm-prompt-tokens"
TAG_LLM_COMPLETION_TOKENS: Final = "llm-completion-tokens"
TAG_LLM_COST_USD: Final = "llm-cost-usd"
TAG_ERROR: Final = "error"
ERROR_SYSTEM: Final = "system"
TAG_DELEGATION: Final = "delegation"
"""``["delegation", "<thread id>"]``: an exchange of the ``send_message`` tool, already handled (no run)."""

# Agents as Nostr citizens (NIP-AE draft): kind-0 profiles, the kind-24010 heartbeat, kind-4199 definitions.
TAG_BOT: Final = "bot"
"""``["bot"]`` on an agent's kind-0 profile."""
TAG_MODEL: Final = "model"
"""``["model", <model>, <agent slug>...]`` on the kind-24010 heartbeat."""
TAG_NAME: Final = "name"
TAG_ROLE: Final = "role"
TAG_DESCRIPTION: Final = "description"
TAG_INSTRUCTIONS: Final = "instructions"

# NIP-42 relay authentication (kind 22242); NIP-17's relay list (kind 10050) names its relays with it too.
TAG_RELAY: Final = "relay"
TAG_CHALLENGE: Final = "challenge"


def is_session_id(value: object) -> TypeGuard[str]:
    """Whether ``value`` is a well-formed backend session id (:data:`SESSION_ID_PATTERN`)."""
    return isinstance(value, str) and SESSION_ID_PATTERN.fullmatch(value) is not None


BUILT_IN_PHASE_NAMES: Final = (
    "chat", "brainstorm", "plan", "execute", "verification", "chores", "reflection",
)
"""The names of the seven phases every project has (:data:`~tenex_daemon.core.phases.BUILT_IN_PHASES`), in
their usual order."""
