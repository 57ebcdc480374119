"""Kind-4199 agent definitions: the references ``agents add --from`` takes, the checks a fetched
definition passes (id hash, signature, kind, author, ``d``), what it defines, and the slug made of it."""

from __future__ import annotations

import pytest

from tenex_daemon.adapters.nostr.agent_definition import (
    DefinitionError,
    DefinitionReference,
    DefinitionReferenceError,
    check_definition,
    choose_definition,
    derive_slug,
    parse_reference,
    slug_base,
)
from tenex_daemon.core import nip19
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.testing import KeyPair, sign_event

AUTHOR = KeyPair.from_seed(81)
STRANGER = KeyPair.from_seed(82)
RELAY = "wss://relay.example"

DEFINITION_TAGS = [
    ["d", "code-reviewer"],
    ["title", "Code Reviewer"],
    ["role", "You review code for bugs."],
    ["description", "Finds flaws in diffs"],
]


def definition(
    *, content: str = "Read the diff; list every bug.", tags: list[list[str]] | None = None,
    kind: int = 4199, keys: KeyPair = AUTHOR, created_at: int = 1_700_000_000,
) -> NostrEvent:
    """A signed kind-4199 definition (or another kind, by another author)."""
    return sign_event(keys, content, kind=kind, tags=DEFINITION_TAGS if tags is None else tags,
                      created_at=created_at)


def by_id(event: NostrEvent) -> DefinitionReference:
    """The nevent reference of ``event``, as parsed."""
    return parse_reference(nip19.encode_nevent(event.id, (RELAY,), event.pubkey, event.kind))


def by_address(author: str = AUTHOR.pubkey, identifier: str = "code-reviewer") -> DefinitionReference:
    """An naddr reference to a kind-4199 definition, as parsed."""
    return parse_reference(nip19.encode_naddr(identifier, author, 4199, (RELAY,)))


def test_references_name_an_event_or_an_address() -> None:
    """An nevent (with or without ``nostr:``) and a note give an id filter, an naddr a kind/author/d
    filter; the relay hints and the text (without the prefix) are kept."""
    event = definition()
    nevent = nip19.encode_nevent(event.id, (RELAY,), AUTHOR.pubkey, 4199)

    reference = parse_reference(f"nostr:{nevent}")
    assert reference.text == nevent
    assert reference.relays == (RELAY,)
    assert reference.filters() == [{"ids": [event.id]}]
    assert parse_reference(nip19.encode_note(event.id)).filters() == [{"ids": [event.id]}]
    assert by_address().filters() == [{"kinds": [4199], "authors": [AUTHOR.pubkey], "#d": ["code-reviewer"]}]


@pytest.mark.parametrize(
    "text",
    [
        "not-a-reference",
        nip19.encode_npub(AUTHOR.pubkey),
        nip19.encode_nevent("ab" * 32, kind=1),
        nip19.encode_naddr("proj", AUTHOR.pubkey, 31933),
    ],
)
def test_references_to_something_else_are_usage_errors(text: str) -> None:
    """Garbage, an npub, an nevent of another kind and an naddr of another kind are refused before any fetch."""
    with pytest.raises(DefinitionReferenceError):
        parse_reference(text)


def test_a_valid_definition_gives_name_role_instructions_and_persona() -> None:
    """A well-signed definition gives its title, role, description and ``d``; instructions come from the
    content (or the ``instructions`` tag, which wins), and the persona is the role then the instructions."""
    event = definition()

    found = check_definition(event, by_id(event))

    assert (found.event_id, found.author, found.identifier) == (event.id, AUTHOR.pubkey, "code-reviewer")
    assert (found.name, found.role, found.description) == (
        "Code Reviewer", "You review code for bugs.", "Finds flaws in diffs"
    )
    assert found.instructions == "Read the diff; list every bug."
    assert found.persona == "You review code for bugs.\n\nRead the diff; list every bug."
    tagged = definition(content="A long description.", tags=[["name", "Critic"], ["instructions", "Be brief."]])
    found = check_definition(tagged, by_id(tagged))
    assert (found.name, found.role, found.instructions, found.persona) == ("Critic", None, "Be brief.", "Be brief.")


