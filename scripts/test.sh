#!/usr/bin/env bash
# The test command (README, "Set up"): create the virtual environments if needed (vLLM's, and SGLang's,
# which cannot share it: the two engines pin different torch releases), then lint, check formatting and
# run the whole test suite, the vLLM and SGLang end-to-end tests included.
#   scripts/test.sh [PYTEST ARGS...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
scripts/setup-venv.sh
venv=${COLDSNAP_VENV:-$root/.venv}
# The SGLang engine tests start their engines with this environment's Python (tests/sglang/sglang_support.py).
COLDSNAP_SGLANG_VENV=$(scripts/setup-sglang-venv.sh)
export COLDSNAP_SGLANG_VENV
export PATH="$venv/bin:$PATH" HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
ruff check .
ruff format --check .
# vLLM leaves its IPC sockets and small files in the temporary folder: give this run its own and remove
# it at the end (pytest's own temporary folders stay where they were, under PYTEST_DEBUG_TEMPROOT).
export PYTEST_DEBUG_TEMPROOT=${PYTEST_DEBUG_TEMPROOT:-${TMPDIR:-/tmp}}
run_tmp=$(mktemp -d "${TMPDIR:-/tmp}/coldsnap-run.XXXXXX")
trap 'rm -rf "$run_tmp"' EXIT
export TMPDIR=$run_tmp
python -m pytest "$@"
