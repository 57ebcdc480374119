"""The control API's listeners: a Unix socket (mode 0600) in the home and, optionally, loopback TCP.

The TCP port is served by its own application, guarded (:mod:`tenex_daemon.app.control.guard`):
a bearer token from a 0600 file, its own Host only, no cross-origin request. The socket's file
mode is its protection, so it asks for none of these.

A stale socket file (nobody answers on it) is replaced; one a process still answers on is
refused with :class:`ControlSocketInUseError`. The socket file is removed on stop only when it
is still the one this server bound.

Every local user reaches the TCP port, and the token is read only once a whole request came: so a
connection that sends no request is closed after :data:`IDLE_CONNECTION_S`, and beyond
:data:`TCP_CONNECTIONS_MAX` open at once a new one is closed as soon as it is accepted. Idle connections
held by the thousand used up the daemon's file descriptors (its socket, its store, its relays failed).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import secrets
import socket
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Final

import structlog
from aiohttp import web

from tenex_daemon.app.control.errors import ControlSetupError, ControlSocketInUseError
from tenex_daemon.app.control.guard import RefusalLog, TcpGuard
from tenex_daemon.app.control.routes import ControlTarget, create_app
from tenex_daemon.app.control.token import TOKEN_BYTES, load_or_create_token, read_token

log = structlog.get_logger(__name__)

_LOOPBACK_NAMES: Final = frozenset({"localhost"})
_UNIX_PATH_MAX: Final = 107


def _is_loopback(host: str) -> bool:
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _clear_stale_socket(path: Path) -> None:
    """Remove a socket file nobody answers on; refuse when a process still listens there."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise ControlSocketInUseError(f"{path} exists and is not a socket; move it away")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink(missing_ok=True)
        log.info("control_socket_stale_removed", path=str(path))
        return
    finally:
        probe.close()
    raise ControlSocketInUseError(
        f"another process answers on {path}: is a daemon already running on this home?"
    )


REQUESTS_AT_STOP_S = 5.0
"""How long a stop waits for the requests still being answered (a rebuild may take minutes) before it
cancels them: aiohttp's 60 s, twice, outlasted systemd's stop timeout."""


IDLE_CONNECTION_S = 5.0
"""How long a connection may wait for its (next) request, counted from its opening and then from each answer,
before the server closes it: aiohttp's keep-alive timeout, whose 3,630 s default let a connection that never
completes a request stay open an hour (bytes received without a whole request do not restart it)."""
TCP_CONNECTIONS_MAX = 64
"""How many connections the TCP port holds open at once; the next is closed as soon as it is accepted (and
counted as refused, ``too_many_connections``). The CLI uses one at a time; the socket is not limited."""
TOO_MANY_CONNECTIONS = "too_many_connections"


