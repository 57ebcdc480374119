"""Shared helpers for the benchmarks: timing with medians and table printing."""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable, Sequence


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
