"""How the CLI reaches conversations: the daemon's control API when it runs, else the store itself.

A running daemon holds the filesystem home's lock, so the CLI asks it over the control
socket (aiohttp's ``UnixConnector``). When nobody answers there and ``control.tcp_port`` is set,
it asks ``127.0.0.1:PORT`` with ``Authorization: Bearer`` and the token of ``run/control.token``
(no readable token file: TCP is not tried; a refused token is an error naming the file). When nobody
answers, the CLI opens the store named by the settings directly. Both paths return the same JSON
shapes (the control API's).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from tenex_daemon.adapters.nostr.signer import KeyFileError
from tenex_daemon.adapters.storage.filesystem import StoreLockedError
from tenex_daemon.app.control.errors import ApiError
from tenex_daemon.app.control.guard import read_token
from tenex_daemon.app.control.parsing import check_id, parse_search
from tenex_daemon.app.control.paths import API_PREFIX
from tenex_daemon.app.control.views import conversation_json, preview_context, summary_json
from tenex_daemon.app.home import load_agents, load_project_pubkey
from tenex_daemon.app.personas import persona_specs
from tenex_daemon.app.settings import Settings, StorageKind
from tenex_daemon.app.wiring import build_store, routing_system_prompt
from tenex_daemon.cli.listeners import listener_uids
from tenex_daemon.core import nip19
from tenex_daemon.core.errors import (
    ConversationArchivedError,
    ConversationNotFoundError,
    TenexError,
    UnknownAgentError,
)
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.nip19 import Entity
from tenex_daemon.core.ports import PeerMessages, Store
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.services.persona import PersonaSpec
from tenex_daemon.services.stopping import PEER_ANSWER_WAIT_S, stop_without_daemon

API_TIMEOUT_S = 30.0
PROBE_TIMEOUT_S = 3.0
REBUILD_TIMEOUT_S = 600.0


class AccessError(TenexError):
    """A request failed; ``status`` as in HTTP (400 bad input, 404 unknown, 409 archived, 503 no answer)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def normalize_event_id(value: str, what: str = "conversation id") -> str:
    """Return the hex id of 64 hex characters, a ``note1`` or an ``nevent1`` (``nostr:`` prefix allowed)."""
    text = value.strip().removeprefix("nostr:")
    if text.startswith(("note1", "nevent1")):
        try:
            return nip19.decode(text).value
        except nip19.Nip19Error as exc:
            raise AccessError(f"{what}: {exc}") from None
    try:
        return check_id(text.lower(), what)
    except ApiError as exc:
        raise AccessError(exc.message, exc.status) from None


MIN_ID_PREFIX = 4
"""The fewest hex digits of a conversation id taken as a short id (``tenexd conversations show 3fa9``)."""
SHORT_ID_SHOWN = 5
"""How many of the conversations an ambiguous short id starts are named in the error."""
_SHORT_ID = re.compile(rf"[0-9a-f]{{{MIN_ID_PREFIX},63}}")


def conversation_reference(value: str, what: str = "conversation id") -> str:
    """Return the hex id of a whole id (hex, ``note1``, ``nevent1``), or the lowercased hex digits a short
    id gives (at least :data:`MIN_ID_PREFIX`, resolved by :func:`resolve_conversation`); raise
    :class:`AccessError` 400 when it is neither."""
    text = value.strip().removeprefix("nostr:").lower()
    if _SHORT_ID.fullmatch(text):
        return text
    try:
        return normalize_event_id(value, what)
    except AccessError:
        if text.startswith(("note1", "nevent1")):
            raise  # its NIP-19 error says what is wrong with it
        raise AccessError(
            f"{what} must be 64 hex characters, the first {MIN_ID_PREFIX} or more of a conversation's id, "
            f"a note1 or an nevent1; got {value.strip()[:80]!r}"
        ) from None


async def resolve_conversation(access: ConversationAccess, reference: str) -> str:
    """Return the conversation id a :func:`conversation_reference` names: itself when whole, else the one
    conversation, archived or not, whose id starts with it; raise :class:`AccessError` 404 when none does
    and 400 when several do (naming them)."""
    if len(reference) == 64:
        return reference
    rows = await access.search({"id_prefix": reference, "limit": str(SHORT_ID_SHOWN + 1)})
    ids = [str(row.get("id")) for row in rows]
    if not ids:
        raise AccessError(f"no conversation id starts with {reference}", 404)
    if len(ids) > 1:
        shown = ", ".join(ids[:SHORT_ID_SHOWN]) + (", ..." if len(ids) > SHORT_ID_SHOWN else "")
        raise AccessError(f"{reference} starts more than one conversation id ({shown}): give more of it", 400)
    return ids[0]


