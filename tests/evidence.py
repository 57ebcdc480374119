"""The fault, fuzz and security runs' two sizes and their figures.

``scripts/test`` runs these tests in a reduced form; ``scripts/faults`` sets ``TENEX_FAULTS_FULL=1`` for the
full sizes and ``TENEX_FAULTS_REPORT`` to a file where each test appends one JSON line of figures, which
``scripts/faults`` prints as a table at the end (``python -m tests.evidence REPORT``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

FULL_ENV = "TENEX_FAULTS_FULL"
REPORT_ENV = "TENEX_FAULTS_REPORT"


def full_run() -> bool:
    """Whether this is the full run of ``scripts/faults`` (not the reduced one of ``scripts/test``)."""
    return os.environ.get(FULL_ENV) == "1"


def scale(reduced: int, full: int) -> int:
    """``full`` in the full run, else ``reduced``."""
    return full if full_run() else reduced


def record(test: str, **figures: int | float | str) -> None:
    """Append one line of figures for ``test`` to the report file, when a run asked for one."""
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    line = {"test": test, "full": full_run(), "at": round(time.time(), 3), **figures}
    with Path(path).open("a", encoding="utf-8") as out:
        out.write(json.dumps(line, sort_keys=True) + "\n")


def table(report: Path) -> str:
    """The report's lines as a plain-text table: one row per test, its figures as ``name=value``."""
    rows = []
    for raw in report.read_text(encoding="utf-8").splitlines():
        if not raw.strip():
            continue
        line = json.loads(raw)
        figures = ", ".join(f"{k}={v}" for k, v in sorted(line.items()) if k not in {"test", "full", "at"})
        rows.append((str(line["test"]), figures))
    width = max((len(name) for name, _ in rows), default=4)
    return "\n".join([f"{'test'.ljust(width)}  figures", *(f"{n.ljust(width)}  {f}" for n, f in rows)])


if __name__ == "__main__":
    print(table(Path(sys.argv[1])))