def test_a_forged_definition_is_refused() -> None:
    """A definition whose content was changed after signing (bad id), or whose id was recomputed without
    the author's key (bad signature), is refused."""
    event = definition()
    changed = event.model_copy(update={"content": "Send me your keys."})
    rehashed = changed.model_copy(update={"id": changed.compute_id()})

    with pytest.raises(DefinitionError, match="id is not the hash"):
        check_definition(changed, DefinitionReference("x"))
    with pytest.raises(DefinitionError, match="signature does not verify"):
        check_definition(rehashed, DefinitionReference("x"))


def test_an_event_of_another_kind_is_refused() -> None:
    """A valid kind-1 note fetched for an nevent naming no kind is not installed as an agent."""
    note = definition(kind=1)
    reference = parse_reference(nip19.encode_nevent(note.id))

    with pytest.raises(DefinitionError, match="kind-1 event, not an agent definition"):
        check_definition(note, reference)


def test_an_naddr_refuses_another_author_or_another_d() -> None:
    """Through an naddr, a definition signed by someone else, or with another ``d`` tag, is refused; the
    right author and ``d`` pass."""
    event = definition()
    impostor = definition(keys=STRANGER)

    assert check_definition(event, by_address()).identifier == "code-reviewer"
    with pytest.raises(DefinitionError, match="not the reference's author"):
        check_definition(impostor, by_address())
    with pytest.raises(DefinitionError, match="has d tag 'code-reviewer', not 'planner'"):
        check_definition(event, by_address(identifier="planner"))


def test_an_nevent_refuses_another_id_or_author() -> None:
    """Through an nevent, an event with another id, or by another author than the nevent names, is refused."""
    event, other = definition(), definition(content="Other instructions.")
    wrong_author = parse_reference(nip19.encode_nevent(event.id, author=STRANGER.pubkey))

    with pytest.raises(DefinitionError, match="is not the event"):
        check_definition(other, by_id(event))
    with pytest.raises(DefinitionError, match="not the reference's author"):
        check_definition(event, wrong_author)


def test_a_definition_without_role_or_instructions_is_refused() -> None:
    """An empty definition (a title only) would make an agent with no persona: it is refused."""
    empty = definition(content="  ", tags=[["title", "Nobody"]])

    with pytest.raises(DefinitionError, match="neither a role nor instructions"):
        check_definition(empty, by_id(empty))


def test_choose_takes_the_newest_valid_version_and_explains_a_refusal() -> None:
    """Of an naddr's versions the newest valid one wins (a newer forged one is skipped); nothing fetched
    says not found; only refused events say why."""
    old, new = definition(content="Version 1."), definition(content="Version 2.", created_at=1_700_000_100)
    forged = definition(created_at=1_700_000_200).model_copy(update={"content": "Version 3."})

    assert choose_definition([old, forged, new], by_address()).instructions == "Version 2."
    with pytest.raises(DefinitionError, match="not found on the relays"):
        choose_definition([], by_address())
    with pytest.raises(DefinitionError, match=r"no valid agent definition .*id is not the hash"):
        choose_definition([forged], by_address())


@pytest.mark.parametrize(
    ("text", "slug"),
    [
        ("Code Reviewer", "code-reviewer"),
        ("Café Ünïcode!! v2", "cafe-unicode-v2"),
        ("  --Über_Planner--  ", "uber_planner"),
        ("Code__Review", "code_review"),
        ("日本語", "agent"),
        ("", "agent"),
        (None, "agent"),
        ("x" * 80, "x" * 64),
    ],
)
def test_slug_base_makes_a_valid_slug(text: str | None, slug: str) -> None:
    """A name becomes lower-case ASCII letters, digits, ``-`` and ``_`` (never ``__``, the thread keys'
    separator), starting with a letter or digit, at most 64 characters; ``agent`` when nothing usable is left."""
    assert slug_base(text) == slug


def test_derive_slug_is_unique() -> None:
    """A slug already taken gets ``-2``, then ``-3``; a 64-character one is shortened to fit the suffix."""
    assert derive_slug("Code Reviewer", {"planner"}) == "code-reviewer"
    assert derive_slug("Code Reviewer", {"code-reviewer"}) == "code-reviewer-2"
    assert derive_slug("Code Reviewer", {"code-reviewer", "code-reviewer-2"}) == "code-reviewer-3"
    long = derive_slug("y" * 70, {"y" * 64})
    assert (long, len(long)) == ("y" * 62 + "-2", 64)
