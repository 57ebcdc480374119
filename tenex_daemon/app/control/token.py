"""The control API's token file (``run/control.token``, mode 0600): made at the daemon's start when
missing and kept across restarts; the daemon checks TCP requests against it
(:mod:`~tenex_daemon.app.control.guard`) and the CLI reads it to send it. Apart from the server so that
the CLI reads it without importing the server.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
from pathlib import Path
from typing import Final

import structlog

from tenex_daemon.app.control.errors import ControlSetupError

log = structlog.get_logger(__name__)

TOKEN_BYTES: Final = 32
_TOKEN_PATTERN: Final = re.compile(r"^[A-Za-z0-9_-]{32,256}$")


def _check_token_file(path: Path) -> str:
    info = path.lstat()
    if not stat.S_ISREG(info.st_mode):
        raise ControlSetupError(f"control token file {path} is not a regular file; move it away")
    if info.st_mode & 0o077:
        raise ControlSetupError(
            f"control token file {path} has mode {stat.S_IMODE(info.st_mode):o}, readable by others; "
            "delete it (a new token is made at the next start) or chmod 600 it"
        )
    token = path.read_text(encoding="ascii", errors="replace").strip()
    if not _TOKEN_PATTERN.match(token):
        raise ControlSetupError(
            f"control token file {path} holds no token (32+ URL-safe characters); delete it"
        )
    return token


def read_token(path: Path) -> str | None:
    """Return the token in ``path`` (None when the file is missing); raise ControlSetupError (a ValueError)
    on a bad file."""
    try:
        return _check_token_file(path)
    except FileNotFoundError:
        return None


def load_or_create_token(path: Path) -> str:
    """Return the token in ``path``, first writing a new one there (mode 0600, atomically) when missing."""
    existing = read_token(path)
    if existing is not None:
        return existing
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    token = secrets.token_urlsafe(TOKEN_BYTES)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, f"{token}\n".encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):
            os.fsync(folder)
    finally:
        os.close(folder)
    log.info("control_token_created", path=str(path))
    return token
