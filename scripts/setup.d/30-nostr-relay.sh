#!/usr/bin/env bash
# The PyPI `nostr-relay` server used by the Nostr integration tests, in its own
# virtual environment (.cache/nostr-relay-venv): it pulls ~40 packages that tenexd
# itself never imports. Skips the install when the pinned version is already there.
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV=.cache/nostr-relay-venv
VERSION=1.14
if [ -x "$VENV/bin/nostr-relay" ] && "$VENV/bin/python" -c "
import importlib.metadata as m, sys
sys.exit(0 if m.version('nostr-relay') == '$VERSION' else 1)" 2>/dev/null; then
    exit 0
fi
echo "setup: installing nostr-relay $VERSION into $VENV" >&2
rm -rf "$VENV"
mkdir -p .cache
if command -v uv >/dev/null 2>&1; then
    uv venv --quiet --python python3 "$VENV"
    uv pip install --quiet --python "$VENV/bin/python" "nostr-relay==$VERSION" aiosqlite uvicorn
else
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "nostr-relay==$VERSION" aiosqlite uvicorn
fi
"$VENV/bin/nostr-relay" --help >/dev/null
