"""Domain errors. Each says what went wrong in words a user can act on."""

from __future__ import annotations

from collections.abc import Sequence


class TenexError(Exception):
    """Base class of every error tenexd raises on purpose."""


class InvalidEventError(TenexError, ValueError):
    """An event does not have the NIP-01 shape or its id does not match its content."""


class ConversationNotFoundError(TenexError, LookupError):
    """No conversation with the given id is stored."""

    def __init__(self, conversation_id: str) -> None:
        super().__init__(f"conversation {conversation_id} not found")
        self.conversation_id = conversation_id


class ConversationExistsError(TenexError):
    """A conversation with the given id is already stored."""

    def __init__(self, conversation_id: str) -> None:
        super().__init__(f"conversation {conversation_id} already exists")
        self.conversation_id = conversation_id


class ConversationArchivedError(TenexError):
    """The conversation is archived and read-only until it is restored."""

    def __init__(self, conversation_id: str) -> None:
        super().__init__(f"conversation {conversation_id} is archived and read-only; restore it first")
        self.conversation_id = conversation_id


class UnknownAgentError(TenexError, LookupError):
    """No agent with the given slug is configured."""

    def __init__(self, slug: str, known: Sequence[str] = ()) -> None:
        """``known``: the slugs there are, named in the message when given."""
        there = f" (agents: {', '.join(known)})" if known else ""
        super().__init__(f"unknown agent {slug!r}{there}")
        self.slug = slug


class PhaseTransitionError(TenexError, ValueError):
    """The phase rules forbid the requested transition."""

    def __init__(self, from_phase: str, to_phase: str, allowed: list[str]) -> None:
        allowed_text = ", ".join(allowed) if allowed else "none"
        super().__init__(
            f"phase transition {from_phase} -> {to_phase} is not allowed "
            f"(allowed from {from_phase}: {allowed_text})"
        )
        self.from_phase = from_phase
        self.to_phase = to_phase
        self.allowed = allowed


class UnknownPhaseError(PhaseTransitionError):
    """The requested phase is not one of the project's."""

    def __init__(self, from_phase: str, to_phase: str, phases: Sequence[str]) -> None:
        TenexError.__init__(self, f"unknown phase {to_phase!r}; the phases are {', '.join(phases)}")
        self.from_phase = from_phase
        self.to_phase = to_phase
        self.allowed = []


class TurnNotFoundError(TenexError, LookupError):
    """The conversation has no orchestrator turn with the given id."""


class EventRefusedError(TenexError):
    """Every relay refused an event for good (NIP-01 ``blocked:`` or ``invalid:`` for its size; a rumor
    too long to gift-wrap): sending it again cannot succeed."""

    def __init__(self, message: str, reasons: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.reasons = reasons
        """The relays' own messages, one per relay."""


class StoreUnavailableError(TenexError, OSError):
    """The store does not answer: its database is down, restarting or unreachable (an ``OSError``, as a
    failing disk is). What was asked may be asked again once it answers."""

    logged_briefly = True
    """Logged as one line, without its traceback (``tenex_daemon.runtime.failures``)."""


class StoreTooNewError(TenexError):
    """The store was written by a newer tenexd (a filesystem store's format, a database's schema): this one
    refuses it rather than drop what it does not know (docs/ARCHITECTURE.md, "Durability contract")."""
