"""Which EVENT a relay's ``OK`` answers: the ``OK`` futures publishers wait on, and answers naming no event.

NIP-01's ``["OK", <event id>, <accepted>, <message>]`` names the event it answers. PyPI nostr-relay (1.14,
``web.py``, ``start_client``) answers an EVENT whose ``add_event`` raises (``StorageError``,
``AuthenticationError``, any other exception: each validator, ``is_not_too_large``'s ``invalid: 280
characters should be enough for anybody`` among them, a write not permitted, bad JSON) with an EMPTY id.
The codec passes such an answer on with ``event_id == ""`` (any other id that is not 64 hex characters it
refuses as a malformed frame). It is attributed by deduction, with no assumption about the order a relay
answers in:

- Each EVENT frame sent on a connection is *owed* one ``OK`` until one naming its id comes or the
  connection closes (an AUTH frame is not: nostr-relay never answers one, and an AUTH owed for good would
  be a candidate of every later answer without an id). An answer without an id was caused by one of the
  frames owed when it came (its candidates), and that frame gets no other answer, so it stays owed.
- Once only one of its candidates is still owed, the answer is that frame's: at once when one frame was
  owed (the usual case), else when the others were answered by id.
- When the answers waiting are exactly as many as the frames their candidates still owe, each of those
  frames got one of them: the same answer for all is each one's; different answers cannot be told apart,
  so those publishers send their events again and this connection sends one EVENT at a time from then on
  (:attr:`AwaitedOks.one_at_a_time`), where each answer has one candidate.
- Otherwise the answer waits for more ``OK``\\ s. One that can never be attributed (every candidate was
  answered by id, frames owed were forgotten past :data:`MAX_OWED`, the connection closed first) is
  counted (:attr:`AwaitedOks.unmatched`) and logged as ``ok_unmatched``.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from typing import Final

import structlog
from websockets.exceptions import ConnectionClosed

from ..codec import OkMessage

log = structlog.get_logger(__name__)

MESSAGE_TOO_BIG: Final = 1009
"""The websocket close code for a message too big to process (RFC 6455)."""

TOO_LARGE_FOR_RELAY: Final = "invalid: event too large for this relay (it closed the connection with 1009)"
"""The refusal a publish gets when the relay closed the connection on its EVENT frame: ``invalid:`` and
"too large", so a publish every relay refused this way is refused for good
(:func:`~.types.refused_for_its_size`)."""


def relay_closed_for_size(exc: ConnectionClosed) -> bool:
    """Whether the relay closed the connection with 1009, first: a frame this side sent was over its limit."""
    return exc.rcvd is not None and exc.rcvd.code == MESSAGE_TOO_BIG and exc.rcvd_then_sent is not False


def we_closed_for_size(exc: ConnectionClosed) -> bool:
    """Whether websockets itself closed the connection with 1009, first: a frame this side received was
    over ``max_size``. (A relay's close with 1009 is echoed with 1009 too, but sent after it came.)"""
    return exc.sent is not None and exc.sent.code == MESSAGE_TOO_BIG and not exc.rcvd_then_sent


RESEND: Final = OkMessage("", False, "resend: the relay's answer could not be told apart from another's")
"""Given (by identity) to a publisher whose frame got an answer that could not be told apart from another
frame's: it sends its event again, one at a time."""

MAX_OWED: Final = 10_000
"""Event ids owed an ``OK`` kept per connection (a relay that never answers some): past it the oldest is
forgotten, and answers without an id are no longer attributed on this connection."""


@dataclass
class _Unnamed:
    """An ``OK`` without an event id, not attributed yet: the answer, and the ids of the frames that may
    have caused it (owed an ``OK`` when it came, and still owed)."""

    answer: OkMessage
    candidates: set[str]


class AwaitedOks:
    """One connection's awaited ``OK``\\ s: the publishers' futures by event id, the frames owed an answer,
    and the answers without an id (module docstring)."""

    def __init__(self, url: str) -> None:
        self.log = log.bind(relay=url)
        self.waiters: dict[str, list[asyncio.Future[OkMessage]]] = {}
        """Per event id, the futures of those waiting for its ``OK``."""
        self.sizes: dict[str, int] = {}
        """Per event id a publish awaits an ``OK`` for: the size of its EVENT frame."""
        self.owed: Counter[str] = Counter()
        """Per event id, its frames sent on this connection that no ``OK`` answered yet."""
        self.unnamed: list[_Unnamed] = []
        self.one_at_a_time = False
        """Set once answers without an id could not be told apart: publishes on this connection then send
        one EVENT at a time (holding :attr:`turn`) until it closes."""
        self.turn = asyncio.Lock()
        self.blind = False
        """Frames owed were forgotten (:data:`MAX_OWED`): answers without an id are not attributed."""
        self.unmatched = 0
        """Answers without an id that could not be attributed, since start."""
        self.attributed = 0
        """Answers without an id attributed to an event, since start."""

    # -- waiting ---------------------------------------------------------------------------

    def expect(self, event_id: str, frame_size: int | None = None) -> asyncio.Future[OkMessage]:
        """Register interest in the ``OK`` for an event id (``frame_size``: its EVENT frame's, for a publish).
        Whoever calls it forgets the future when done waiting (:meth:`forget`)."""
        future: asyncio.Future[OkMessage] = asyncio.get_running_loop().create_future()
        self.waiters.setdefault(event_id, []).append(future)
        if frame_size is not None:
            self.sizes[event_id] = frame_size
        return future

    def forget(self, event_id: str, future: asyncio.Future[OkMessage]) -> None:
        """Stop waiting with ``future`` (the frame stays owed its answer: it may still come)."""
        waiting = self.waiters.get(event_id)
        if waiting and future in waiting:
            waiting.remove(future)
            if not waiting:
                del self.waiters[event_id]
                self.sizes.pop(event_id, None)

    def refuse_largest(self, message: str) -> tuple[str, int] | None:
        """The relay closed the connection with 1009 on a frame we sent: the largest EVENT still awaited here
        is at least as large, so over its limit too: its publishers are answered ``OK false`` with
        ``message``. Return its id and frame size (None: no EVENT awaited)."""
        waiting = [(size, event_id) for event_id, size in self.sizes.items() if self.waiters.get(event_id)]
        if not waiting:
            return None
        size, event_id = max(waiting)
        self.resolve(event_id, OkMessage(event_id, False, message))
        return event_id, size

    def resolve(self, event_id: str, answer: OkMessage) -> None:
        """Give ``answer`` to everyone waiting for ``event_id``'s ``OK``."""
        self.sizes.pop(event_id, None)
        for future in self.waiters.pop(event_id, []):
            if not future.done():
                future.set_result(answer)

    # -- frames owed an answer -------------------------------------------------------------

    def sending(self, event_id: str) -> None:
        """An EVENT or AUTH frame for ``event_id`` is about to go out on this connection: it is owed an
        ``OK`` (counted before the send, as the answer may be read before the send returns)."""
        self.owed[event_id] += 1
        if len(self.owed) > MAX_OWED:
            oldest = next(iter(self.owed))
            self._drop_owed(oldest)
            if not self.blind:
                self._go_blind()

    def _go_blind(self) -> None:
        """Owed frames were forgotten: no answer without an id is attributed here any more (a forgotten
        frame may be what it answers)."""
        self.blind = True
        note = "answers without an event id are no longer attributed on this connection"
        self.log.warning("ok_tracking_full", owed=MAX_OWED, note=note)
        for unnamed in self.unnamed:
            self._unmatched(unnamed.answer, "frames owed an OK were forgotten", len(unnamed.candidates))
        self.unnamed.clear()

    def not_sent(self, event_id: str) -> None:
        """The frame counted by :meth:`sending` did not go out."""
        self._drop_owed(event_id)

    def _drop_owed(self, event_id: str) -> bool:
        """One frame of ``event_id`` is owed nothing any more; return whether one was owed."""
        count = self.owed.get(event_id, 0)
        if count <= 1:
            self.owed.pop(event_id, None)
        else:
            self.owed[event_id] = count - 1
        return count > 0

    # -- answers ---------------------------------------------------------------------------

    def answer(self, message: OkMessage) -> None:
        """An ``OK`` from the relay: matched by its id, or, without one, attributed when that can be told."""
        if message.event_id:
            self._drop_owed(message.event_id)
            self.resolve(message.event_id, message)
            if self.unnamed:
                self._deduce()
            return
        if self.blind:
            self._unmatched(message, "frames owed an OK were forgotten on this connection", 0)
            return
        if not self.owed:
            self._unmatched(message, "no EVENT awaits an OK on this connection", 0)
            return
        unnamed = _Unnamed(message, set(self.owed))
        self.unnamed.append(unnamed)
        self._deduce()
        if unnamed in self.unnamed:
            self.log.info("ok_without_event_id", attribution="pending", candidates=len(unnamed.candidates),
                          accepted=message.accepted, message=message.message[:300])

    def closed(self, *, keep_pace: bool = False) -> None:
        """The connection closed: nothing more is owed on it; answers still unattributed stay so.
        ``keep_pace``: the next connection is to the same relay, opened anew on purpose (nostr-relay's
        slowing): if this one sent one EVENT at a time, so does that one."""
        for unnamed in self.unnamed:
            self._unmatched(unnamed.answer, "the connection closed first", len(unnamed.candidates))
        self.unnamed.clear()
        self.owed.clear()
        self.waiters.clear()
        self.sizes.clear()
        self.one_at_a_time = self.one_at_a_time and keep_pace
        self.blind = False

    def _deduce(self) -> None:
        """Attribute every answer without an id that can be told (module docstring)."""
        progress = True
        while progress and self.unnamed:
            progress = False
            for unnamed in list(self.unnamed):
                unnamed.candidates &= self.owed.keys()
                if len(unnamed.candidates) > 1:
                    continue
                self.unnamed.remove(unnamed)
                progress = True
                if unnamed.candidates:
                    (event_id,) = unnamed.candidates
                    self._drop_owed(event_id)
                    self._attribute(event_id, unnamed.answer, "the only frame it can answer")
                else:
                    self._unmatched(unnamed.answer, "every frame it could answer was answered by id", 0)
        if self.unnamed:
            self._settle_together()

    def _settle_together(self) -> None:
        """When the answers waiting are as many as the frames their candidates still owe, each of those
        frames got one: the same answer is each one's; different ones are sent again, one at a time."""
        frames = set().union(*(unnamed.candidates for unnamed in self.unnamed))
        if sum(self.owed[event_id] for event_id in frames) != len(self.unnamed):
            return
        answers = {(unnamed.answer.accepted, unnamed.answer.message) for unnamed in self.unnamed}
        unnamed_now, self.unnamed = self.unnamed, []
        if len(answers) == 1:
            for event_id in frames:
                while self._drop_owed(event_id):
                    self._attribute(event_id, unnamed_now[0].answer, "the same answer for each frame")
            return
        self.one_at_a_time = True
        why = "different answers for the same frames: each sent again, one at a time"
        for unnamed in unnamed_now:
            self._unmatched(unnamed.answer, why, len(frames))
        for event_id in frames:
            del self.owed[event_id]
            self.resolve(event_id, RESEND)

    def _attribute(self, event_id: str, answer: OkMessage, rule: str) -> None:
        self.attributed += 1
        waiting = len(self.waiters.get(event_id, ()))
        self.log.info("ok_without_event_id", attribution=rule, event_id=event_id, waiting=waiting,
                      accepted=answer.accepted, message=answer.message[:300])
        self.resolve(event_id, OkMessage(event_id, answer.accepted, answer.message))

    def _unmatched(self, answer: OkMessage, why: str, candidates: int) -> None:
        self.unmatched += 1
        self.log.warning("ok_unmatched", event_id=answer.event_id, why=why, candidates=candidates,
                         accepted=answer.accepted, message=answer.message[:300])
