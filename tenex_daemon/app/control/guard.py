"""What the control API's loopback TCP port asks of a request: its token, its own Host, its own origin.

The Unix socket is protected by its file mode (0600); a TCP port on loopback is reachable by every
local user and, through a browser, by every web page. So on TCP:

- the Host header must name the server itself (``127.0.0.1:PORT``, ``localhost:PORT`` or the bind
  host): a page whose DNS name was rebound to 127.0.0.1 sends its own name (403 ``bad_host``);
- a request with an ``Origin`` other than the server's own (``null`` included), or a
  ``Sec-Fetch-Site`` of another site, is refused (403 ``cross_origin``): a cross-site POST;
- it must carry ``Authorization: Bearer <token>`` (401 ``no_token`` / ``bad_token``), the token
  read from a 0600 file in the home (``run/control.token``), created at the daemon's start when
  missing and kept across restarts (:mod:`~tenex_daemon.app.control.token`); the CLI reads the same file.

Each refusal is logged (``control_request_refused`` with its ``reason``) and counted
(``tenexd_control_requests_refused_total{reason}``).
"""

from __future__ import annotations

import hmac
from enum import StrEnum
from typing import Final

import structlog
from aiohttp import web
from aiohttp.typedefs import Middleware

from tenex_daemon.app.control.routes import TARGET_KEY, Handler

log = structlog.get_logger(__name__)

_SAME_SITE_FETCHES: Final = frozenset({"same-origin", "none"})


class Refusal(StrEnum):
    """Why a TCP request was refused (the log field and the counter's label)."""

    BAD_HOST = "bad_host"
    CROSS_ORIGIN = "cross_origin"
    NO_TOKEN = "no_token"
    BAD_TOKEN = "bad_token"


def _host_literal(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class TcpGuard:
    """Checks Host, Origin and the bearer token of requests on the TCP port (see the module's doc).

    Nothing is allowed until :meth:`bind` names the port the server listens on.
    """

    def __init__(self, token: str, bind_host: str) -> None:
        """Accept ``token``; ``bind_host`` is also accepted as a Host name."""
        self.token = token
        self.bind_host = bind_host
        self._hosts: frozenset[str] = frozenset()
        self._origins: frozenset[str] = frozenset()

    def bind(self, port: int) -> None:
        """Accept the Host names and origins of the server on ``port``."""
        names = {"127.0.0.1", "localhost", _host_literal(self.bind_host).lower()}
        hosts = {f"{name}:{port}" for name in names}
        if port == 80:
            hosts |= names
        self._hosts = frozenset(hosts)
        self._origins = frozenset(f"http://{host}" for host in hosts)

    def refusal(self, request: web.Request) -> Refusal | None:
        """Return why ``request`` is refused, or None when it may be served."""
        if request.headers.get("Host", "").strip().lower() not in self._hosts:
            return Refusal.BAD_HOST
        origin = request.headers.get("Origin")
        if origin is not None and origin.strip().lower().rstrip("/") not in self._origins:
            return Refusal.CROSS_ORIGIN
        fetch_site = request.headers.get("Sec-Fetch-Site")
        if fetch_site is not None and fetch_site.strip().lower() not in _SAME_SITE_FETCHES:
            return Refusal.CROSS_ORIGIN
        scheme, _, credentials = request.headers.get("Authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer" or not credentials.strip():
            return Refusal.NO_TOKEN
        # surrogateescape: a header's bytes that are not UTF-8 (aiohttp keeps them as surrogates) are a wrong
        # token like any other, not a failed request
        given = credentials.strip().encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, self.token.encode()):
            return Refusal.BAD_TOKEN
        return None

    def middleware(self) -> Middleware:
        """Return the aiohttp middleware refusing what :meth:`refusal` refuses, as JSON with the reason."""

        @web.middleware
        async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
            reason = self.refusal(request)
            if reason is None:
                return await handler(request)
            log.warning(
                "control_request_refused", reason=reason.value, method=request.method, path=request.path,
                host=request.headers.get("Host", "")[:200], origin=request.headers.get("Origin", "")[:200],
            )
            request.app[TARGET_KEY].metrics.control_request_refused(reason.value)
            return _refused(reason)

        return guard


_MESSAGES: Final = {
    Refusal.BAD_HOST: "the Host header must name this server (127.0.0.1:PORT or localhost:PORT)",
    Refusal.CROSS_ORIGIN: "cross-origin requests are refused (Origin or Sec-Fetch-Site of another site)",
    Refusal.NO_TOKEN: "the TCP control API needs Authorization: Bearer <the home's run/control.token>",
    Refusal.BAD_TOKEN: "wrong token (see the home's run/control.token)",
}


def _refused(reason: Refusal) -> web.Response:
    unauthorized = reason in (Refusal.NO_TOKEN, Refusal.BAD_TOKEN)
    headers = {"WWW-Authenticate": 'Bearer realm="tenexd"'} if unauthorized else None
    body = {"error": _MESSAGES[reason], "reason": reason.value}
    return web.json_response(body, status=401 if unauthorized else 403, headers=headers)
