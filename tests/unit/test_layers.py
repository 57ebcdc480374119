"""The layers import one way only: core <- services <- adapters/app <- cli (docs/ARCHITECTURE.md);
runtime (asyncio helpers) imports nothing of tenexd and may be used by all but the core; no module
reaches itself through its imports."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "tenex_daemon"

# What each layer may import from tenex_daemon (besides itself).
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "runtime": set(),
    "services": {"core", "runtime"},
    "adapters": {"core", "runtime"},
    "app": {"core", "runtime", "services", "adapters"},
    "cli": {"core", "runtime", "services", "adapters", "app"},
    "testing": {"core", "runtime", "services", "adapters"},
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
    """The package has the five layers of docs/ARCHITECTURE.md."""
    for layer in ("core", "services", "adapters", "app", "cli"):
        assert (PACKAGE / layer / "__init__.py").is_file(), layer


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the tenex_daemon modules it imports (relative imports resolved; ``from pkg import mod``
    counts as importing ``pkg.mod`` when that is a module)."""
    files = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
            else:
                continue
            edges.update(t for t in targets if t in files and t != name)
        graph[name] = edges
    return graph


def test_no_import_circles() -> None:
    """No module reaches itself through the modules it imports (type-checking-only imports included)."""
    graph = _import_graph()
    circles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                circles.append([*path[path.index(target):], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert circles == []
