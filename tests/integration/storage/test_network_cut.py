"""PostgreSQL over a network that stops carrying anything: statements fail in bounded time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]


def test_a_statement_over_a_cut_network_fails_within_seconds_instead_of_waiting_forever() -> None:
    """With the network cut (in a namespace of the test's own, loopback taken down), a statement waiting
    for its answer and one sent after the cut each fail with a closed connection within about 25 s (the
    socket's keepalive and its bound on unacknowledged data), and the store then closes at once; without
    them both waited for as long as the test let them."""
    run = subprocess.run(
        ["unshare", "--net", sys.executable, "-m", "tests.integration.storage.network_cut"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])

    for statement in ("waiting", "sent_after_the_cut"):
        assert result[statement]["raised"] == "ConnectionDoesNotExistError", result
        assert result[statement]["after_s"] < 45, result
    assert result["close_s"] < 10, result
