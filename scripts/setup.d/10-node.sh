#!/usr/bin/env bash
# Node packages for the Nostr interop tests (nostr-tools + ws + @nostr-dev-kit/ndk, tests/node/), installed
# with `npm ci` from the committed lockfile. Skips the install when node_modules is
# newer than the lockfile (npm writes node_modules/.package-lock.json on every install).
set -euo pipefail
cd "$(dirname "$0")/../../tests/node"

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    echo "setup: node and npm are needed for tests/node (Node >= 20)" >&2
    exit 1
fi
stamp=node_modules/.package-lock.json
if [ -f "$stamp" ] && [ "$stamp" -nt package-lock.json ] && [ -d node_modules/nostr-tools ] && [ -d node_modules/ws ] \
    && [ -d node_modules/@nostr-dev-kit/ndk ]; then
    exit 0
fi
echo "setup: npm ci in tests/node" >&2
npm ci --no-audit --no-fund --loglevel=error
