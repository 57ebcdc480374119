"""How the CLI reaches conversations: the daemon's control API when it runs
(:mod:`~tenex_daemon.cli.client`), else the store itself, opened here. Both paths return the same JSON
shapes (the control API's).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from tenex_daemon.adapters.nostr.signer import KeyFileError
from tenex_daemon.adapters.storage.filesystem import StoreLockedError
from tenex_daemon.adapters.storage.memory import MemoryStore
from tenex_daemon.app.control.errors import ApiError
from tenex_daemon.app.control.parsing import parse_search
from tenex_daemon.app.control.views import conversation_json, preview_context, summary_json
from tenex_daemon.app.home import load_agents, load_project_pubkey
from tenex_daemon.app.personas import persona_specs
from tenex_daemon.app.settings import Settings, StorageKind
from tenex_daemon.app.store_check import serves_this_project
from tenex_daemon.app.wiring import build_store, routing_system_prompt, store_to_read
from tenex_daemon.cli.client import ApiAccess, daemon_session
from tenex_daemon.cli.references import AccessError, ConversationAccess
from tenex_daemon.core.errors import (
    ConversationArchivedError,
    ConversationNotFoundError,
    UnknownAgentError,
)
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.nip19 import Entity
from tenex_daemon.core.ports import PeerMessages, Store
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.services.persona import PersonaSpec
from tenex_daemon.services.stopping import PEER_ANSWER_WAIT_S, stop_without_daemon


class StoreResolver:
    """Resolves ``note``/``nevent`` references from the store alone (no relays without the daemon)."""

    def __init__(self, store: Store) -> None:
        """Look events up in ``store``."""
        self._store = store

    async def resolve(self, entity: Entity) -> NostrEvent | None:
        """Return the stored event an entity points at, or None."""
        if entity.kind_name not in ("note", "nevent"):
            return None
        found = await self._store.find_event(entity.value)
        # a private conversation's message (unsigned) is never shown outside it
        return None if found is None or not found[1].is_signed else found[1]


class LocalAccess:
    """Conversation access through the store itself (the daemon is not running)."""

    via = "store"

    def __init__(
        self,
        manager: ConversationManager,
        personas: Mapping[str, PersonaSpec] | None = None,
        routing_prompt: str | None = None,
        *,
        peers: PeerMessages | None = None,
        stop_wait_s: float = PEER_ANSWER_WAIT_S,
    ) -> None:
        """Use ``manager`` (over an opened store); ``personas``: the agents' persona specs by slug;
        ``routing_prompt``: the orchestrator model's system prompt (None: it routes by rules); ``peers``:
        the messages of a database other daemons share (a stop is told to them, answers awaited
        ``stop_wait_s``)."""
        self.manager = manager
        self.personas = personas
        self.routing_prompt = routing_prompt
        self.peers = peers
        self.stop_wait_s = stop_wait_s

    async def search(self, query: Mapping[str, str]) -> list[dict[str, Any]]:
        """Search with the control API's parameter rules."""
        try:
            args = parse_search(query, self.manager.phase_rules.phases)
        except ApiError as exc:
            raise AccessError(exc.message, exc.status) from None
        return [summary_json(row) for row in await self.manager.search_conversations(**args)]

    async def get(self, conversation_id: str) -> dict[str, Any]:
        """Return a conversation in full."""
        conversation = await self.manager.get_conversation(conversation_id)
        if conversation is None:
            raise AccessError(f"conversation {conversation_id} not found", 404)
        return conversation_json(conversation, expires_at=self.manager.expires_at(conversation))

    async def archive(self, conversation_id: str) -> None:
        """Archive a conversation."""
        if not await _mapped(self.manager.archive_conversation(conversation_id, ending_by="owner")):
            raise AccessError(f"conversation {conversation_id} is archived already", 409)

    async def restore(self, conversation_id: str) -> None:
        """Restore a conversation."""
        if not await _mapped(self.manager.restore_conversation(conversation_id)):
            raise AccessError(f"conversation {conversation_id} is not archived", 409)

    async def end(self, conversation_id: str, reason: str | None) -> None:
        """End a conversation (by the owner)."""
        if not await _mapped(self.manager.end_conversation(conversation_id, by="owner", reason=reason)):
            raise AccessError(f"conversation {conversation_id} is ended already", 409)

    async def stop(self, conversation_id: str, agent: str | None) -> dict[str, Any]:
        """This home's daemon does not run: remove the conversation's journaled runs (a crashed daemon's),
        record the stop, and tell the daemons sharing the database (their runs stop; they answer which)."""
        stopping = stop_without_daemon(
            self.manager, conversation_id, agent, by="owner", messages=self.peers, wait_s=self.stop_wait_s
        )
        report = await _mapped(stopping)
        return {"id": conversation_id, "stopped": list(report.agents), "notice": None}

    async def context(self, conversation_id: str, agent: str, trigger: str | None) -> dict[str, Any]:
        """Preview an agent's context without changing its state."""
        result: dict[str, Any] = await _mapped(
            preview_context(self.manager, conversation_id, agent, trigger, self.personas, self.routing_prompt)
        )
        return result

    async def conversation_of_event(self, event_id: str) -> dict[str, Any]:
        """Return the conversation rooted at or holding the event."""
        conversation_id = await self.manager.find_conversation_of_event(event_id)
        if conversation_id is None:
            raise AccessError(f"no conversation holds event {event_id}", 404)
        return await self.get(conversation_id)


