"""The control API's errors: one answered to the client, one raised when the socket is taken."""

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
