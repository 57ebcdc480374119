"""A real PostgreSQL server for tests: ``initdb`` + ``pg_ctl`` in a temp folder on a free port.

PostgreSQL refuses to run as root, so under root the server runs as a non-root user
(``postgres`` or ``tenexd-pg``, created with ``useradd`` when missing) through ``runuser``.
One server per test session (shared by every test module); each test gets a fresh database.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import itertools
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import asyncpg

SERVER_USERS = ("postgres", "tenexd-pg")


def find_bin_dir() -> Path | None:
    """Return the folder holding ``initdb`` and ``pg_ctl``, or None when PostgreSQL is missing."""
    found = shutil.which("initdb")
    if found:
        return Path(os.path.realpath(found)).parent
    for candidate in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.path.exists(os.path.join(candidate, "initdb")):
            return Path(candidate)
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _server_user() -> str | None:
    """None when not root; else a non-root account to run the server as (created if needed)."""
    if os.geteuid() != 0:
        return None
    for name in SERVER_USERS:
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    subprocess.run(["useradd", "--system", "--no-create-home", SERVER_USERS[1]], check=True)
    return SERVER_USERS[1]


def _server_options(port: int, data_dir: Path) -> str:
    """The server's command-line options (pg_ctl -o): loopback TCP on ``port``, its socket in ``data_dir``."""
    return f"-p {port} -k {data_dir} -c listen_addresses=127.0.0.1 -c fsync=on -c max_connections=200"


@dataclass
class PostgresServer:
    """A running cluster: connect as ``postgres`` over TCP on 127.0.0.1 (trust auth)."""

    data_dir: Path
    port: int
    pid: int
    bin_dir: Path
    user: str | None
    _databases: ClassVar[itertools.count[int]] = itertools.count(1)

    def dsn(self, database: str = "postgres") -> str:
        """A connection URL for ``database``."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    @classmethod
    def start(cls) -> PostgresServer:
        """Create a cluster in a temp folder and start it; wait until it accepts connections."""
        bin_dir = find_bin_dir()
        if bin_dir is None:
            raise RuntimeError("PostgreSQL is not installed (run scripts/setup.d/20-postgres.sh)")
        user = _server_user()
        data_dir = Path(tempfile.mkdtemp(prefix="tenexd-pg-"))
        prefix: list[str] = []
        if user is not None:
            entry = pwd.getpwnam(user)
            os.chown(data_dir, entry.pw_uid, entry.pw_gid)
            prefix = ["runuser", "-u", user, "--"]
        os.chmod(data_dir, 0o700)
        cluster = data_dir / "cluster"
        subprocess.run(
            [*prefix, str(bin_dir / "initdb"), "-D", str(cluster), "-U", "postgres", "-A", "trust",
             "-E", "UTF8", "--locale=C", "--no-sync"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        port = _free_port()
        options = _server_options(port, data_dir)
        subprocess.run(
            [*prefix, str(bin_dir / "pg_ctl"), "-D", str(cluster), "-o", options,
             "-l", str(data_dir / "server.log"), "-w", "-t", "60", "start"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        pid = int((cluster / "postmaster.pid").read_text().split("\n", 1)[0])
        server = cls(data_dir, port, pid, bin_dir, user)
        atexit.register(server.stop)
        return server

    def restart(self, *, crash: bool = True) -> None:
        """Stop the server (``crash``: immediate mode, as a crash: no checkpoint, recovery on start;
        else fast) and start it again on the same port and data; :attr:`pid` follows."""
        prefix = ["runuser", "-u", self.user, "--"] if self.user is not None else []
        cluster = self.data_dir / "cluster"
        pg_ctl = str(self.bin_dir / "pg_ctl")
        subprocess.run(
            [*prefix, pg_ctl, "-D", str(cluster), "-m", "immediate" if crash else "fast", "-w", "stop"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        options = _server_options(self.port, self.data_dir)
        subprocess.run(
            [*prefix, pg_ctl, "-D", str(cluster), "-o", options,
             "-l", str(self.data_dir / "server.log"), "-w", "-t", "60", "start"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        self.pid = int((cluster / "postmaster.pid").read_text().split("\n", 1)[0])

    def stop(self) -> None:
        """Stop the server by its pid (fast shutdown) and remove its folder."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGINT)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                os.kill(self.pid, 0)
                time.sleep(0.05)
            os.kill(self.pid, signal.SIGKILL)
        shutil.rmtree(self.data_dir, ignore_errors=True)

    async def create_database(self) -> str:
        """Create a fresh, empty database and return its URL."""
        name = f"t_{os.getpid()}_{next(self._databases)}"
        conn = await asyncpg.connect(self.dsn())
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()
        return self.dsn(name)


_shared: PostgresServer | None = None


def shared_server() -> PostgresServer:
    """The session's one server, started on first use and stopped (by pid) at exit."""
    global _shared
    if _shared is None:
        _shared = PostgresServer.start()
    return _shared
