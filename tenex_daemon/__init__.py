"""tenexd: the conversation brain of a team of AI agents living on Nostr.

The stable public API (docs/ARCHITECTURE.md, "Public Python API")::

    from tenex_daemon import NostrEvent, Agent, Phase, ConversationManager, MemoryStore
    from tenex_daemon import FileSystemStore, PostgresStore, ThreadManager
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tenex_daemon.adapters.storage.filesystem import FileSystemStore, StoreLockedError
    from tenex_daemon.adapters.storage.memory import MemoryStore
    from tenex_daemon.adapters.storage.postgres import PostgresStore
    from tenex_daemon.adapters.storage.tenex_import import ImportReport, import_tenex_home
    from tenex_daemon.core.agents import Agent, AgentDirectory
    from tenex_daemon.core.context import AgentContext, ChatMessage
    from tenex_daemon.core.conversation import AgentState, Conversation, ConversationMetadata
    from tenex_daemon.core.errors import (
        ConversationArchivedError,
        ConversationNotFoundError,
        InvalidEventError,
        PhaseTransitionError,
        TenexError,
        UnknownAgentError,
    )
    from tenex_daemon.core.events import NostrEvent
    from tenex_daemon.core.execution_time import ExecutionTime
    from tenex_daemon.core.phases import Phase, PhaseRules, PhaseTransition
    from tenex_daemon.core.search import ConversationSummary, SearchQuery
    from tenex_daemon.core.threads import ConversationThread, ThreadPersistenceError
    from tenex_daemon.core.turns import Completion, OrchestratorTurn
    from tenex_daemon.services.conversation_manager import ConversationManager
    from tenex_daemon.services.threads import ThreadManager

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "Agent": "tenex_daemon.core.agents",
    "AgentContext": "tenex_daemon.core.context",
    "AgentDirectory": "tenex_daemon.core.agents",
    "AgentState": "tenex_daemon.core.conversation",
    "ChatMessage": "tenex_daemon.core.context",
    "Completion": "tenex_daemon.core.turns",
    "Conversation": "tenex_daemon.core.conversation",
    "ConversationArchivedError": "tenex_daemon.core.errors",
    "ConversationManager": "tenex_daemon.services.conversation_manager",
    "ConversationMetadata": "tenex_daemon.core.conversation",
    "ConversationNotFoundError": "tenex_daemon.core.errors",
    "ConversationSummary": "tenex_daemon.core.search",
    "ConversationThread": "tenex_daemon.core.threads",
    "ExecutionTime": "tenex_daemon.core.execution_time",
    "FileSystemStore": "tenex_daemon.adapters.storage.filesystem",
    "ImportReport": "tenex_daemon.adapters.storage.tenex_import",
    "InvalidEventError": "tenex_daemon.core.errors",
    "MemoryStore": "tenex_daemon.adapters.storage.memory",
    "NostrEvent": "tenex_daemon.core.events",
    "OrchestratorTurn": "tenex_daemon.core.turns",
    "Phase": "tenex_daemon.core.phases",
    "PhaseRules": "tenex_daemon.core.phases",
    "PhaseTransition": "tenex_daemon.core.phases",
    "PhaseTransitionError": "tenex_daemon.core.errors",
    "PostgresStore": "tenex_daemon.adapters.storage.postgres",
    "SearchQuery": "tenex_daemon.core.search",
    "StoreLockedError": "tenex_daemon.adapters.storage.filesystem",
    "TenexError": "tenex_daemon.core.errors",
    "ThreadManager": "tenex_daemon.services.threads",
    "ThreadPersistenceError": "tenex_daemon.core.threads",
    "UnknownAgentError": "tenex_daemon.core.errors",
    "import_tenex_home": "tenex_daemon.adapters.storage.tenex_import",
}
"""Public name -> the module defining it; imported on first use (PEP 562), so importing one
submodule (the CLI, a store) does not pull in every adapter and its libraries."""


def __getattr__(name: str) -> Any:
    """Import a public name from its module the first time it is asked for."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])

__all__ = [
    "Agent",
    "AgentContext",
    "AgentDirectory",
    "AgentState",
    "ChatMessage",
    "Completion",
    "Conversation",
    "ConversationArchivedError",
    "ConversationManager",
    "ConversationMetadata",
    "ConversationNotFoundError",
    "ConversationSummary",
    "ConversationThread",
    "ExecutionTime",
    "FileSystemStore",
    "ImportReport",
    "InvalidEventError",
    "MemoryStore",
    "NostrEvent",
    "OrchestratorTurn",
    "Phase",
    "PhaseRules",
    "PhaseTransition",
    "PhaseTransitionError",
    "PostgresStore",
    "SearchQuery",
    "StoreLockedError",
    "TenexError",
    "ThreadManager",
    "ThreadPersistenceError",
    "UnknownAgentError",
    "__version__",
    "import_tenex_home",
]
