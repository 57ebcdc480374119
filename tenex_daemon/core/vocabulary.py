"""The Nostr kinds and tag names tenexd speaks (PROTOCOL.md).

This is the one place that names these numbers and tag shapes; the codec and the
core both read them from here.
"""

from __future__ import annotations

from typing import Final

KIND_PROFILE: Final = 0
KIND_NOTE: Final = 1
KIND_CONVERSATION_ROOT: Final = 11
KIND_COMMENT: Final = 1111
KIND_TASK: Final = 1934
KIND_STREAMING: Final = 21111
KIND_PROJECT_STATUS: Final = 24010
KIND_TYPING_START: Final = 24111
KIND_TYPING_STOP: Final = 24112
KIND_ARTICLE: Final = 30023
KIND_PROJECT: Final = 31933
KIND_RELAY_AUTH: Final = 22242

TAG_TITLE: Final = "title"
TAG_ADDRESS: Final = "a"
TAG_SESSION: Final = "claude-session"
TAG_TOOL: Final = "tool"
TOOL_COMPLETE: Final = "complete"
TAG_PHASE: Final = "phase"
TAG_PUBKEY: Final = "p"
TAG_EVENT: Final = "e"
TAG_IDENTIFIER: Final = "d"
