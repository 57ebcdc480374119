"""Who listens on a TCP port of this machine: the CLI sends the control token only to its daemon's user.

With the daemon down, any local user may listen on ``control.tcp_port``; a CLI that sent the token there
would hand it over (and the token is kept across restarts). Linux says which user owns each listening
socket in ``/proc/net/tcp`` and ``/proc/net/tcp6`` (readable by every user): the CLI sends the token only
when every socket listening on the port where a connection to 127.0.0.1 goes (127.0.0.1, 0.0.0.0, ::)
belongs to the token file's owner, the user the daemon runs as.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

PROC_NET_TCP: tuple[Path, ...] = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
"""The kernel's tables of TCP sockets (IPv4, IPv6)."""
LISTEN: Final = "0A"
"""A socket's state in those tables when it listens."""
LOOPBACK_REACHING: Final = frozenset({
    "0100007F",  # 127.0.0.1
    "00000000",  # 0.0.0.0
    "00000000000000000000000000000000",  # ::
    "0000000000000000FFFF00000100007F",  # ::ffff:127.0.0.1
})
"""The local addresses (as the tables write them) of a socket that a connection to 127.0.0.1 can reach."""


def listener_uids(port: int, tables: tuple[Path, ...] | None = None) -> set[int] | None:
    """The users owning a socket that listens on ``port`` at an address a connection to 127.0.0.1 reaches;
    None when the system has no such tables to read (not Linux): who listens cannot be told."""
    found: set[int] = set()
    read_any = False
    for table in PROC_NET_TCP if tables is None else tables:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        read_any = True
        for line in lines:
            fields = line.split()
            if len(fields) < 8 or fields[3] != LISTEN:
                continue
            address, _, port_hex = fields[1].rpartition(":")
            if address.upper() not in LOOPBACK_REACHING:
                continue
            try:
                if int(port_hex, 16) == port:
                    found.add(int(fields[7]))
            except ValueError:
                continue
    return found if read_any else None
