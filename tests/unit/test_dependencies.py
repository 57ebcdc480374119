"""Every dependency earns its place: each runtime dependency is imported, and the README's dependency table
names only declared dependencies."""

from __future__ import annotations

import ast
import re
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*")


def _normalized(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    match = _NAME.match(requirement.strip())
    assert match is not None, requirement
    return _normalized(match.group(0))


def _pyproject() -> dict[str, object]:
    return tomllib.loads((REPO / "pyproject.toml").read_text("utf-8"))


def runtime_dependencies() -> set[str]:
    """The names in ``[project].dependencies``."""
    project = _pyproject()["project"]
    assert isinstance(project, dict)
    return {_requirement_name(r) for r in project["dependencies"]}


def declared_dependencies() -> set[str]:
    """Every name pyproject.toml declares: runtime, extras and the dev group."""
    data = _pyproject()
    project = data["project"]
    groups = data["dependency-groups"]
    assert isinstance(project, dict)
    assert isinstance(groups, dict)
    names = set(runtime_dependencies())
    for requirements in project.get("optional-dependencies", {}).values():
        names |= {_requirement_name(r) for r in requirements}
    for requirements in groups.values():
        names |= {_requirement_name(r) for r in requirements if isinstance(r, str)}
    return names


def imported_distributions() -> set[str]:
    """The distributions whose top-level modules tenex_daemon/ or tests/ import."""
    modules: set[str] = set()
    for folder in ("tenex_daemon", "tests"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text("utf-8"))):
                if isinstance(node, ast.Import):
                    modules |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    modules.add(node.module.split(".")[0])
    owners = packages_distributions()
    return {_normalized(dist) for module in modules for dist in owners.get(module, ())}


def readme_table_names() -> set[str]:
    """The dependency names in the first column of the README's dependency table."""
    lines = (REPO / "README.md").read_text("utf-8").splitlines()
    start = lines.index("| dependency | why |") + 2
    names: set[str] = set()
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cell = line.split("|")[1]
        for part in re.sub(r"\(.*?\)", "", cell).split(","):
            names.add(_normalized(part.strip().split("[")[0]))
    return names


def test_every_runtime_dependency_is_imported() -> None:
    """Each of ``[project].dependencies`` is imported by the package or its tests (none is left unused)."""
    assert runtime_dependencies() - imported_distributions() == set()


def test_the_readme_table_names_only_declared_dependencies() -> None:
    """Every row of the README's dependency table names a dependency pyproject.toml declares."""
    assert readme_table_names() - declared_dependencies() == set()
