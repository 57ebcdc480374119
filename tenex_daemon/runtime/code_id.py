"""Which code a process runs: a short digest of the package's source files, taken once per process.

Every commit says version 0.1.0, so after an upgrade in place nothing told whether the running daemon had
been restarted onto the code installed. The daemon writes its digest into its status when it starts;
``tenexd status`` compares it with its own.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]
"""The ``tenex_daemon`` package folder."""


@functools.cache
def code_id() -> str:
    """This process's package's :func:`digest_of` (taken once)."""
    return digest_of(PACKAGE)


def digest_of(root: Path) -> str:
    """The first 12 hex digits of a SHA-256 over the ``.py`` files under ``root`` (their paths and bytes, in
    path order): equal for the same code, different once any file changed, was added or removed."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode("utf-8") + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]
