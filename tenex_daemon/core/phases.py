"""Conversation phases and the rules that say which transitions are allowed."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Final

from pydantic import BaseModel, ConfigDict, GetCoreSchemaHandler
from pydantic_core import core_schema

from tenex_daemon.core.errors import PhaseTransitionError, UnknownPhaseError
from tenex_daemon.core.vocabulary import BUILT_IN_PHASE_NAMES

PHASE_NAME: Final = re.compile(r"[a-z][a-z0-9_-]{0,31}")
"""What a phase's name may be: lower case, a letter first, at most 32 characters."""


class Phase(str):
    """The operational phase a conversation is in (docs/ARCHITECTURE.md, "Phases and transitions"): one of
    the seven built in (``Phase.CHAT`` ... ``Phase.REFLECTION``) or one a project adds in its ``[phases]``
    table.

    A phase is its name (a ``str``); ``Phase("chat") is Phase.CHAT`` holds for the seven built in, so they
    may be compared with ``is`` as an enum's members were. A name that is not a phase name
    (:data:`PHASE_NAME`) raises ``ValueError``.
    """

    __slots__ = ()

    CHAT: ClassVar[Phase]
    BRAINSTORM: ClassVar[Phase]
    PLAN: ClassVar[Phase]
    EXECUTE: ClassVar[Phase]
    VERIFICATION: ClassVar[Phase]
    CHORES: ClassVar[Phase]
    REFLECTION: ClassVar[Phase]

    def __new__(cls, name: str) -> Phase:
        """The phase named ``name`` (the built-in one's own object for a built-in name)."""
        if type(name) is Phase:
            return name
        known = _BUILT_IN.get(name) if isinstance(name, str) else None
        if known is not None:
            return known
        if not isinstance(name, str) or not PHASE_NAME.fullmatch(name):
            raise ValueError(
                f"{name!r} is not a phase name (lower-case letters, digits, '-' and '_', a letter first, "
                "at most 32 characters)"
            )
        return super().__new__(cls, name)

    @property
    def value(self) -> str:
        """The phase's name (as an enum member's ``value``)."""
        return str.__str__(self)

    def __repr__(self) -> str:
        return f"Phase({self.value!r})"

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        """Validated from a string, stored as the string."""
        return core_schema.no_info_after_validator_function(
            cls, core_schema.str_schema(), serialization=core_schema.plain_serializer_function_ser_schema(str)
        )


_BUILT_IN: dict[str, Phase] = {}
for _name in BUILT_IN_PHASE_NAMES:
    _BUILT_IN[_name] = str.__new__(Phase, _name)
    setattr(Phase, _name.upper(), _BUILT_IN[_name])
BUILT_IN_PHASES: Final = tuple(_BUILT_IN.values())
"""The seven phases every project has names for, in their usual order."""


DEFAULT_TRANSITIONS: Mapping[Phase, frozenset[Phase]] = {
    Phase.CHAT: frozenset({Phase.EXECUTE, Phase.PLAN, Phase.BRAINSTORM}),
    Phase.BRAINSTORM: frozenset({Phase.CHAT, Phase.PLAN, Phase.EXECUTE}),
    Phase.PLAN: frozenset({Phase.EXECUTE, Phase.CHAT}),
    Phase.EXECUTE: frozenset({Phase.VERIFICATION, Phase.CHAT}),
    Phase.VERIFICATION: frozenset({Phase.CHORES, Phase.EXECUTE, Phase.CHAT}),
    Phase.CHORES: frozenset({Phase.REFLECTION, Phase.CHAT}),
    Phase.REFLECTION: frozenset({Phase.CHAT}),
}
"""TENEX's phase rules plus the way back to chat that TENEX clients expect (docs/ARCHITECTURE.md)."""


class PhaseRules:
    """Which phase transitions a project allows. Same-phase handoffs are always allowed."""

    def __init__(
        self, transitions: Mapping[Phase, Iterable[Phase]] | Mapping[str, Iterable[str]] | None = None
    ) -> None:
        source: Mapping[Any, Iterable[Any]] = DEFAULT_TRANSITIONS if transitions is None else transitions
        self._allowed: dict[Phase, frozenset[Phase]] = {
            Phase(k): frozenset(Phase(v) for v in vs) for k, vs in source.items()
        }
        named = dict.fromkeys(Phase(p) for k, vs in source.items() for p in (k, *vs))  # in the table's order
        added = tuple(p for p in named if p not in _BUILT_IN)
        built_in = (p for p in BUILT_IN_PHASES if p in named or p is Phase.CHAT)
        self.phases: tuple[Phase, ...] = (*built_in, *added)
        """Every phase the rules name (chat, where conversations start, always): the built-in ones in their
        usual order, then those the project added in the order the table names them."""

    @classmethod
    def permissive(cls) -> PhaseRules:
        """Rules that allow every move between the built-in phases (for projects that do not enforce them)."""
        return cls({p: BUILT_IN_PHASES for p in BUILT_IN_PHASES})

    def allowed_from(self, phase: Phase) -> frozenset[Phase]:
        """Return the phases reachable from ``phase`` (not counting a same-phase handoff). From a phase the
        rules do not name (a conversation stored before the table changed, or imported) every phase of the
        project is: the table says nothing of it, and it must not hold the conversation for good."""
        if phase not in self.phases:
            return frozenset(self.phases)
        return self._allowed.get(phase, frozenset())

    def is_allowed(self, from_phase: Phase, to_phase: Phase) -> bool:
        """Return whether ``from_phase -> to_phase`` is allowed."""
        return from_phase == to_phase or to_phase in self.allowed_from(from_phase)

    def check(self, from_phase: Phase, to_phase: Phase) -> None:
        """Raise :class:`PhaseTransitionError` when the transition is not allowed
        (:class:`UnknownPhaseError` when ``to_phase`` is not one of the project's)."""
        if from_phase != to_phase and to_phase not in self.phases:
            raise UnknownPhaseError(from_phase.value, to_phase.value, self.phases)
        if not self.is_allowed(from_phase, to_phase):
            allowed = sorted(p.value for p in self.allowed_from(from_phase))
            raise PhaseTransitionError(from_phase.value, to_phase.value, allowed)


class PhaseTransition(BaseModel):
    """A recorded phase change (or same-phase handoff) with who made it and why."""

    model_config = ConfigDict(frozen=True)

    from_phase: Phase
    to_phase: Phase
    message: str
    timestamp: int
    """Milliseconds since the epoch."""
    agent_slug: str
    agent_pubkey: str
    agent_name: str
    reason: str | None = None
    summary: str | None = None
    history_index: int = 0
    """Length of history when the transition was recorded (used by the while-away block)."""

    @property
    def is_handoff(self) -> bool:
        """Whether this is a same-phase handoff rather than a phase change."""
        return self.from_phase == self.to_phase
