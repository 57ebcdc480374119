"""API keys for LLM providers: from an environment variable or from a file only its owner can read."""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

from tenex_daemon.core.llm import BackendAuthError


class KeyFileError(BackendAuthError):
    """An API key file is missing, empty, or readable by others than its owner."""


def read_key_file(path: str | os.PathLike[str]) -> str:
    """Return the key stored in ``path``; the file must exist, be non-empty and have mode 0600 (or 0400)."""
    file = Path(path).expanduser()
    try:
        mode = file.stat().st_mode
    except FileNotFoundError:
        raise KeyFileError(message=f"API key file {file} does not exist") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(
            message=(
                f"API key file {file} is readable by others (mode {stat.S_IMODE(mode):o}): chmod 600 {file}"
            )
        )
    if file.is_dir():
        raise KeyFileError(message=f"API key file {file} is a folder, not a file")
    try:
        key = file.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError:
        raise KeyFileError(message=f"API key file {file} is not UTF-8 text") from None
    except OSError as exc:  # not this user's to read, and the like
        raise KeyFileError(message=f"API key file {file} cannot be read: {exc.strerror}") from None
    if not key:
        raise KeyFileError(message=f"API key file {file} is empty")
    return key


def resolve_api_key(
    *,
    key_file: str | os.PathLike[str] | None = None,
    env_var: str | None = None,
    default_env_var: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """Return the API key: from ``key_file`` when given, else from ``env_var`` (or the provider's usual one).

    A named file or variable that gives nothing is an error; the provider's usual variable may be unset
    (None is returned, for servers that need no key).
    """
    env = os.environ if environ is None else environ
    if key_file is not None:
        return read_key_file(key_file)
    if env_var is not None:
        value = env.get(env_var, "").strip()
        if not value:
            raise BackendAuthError(
                message=f"the environment variable {env_var} holding the API key is not set"
            )
        return value
    if default_env_var is not None:
        return env.get(default_env_var, "").strip() or None
    return None
