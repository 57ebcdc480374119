"""An ``naddr`` resolves only to the event its address names: its author, its kind, its ``d`` tag."""

from __future__ import annotations

from typing import Any

from tenex_daemon.adapters.nostr.relay_pool.resolver import RelayEventResolver
from tenex_daemon.core import nip19
from tenex_daemon.core.events import NostrEvent
from tests.conftest import Cast


class AnsweringRelay:
    """A relay pool that answers every fetch with the same events, whatever the filter asked for
    (a relay that ignores a filter, or one that lies)."""

    def __init__(self, events: list[NostrEvent]) -> None:
        self.events = events
        self.filters: list[dict[str, Any]] = []

    async def fetch_event(self, event_id: str, timeout: float = 5.0) -> NostrEvent | None:  # noqa: ASYNC109
        return None

    async def fetch(self, filters: list[dict[str, Any]], timeout: float = 5.0) -> list[NostrEvent]:  # noqa: ASYNC109
        self.filters.extend(filters)
        return list(self.events)


async def test_an_address_resolves_to_its_own_authors_article_only(cast: Cast) -> None:
    """A relay that answers an ``naddr`` with another key's event of the same kind and ``d`` tag, or
    the author's event of another kind, gives nothing; the author's own article of that kind is taken."""
    address = nip19.decode(nip19.encode_naddr("plan", cast.user.pubkey, 30023))
    impostor = cast.factory.event(cast.other_user, "not the plan", kind=30023, tags=[["d", "plan"]])
    other_kind = cast.user_says("a draft", kind=30024, tags=[["d", "plan"]])
    article = cast.user_says("the plan", kind=30023, tags=[["d", "plan"]])

    lied_to = await RelayEventResolver(AnsweringRelay([impostor, other_kind])).resolve(  # type: ignore[arg-type]
        address
    )
    relay = AnsweringRelay([impostor, other_kind, article])
    found = await RelayEventResolver(relay).resolve(address)  # type: ignore[arg-type]

    assert lied_to is None
    assert found == article
    assert relay.filters == [{"kinds": [30023], "authors": [cast.user.pubkey], "#d": ["plan"]}]