class ConversationAccess(Protocol):
    """Conversation operations the CLI needs; each returns the control API's JSON shapes."""

    via: str
    """``control API`` or ``store``: where the answers come from."""

    async def search(self, query: Mapping[str, str]) -> list[dict[str, Any]]:
        """Return summary rows matching the query parameters of ``GET /api/v1/conversations``."""

    async def get(self, conversation_id: str) -> dict[str, Any]:
        """Return a conversation in full (raises AccessError 404 when unknown)."""

    async def archive(self, conversation_id: str) -> None:
        """Archive a conversation (raises AccessError 409 when it is archived already)."""

    async def restore(self, conversation_id: str) -> None:
        """Restore an archived conversation (raises AccessError 409 when it is not archived)."""

    async def end(self, conversation_id: str, reason: str | None) -> None:
        """End a conversation (by the owner): recorded with it (when, who, why); it stays writable."""

    async def stop(self, conversation_id: str, agent: str | None) -> dict[str, Any]:
        """Stop the agents working on a conversation (``agent`` only, when given), as the owner; return
        ``{"id", "stopped": [slugs], "notice": id | None}``."""

    async def context(self, conversation_id: str, agent: str, trigger: str | None) -> dict[str, Any]:
        """Return what the agent would be sent now, without changing its state."""

    async def conversation_of_event(self, event_id: str) -> dict[str, Any]:
        """Return the conversation rooted at or holding this event (raises AccessError 404)."""


