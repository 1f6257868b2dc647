#!/usr/bin/env bash
# The test command (README, "Set up"): create the virtual environment if needed, then lint, check
# formatting and run the whole test suite, vLLM end-to-end tests included.
#   scripts/test.sh [PYTEST ARGS...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
scripts/setup-venv.sh
venv=${COLDSNAP_VENV:-$root/.venv}
export PATH="$venv/bin:$PATH" HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
ruff check .
ruff format --check .
exec python -m pytest "$@"
