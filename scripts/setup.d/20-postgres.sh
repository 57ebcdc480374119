#!/usr/bin/env bash
# PostgreSQL for the storage tests: the tests start their own server (initdb + pg_ctl in a temp
# folder), so this only makes sure the binaries exist and that a non-root account can run them
# (PostgreSQL refuses to run as root).
set -euo pipefail

have_initdb() {
    command -v initdb >/dev/null 2>&1 || compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null
}

if ! have_initdb; then
    echo "setup: installing PostgreSQL" >&2
    if [ "$(id -u)" -eq 0 ]; then
        apt-get update && apt-get install -y postgresql
    else
        sudo apt-get update && sudo apt-get install -y postgresql
    fi
fi

if [ "$(id -u)" -eq 0 ] && ! id postgres >/dev/null 2>&1 && ! id tenexd-pg >/dev/null 2>&1; then
    useradd --system --no-create-home tenexd-pg
fi
