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

Each refusal is counted (``tenexd_control_requests_refused_total{reason}``) and logged
(``control_request_refused`` with its ``reason``), the first :data:`LOGGED_PER_INTERVAL` of a reason in
each :data:`REFUSAL_LOG_INTERVAL_S` seconds only (:class:`RefusalLog`): refusals cost a client nothing, and
logging each one let anyone on the host write hundreds of megabytes of log in seconds.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable
from enum import StrEnum
from typing import Final

import structlog
from aiohttp import web
from aiohttp.typedefs import Middleware

from tenex_daemon.app.control.routes import TARGET_KEY, Handler
from tenex_daemon.runtime.log_budget import LineBudget

log = structlog.get_logger(__name__)

_SAME_SITE_FETCHES: Final = frozenset({"same-origin", "none"})
LOGGED_CHARS: Final = 200
"""How much of a refused request's path, Host and Origin is logged (they are the client's, of any length)."""
REFUSAL_LOG_INTERVAL_S: Final = 10.0
"""The interval in which a refusal's reason is logged :data:`LOGGED_PER_INTERVAL` times at most."""
LOGGED_PER_INTERVAL: Final = 5
"""How many refusals of a reason are logged in an interval: a client misconfigured once shows in the log
as it is, a flood costs five lines a reason."""


class Refusal(StrEnum):
    """Why a TCP request was refused (the log field and the counter's label)."""

    BAD_HOST = "bad_host"
    CROSS_ORIGIN = "cross_origin"
    NO_TOKEN = "no_token"
    BAD_TOKEN = "bad_token"


class RefusalLog:
    """Logs ``event`` for the first ``per_interval`` refusals of a reason in each ``interval_s`` seconds;
    the next line of a reason says how many of its refusals were not logged before it (``not_logged``).

    A refused client can repeat itself thousands of times a second at no cost: one warning each filled the
    disk (30,000 refusals of an 8,000-character path in 10 s wrote 255 MB). The metrics count every one.
    """

    def __init__(
        self,
        event: str,
        interval_s: float = REFUSAL_LOG_INTERVAL_S,
        per_interval: int = LOGGED_PER_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Log under the name ``event``; ``clock`` (seconds, monotonic) is the test's to set."""
        self.event = event
        self._budget = LineBudget(per_interval, interval_s, clock)

    def __call__(self, reason: str, **fields: object) -> None:
        """Log a refusal for ``reason`` with ``fields``, or count it for the next line when its interval
        logged ``per_interval`` already."""
        not_logged = self._budget.take(reason)
        if not_logged is None:
            return
        log.warning(self.event, reason=reason, **fields, **({"not_logged": not_logged} if not_logged else {}))


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
        self.log_refusal = RefusalLog("control_request_refused")

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
            request.app[TARGET_KEY].metrics.control_request_refused(reason.value)
            self.log_refusal(
                reason.value, method=request.method[:LOGGED_CHARS], path=request.path[:LOGGED_CHARS],
                host=request.headers.get("Host", "")[:LOGGED_CHARS],
                origin=request.headers.get("Origin", "")[:LOGGED_CHARS],
            )
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
