"""The conversation store's format number, in ``conversations/.format``: what the tenexd that last opened
the store writes there (docs/ARCHITECTURE.md, "Durability contract"). A store whose number is newer than
this tenexd knows was written by a newer tenexd: it is refused, since this one would drop, at its first
save of each conversation, the state fields it does not know (a conversation's end, its summary, a
title's source), and a later upgrade could not tell what was lost. An older number (or none: a store from
before the file) is raised to this one's."""

from __future__ import annotations

from pathlib import Path

from tenex_daemon.adapters.storage.atomic import replace_file
from tenex_daemon.adapters.storage.filesystem.lock import StoreOpenError
from tenex_daemon.core.errors import StoreTooNewError

STORE_FORMAT = 2
"""This tenexd's format. 1 (no file): the stores of the tenexds before the file. 2: the first with it
(conversations that end, with titles and summaries). Raised whenever a state field is added that an older
tenexd would drop on saving."""
FORMAT_NAME = ".format"


class StoreFormatError(StoreOpenError, StoreTooNewError):
    """The store was written by a newer tenexd (or its format file cannot be read as one)."""


def check_store_format(root: Path) -> None:
    """Refuse a store whose format is newer than :data:`STORE_FORMAT` (or unreadable), saying what to do;
    write this format to one that has an older one, or none."""
    path = root / FORMAT_NAME
    found: int | None = None
    try:
        data = path.read_bytes().strip()
    except FileNotFoundError:
        pass
    else:
        if not data.isdigit():  # bytes: ASCII digits only
            raise StoreFormatError(
                f"{path} does not hold a store format number ({data[:20]!r}): it was damaged, or is not "
                f"tenexd's; if the store is, write the format of the tenexd that last ran it (this one: "
                f"{STORE_FORMAT})"
            )
        found = int(data)
    if found is not None and found > STORE_FORMAT:
        raise StoreFormatError(
            f"the conversation store in {root} was written by a newer tenexd (store format {found}; this one "
            f"knows {STORE_FORMAT}): upgrade tenexd (an older one would drop what it does not know)"
        )
    if found != STORE_FORMAT:
        replace_file(path, f"{STORE_FORMAT}\n".encode())
