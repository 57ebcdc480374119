"""The layers import one way only: core <- services <- adapters/app <- cli (ARCHITECTURE.md)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "tenex_daemon"

# What each layer may import from tenex_daemon (besides itself).
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "services": {"core"},
    "adapters": {"core"},
    "app": {"core", "services", "adapters"},
    "cli": {"core", "services", "adapters", "app"},
    "testing": {"core", "services", "adapters"},
}

# Libraries the pure core must not touch.
CORE_FORBIDDEN = {
    "asyncio",
    "pynostr",
    "nostr_sdk",
    "websockets",
    "aiofiles",
    "asyncpg",
    "aiohttp",
    "coincurve",
}


def imports_of(path: Path) -> list[str]:
    """Return the absolute module names a file imports."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_layers_import_one_way() -> None:
    """No module imports from a layer above its own."""
    violations: list[str] = []
    for layer, allowed in ALLOWED.items():
        for path in (PACKAGE / layer).rglob("*.py"):
            for name in imports_of(path):
                parts = name.split(".")
                if parts[0] != "tenex_daemon" or len(parts) < 2:
                    continue
                target = parts[1]
                if target != layer and target not in allowed:
                    violations.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert violations == []


def test_core_does_no_io_and_uses_no_nostr_library() -> None:
    """The core imports no asyncio, Nostr, network, database or crypto library."""
    violations = [
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in (PACKAGE / "core").rglob("*.py")
        for name in imports_of(path)
        if name.split(".")[0] in CORE_FORBIDDEN
    ]
    assert violations == []


def test_every_layer_exists() -> None:
    """The package has the five layers of ARCHITECTURE.md."""
    for layer in ("core", "services", "adapters", "app", "cli"):
        assert (PACKAGE / layer / "__init__.py").is_file(), layer
