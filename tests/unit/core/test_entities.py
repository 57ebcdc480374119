"""nostr: references inlined into what an agent sees, through the resolver port."""

from __future__ import annotations

from tenex_daemon import ConversationManager, MemoryStore
from tenex_daemon.core import nip19
from tenex_daemon.core.references import (
    MAX_INLINED_CHARS_PER_MESSAGE,
    MAX_REFERENCES_PER_MESSAGE,
    find_event_references,
)
from tenex_daemon.testing import FakeClock, FakeResolver
from tests.conftest import Cast


async def test_valid_note_reference_is_inlined(
    manager: ConversationManager, cast: Cast, resolver: FakeResolver
) -> None:
    """A resolvable nostr:note1 reference is replaced by a <nostr-event> element with its content."""
    referenced = cast.factory.event(cast.other_user, "The referenced spec", kind=1)
    resolver.add(referenced)
    uri = "nostr:" + nip19.encode_note(referenced.id)
    root = cast.user_says(f"Please read {uri} first", kind=11)
    cid = (await manager.create_conversation(root)).id

    context = await manager.build_agent_messages(cid, "alice", root)

    assert context.messages[0].content == (
        f'Please read <nostr-event entity="{uri}">The referenced spec</nostr-event> first'
    )


async def test_nevent_and_naddr_references_are_inlined(
    manager: ConversationManager, cast: Cast, resolver: FakeResolver
) -> None:
    """nevent (with relay, author, kind) and naddr references both resolve and inline."""
    note = cast.factory.event(cast.other_user, "event body", kind=1)
    article = cast.factory.event(cast.other_user, "article body", kind=30023, tags=[["d", "spec"]])
    resolver.add(note)
    resolver.add(article, f"30023:{cast.other_user.pubkey}:spec")
    nevent = "nostr:" + nip19.encode_nevent(note.id, ("wss://r.example",), cast.other_user.pubkey, 1)
    naddr = "nostr:" + nip19.encode_naddr("spec", cast.other_user.pubkey, 30023)
    root = cast.user_says(f"{nevent} and {naddr}", kind=11)
    cid = (await manager.create_conversation(root)).id

    context = await manager.build_agent_messages(cid, "alice", root)

    assert context.messages[0].content == (
        f'<nostr-event entity="{nevent}">event body</nostr-event> and '
        f'<nostr-event entity="{naddr}">article body</nostr-event>'
    )


async def test_invalid_and_unresolvable_references_are_left_as_written(
    manager: ConversationManager, cast: Cast, resolver: FakeResolver
) -> None:
    """A bad checksum is never looked up; a valid but unknown id is looked up and left as written."""
    unknown = "nostr:" + nip19.encode_note("ab" * 32)
    broken = unknown[:-1] + ("q" if unknown[-1] != "q" else "p")
    text = f"see {broken} and {unknown}"
    root = cast.user_says(text, kind=11)
    cid = (await manager.create_conversation(root)).id

    context = await manager.build_agent_messages(cid, "alice", root)

    assert context.messages[0].content == text
    assert [e.value for e in resolver.lookups] == ["ab" * 32]


async def test_no_lookups_without_entities(
    manager: ConversationManager, cast: Cast, resolver: FakeResolver
) -> None:
    """Content without nostr: references causes no resolver call."""
    root = cast.user_says("plain text, npub-like words, nostr without colon", kind=11)
    cid = (await manager.create_conversation(root)).id

    await manager.build_agent_messages(cid, "alice", root)

    assert resolver.lookups == []


async def test_profile_references_are_not_event_references(cast: Cast) -> None:
    """npub and nprofile URIs are valid NIP-19 but are not events to inline."""
    npub = "nostr:" + nip19.encode_npub(cast.user.pubkey)
    nprofile = "nostr:" + nip19.encode_nprofile(cast.user.pubkey, ("wss://x",))
    assert find_event_references(f"{npub} {nprofile}") == []


async def test_slow_resolver_never_blocks_longer_than_the_timeout(cast: Cast, clock: FakeClock) -> None:
    """A resolver slower than the timeout leaves the reference as written and the build completes."""
    referenced = cast.factory.event(cast.other_user, "late", kind=1)
    slow = FakeResolver({referenced.id: referenced}, delay=5.0)
    manager = ConversationManager(
        MemoryStore(), cast.agents, resolver=slow, clock=clock, resolve_timeout=0.05
    )
    uri = "nostr:" + nip19.encode_note(referenced.id)
    root = cast.user_says(f"look {uri}", kind=11)
    cid = (await manager.create_conversation(root)).id

    context = await manager.build_agent_messages(cid, "alice", root)

    assert context.messages[0].content == f"look {uri}"


async def test_references_in_history_and_block_are_inlined_everywhere(
    manager: ConversationManager, cast: Cast, resolver: FakeResolver
) -> None:
    """A reference in an earlier message is inlined both in history and in the while-away block."""
    referenced = cast.factory.event(cast.other_user, "SPEC", kind=1)
    resolver.add(referenced)
    uri = "nostr:" + nip19.encode_note(referenced.id)
    root = cast.user_says(f"read {uri}", kind=11)
    cid = (await manager.create_conversation(root)).id
    trigger = cast.user_says("bob, thoughts?")
    await manager.add_event(cid, trigger)

    context = await manager.build_agent_messages(cid, "bob", trigger)

    inlined = f'read <nostr-event entity="{uri}">SPEC</nostr-event>'
    assert context.messages[0].content == inlined
    assert f"🟢 USER:\n{inlined}\n\n" in context.messages[1].content


async def test_one_message_inlines_at_most_its_share_of_referenced_content(
    manager: ConversationManager, cast: Cast, resolver: FakeResolver
) -> None:
    """A message repeating one reference to a 64 KiB note 100 times is given that note inline only while
    256 KiB of content fits (4 times), the later occurrences as written: it built 6.4 MB, and a large message
    of such repeats hundreds of megabytes."""
    big = "x" * 65_536
    referenced = cast.factory.event(cast.other_user, big, kind=1)
    resolver.add(referenced)
    uri = "nostr:" + nip19.encode_note(referenced.id)
    root = cast.user_says(" ".join([uri] * 100), kind=11)
    cid = (await manager.create_conversation(root)).id

    context = await manager.build_agent_messages(cid, "alice", root)

    shown = context.messages[0].content
    assert shown.count(big) == MAX_INLINED_CHARS_PER_MESSAGE // len(big) == 4
    assert shown.count(uri) == 100  # each occurrence is there, inline (in its element) or as written
    assert len(shown) < 300_000


def test_at_most_32_distinct_references_of_one_message_are_resolved() -> None:
    """Of a message naming 40 distinct notes, the first 32 are looked up (each one a relay request)."""
    uris = ["nostr:" + nip19.encode_note(f"{n:02x}" * 32) for n in range(40)]

    found = find_event_references(" ".join(uris + uris))

    assert found == uris[:MAX_REFERENCES_PER_MESSAGE]
    assert MAX_REFERENCES_PER_MESSAGE == 32
