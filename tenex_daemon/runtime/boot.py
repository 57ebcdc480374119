"""This machine's boot: its id and the time since it, sleep included (Linux; fallbacks elsewhere)."""

from __future__ import annotations

import time
from pathlib import Path

BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str | None:
    """This boot's id (Linux ``/proc/sys/kernel/random/boot_id``), None where there is none."""
    try:
        return BOOT_ID_PATH.read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def boot_seconds() -> float:
    """Seconds since boot, sleep included (Linux ``CLOCK_BOOTTIME``; elsewhere the monotonic clock)."""
    clock_id = getattr(time, "CLOCK_BOOTTIME", None)
    return time.clock_gettime(clock_id) if clock_id is not None else time.monotonic()