class ApiAccess:
    """Conversation access through a running daemon's control API."""

    via = "control API"

    def __init__(self, session: aiohttp.ClientSession, base_url: str = "http://tenexd") -> None:
        """Use ``session`` (bound to the control socket, or carrying the TCP token) at ``base_url``."""
        self._session = session
        self._base_url = base_url

    async def _call(
        self, method: str, path: str, *, params: Mapping[str, str] | None = None, body: Any = None,
        timeout: float = API_TIMEOUT_S,  # noqa: ASYNC109 - aiohttp's per-request timeout
    ) -> dict[str, Any]:
        try:
            async with self._session.request(
                method, f"{self._base_url}{API_PREFIX}{path}", params=params, json=body,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as response:
                text = await response.text()
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            message = f"the daemon's control API did not answer ({type(exc).__name__})"
            raise AccessError(message, 503) from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = {"error": text[:300]}
        if status >= 400:
            detail = data.get("error") if isinstance(data, dict) else None
            raise AccessError(str(detail or f"HTTP {status}"), status)
        if not isinstance(data, dict):
            raise AccessError("the control API answered something other than a JSON object", 502)
        return data

    async def search(self, query: Mapping[str, str]) -> list[dict[str, Any]]:
        """Search through ``GET /api/v1/conversations``."""
        data = await self._call("GET", "/conversations", params=query)
        rows = data.get("conversations", [])
        return list(rows) if isinstance(rows, list) else []

    async def get(self, conversation_id: str) -> dict[str, Any]:
        """``GET /api/v1/conversations/{id}``."""
        return await self._call("GET", f"/conversations/{conversation_id}")

    async def archive(self, conversation_id: str) -> None:
        """``POST /api/v1/conversations/{id}/archive``."""
        await self._call("POST", f"/conversations/{conversation_id}/archive")

    async def restore(self, conversation_id: str) -> None:
        """``POST /api/v1/conversations/{id}/restore``."""
        await self._call("POST", f"/conversations/{conversation_id}/restore")

    async def end(self, conversation_id: str, reason: str | None) -> None:
        """``POST /api/v1/conversations/{id}/end``."""
        body = {"reason": reason} if reason else None
        await self._call("POST", f"/conversations/{conversation_id}/end", body=body)

    async def stop(self, conversation_id: str, agent: str | None) -> dict[str, Any]:
        """``POST /api/v1/conversations/{id}/stop``."""
        body = {"agent": agent} if agent else None
        return await self._call("POST", f"/conversations/{conversation_id}/stop", body=body)

    async def context(self, conversation_id: str, agent: str, trigger: str | None) -> dict[str, Any]:
        """``GET /api/v1/conversations/{id}/context``."""
        params = {"agent": agent}
        if trigger is not None:
            params["trigger"] = trigger
        return await self._call("GET", f"/conversations/{conversation_id}/context", params=params)

    async def conversation_of_event(self, event_id: str) -> dict[str, Any]:
        """``GET /api/v1/tasks/{id}/conversation`` (it finds the conversation holding any event)."""
        return await self._call("GET", f"/tasks/{event_id}/conversation")

    async def rebuild(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """``POST /api/v1/conversations/rebuild`` (the daemon fetches from its relays: minutes allowed)."""
        return await self._call("POST", "/conversations/rebuild", body=dict(body), timeout=REBUILD_TIMEOUT_S)


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


async def _probe(session: aiohttp.ClientSession, base_url: str) -> int | None:
    """Return the status of ``GET /api/v1/status`` (None: nobody answers)."""
    try:
        async with session.get(
            f"{base_url}{API_PREFIX}/status", timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
        ) as response:
            await response.read()
            status = response.status
    except (aiohttp.ClientError, TimeoutError, OSError):
        return None
    return status


async def _socket_session(settings: Settings) -> aiohttp.ClientSession | None:
    """Return a session on the control socket if a daemon answers there, else None."""
    path = settings.control_socket_path
    if not path.is_socket():
        return None
    session = aiohttp.ClientSession(
        connector=aiohttp.UnixConnector(path=str(path)),
        timeout=aiohttp.ClientTimeout(total=API_TIMEOUT_S),
    )
    if await _probe(session, "http://tenexd") is None:
        await session.close()
        return None
    return session


async def _tcp_session(settings: Settings) -> tuple[aiohttp.ClientSession, str] | None:
    """Return a session (carrying the token) and base URL on ``control.tcp_port`` if a daemon answers."""
    port = settings.control.tcp_port
    if port is None:
        return None
    token_path = settings.control_token_path
    try:
        token = read_token(token_path)
    except (ValueError, OSError):
        token = None  # a daemon refuses to start on a bad token file: none answers with it
    if token is None:
        return None
    base_url = f"http://127.0.0.1:{port}"
    if not _daemons_user_listens(port, token_path, base_url):
        return None
    session = aiohttp.ClientSession(
        headers={"Authorization": f"Bearer {token}"}, timeout=aiohttp.ClientTimeout(total=API_TIMEOUT_S)
    )
    status = await _probe(session, base_url)
    if status == 200:
        return session, base_url
    await session.close()
    if status in (401, 403):
        raise AccessError(f"the daemon on {base_url} refused the token in {token_path} (HTTP {status})", 503)
    return None


def _daemons_user_listens(port: int, token_path: Path, base_url: str) -> bool:
    """Whether the token may go to ``port``: False when nobody listens there; AccessError (503) when another
    user than the token file's owner (the daemon's user) listens there too (:mod:`.listeners`)."""
    uids = listener_uids(port)
    if uids is None:  # not Linux: who listens cannot be told
        return True
    if not uids:
        return False
    try:
        owner = token_path.stat().st_uid
    except FileNotFoundError:  # removed since it was read: no daemon made it
        return False
    if uids != {owner}:
        others = ", ".join(str(uid) for uid in sorted(uids - {owner}))
        raise AccessError(
            f"{base_url} is listened on by uid {others}, not by the daemon's user (uid {owner}, owner of "
            f"{token_path}): the token is not sent there",
            503,
        )
    return True


async def _daemon_session(settings: Settings) -> tuple[aiohttp.ClientSession, str] | None:
    """Return a session and base URL on the daemon's control API (the socket, else TCP), else None."""
    session = await _socket_session(settings)
    if session is not None:
        return session, "http://tenexd"
    return await _tcp_session(settings)


async def live_status(settings: Settings) -> dict[str, Any] | None:
    """The status the daemon answers on its control API now (None: nobody answers, or not with one)."""
    try:
        daemon = await _daemon_session(settings)
    except AccessError:
        return None
    if daemon is None:
        return None
    session, base_url = daemon
    try:
        async with session.get(f"{base_url}{API_PREFIX}/status") as response:
            data = await response.json() if response.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
        data = None
    finally:
        await session.close()
    return data if isinstance(data, dict) else None


@asynccontextmanager
async def open_access(settings: Settings) -> AsyncIterator[ConversationAccess]:
    """Yield access through the daemon's control API if it answers, else through the store itself."""
    daemon = await _daemon_session(settings)
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
    store = build_store(settings)
    try:
        await store.open()
    except StoreLockedError as exc:
        raise AccessError(
            f"{exc}; its control socket {settings.control_socket_path} does not answer "
            "(is the daemon stuck? see `tenexd status`)",
            503,
        ) from None
    except OSError as exc:  # a storage path that is a file, or not this user's to read
        raise AccessError(f"cannot open the store: {exc}", 400) from None
    try:
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
