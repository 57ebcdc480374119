"""Fixtures of the fault runs: a real relay, a fresh home and a running daemon, as in tests/e2e."""

from tests.e2e.conftest import daemon, home, relay

__all__ = ["daemon", "home", "relay"]
