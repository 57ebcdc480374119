"""A private conversation's message never leaves it through a ``nostr:`` reference."""

from __future__ import annotations

from typing import Any

from tenex_daemon.adapters.nostr.relay_pool.resolver import RelayEventResolver
from tenex_daemon.core import nip19
from tenex_daemon.core.events import NostrEvent, compute_event_id
from tests.conftest import Cast
from tests.unit.nostr.test_private import rumor_dict


class OneEventStore:
    """A store holding one event, in some conversation."""

    def __init__(self, event: NostrEvent) -> None:
        self.event = event

    async def find_event(self, event_id: str) -> tuple[str, NostrEvent] | None:
        return ("conversation", self.event) if event_id == self.event.id else None


class NoRelay:
    """A relay pool that finds nothing."""

    async def fetch_event(self, event_id: str, timeout: float = 5.0) -> NostrEvent | None:  # noqa: ASYNC109
        return None

    async def fetch(self, filters: list[dict[str, Any]], timeout: float = 5.0) -> list[NostrEvent]:  # noqa: ASYNC109
        return []


async def test_a_stored_private_message_is_not_resolved_but_a_signed_event_is(cast: Cast) -> None:
    """A `nostr:nevent` naming a stored kind-14 message (unsigned) resolves to nothing, so its text cannot
    reach a public conversation's context; a stored signed event still resolves from the store."""
    fields = rumor_dict(cast.user, "my secret plan")
    made_id = compute_event_id(fields["pubkey"], fields["created_at"], fields["kind"], fields["tags"], fields["content"])
    private = NostrEvent.model_validate({**fields, "id": made_id, "sig": ""})
    public = cast.user_says("a public note", kind=1)

    hidden = await RelayEventResolver(NoRelay(), store=OneEventStore(private)).resolve(  # type: ignore[arg-type]
        nip19.decode(nip19.encode_nevent(private.id))
    )
    shown = await RelayEventResolver(NoRelay(), store=OneEventStore(public)).resolve(  # type: ignore[arg-type]
        nip19.decode(nip19.encode_nevent(public.id))
    )

    assert hidden is None
    assert shown == public
