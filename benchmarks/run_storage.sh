#!/usr/bin/env bash
# The storage benchmark with its peers (OpenAI Agents SDK SQLiteSession, LangGraph SqliteSaver).
# Peers live in their own virtual environment (.cache/bench-peers-venv) so they never enter
# tenexd's lock file; tenexd itself is importable there through PYTHONPATH and our .venv's
# site-packages. Arguments go to benchmarks/bench_storage.py (e.g. --scale 0.1 for a quick run).
set -euo pipefail
cd "$(dirname "$0")/.."

peers=.cache/bench-peers-venv
if [ ! -x "$peers/bin/python" ] || ! "$peers/bin/python" -c "import agents, langgraph.checkpoint.sqlite" 2>/dev/null; then
    echo "bench: preparing $peers (openai-agents, langgraph, langgraph-checkpoint-sqlite)" >&2
    uv venv --quiet --python "$(.venv/bin/python -c 'import sys; print(sys.executable)')" "$peers"
    uv pip install --quiet --python "$peers/bin/python" openai-agents langgraph langgraph-checkpoint-sqlite
fi
ours=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# Peers' own packages come first, then ours (tenexd's dependencies for the stores).
PYTHONPATH="$PWD:$("$peers/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'):$ours" \
    exec "$peers/bin/python" -m benchmarks.bench_storage "$@"
