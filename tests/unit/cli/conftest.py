"""Fixtures of the CLI tests: logging restored after each test (the app tests' fixture)."""

from __future__ import annotations

from tests.unit.app.conftest import restore_logging

__all__ = ["restore_logging"]
