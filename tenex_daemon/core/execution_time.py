"""Execution time: how long agents actually worked on a conversation (docs/ARCHITECTURE.md).

Times are milliseconds since the epoch, passed in by the caller (the core reads no clock).
"""

from __future__ import annotations

from pydantic import BaseModel

STALE_SESSION_MS = 30 * 60 * 1000
"""An active session not updated for longer than this is considered orphaned by a crash."""


def _round_half_up_seconds(milliseconds: int) -> int:
    return (max(milliseconds, 0) + 500) // 1000


class ExecutionTime(BaseModel):
    """Cumulative working time of a conversation, across sessions and restarts."""

    total_seconds: int = 0
    current_session_start: int | None = None
    is_active: bool = False
    last_updated: int = 0

    def start(self, now_ms: int) -> None:
        """Start a session; a no-op when one is already active."""
        if self.is_active:
            return
        self.is_active = True
        self.current_session_start = now_ms
        self.last_updated = now_ms

    def stop(self, now_ms: int) -> int:
        """Stop the active session and return the seconds it added (0 when inactive).

        Seconds are rounded half up, so 1,499 ms adds 1 and 1,500 ms adds 2.
        """
        if not self.is_active or self.current_session_start is None:
            return 0
        added = _round_half_up_seconds(now_ms - self.current_session_start)
        self.total_seconds += added
        self.is_active = False
        self.current_session_start = None
        self.last_updated = now_ms
        return added

    def add_run(self, duration_ms: int, now_ms: int) -> int:
        """Add the working time of one run that lasted ``duration_ms`` and ends now (rounded half up to
        seconds, as :meth:`stop`); return the seconds added. A live session is left as it is."""
        added = _round_half_up_seconds(duration_ms)
        self.total_seconds += added
        self.last_updated = max(self.last_updated, now_ms)
        return added

    def touch(self, now_ms: int) -> None:
        """Record that the active session is still alive (a heartbeat for crash detection)."""
        if self.is_active:
            self.last_updated = now_ms

    def total(self, now_ms: int) -> int:
        """Return total seconds, including the live session if one is active."""
        if self.is_active and self.current_session_start is not None:
            return self.total_seconds + _round_half_up_seconds(now_ms - self.current_session_start)
        return self.total_seconds

    def reset_if_stale(self, now_ms: int, stale_after_ms: int = STALE_SESSION_MS) -> bool:
        """Drop an active session orphaned by a crash; return whether one was dropped.

        A session is stale when it has not been updated for more than ``stale_after_ms``.
        Its time is not added: nobody knows how much of it was real work.
        """
        if self.is_active and now_ms - self.last_updated > stale_after_ms:
            self.is_active = False
            self.current_session_start = None
            self.last_updated = now_ms
            return True
        return False
