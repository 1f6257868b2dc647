"""Concurrency: real processes materializing one digest at once, with working and with broken locks.

The lock only prevents duplicate work; the broken-lock test (``flock`` a no-op in every child, as on
Lustre/GPFS/some NFS mounts, huggingface_hub PR #4306) proves safety does not depend on it.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

from cache_support import assert_no_wrong_eligible_object, child_command, eligible_objects, sha256_of, temporaries
from slabs import stage_checkpoint

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.cache.records import record_state
from coldsnap_core.capture.materialize import materialize_payload
from coldsnap_core.copy.host import HostCopyBackend

PROCESSES = 8


def _run_together(commands: list[list[str]], start_file: Path) -> list[tuple[int, str, str]]:
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for cmd in commands]
    time.sleep(0.5)  # let every child import and stage its slabs, then release them at once
    start_file.touch()
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=180)
        out.append((proc.returncode, stdout, stderr))
    return out


def test_eight_processes_materialize_one_digest(captured, tmp_path: Path) -> None:
    """8 real processes materialize the same digest at once: every one succeeds, exactly one writes
    (the others find the valid object under the lock), one object, no temporary file left."""
    state = tmp_path / "state"
    start = tmp_path / "go"
    cmd = child_command(captured.checkpoint, captured.artifact_dir, state, "--start-file", str(start))
    results = _run_together([cmd] * PROCESSES, start)
    assert [rc for rc, _, _ in results] == [0] * PROCESSES, [err for _, _, err in results]
    written = [line for _, out, _ in results for line in out.splitlines() if '"written": true' in line]
    assert len(written) == 1
    assert list(eligible_objects(state)) == [captured.pack.sha256]
    assert sha256_of(eligible_objects(state)[captured.pack.sha256]) == captured.pack.sha256
    assert temporaries(state) == []
    assert record_state(PayloadCache(state), captured.pack.sha256) == "trusted"


def test_eight_processes_with_broken_flock_still_converge_safely(captured, tmp_path: Path) -> None:
    """With ``flock`` a no-op everywhere (every lock "succeeds"), all 8 writers may write at once:
    still every process succeeds, the one eligible object is correct, and no temporary is left,
    because safety comes from unique temporary names, the SHA-256 check and the atomic rename."""
    state = tmp_path / "state"
    start = tmp_path / "go"
    cmd = child_command(captured.checkpoint, captured.artifact_dir, state, "--start-file", str(start), "--break-flock")
    results = _run_together([cmd] * PROCESSES, start)
    assert [rc for rc, _, _ in results] == [0] * PROCESSES, [err for _, _, err in results]
    assert list(eligible_objects(state)) == [captured.pack.sha256]
    assert_no_wrong_eligible_object(state)
    assert temporaries(state) == []


def test_threads_admitting_an_unrecorded_object_hash_it_once(captured) -> None:
    """Four threads admit an object that has no record: the digest lock makes them hash it once in
    total (a regression that hashes outside the lock, or skips the re-check under it, hashes 2-4x)."""
    cache = PayloadCache(captured.capture_root)
    digest = captured.pack.sha256
    cache.record_path(digest).unlink()
    hashed = []
    lock = threading.Lock()

    def progress(n: int) -> None:
        with lock:
            hashed.append(n)
        time.sleep(0.01)  # keep the first hasher busy while the others queue on the lock

    barrier = threading.Barrier(4)
    errors = []

    def admit() -> None:
        barrier.wait()
        try:
            cache.admit(digest, progress=progress)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=admit) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sum(hashed) == captured.pack.size_bytes


def test_lock_timeout_proceeds_without_the_lock(captured, tmp_path: Path, caplog) -> None:
    """A holder that never releases the lock (another real process) delays a writer only up to the
    timeout; the writer then proceeds with a WARNING and still produces the one valid object."""
    state = tmp_path / "state"
    cache = PayloadCache(state, lock_timeout_seconds=0.3)
    cache.ensure_dirs()
    lock_path = cache.lock_path(captured.pack.sha256)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import filelock, sys, time; l = filelock.FileLock(sys.argv[1]); l.acquire(); print('held', flush=True); time.sleep(60)",
            str(lock_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        slabs = stage_checkpoint(captured.checkpoint, slab_count=2)
        with caplog.at_level(logging.WARNING):
            handle = materialize_payload(captured.manifest, slabs.allocations, HostCopyBackend(threads=1), cache, mode="required")
        assert handle.result.written
        assert "proceeding without it" in caplog.text
        assert sha256_of(cache.object_path(captured.pack.sha256)) == captured.pack.sha256
    finally:
        holder.kill()
        holder.wait()
