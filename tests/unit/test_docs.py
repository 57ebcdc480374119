"""The design pages live in docs/, and every citation of one in the code, tests and scripts points there."""

from __future__ import annotations

import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

# Where citations are looked for: the package, its tests, scripts, benchmarks, the example home
# and the README (the design pages themselves are read separately).
SCANNED = ("tenex_daemon", "tests", "scripts", "benchmarks", ".tenex", "README.md")
SKIPPED_DIRS = frozenset({"node_modules", "__pycache__", ".venv", ".mypy_cache", ".pytest_cache"})

PAGE_NAMES = "ARCHITECTURE|CONTEXT|PROTOCOL|STYLE|FIELD_NOTES"
DOCS_PAGE = re.compile(r"docs/([A-Za-z0-9_-]+)\.md")
BARE_PAGE = re.compile(rf"(?<![\w/.-])({PAGE_NAMES})\.md")
CITED_SECTION = re.compile(r"docs/([A-Za-z0-9_-]+)\.md,?\s*\(?\"([^\"\n]+)\"")
OUTSIDE = (
    re.compile(r"shared/+design"),
    re.compile(r"[s]eeds/"),
    re.compile(r"\b\d{3}_[0-9a-f]{16}\.txt\b"),
    re.compile(r"\b[Ss]eeds? 00[0-4]\b"),
)
"""Documents that are not in the repository: the design folder, the seed files, seeds by number."""
PLANNED = " (planned)"


@functools.cache
def scanned_files() -> tuple[tuple[str, str], ...]:
    """Return (path relative to the repository, text) of every readable text file scanned."""
    found: list[tuple[str, str]] = []
    for name in SCANNED:
        start = ROOT / name
        paths = [start] if start.is_file() else sorted(start.rglob("*")) if start.is_dir() else []
        for path in paths:
            relative = path.relative_to(ROOT)
            if not path.is_file() or SKIPPED_DIRS.intersection(relative.parts):
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            found.append((relative.as_posix(), text))
    return tuple(found)


def doc_pages() -> tuple[tuple[str, str], ...]:
    """Return (path relative to the repository, text) of every page in docs/."""
    return tuple((f"docs/{p.name}", p.read_text(encoding="utf-8")) for p in sorted(DOCS.glob("*.md")))


def headings(page: str) -> set[str]:
    """Return the headings of ``docs/<page>.md``, each without its ``#`` marks and "(planned)"."""
    text = (DOCS / f"{page}.md").read_text(encoding="utf-8")
    found: set[str] = set()
    for line in text.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip()
            found.add(title.removesuffix(PLANNED))
    return found


def lines_matching(
    pattern: re.Pattern[str], files: tuple[tuple[str, str], ...]
) -> list[tuple[str, int, re.Match[str]]]:
    """Return (path, line number, match) for every match of ``pattern`` in ``files``."""
    return [
        (path, number, match)
        for path, text in files
        for number, line in enumerate(text.splitlines(), start=1)
        for match in pattern.finditer(line)
    ]


def test_the_design_pages_exist() -> None:
    """docs/ holds the architecture, context, protocol and style pages and an index."""
    for name in ("README", "ARCHITECTURE", "CONTEXT", "PROTOCOL", "STYLE"):
        assert (DOCS / f"{name}.md").is_file(), name


def test_every_cited_docs_page_exists() -> None:
    """Every docs/ page named in the code, tests, scripts, benchmarks or README exists."""
    missing = [
        f"{path}:{number}: {match.group(0)}"
        for path, number, match in lines_matching(DOCS_PAGE, scanned_files() + doc_pages())
        if not (DOCS / f"{match.group(1)}.md").is_file()
    ]
    assert missing == []


def test_nothing_cites_a_document_outside_the_repository() -> None:
    """No file names the design folder, a seed file or a seed by number: citations go to docs/."""
    outside = [
        f"{path}:{number}: {match.group(0)}"
        for pattern in OUTSIDE
        for path, number, match in lines_matching(pattern, scanned_files() + doc_pages())
    ]
    assert outside == []


def test_design_pages_are_cited_by_their_path_in_docs() -> None:
    """A design page is cited as docs/<page>.md, so a reader finds it from the repository's root."""
    bare = [
        f"{path}:{number}: {match.group(0)}" for path, number, match in lines_matching(BARE_PAGE, scanned_files())
    ]
    assert bare == []


def test_every_cited_section_exists() -> None:
    """A section quoted after a docs/ page (docs/<page>.md, "Section") is a heading of that page."""
    unknown = [
        f"{path}:{number}: {match.group(0)}"
        for path, number, match in lines_matching(CITED_SECTION, scanned_files() + doc_pages())
        if (DOCS / f"{match.group(1)}.md").is_file() and match.group(2) not in headings(match.group(1))
    ]
    assert unknown == []


def test_the_index_links_every_page() -> None:
    """docs/README.md links every other page of docs/."""
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    unlinked = [p.name for p in sorted(DOCS.glob("*.md")) if p.name != "README.md" and f"]({p.name})" not in index]
    assert unlinked == []
