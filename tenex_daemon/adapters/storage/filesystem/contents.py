"""What a filesystem store holds beside its conversations, read from its files for a copy into another store
(``tenexd migrate --from-store``): the keys of its small values and its processed event ids.

Read a store that was opened and closed cleanly since it was last written (its commit journal replayed and
checkpointed, every derived line written), with no process holding it: its files then say everything.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

from tenex_daemon.adapters.storage.filesystem.layout import Layout
from tenex_daemon.adapters.storage.filesystem.processed import BUCKET_CHARS, read_bucket

_HEX = frozenset("0123456789abcdef")


def value_keys(layout: Layout) -> list[str]:
    """The keys of the small values the store holds (an erased value's file, a tombstone, is not one)."""
    keys = []
    try:
        entries = list(os.scandir(layout.meta_dir))
    except FileNotFoundError:
        return []
    for entry in entries:
        if not entry.name.endswith(".json") or not entry.is_file(follow_symlinks=False):
            continue
        try:
            with open(entry.path, "rb") as file:
                record = json.loads(file.read())
        except (OSError, ValueError):
            continue  # unreadable: the store itself moves it to corrupt/ when it reads it
        key = record.get("key") if isinstance(record, dict) else None
        if isinstance(key, str) and record.get("value") is not None:
            keys.append(key)
    return sorted(keys)


def processed_ids(layout: Layout) -> Iterator[tuple[str, str]]:
    """Every event id the store counts as processed, with its conversation's id (empty: none; one that no
    longer exists: the conversation was deleted, its ids stay processed), bucket by bucket."""
    try:
        names = sorted(entry.name for entry in os.scandir(layout.events_dir))
    except FileNotFoundError:
        return
    for name in names:
        if len(name) == BUCKET_CHARS and set(name) <= _HEX:
            yield from read_bucket(layout.events_dir / name).items()
