"""The control API's listeners: a Unix socket (mode 0600) in the home and, optionally, loopback TCP.

A stale socket file (nobody answers on it) is replaced; one a process still answers on is
refused with :class:`ControlSocketInUseError`. The socket file is removed on stop only when it
is still the one this server bound.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import stat
from pathlib import Path
from typing import Final

import structlog
from aiohttp import web

from tenex_daemon.app.control.errors import ControlSocketInUseError
from tenex_daemon.app.control.routes import ControlTarget, create_app

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


class ControlServer:
    """Serves :func:`create_app` on a Unix socket (mode 0600) and, optionally, loopback TCP.

    ``tcp_port=0`` picks a free port (see :attr:`tcp_address`). Use ``await start()`` and
    ``await stop()``, or ``async with``.
    """

    def __init__(
        self,
        target: ControlTarget,
        socket_path: str | os.PathLike[str] | None,
        tcp_port: int | None = None,
        *,
        tcp_host: str = "127.0.0.1",
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
        self._runner: web.AppRunner | None = None
        self._socket_inode: tuple[int, int] | None = None

    async def __aenter__(self) -> ControlServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Bind the socket (0600) and the TCP port, and start serving."""
        if self._runner is not None:
            return
        runner = web.AppRunner(create_app(self.target), access_log=None, handle_signals=False)
        await runner.setup()
        try:
            if self.socket_path is not None:
                await web.SockSite(runner, self._bind_unix(self.socket_path)).start()
            if self.tcp_port is not None:
                site = web.TCPSite(runner, self.tcp_host, self.tcp_port, reuse_address=True)
                await site.start()
                for address in runner.addresses:
                    if isinstance(address, tuple):
                        self.tcp_address = (str(address[0]), int(address[1]))
        except BaseException:
            await runner.cleanup()
            self._remove_socket()
            raise
        self._runner = runner
        log.info(
            "control_api_started",
            socket=str(self.socket_path) if self.socket_path else None,
            tcp=f"{self.tcp_address[0]}:{self.tcp_address[1]}" if self.tcp_address else None,
        )

    def _bind_unix(self, path: Path) -> socket.socket:
        if len(os.fsencode(path)) > _UNIX_PATH_MAX:
            raise ValueError(
                f"control socket path {path} is longer than {_UNIX_PATH_MAX} bytes; "
                "set control.socket to a shorter path"
            )
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
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        self._remove_socket()
        self.tcp_address = None
