"""Checksummed append-only logs: one conversation's ``events.log``, the index logs.

A line is ``<crc32 of the payload: 8 hex digits> <payload>\\n``. A crash can leave a torn
tail (bytes after the last newline: an unterminated line), cut on the next read; a complete line
whose checksum fails is corruption, never a torn tail, even when it is the last one: the log is
copied to ``corrupt/`` before anything is cut.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from tenex_daemon.core.events import NostrEvent


def encode_line(payload: bytes) -> bytes:
    """Return a log line: crc32 of the payload (8 hex digits), a space, the payload, a newline."""
    return b"%08x " % zlib.crc32(payload) + payload + b"\n"


def encode_event(event: NostrEvent) -> bytes:
    """Return the log line of one event."""
    return encode_line(event.model_dump_json().encode("utf-8"))


def parse_event(payload: bytes) -> NostrEvent | None:
    """The event of a good line's payload, or None when it is not a valid event."""
    try:
        return NostrEvent.model_validate_json(payload)
    except ValidationError:
        return None


def _check_line(line: bytes) -> bytes | None:
    """Return the payload of a complete line (without newline) if its checksum holds."""
    if len(line) < 10 or line[8:9] != b" ":
        return None
    try:
        crc = int(line[:8], 16)
    except ValueError:
        return None
    payload = line[9:]
    return payload if zlib.crc32(payload) == crc else None


@dataclass
class LogScan:
    """What reading a checksummed log found."""

    payloads: list[bytes]
    good_end: int
    """Offset just after the last good line."""
    size: int
    bad_lines: int
    """Complete lines whose checksum fails, wherever they are (corruption, not a torn tail)."""
    line_end: int = -1
    """Offset just after the last complete line (-1: ``good_end``); what follows is the torn tail."""

    def __post_init__(self) -> None:
        if self.line_end < 0:
            self.line_end = self.good_end

    @property
    def torn(self) -> bool:
        """Whether bytes follow the last complete line (an unterminated line)."""
        return self.line_end < self.size


def scan_log(data: bytes, start: int = 0, *, offset: int = 0) -> LogScan:
    """Split ``data`` (from ``start``) into good payloads, corrupt lines and a torn tail.

    ``offset``: where ``data`` begins in its file (a tail read from there); the offsets returned are
    the file's."""
    payloads: list[bytes] = []
    good_end = start
    bad_lines = 0
    pos = start
    size = len(data)
    while pos < size:
        end = data.find(b"\n", pos)
        if end < 0:
            break
        payload = _check_line(data[pos:end])
        if payload is None:
            bad_lines += 1
        else:
            payloads.append(payload)
            good_end = end + 1
        pos = end + 1
    return LogScan(payloads, offset + good_end, offset + size, bad_lines, offset + pos)


def cut_tail(path: Path, end: int, *, durable: bool) -> None:
    """Cut ``path`` back to ``end`` bytes (a torn tail), fsynced when ``durable``."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, end)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def after_last_line(fd: int, size: int) -> int:
    """The offset just after the file's last newline (0 when it has none): its torn tail starts there."""
    end = size
    while end > 0:
        start = max(end - (1 << 16), 0)
        cut = os.pread(fd, end - start, start).rfind(b"\n")
        if cut >= 0:
            return start + cut + 1
        end = start
    return 0


def ends_a_line(path: Path, offset: int) -> bool:
    """Whether the byte just before ``offset`` (> 0) is a newline: a line ends there."""
    with open(path, "rb") as handle:
        handle.seek(offset - 1)
        return handle.read(1) == b"\n"
