"""Small files the app writes whole: config.toml, the status file."""

from __future__ import annotations

from pathlib import Path

from tenex_daemon.adapters.storage.atomic import replace_file


def write_text_atomic(path: Path, text: str, mode: int = 0o600) -> None:
    """Write ``text`` to a temp file beside ``path``, fsync it, rename it over ``path``, fsync the folder.

    A reader sees the old file or the new one, never a part; a crash leaves one of the two. The
    temp file is one of this call's own (another process may write the same file meanwhile).
    """
    replace_file(path, text.encode("utf-8"), mode=mode, unique_temp=True)
