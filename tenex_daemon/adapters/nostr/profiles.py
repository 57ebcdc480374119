"""People's profile names (kind 0) from the relays: what labels a person when several people write in a
conversation (docs/CONTEXT.md, step 1). Implements :class:`~tenex_daemon.core.ports.ProfileNames`.

A person's newest profile is fetched once (one request for every person not yet asked, the events
validated by the pool: a relay cannot put a name in someone's mouth), its ``display_name`` else ``name``
kept in memory for the daemon's life; a person without one (or whose relays did not answer in time) is
asked again after ``retry_s``. A fetch never waits longer than ``timeout``: the run goes on with the short
npub.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol

import structlog

from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.vocabulary import KIND_PROFILE

log = structlog.get_logger(__name__)

DEFAULT_TIMEOUT_S = 2.0
DEFAULT_RETRY_S = 3600.0
MAX_KEPT = 10_000
"""People whose name (or its absence) is kept; past it the oldest asked are forgotten first."""


class _Fetcher(Protocol):
    async def fetch(
        self, filters: Sequence[dict[str, Any]], *, timeout: float | None = None  # noqa: ASYNC109
    ) -> list[NostrEvent]:
        """Validated events matching ``filters``, newest first."""


def profile_name(event: NostrEvent) -> str | None:
    """The name a kind-0 profile gives: ``display_name``, else ``name`` (None when neither is a non-blank
    string, or the content is not a JSON object)."""
    try:
        profile = json.loads(event.content)
    except ValueError:
        return None
    if not isinstance(profile, dict):
        return None
    for key in ("display_name", "name"):
        value = profile.get(key)
        if isinstance(value, str) and value.strip():
            return value.strip()
    return None


class RelayProfileNames:
    """Profile names fetched from the relays and kept in memory (see the module docstring)."""

    def __init__(
        self,
        pool: _Fetcher,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        retry_s: float = DEFAULT_RETRY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pool = pool
        self._timeout = timeout
        self._retry_s = retry_s
        self._clock = clock
        self._known: dict[str, tuple[str | None, float]] = {}
        """Pubkey -> (its name, None when none was found; when it was asked)."""

    async def names(self, pubkeys: Collection[str]) -> dict[str, str]:
        """The names of ``pubkeys`` known or fetched now (a pubkey without one is left out)."""
        now = self._clock()
        asking = sorted(
            pubkey for pubkey in set(pubkeys)
            if pubkey not in self._known
            or (self._known[pubkey][0] is None and now - self._known[pubkey][1] >= self._retry_s)
        )
        if asking:
            found = await self._fetch(asking)
            for pubkey in asking:
                self._known.pop(pubkey, None)  # newest asked last: the first forgotten are the oldest
                self._known[pubkey] = (found.get(pubkey), now)
            while len(self._known) > MAX_KEPT:
                del self._known[next(iter(self._known))]
        return {pubkey: name for pubkey in pubkeys if (name := self._known.get(pubkey, (None, 0.0))[0])}

    async def _fetch(self, pubkeys: list[str]) -> dict[str, str]:
        """The newest profile's name of each of ``pubkeys`` the relays give in time."""
        try:
            wanted = [{"kinds": [KIND_PROFILE], "authors": pubkeys}]
            events = await self._pool.fetch(wanted, timeout=self._timeout)
        except Exception as exc:  # the relays are away: the labels stay short npubs for now
            log.info("profiles_not_fetched", people=len(pubkeys), error=str(exc) or type(exc).__name__)
            return {}
        asked = set(pubkeys)
        seen: set[str] = set()
        found: dict[str, str] = {}
        for event in sorted(events, key=lambda e: -e.created_at):  # the newest profile of each counts
            if event.kind != KIND_PROFILE or event.pubkey not in asked or event.pubkey in seen:
                continue
            seen.add(event.pubkey)
            name = profile_name(event)
            if name is not None:
                found[event.pubkey] = name
        return found
