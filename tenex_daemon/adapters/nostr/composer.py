"""Signed agent replies: a :class:`~tenex_daemon.core.ports.ReplySpec` made into a kind-1111 event."""

from __future__ import annotations

from collections.abc import Mapping

from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.ports import ReplySpec
from tenex_daemon.core.vocabulary import KIND_COMMENT

from .codec import ReplyDetails, ThreadRoot, build_reply_tags
from .signer import Signer


class SignedReplyComposer:
    """Builds an agent's kind-1111 reply with docs/PROTOCOL.md's tags and signs it with the agent's key."""

    def __init__(self, signers: Mapping[str, Signer], project: tuple[str, str] | None) -> None:
        """Sign with ``signers`` by agent slug; ``project`` is (owner pubkey, d-tag) for the ``a`` tag."""
        self._signers = signers
        self._project = project

    def compose(self, spec: ReplySpec) -> NostrEvent:
        """Return the signed reply."""
        root = ThreadRoot.of(spec.root) if spec.root is not None else None
        details = ReplyDetails(
            project=self._project,
            phase=spec.phase,
            net_time_seconds=spec.net_time_seconds,
            session_id=spec.session_id,
            complete=spec.complete,
            llm_model=spec.model,
            prompt_tokens=spec.prompt_tokens,
            completion_tokens=spec.completion_tokens,
            error=spec.error,
            delegation=spec.delegation,
        )
        tags = build_reply_tags(spec.trigger, spec.destinations, root=root, details=details)
        return self._signers[spec.agent_slug].sign(KIND_COMMENT, spec.content, tags)
