"""The CLI's client of a running daemon's control API.

A running daemon holds the filesystem home's lock, so the CLI asks it over the control socket
(aiohttp's ``UnixConnector``). When nobody answers there and ``control.tcp_port`` is set, it asks
``127.0.0.1:PORT`` with ``Authorization: Bearer`` and the token of ``run/control.token`` (no readable
token file: TCP is not tried; a refused token is an error naming the file). Without the store's modules:
``tenexd status`` loads only this.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from tenex_daemon.app.control.paths import API_PREFIX
from tenex_daemon.app.control.token import read_token
from tenex_daemon.cli.listeners import listener_uids
from tenex_daemon.cli.references import AccessError

if TYPE_CHECKING:
    from tenex_daemon.app.settings import Settings

API_TIMEOUT_S = 30.0
PROBE_TIMEOUT_S = 3.0
REBUILD_TIMEOUT_S = 600.0


OLDER_DAEMON_SAYS = ("unknown parameter(s)", "404: Not Found")
"""How a control API that does not know what this command asks begins its refusal (a parameter, a route)."""
OLDER_DAEMON = (
    "the daemon running is older than this tenexd: restart it to run the version installed, "
    "e.g. `systemctl restart tenexd`"
)


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
            detail = str((data.get("error") if isinstance(data, dict) else None) or f"HTTP {status}")
            if status in (400, 404) and detail.startswith(OLDER_DAEMON_SAYS):
                detail += f" ({OLDER_DAEMON})"
            raise AccessError(detail, status)
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


async def daemon_session(settings: Settings) -> tuple[aiohttp.ClientSession, str] | None:
    """Return a session and base URL on the daemon's control API (the socket, else TCP), else None."""
    session = await _socket_session(settings)
    if session is not None:
        return session, "http://tenexd"
    return await _tcp_session(settings)


async def live_status(settings: Settings) -> dict[str, Any] | None:
    """The status the daemon answers on its control API now (None: nobody answers, or not with one)."""
    try:
        daemon = await daemon_session(settings)
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


def served_agents(status: Mapping[str, Any]) -> dict[str, str] | None:
    """The agents a running daemon serves, slug -> public key, as its status document lists them (``agents``,
    filled before its control API answers); None when the document lists none that way (another version's)."""
    listed = status.get("agents")
    if not isinstance(listed, list):
        return None
    return {
        entry["slug"]: str(entry.get("pubkey"))
        for entry in listed
        if isinstance(entry, dict) and isinstance(entry.get("slug"), str)
    }


def unserved_reason(status: Mapping[str, Any] | None, slug: str, pubkey: str | None = None) -> str | None:
    """Why the running daemon whose status document is ``status`` cannot answer as agent ``slug`` (with public
    key ``pubkey`` when given): it does not serve it, as when the agent was added to config.toml after the
    daemon started (the daemon reads its agents once, at start). None when it serves it, or when no daemon
    answers (``status`` None) or its document does not say."""
    served = served_agents(status) if status is not None else None
    if served is None or (slug in served and pubkey in (None, served[slug])):
        return None
    names = ", ".join(served) or "none"
    return (
        f"the running daemon does not serve agent {slug!r} (it serves: {names}): it was started before the "
        f"agent was added to config.toml (or its key changed), and reads its agents only at start; restart "
        "the daemon (stop `tenexd run` and start it again; under systemd `systemctl restart tenexd`), then "
        "try again"
    )