async def _mapped(awaitable: Any) -> Any:
    """Await, turning domain errors into :class:`AccessError` with the control API's statuses."""
    try:
        return await awaitable
    except ApiError as exc:
        raise AccessError(exc.message, exc.status) from None
    except (ConversationNotFoundError, UnknownAgentError) as exc:
        raise AccessError(str(exc), 404) from None
    except ConversationArchivedError as exc:
        raise AccessError(str(exc), 409) from None


@asynccontextmanager
async def open_access(settings: Settings, create: bool = False) -> AsyncIterator[ConversationAccess]:
    """Yield access through the daemon's control API if it answers, else through the store itself. A
    filesystem store not made yet is read as an empty one and left unmade unless ``create`` (a command that
    writes conversations): ``conversations list`` in a new home, or with a mistyped ``storage.path``,
    leaves no empty store behind."""
    daemon = await daemon_session(settings)
    if daemon is not None:
        session, base_url = daemon
        try:
            yield ApiAccess(session, base_url)
        finally:
            await session.close()
        return
    try:  # before the store: a home without its keys is refused with nothing created in it
        agents = load_agents(settings)
        project = load_project_pubkey(settings)
    except KeyFileError as exc:
        raise AccessError(str(exc), 400) from None
    store = build_store(settings) if create or store_to_read(settings) else MemoryStore()
    try:
        await store.open()
    except StoreLockedError as exc:
        raise AccessError(
            f"{exc}; its control socket {settings.control_socket_path} does not answer (a daemon starting "
            "opens it once its relays answer: try again in a moment; if it lasts, see `tenexd status`)",
            503,
        ) from None
    except OSError as exc:  # a storage path that is a file, or not this user's to read
        raise AccessError(f"cannot open the store: {exc}", 400) from None
    try:
        await serves_this_project(settings, store, project)
        manager = ConversationManager(
            store,
            agents,
            project,
            resolver=StoreResolver(store),
            phase_rules=settings.phase_rules(),
            owner_pubkey=settings.owner,
            task_session_ttl_h=settings.tasks.session_ttl_h,
        )
        peers = store if isinstance(store, PeerMessages) else None  # PostgreSQL's: other daemons may share it
        yield LocalAccess(
            manager, persona_specs(settings, agents), routing_system_prompt(settings),
            peers=peers if settings.storage.kind is StorageKind.POSTGRES else None,
            stop_wait_s=settings.daemon.stop_wait_s,
        )
    finally:
        await store.close()
