"""When a daemon sharing a database believes a peer dead: its name found free at every look for the grace
time, while this daemon kept its own name (a database restart frees every name at once)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tenex_daemon.app import daemon as daemon_module
from tenex_daemon.app.daemon import PEER_GRACE_S, Daemon


class Looker:
    """The part of a daemon that judges its peers: its store's ``Peers`` (a count of its own names lost)
    and the peers seen free so far."""

    def __init__(self) -> None:
        self._peers = SimpleNamespace(names_lost=0)
        self._peer_free_since: dict[str, tuple[float, int]] = {}

    def believed_dead(self, instance: str, free: bool) -> bool:
        """The daemon's own judgement, on these parts (all it reads)."""
        return Daemon._believed_dead(self, instance, free)  # type: ignore[arg-type]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The daemon module's monotonic clock, set by the test (seconds)."""
    now = [100.0]
    monkeypatch.setattr(daemon_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    return now


def test_a_name_free_at_every_look_for_the_grace_time_is_a_dead_peers(clock: list[float]) -> None:
    """Looks every second find the peer's name free: not dead before the grace time is over, dead then."""
    looker = Looker()
    seen = []
    for _ in range(int(PEER_GRACE_S) + 1):
        seen.append(looker.believed_dead("b", True))
        clock[0] += 1.0

    assert seen == [False] * int(PEER_GRACE_S) + [True]


def test_a_name_free_at_every_look_across_a_database_restart_is_not_a_dead_peers(clock: list[float]) -> None:
    """The peer's name is found free at every look, but this daemon's own name was lost and taken again in
    between (a database restart, when every name is free for a moment, even a live peer's): the count
    starts again then, and the peer counts as dead only a whole grace time after this daemon's last loss."""
    looker = Looker()
    seen = []
    for second in range(int(PEER_GRACE_S) + 4):
        if second == 3:
            looker._peers.names_lost += 1
        seen.append(looker.believed_dead("b", True))
        clock[0] += 1.0

    assert seen == [False] * (3 + int(PEER_GRACE_S)) + [True]


def test_a_name_held_at_one_look_starts_the_count_again(clock: list[float]) -> None:
    """One look finds the peer holding its name: the grace time counts from the next free look."""
    looker = Looker()
    looks = [True, True, True, False] + [True] * (int(PEER_GRACE_S) + 1)
    seen = []
    for free in looks:
        seen.append(looker.believed_dead("b", free))
        clock[0] += 1.0

    assert seen == [False] * (len(looks) - 1) + [True]
