"""Shared helpers for the benchmarks: timing with medians, table printing, figures for comparisons."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

FIGURES_ENV = "TENEX_BENCH_FIGURES"
"""When set, the file each benchmark appends its headline figures to (JSON lines), for an A/B script."""


def median_seconds(fn: Callable[[], object], rounds: int) -> float:
    """Return the median wall time of ``rounds`` calls of ``fn``."""
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


async def median_seconds_async(
    fn: Callable[[], Awaitable[object]],
    rounds: int,
    before: Callable[[], Awaitable[object]] | None = None,
) -> float:
    """Return the median wall time of ``rounds`` awaited calls; ``before`` runs untimed each round."""
    samples = []
    for _ in range(rounds):
        if before is not None:
            await before()
        start = time.perf_counter()
        await fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Print a plain-text table with right-aligned columns."""
    cells = [list(map(str, header))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    print(f"\n{title}")
    line = "  ".join("-" * w for w in widths)
    print(line)
    for n, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
        if n == 0:
            print(line)
    print(line)


def fmt_ms(seconds: float) -> str:
    """Format seconds as milliseconds with three decimals."""
    return f"{seconds * 1000:.3f} ms"


def emit_figures(suite: str, figures: Mapping[str, float | None]) -> None:
    """Append ``figures`` (name -> value) as one JSON line to the file named by ``TENEX_BENCH_FIGURES``.

    Does nothing when the variable is unset: the tables printed are the benchmark's own output;
    this line is what a before/after comparison takes medians of, without parsing the tables.
    """
    path = os.environ.get(FIGURES_ENV)
    if not path:
        return
    tenexd = sys.modules.get("tenex_daemon")
    code = os.path.dirname(tenexd.__file__) if tenexd is not None and tenexd.__file__ else None
    line = {"suite": suite, "code": code, "figures": dict(figures)}  # code: which tenexd was measured
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")
