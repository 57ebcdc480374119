"""Where the home is: the ``--home`` given, else ``$TENEX_HOME``, else ``./.tenex``. Apart from the
settings so that ``tenexd --help`` names the default without loading them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Final

DEFAULT_HOME: Final = ".tenex"


def resolve_home(home: str | Path | None, env: Mapping[str, str] | None = None) -> Path:
    """Return the home: the argument, else ``$TENEX_HOME``, else ``./.tenex``."""
    environment = os.environ if env is None else env
    if home is not None:
        return Path(home).expanduser().resolve()
    if environment.get("TENEX_HOME"):
        return Path(environment["TENEX_HOME"]).expanduser().resolve()
    return Path(DEFAULT_HOME).resolve()
