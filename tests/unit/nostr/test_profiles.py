"""People's profile names from the relays (kind 0): what labels a person where several people write."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tenex_daemon.adapters.nostr.profiles import RelayProfileNames, profile_name
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.testing import EventFactory, KeyPair

CAROL, DAVE, ERIN = KeyPair.from_seed(21), KeyPair.from_seed(22), KeyPair.from_seed(23)


class Relays:
    """Relays holding some events: each fetch is recorded; ``down`` makes it fail."""

    def __init__(self, events: list[NostrEvent]) -> None:
        self.events = events
        self.fetches: list[list[str]] = []
        self.down = False

    async def fetch(self, filters: Sequence[dict[str, Any]], *, timeout: float | None = None) -> list[NostrEvent]:  # noqa: ASYNC109
        """The held events of the kinds and authors asked for."""
        [wanted] = filters
        self.fetches.append(list(wanted["authors"]))
        if self.down:
            raise OSError("no relay answers")
        return [e for e in self.events if e.kind in wanted["kinds"] and e.pubkey in wanted["authors"]]


def profile(factory: EventFactory, keys: KeyPair, **fields: object) -> NostrEvent:
    return factory.event(keys, json.dumps(fields), kind=0)


def test_a_profile_gives_its_display_name_else_its_name() -> None:
    """display_name wins over name; blank or non-string values, and content that is not a JSON object,
    give none."""
    factory = EventFactory()
    assert profile_name(profile(factory, CAROL, name="carol", display_name=" Carol C ")) == "Carol C"
    assert profile_name(profile(factory, CAROL, name="carol", display_name="  ")) == "carol"
    assert profile_name(profile(factory, CAROL, name=5)) is None
    assert profile_name(factory.event(CAROL, "not json", kind=0)) is None
    assert profile_name(factory.event(CAROL, "[1]", kind=0)) is None


async def test_names_are_fetched_once_the_newest_profile_counts_and_the_nameless_are_asked_again() -> None:
    """One request asks every person not yet asked; each person's newest profile counts (an older one's
    name does not stand in for a newer one without a name); names are kept, and a person without one
    is asked again only once ``retry_s`` has passed."""
    factory = EventFactory()
    relays = Relays([
        profile(factory, CAROL, name="Old Carol"),
        profile(factory, CAROL, name="Carol"),
        profile(factory, DAVE, name="Dave"),
        profile(factory, DAVE, about="no name any more"),
    ])
    now = [1000.0]
    names = RelayProfileNames(relays, retry_s=60, clock=lambda: now[0])

    assert await names.names([CAROL.pubkey, DAVE.pubkey, ERIN.pubkey]) == {CAROL.pubkey: "Carol"}
    assert relays.fetches == [sorted([CAROL.pubkey, DAVE.pubkey, ERIN.pubkey])]
    assert await names.names([CAROL.pubkey, ERIN.pubkey]) == {CAROL.pubkey: "Carol"}
    assert len(relays.fetches) == 1

    relays.events.append(profile(factory, ERIN, name="Erin"))
    now[0] += 61
    assert await names.names([CAROL.pubkey, ERIN.pubkey]) == {CAROL.pubkey: "Carol", ERIN.pubkey: "Erin"}
    assert relays.fetches[1:] == [[ERIN.pubkey]]


async def test_relays_that_fail_leave_the_labels_short_npubs_for_now() -> None:
    """A fetch that fails gives no names (the run goes on) and is tried again after ``retry_s``."""
    factory = EventFactory()
    relays = Relays([profile(factory, CAROL, name="Carol")])
    relays.down = True
    now = [0.0]
    names = RelayProfileNames(relays, retry_s=60, clock=lambda: now[0])

    assert await names.names([CAROL.pubkey]) == {}
    relays.down = False
    assert await names.names([CAROL.pubkey]) == {}
    now[0] += 60
    assert await names.names([CAROL.pubkey]) == {CAROL.pubkey: "Carol"}
