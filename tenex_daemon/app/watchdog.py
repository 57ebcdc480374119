"""systemd's watchdog (``WATCHDOG=1``): a ping says the event loop turns and the store's writes go through.

A ping that proved only the event loop would keep a daemon whose store is stuck alive for good: a
commit thread hung in an fsync on a dead disk, a PostgreSQL pool whose connections never answer. Every
reply waits for the store, so such a daemon answers nobody, and systemd restarting it is the way out.

So beside each round of pings the watchdog writes one small value through the store
(:data:`WATCHDOG_KEY`, the time it was written), off any reply's path: the write takes the way every
durable write takes (the filesystem store's group commit and fsync, a PostgreSQL transaction on its
query pool) and waits behind the writes in flight there. A new one starts only once the last one is
done, at the pace of the pings (half of ``WatchdogSec``: every 15 s under ``systemd/tenexd.service``,
a small fraction of the status file's writes). While a write has waited longer than
:data:`STORE_STUCK_AFTER_S`, the pings stop (``watchdog_withheld``) and systemd restarts the daemon
``WatchdogSec`` later; they go on if the write ends first (``watchdog_resumed``).

A write that fails (a full disk, a database restarting or refusing) answered: the store is not stuck,
a restart would not help, and the daemon retries its own work (docs/ARCHITECTURE.md, "Durability
contract"). It is logged, once for each run of failures. Without systemd's watchdog the write goes on
every :data:`PROBE_EVERY_S`, no ping is sent, and a write stuck past the bound shows in ``tenexd status``
as degraded (as it does under systemd).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import structlog

from tenex_daemon.app.notify import SystemdNotifier
from tenex_daemon.core.ports import SmallValues
from tenex_daemon.runtime.failures import log_failure

log = structlog.get_logger(__name__)

STORE_STUCK_AFTER_S = 60.0
"""How long the watchdog's write may wait before the store counts as stuck and the pings stop. Longer
than any write of a working store (a journal's checkpoint on a slow disk, a database's answer over a
network that stopped carrying it, cut after about 25 s)."""
PROBE_EVERY_S = 15.0
"""How often the store is probed when systemd asks for no watchdog (the status says when it is stuck)."""
WATCHDOG_KEY = "watchdog.store"
"""The small value the watchdog writes (the Unix time of the write)."""


def watchdog_key(instance: str | None) -> str:
    """Where the probe writes: :data:`WATCHDOG_KEY`, with ``:<instance>`` after it for a daemon sharing its
    database (each its own row, so none waits behind another's; a dead one's is forgotten on takeover)."""
    return WATCHDOG_KEY if instance is None else f"{WATCHDOG_KEY}:{instance}"


def store_probe(store: SmallValues, instance: str | None = None) -> Callable[[], Awaitable[None]]:
    """A write of the time under :func:`watchdog_key`: one durable write through ``store``."""
    key = watchdog_key(instance)

    async def probe() -> None:
        await store.set_meta(key, str(round(time.time())))

    return probe


class Watchdog:
    """Pings systemd's watchdog while the store's writes go through (see the module's doc)."""

    def __init__(
        self,
        notifier: SystemdNotifier,
        probe: Callable[[], Awaitable[None]],
        *,
        stuck_after_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        ping: bool = True,
    ) -> None:
        self.notifier = notifier
        self.ping = ping
        """Whether systemd asked for a watchdog; without one, only :meth:`stuck_s` tells (the status)."""
        self.probe = probe
        self.stuck_after_s = STORE_STUCK_AFTER_S if stuck_after_s is None else stuck_after_s
        """:data:`STORE_STUCK_AFTER_S` unless given."""
        self.clock = clock
        self._probing: asyncio.Task[None] | None = None
        self._probe_started = 0.0
        self._withheld = False
        self._failing = False

    def stuck_s(self) -> float | None:
        """How long the write in flight has waited, once that is past the bound (the store looks stuck);
        None while it is not."""
        waited = self.waited_s()
        return waited if waited > self.stuck_after_s else None

    def waited_s(self) -> float:
        """How long the write in flight has waited (0 when none is)."""
        if self._probing is None or self._probing.done():
            return 0.0
        return self.clock() - self._probe_started

    def beat(self) -> bool:
        """One round: start a write unless one is in flight, then ping unless the one in flight waited too
        long; return whether it pinged."""
        if self._probing is None or self._probing.done():
            self._probe_started = self.clock()
            self._probing = asyncio.get_running_loop().create_task(self._write(), name="watchdog write")
        waited = self.waited_s()
        if waited > self.stuck_after_s:
            if not self._withheld:
                self._withheld = True
                then = "the pings stop, and systemd restarts the daemon" if self.ping else "degraded"
                note = f"a store write has not ended: {then}"
                log.error("watchdog_withheld", waited_s=round(waited, 1), note=note)
            return False
        if self._withheld:
            self._withheld = False
            log.warning("watchdog_resumed", note="the store's write ended")
        if self.ping:
            self.notifier.watchdog()
        return self.ping

    async def run(self, every_s: float) -> None:
        """Ping every ``every_s`` while the store's writes go through, until cancelled."""
        try:
            while True:
                self.beat()
                await asyncio.sleep(every_s)
        finally:
            if self._probing is not None:
                self._probing.cancel()

    async def _write(self) -> None:
        try:
            await self.probe()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an answer all the same: the store is not stuck
            if not self._failing:
                self._failing = True
                note = "the store answered: the pings go on"
                log_failure(log, "watchdog_write_failed", exc, brief=(OSError,), note=note)
            return
        self._failing = False
