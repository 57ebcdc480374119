"""The control API's errors: one answered to the client, one raised when the socket is taken, one for a
control file or path the daemon cannot start with."""

from __future__ import annotations

from tenex_daemon.core.errors import TenexError


class ApiError(TenexError):
    """An error answered as JSON ``{"error": message}`` with an HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class ControlSocketInUseError(TenexError):
    """Another process answers on the control socket (a daemon already runs on this home)."""


class ControlSetupError(TenexError, ValueError):
    """The control API cannot start with the home as it is (a token file others can read, a socket path too
    long): configuration, which the person mends (``tenexd run`` exits 2 naming it)."""
