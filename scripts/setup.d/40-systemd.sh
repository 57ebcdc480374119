#!/usr/bin/env bash
# `systemd-analyze verify` checks systemd/tenexd.service in tests/integration/app/test_systemd_unit.py.
# Debian's `systemd` package provides it; nothing is installed when it is already there.
set -euo pipefail

if command -v systemd-analyze >/dev/null 2>&1; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup: systemd-analyze is missing and apt-get is not available; the unit test will be skipped" >&2
    exit 0
fi
echo "setup: installing the Debian systemd package (systemd-analyze)" >&2
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends systemd >/dev/null
systemd-analyze --version | head -1 >&2
