"""Signed agent replies: a :class:`~tenex_daemon.core.ports.ReplySpec` made into an event of the kind its
conversation speaks (kind 1 with NIP-10 tags in a kind-1 conversation, kind 1111 with NIP-22 tags in
the others: docs/PROTOCOL.md, "Tags tenexd writes on an agent reply")."""

from __future__ import annotations

from collections.abc import Mapping

from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.ports import ReplySpec
from tenex_daemon.core.vocabulary import KIND_COMMENT

from .codec import ReplyDetails, ThreadRoot, build_agent_reply, root_of, task_thread_root
from .signer import Signer

REPLY_AHEAD_S = 300
"""How far past the daemon's clock a reply may be dated to come after its trigger (relays refuse events
dated far ahead: strfry past 15 minutes, PyPI nostr-relay past an hour)."""


def reply_created_at(trigger: NostrEvent, now: float, after: int = 0) -> int:
    """A reply's ``created_at``: now, or just after its trigger (or ``after``, the newest date of the other
    events it answers: a burst's messages, its run's ``send_message`` exchange) when that is dated later (a
    person's clock ahead of the daemon's, or the daemon's stepped back), at most :data:`REPLY_AHEAD_S` ahead:
    clients order a thread by date, and show an answer dated before its question above it."""
    now_s = int(now)
    return max(now_s, min(max(trigger.created_at, after) + 1, now_s + REPLY_AHEAD_S))


class SignedReplyComposer:
    """Builds an agent's reply with docs/PROTOCOL.md's kind and tags and signs it with the agent's key."""

    def __init__(self, signers: Mapping[str, Signer], project: tuple[str, str] | None) -> None:
        """Sign with ``signers`` by agent slug; ``project`` is (owner pubkey, d-tag) for the ``a`` tag."""
        self._signers = signers
        self._project = project

    def compose(self, spec: ReplySpec) -> NostrEvent:
        """Return the signed reply: kind 1 when the conversation's root is a kind 1, else kind 1111, dated
        by :func:`reply_created_at`.

        Without a root (not stored) the root is the one the trigger's tags name, else the trigger; in a
        task's session the root is the task (:func:`~.codec.task_thread_root`); when the conversation's
        first event is a reply (a comment, or a kind-1 note in a NIP-10 thread: its own root could not be
        found), the root that reply names.
        """
        root: ThreadRoot | NostrEvent | None = spec.root
        if spec.task_id is not None:
            root = task_thread_root(spec.task_id, spec.root)
        elif spec.root is not None and (spec.missing_root is not None or spec.root.kind == KIND_COMMENT):
            # a reply whose own root no relay gave started the conversation (or a comment is its first
            # event): the root that reply names
            root = root_of(spec.root)
        details = ReplyDetails(
            project=self._project,
            phase=spec.phase,
            net_time_seconds=spec.net_time_seconds,
            session_id=spec.session_id,
            complete=spec.complete,
            llm_model=spec.model,
            prompt_tokens=spec.prompt_tokens,
            completion_tokens=spec.completion_tokens,
            cost_usd=spec.cost_usd,
            error=spec.error,
            delegation=spec.delegation,
        )
        kind, tags = build_agent_reply(spec.trigger, spec.destinations, root=root, details=details)
        signer = self._signers[spec.agent_slug]
        created_at = reply_created_at(spec.trigger, signer.now(), spec.after)
        return signer.sign(kind, spec.content, tags, created_at=created_at)
