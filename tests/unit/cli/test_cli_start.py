"""The command line starts light: building ``tenexd --help`` loads none of the daemon's parts, and what
``tenexd status`` loads reaches neither nostr-sdk, the store nor the services (docs/BENCHMARKS.md, "The
command line's start"). Checked in a fresh interpreter, by the modules loaded, not by time (typer itself
loads pydantic: not counted)."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = (
    "nostr_sdk",
    "aiohttp",
    "tenex_daemon.app.daemon",
    "tenex_daemon.app.rebuild",
    "tenex_daemon.app.control.routes",
    "tenex_daemon.adapters.storage.filesystem",
    "tenex_daemon.services.conversation_manager",
)


def loaded_after(code: str) -> set[str]:
    """The HEAVY modules a fresh interpreter holds after running ``code``."""
    probe = f"import json, sys\n{code}\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(json.loads(result.stdout.splitlines()[-1]))


def test_the_help_loads_none_of_the_daemons_parts() -> None:
    """The app with every command registered and its help rendered loads no heavy module."""
    code = (
        "from typer.main import get_command\n"
        "from tenex_daemon.cli.main import app\n"
        "command = get_command(app)\n"
        "command.get_help(command.make_context('tenexd', ['--help'], resilient_parsing=True))\n"
    )
    assert loaded_after(code) == set()


def test_status_loads_only_the_settings_and_the_control_api_client() -> None:
    """What ``tenexd status`` imports (settings, status file, control API client) leaves out nostr-sdk, the
    store, the services and the control API's server."""
    code = (
        "import tenex_daemon.cli.main, tenex_daemon.app.settings, tenex_daemon.app.status\n"
        "import tenex_daemon.cli.client\n"
    )
    assert loaded_after(code) == {"aiohttp"}
