"""Private conversations (NIP-17) on every store: the decrypted rumors (unsigned, ``sig`` empty) are kept,
reloaded and found like any event, and the conversation stays private."""

from __future__ import annotations

import pytest

from tenex_daemon.adapters.nostr.private import make_rumor
from tenex_daemon.core.conversation import Conversation
from tests.conftest import Cast
from tests.contract.conftest import StoreHarness

pytestmark = pytest.mark.integration

T0 = 1_700_000_000_000


async def test_a_private_conversation_of_rumors_survives_a_reopen(harness: StoreHarness, cast: Cast) -> None:
    """A conversation rooted at a person's rumor, with the agent's rumor appended, comes back from a
    reopened store with both rumors unsigned and intact (their ids checked), private, each found by id."""
    store = await harness.open()
    question = make_rumor(cast.user.pubkey, "a secret ✓", [["p", cast.alice.pubkey]], 1_700_000_000)
    answer = make_rumor(cast.alice.pubkey, "kept", [["p", cast.user.pubkey], ["e", question.id, "", "reply"]],
                        1_700_000_001)
    conversation = Conversation(id=question.id, root_kind=14, created_at=T0, updated_at=T0,
                                channel=f"dm:alice:{cast.user.pubkey}")
    conversation.append(question)
    await store.create(conversation)
    await store.append_event(conversation.id, answer)
    reopened = await harness.reopen(store)
    loaded = await reopened.load(conversation.id)
    assert loaded is not None
    assert loaded.private
    assert loaded.history == [question, answer]
    assert all(event.sig == "" and event.has_valid_id() for event in loaded.history)
    assert await reopened.find_event(answer.id) == (conversation.id, answer)
    assert await reopened.is_processed(question.id)
