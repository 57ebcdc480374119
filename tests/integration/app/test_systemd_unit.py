"""The systemd unit: `systemd-analyze verify` accepts it and it asks for what the daemon provides."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
UNIT = ROOT / "systemd" / "tenexd.service"
TENEXD = Path(sys.executable).parent / "tenexd"


def unit_sections() -> configparser.ConfigParser:
    """The unit file parsed as INI (systemd keys are case-sensitive)."""
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(UNIT.read_text())
    return parser


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    """`systemd-analyze verify` reports nothing for the unit once ExecStart points at an installed tenexd."""
    installed = UNIT.read_text().replace("/opt/tenexd/.venv/bin/tenexd", str(TENEXD))
    assert installed != UNIT.read_text(), "the unit's ExecStart path changed; update this test"
    unit = tmp_path / "tenexd.service"
    unit.write_text(installed)

    result = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )

    assert result.returncode == 0, result.stderr
    assert "tenexd.service" not in result.stderr, result.stderr


def test_unit_is_notify_type_with_watchdog_restart_and_hardening() -> None:
    """The unit is Type=notify with a watchdog, restarts on failure, runs as its own user and is hardened."""
    service = unit_sections()["Service"]

    assert service["Type"] == "notify"
    assert int(service["WatchdogSec"]) > 0
    assert service["Restart"] == "on-failure"
    assert service["User"] == "tenexd"
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ReadWritePaths": "/var/lib/tenexd",
        "PrivateTmp": "yes",
        "ProtectHome": "yes",
    }.items():
        assert service[key] == value, key
    assert "\nEnvironment=TENEX_HOME=/var/lib/tenexd\n" in UNIT.read_text()
