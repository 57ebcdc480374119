"""Acknowledging at once what a relay connection's socket received (``TCP_QUICKACK``), rather than when the
kernel's delayed acknowledgement comes: a relay's frames are small and come one at a time."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable

from websockets.asyncio.client import ClientConnection


def quick_ack(ws: ClientConnection) -> Callable[[], None]:
    """Return a call that acknowledges what the connection's socket received so far, at once.

    Linux only (``TCP_QUICKACK``; elsewhere, or for a socket that refuses it, a no-op). Made
    per connection: the option is not sticky, so it is set again after every frame read.
    """
    option = getattr(socket, "TCP_QUICKACK", None)
    sock = ws.transport.get_extra_info("socket") if ws.transport is not None else None
    if option is None or sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return no_ack

    def ack() -> None:
        with contextlib.suppress(OSError):  # closed meanwhile: the read loop sees it next
            sock.setsockopt(socket.IPPROTO_TCP, option, 1)

    return ack


def no_ack() -> None:
    """Nothing to do (no ``TCP_QUICKACK`` here, or a socket that is not TCP)."""
    return None
