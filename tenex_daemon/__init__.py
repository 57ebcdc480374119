"""tenexd: the conversation brain of a team of AI agents living on Nostr.

The stable public API (ARCHITECTURE.md)::

    from tenex_daemon import NostrEvent, Agent, Phase, ConversationManager, MemoryStore
    from tenex_daemon import FileSystemStore, PostgresStore, ThreadManager
"""

from __future__ import annotations

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
