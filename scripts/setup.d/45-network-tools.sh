#!/usr/bin/env bash
# tests/integration/storage/test_network_cut.py cuts PostgreSQL's network for real: it runs in a network
# namespace of its own (`unshare`, Debian's util-linux) and takes its loopback down (`ip`, iproute2).
# Nothing is installed when both are there.
set -euo pipefail

if command -v unshare >/dev/null 2>&1 && command -v ip >/dev/null 2>&1; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup: unshare or ip is missing and apt-get is not available; the network-cut test will fail" >&2
    exit 0
fi
echo "setup: installing util-linux and iproute2 (unshare, ip)" >&2
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends util-linux iproute2 >/dev/null