class _CappedConnection(asyncio.Protocol):
    """A connection accepted on the TCP port: handed to aiohttp's ``server`` while it holds fewer than
    ``cap`` connections, else closed at once.

    The count is read when the connection is made, not in the protocol factory: the event loop calls the
    factory for a whole batch of accepted connections before any of them is made (and counted by aiohttp),
    so a burst would pass a cap checked there.
    """

    def __init__(self, server: web.Server, cap: int, refused: Callable[[], None]) -> None:
        """Hand over to ``server`` below ``cap`` connections; call ``refused`` for each one closed."""
        self._server = server
        self._cap = cap
        self._refused = refused

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Close ``transport`` when the server holds ``cap`` connections, else give it to a handler."""
        if len(self._server.connections) >= self._cap:
            transport.close()
            self._refused()
            return
        handler = self._server()
        transport.set_protocol(handler)
        handler.connection_made(transport)


class ControlServer:
    """Serves :func:`create_app` on a Unix socket (mode 0600) and, optionally, loopback TCP.

    ``tcp_port=0`` picks a free port (see :attr:`tcp_address`). TCP asks for the token in
    ``token_path`` (created 0600 when missing); without a path, a new token for this run only
    (:attr:`token`). Use ``await start()`` and ``await stop()``, or ``async with``.
    """

    def __init__(
        self,
        target: ControlTarget,
        socket_path: str | os.PathLike[str] | None,
        tcp_port: int | None = None,
        *,
        tcp_host: str = "127.0.0.1",
        token_path: str | os.PathLike[str] | None = None,
    ) -> None:
        """Describe the server; nothing listens until :meth:`start`."""
        if socket_path is None and tcp_port is None:
            raise ValueError("the control API needs a Unix socket path, a TCP port, or both")
        if tcp_port is not None and not _is_loopback(tcp_host):
            raise ValueError(f"the control API listens on loopback only, not {tcp_host!r}")
        self.target = target
        self.socket_path = Path(socket_path) if socket_path is not None else None
        self.tcp_port = tcp_port
        self.tcp_host = tcp_host
        self.tcp_address: tuple[str, int] | None = None
        """The bound TCP (host, port) once started."""
        self.token_path = Path(token_path) if token_path is not None else None
        self.token: str | None = None
        """The token TCP asks for, once started (None without TCP)."""
        self._runners: list[web.AppRunner] = []
        self._tcp_listener: asyncio.Server | None = None
        self._log_refusal = RefusalLog("control_connection_refused")
        self._socket_inode: tuple[int, int] | None = None

    def check(self) -> None:
        """Raise :class:`ControlSetupError` now for what :meth:`start` would refuse in the home as it is (a
        socket path too long, a token file others can read): a daemon says so before it starts anything."""
        if self.socket_path is not None:
            _check_socket_path(self.socket_path)
        if self.tcp_port is not None and self.token_path is not None:
            read_token(self.token_path)

    async def __aenter__(self) -> ControlServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Bind the socket (0600) and the TCP port, and start serving."""
        if self._runners:
            return
        try:
            if self.socket_path is not None:
                runner = await self._runner_for(create_app(self.target))
                await web.SockSite(runner, self._bind_unix(self.socket_path)).start()
            if self.tcp_port is not None:
                await self._start_tcp(self.tcp_port)
        except BaseException:
            await self.stop()
            raise
        log.info(
            "control_api_started",
            socket=str(self.socket_path) if self.socket_path else None,
            tcp=f"{self.tcp_address[0]}:{self.tcp_address[1]}" if self.tcp_address else None,
            token=str(self.token_path) if self.tcp_address and self.token_path else None,
        )

    async def _runner_for(self, app: web.Application) -> web.AppRunner:
        runner = web.AppRunner(
            app, access_log=None, handle_signals=False, shutdown_timeout=REQUESTS_AT_STOP_S,
            keepalive_timeout=IDLE_CONNECTION_S,
        )
        await runner.setup()
        self._runners.append(runner)
        return runner

    async def _start_tcp(self, port: int) -> None:
        """Serve the guarded application on ``tcp_host:port`` (the guard passes nothing before it knows
        the port), at most :data:`TCP_CONNECTIONS_MAX` connections at once."""
        if self.token_path is not None:
            self.token = load_or_create_token(self.token_path)
        else:
            self.token = secrets.token_urlsafe(TOKEN_BYTES)
        guard = TcpGuard(self.token, self.tcp_host)
        runner = await self._runner_for(create_app(self.target, guard=guard.middleware()))
        server = runner.server
        assert server is not None  # set up by _runner_for
        self._tcp_listener = await asyncio.get_running_loop().create_server(
            lambda: _CappedConnection(server, TCP_CONNECTIONS_MAX, self._connection_refused),
            self.tcp_host, port, reuse_address=True,
        )
        for sock in self._tcp_listener.sockets:
            address = sock.getsockname()
            self.tcp_address = (str(address[0]), int(address[1]))
        if self.tcp_address is None:
            raise OSError(f"the control API's TCP port {self.tcp_host}:{port} reported no address")
        guard.bind(self.tcp_address[1])

    def _connection_refused(self) -> None:
        self.target.metrics.control_request_refused(TOO_MANY_CONNECTIONS)
        self._log_refusal(TOO_MANY_CONNECTIONS, limit=TCP_CONNECTIONS_MAX)

    def _bind_unix(self, path: Path) -> socket.socket:
        _check_socket_path(path)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        _clear_stale_socket(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            old_umask = os.umask(0o177)
            try:
                sock.bind(str(path))
            finally:
                os.umask(old_umask)
            os.chmod(path, 0o600)
            info = path.stat()
            self._socket_inode = (info.st_dev, info.st_ino)
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock

    def _remove_socket(self) -> None:
        if self.socket_path is None or self._socket_inode is None:
            return
        with contextlib.suppress(OSError):
            info = self.socket_path.stat()
            if (info.st_dev, info.st_ino) == self._socket_inode:
                self.socket_path.unlink()
        self._socket_inode = None

    async def stop(self) -> None:
        """Stop serving and remove the socket file. Safe to call twice."""
        listener, self._tcp_listener = self._tcp_listener, None
        if listener is not None:  # no new connection while the open ones are closed
            listener.close()
        runners, self._runners = self._runners, []
        for runner in reversed(runners):
            await runner.cleanup()
        self._remove_socket()
        self.tcp_address = None


def _check_socket_path(path: Path) -> None:
    if len(os.fsencode(path)) > _UNIX_PATH_MAX:
        raise ControlSetupError(
            f"control socket path {path} is longer than {_UNIX_PATH_MAX} bytes; "
            "set control.socket to a shorter path"
        )
