"""The Nostr shapes of live status and stop (docs/PROTOCOL.md): kind-24133 events composed and signed by
the project key, kind-24134 requests classified as stops of the conversation they name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tenex_daemon.adapters.nostr.classifier import classify_event, conversation_lane
from tenex_daemon.adapters.nostr.metadata_event import ConversationMetadataComposer
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.adapters.nostr.status_events import StatusEventPublisher
from tenex_daemon.core.classify import EventClass
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.testing import EventFactory, KeyPair

PROJECT = KeyPair.from_seed(3)
OWNER = KeyPair.from_seed(1)
AGENT = KeyPair.from_seed(11)
ROOT = "a" * 64


@dataclass
class Pool:
    """Records what would be published and how."""

    events: list[tuple[NostrEvent, dict[str, Any]]] = field(default_factory=list)

    async def publish(self, event: NostrEvent, **options: Any) -> object:
        """Record the event and the options."""
        self.events.append((event, options))
        return None


async def test_a_status_names_the_root_each_working_agent_the_person_and_the_project() -> None:
    """A kind-24133 status is signed by the project key with ``e`` = root, one ``p`` per agent, ``P`` = the
    person and the project's ``a``; it is published best effort (a refusal raises nothing)."""
    pool = Pool()
    publisher = StatusEventPublisher(pool, Signer.from_text(PROJECT.secret), (OWNER.pubkey, "demo"))

    await publisher.working(ROOT, ROOT, OWNER.pubkey, (AGENT.pubkey, AGENT.pubkey))

    event, options = pool.events[0]
    assert event.kind == 24133
    assert event.pubkey == PROJECT.pubkey
    assert event.has_valid_id()
    assert event.content == ""
    assert event.tags == [
        ["e", ROOT], ["p", AGENT.pubkey], ["P", OWNER.pubkey], ["a", f"31933:{OWNER.pubkey}:demo"],
    ]
    assert options["raise_on_failure"] is False


async def test_an_idle_status_has_no_p_tag_and_is_dated_after_the_one_before() -> None:
    """The idle status (nobody works) carries no ``p`` tag and, published within the same second as the
    busy one, is dated later, so clients keeping the newest keep it; without a project there is no ``a``."""
    pool = Pool()
    publisher = StatusEventPublisher(pool, Signer.from_text(PROJECT.secret), None)

    await publisher.working(ROOT, ROOT, None, (AGENT.pubkey,))
    await publisher.working(ROOT, ROOT, None, ())

    busy, idle = (event for event, _ in pool.events)
    assert idle.tags == [["e", ROOT]]
    assert idle.created_at > busy.created_at


def test_a_conversations_metadata_signed_in_one_second_is_dated_newest_last() -> None:
    """A conversation's kind-513 "ended" signed in the same second as its "active" one is dated later (clients
    keep the newest 513: a tie they break by id showed an ended conversation as active); another
    conversation's is dated by the clock alone."""
    composer = ConversationMetadataComposer(Signer.from_text(PROJECT.secret), None)

    active = composer.compose(ROOT, "A title", "A summary.", ended=False)
    ended = composer.compose(ROOT, "A title", "A summary.", ended=True)
    other = composer.compose("b" * 64, "Other", "", ended=False)

    assert ended.created_at > active.created_at
    assert other.created_at <= active.created_at + 1
    assert ended.has_valid_id()


def test_a_stop_request_is_classified_as_a_stop_of_the_conversation_it_names() -> None:
    """A kind-24134 event with an ``e`` tag is a stop of that conversation (and travels in its lane); one
    without is ignored with the reason."""
    events = EventFactory()
    stop = events.event(OWNER, "", kind=24134, tags=[["e", ROOT], ["p", AGENT.pubkey]])
    bare = events.event(OWNER, "", kind=24134, tags=[["p", AGENT.pubkey]])

    classified = classify_event(stop)
    ignored = classify_event(bare)

    assert (classified.kind, classified.conversation_id) == (EventClass.STOP, ROOT)
    assert conversation_lane(stop) == ROOT
    assert (ignored.kind, ignored.reason) == (EventClass.IGNORED, "stop_without_conversation")
