"""The embedded relay: nostr-sdk's LocalRelay inside the daemon, events kept in LMDB under the home."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import nostr_sdk
import structlog
from nostr_sdk import nostr_sdk as nostr_sdk_ffi

log = structlog.get_logger(__name__)


class EmbeddedRelay:
    """A real Nostr relay on ``ws://host:port``, run in this process (for ``tenexd run --embedded-relay``)."""

    def __init__(self, db_path: Path, host: str = "127.0.0.1", port: int = 7777) -> None:
        self.db_path = db_path
        self.host = host
        self.port = port
        self._relay: Any = None
        self._db: Any = None

    @property
    def url(self) -> str:
        """The relay's websocket URL."""
        return f"ws://{self.host}:{self.port}"

    async def start(self) -> None:
        """Open the LMDB database and start serving; returns once the port accepts connections."""
        # LMDB calls back into Python from the relay's threads: it needs this loop.
        nostr_sdk_ffi.uniffi_set_event_loop(asyncio.get_running_loop())
        self.db_path.mkdir(parents=True, exist_ok=True)
        self._db = await nostr_sdk.NostrLmdb.open(str(self.db_path))
        self._relay = (
            nostr_sdk.LocalRelayBuilder()
            .addr(self.host)
            .port(self.port)
            .database(self._db)
            .rate_limit(nostr_sdk.RateLimit(max_reqs=1000, notes_per_minute=100_000))
            .build()
        )
        await self._relay.run()
        await self._wait_listening()
        log.info("embedded_relay_started", url=self.url, path=str(self.db_path))

    async def _wait_listening(self, within: float = 10.0) -> None:
        deadline = time.monotonic() + within
        while True:
            try:
                _, writer = await asyncio.open_connection(self.host, self.port)
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"embedded relay did not listen on {self.url}") from None
                await asyncio.sleep(0.05)
                continue
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            return

    def stop(self) -> None:
        """Stop serving (the LMDB files stay)."""
        if self._relay is not None:
            self._relay.shutdown()
            self._relay = None
            log.info("embedded_relay_stopped", url=self.url)
