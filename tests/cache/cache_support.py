"""Helpers for the cache tests, and the child-process entry point they run with ``sys.executable``.

The children are real processes doing real work on real files: they stage a small real safetensors
checkpoint into host slabs (:func:`slabs.stage_checkpoint`), read the worker's native
manifest from an artifact captured earlier, and materialize the pack into a state root with the real
canonical writer, real ``filelock`` locks and real ``fsync``/``rename``. Optional fault injection:

* ``--kill-at-byte N``: SIGKILL itself once exactly ``N`` bytes of the pack's temporary file are
  written (the write that crosses ``N`` is cut short at ``N``);
* ``--kill-at CALL:K:WHEN``: SIGKILL itself just ``before`` or ``after`` the ``K``-th call of
  ``os.CALL`` (``rename``, ``fsync``, ``fchmod``, ``unlink``), i.e. between two system calls of the
  commit protocol (crash-state enumeration in the manner of ALICE: Pillai et al., "All File Systems Are Not
  Created Equal", OSDI 2014);
* ``--count-calls``: report how many times each of those calls ran (to enumerate the points);
* ``--break-flock``: make ``fcntl.flock`` a no-op, as on Lustre/GPFS/some NFS (huggingface_hub
  PR #4306), so every lock "succeeds" for everyone;
* ``--fsize-limit N``: ``RLIMIT_FSIZE`` of ``N`` bytes (a full file system, as the writer sees it);
* ``--start-file PATH``: wait until ``PATH`` exists before starting (all children start together).

The child prints one JSON line: ``{"ok": true, "written": bool, "calls": {...}}`` or
``{"ok": false, "error": "<class>", "message": "..."}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from coldsnap_core.cache.payload_cache import PayloadCache
    from coldsnap_core.copy.host import HostCopyBackend

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO / "tools"))  # the test-only slabs, also when this file runs as a child process
WATCHED_CALLS = ("rename", "fsync", "fchmod", "unlink")


def make_checkpoint(folder: Path, *, seed: int = 0) -> Path:
    """A small real safetensors checkpoint (about 2.3 MB, 5 tensors, one duplicated content).

    ``w_dup`` holds the same bytes as ``w_a``, so the pack stores that content once.
    """
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    a = rng.standard_normal((256, 512)).astype(np.float32)
    tensors = {
        "w_a": a,
        "w_b": rng.standard_normal((300, 700)).astype(np.float16),
        "w_c": rng.integers(-128, 127, size=(1000, 333), dtype=np.int8),
        "w_dup": a.copy(),
        "w_small": rng.standard_normal((7,)).astype(np.float32),
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def capture(
    checkpoint: Path,
    artifact_dir: Path,
    state_root: Path,
    *,
    rank: int = 0,
    world_size: int = 1,
    reverse: bool = False,
    slab_count: int = 2,
    target=None,
):
    """Capture ``checkpoint`` (staged into slabs) as one worker of ``artifact_dir``; return the CaptureResult.
    ``target`` is the ``TargetIdentity`` its ``target.json`` records (default: this node's, without an engine)."""
    from slabs import checkpoint_files, stage_checkpoint

    from coldsnap_core.cache.payload_cache import PayloadCache
    from coldsnap_core.capture.worker import capture_worker
    from coldsnap_core.copy.host import HostCopyBackend
    from coldsnap_core.format.manifest import WorkerIdentity
    from coldsnap_core.identity.model_identity import identify_checkpoint

    slabs = stage_checkpoint(checkpoint, slab_count=slab_count, reverse=reverse)
    model = identify_checkpoint(checkpoint_files(checkpoint), source=str(checkpoint))
    return capture_worker(
        allocation_map=slabs.allocation_map,
        allocations=slabs.allocations,
        model_ranges=slabs.model_ranges,
        worker=WorkerIdentity("worker", rank, world_size, 0, 1),
        capture_point="portable",
        model=model,
        cache=PayloadCache(state_root),
        artifact_dir=artifact_dir,
        backend=HostCopyBackend(threads=1),
        target=target,
    )


def hydrate_captured(
    captured,
    cache: PayloadCache,
    *,
    backend: HostCopyBackend | None = None,
    verify_extents: bool = False,
    name_manifest: bool = False,
) -> list[np.ndarray]:
    """Hydrate the capture's ``worker-0-of-1`` capsule into fresh host allocations
    (:func:`slabs.allocate`) through ``backend`` (default: the host backend on one
    thread) and return them; ``name_manifest`` passes the native manifest's path for error messages."""
    from slabs import allocate

    from coldsnap_core.artifact.capsules import read_capsule
    from coldsnap_core.copy.host import HostCopyBackend
    from coldsnap_core.format.allocation import LiveAllocation
    from coldsnap_core.restore.hydrate import hydrate

    capsule = read_capsule(captured.artifact_dir / "workers" / "worker-0-of-1")
    arrays = allocate(capsule.native.allocations)
    hydrate(
        capsule.native,
        blob_path=capsule.blob_path,
        cache=cache,
        allocations=[LiveAllocation(i, int(a.ctypes.data), a.nbytes) for i, a in enumerate(arrays)],
        backend=backend or HostCopyBackend(threads=1),
        verify_extents=verify_extents,
        manifest_file=str(capsule.native_manifest_path) if name_manifest else None,
    )
    return arrays


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def flip_byte(path: Path, offset: int) -> None:
    """Flip one byte in place (the object is 0444; we are its owner, so make it writable first)."""
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.chmod(path, 0o444)


def eligible_objects(state_root: Path) -> dict[str, Path]:
    """Every ``<digest>.pack`` at an object path of the cache (what a reader could pick up)."""
    folder = state_root / "model-payloads" / "sha256"
    if not folder.is_dir():
        return {}
    return {p.name[:-5]: p for p in folder.iterdir() if p.name.endswith(".pack")}


def assert_no_wrong_eligible_object(state_root: Path) -> None:
    """Every object at an object path hashes to its name, and admission agrees."""
    from coldsnap_core.cache.payload_cache import PayloadCache

    cache = PayloadCache(state_root)
    for digest, path in eligible_objects(state_root).items():
        assert sha256_of(path) == digest, f"{path} is eligible but its bytes hash to something else"
        assert cache.admit(digest) == path


def temporaries(state_root: Path) -> list[Path]:
    folder = state_root / "model-payloads" / "tmp"
    return sorted(folder.iterdir()) if folder.is_dir() else []


def child_command(
    checkpoint: Path, artifact_dir: Path, state_root: Path, *extra: str, reverse: bool = False, slab_count: int = 2
) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), str(checkpoint), str(artifact_dir), str(state_root)]
    cmd += ["--slab-count", str(slab_count)]
    if reverse:
        cmd.append("--reverse")
    return cmd + list(extra)


def run_child(
    cmd: list[str], *, timeout_seconds: float = 120.0, env: dict[str, str] | None = None
) -> tuple[int, dict | None, str]:
    """Run a child to completion (with ``env`` added to this process's environment); return ``(returncode, parsed
    JSON line or None, stderr)``."""
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout_seconds, cwd=REPO, env={**os.environ, **(env or {})}
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc.returncode, (json.loads(lines[-1]) if lines else None), proc.stderr


# --- the child ---------------------------------------------------------------------------------------


def _install_faults(args: argparse.Namespace, calls: dict[str, int]) -> None:
    import fcntl

    from coldsnap_core import _io

    if args.break_flock:
        fcntl.flock = lambda fd, operation: None  # type: ignore[assignment]
    if args.fsize_limit is not None:
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (args.fsize_limit, args.fsize_limit))
    kill_call = None
    if args.kill_at:
        name, k, when = args.kill_at.split(":")
        kill_call = (name, int(k), when)
    for name in WATCHED_CALLS:
        original = getattr(os, name)

        def watched(*a, _name=name, _original=original, **kw):
            calls[_name] = calls.get(_name, 0) + 1
            hit = kill_call is not None and kill_call[0] == _name and kill_call[1] == calls[_name]
            if hit and kill_call[2] == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            result = _original(*a, **kw)
            if hit and kill_call[2] == "after":
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        setattr(os, name, watched)
    if args.kill_at_byte is not None:
        limit = args.kill_at_byte
        original_write_all = _io.write_all
        written = {"n": 0}

        def write_all(fd, data, *, file):
            if str(file).endswith(".partial") and ".record." not in str(file):
                view = memoryview(data).cast("B")
                room = limit - written["n"]
                if len(view) >= room:
                    original_write_all(fd, view[:room], file=file)
                    os.kill(os.getpid(), signal.SIGKILL)
                written["n"] += len(view)
            return original_write_all(fd, data, file=file)

        _io.write_all = write_all


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("state_root", type=Path)
    parser.add_argument("--slab-count", type=int, default=2)
    parser.add_argument("--reverse", action="store_true")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--kill-at", default=None)
    parser.add_argument("--kill-at-byte", type=int, default=None)
    parser.add_argument("--count-calls", action="store_true")
    parser.add_argument("--break-flock", action="store_true")
    parser.add_argument("--fsize-limit", type=int, default=None)
    parser.add_argument("--start-file", type=Path, default=None)
    args = parser.parse_args(argv)

    from slabs import stage_checkpoint

    from coldsnap_core.artifact.capsules import read_capsule
    from coldsnap_core.cache.payload_cache import PayloadCache
    from coldsnap_core.capture.materialize import materialize_payload
    from coldsnap_core.copy.host import HostCopyBackend
    from coldsnap_core.errors import ColdsnapError

    slabs = stage_checkpoint(args.checkpoint, slab_count=args.slab_count, reverse=args.reverse)
    manifest = read_capsule(args.artifact / "workers" / f"worker-{args.rank}-of-1").native
    cache = PayloadCache(args.state_root)
    calls: dict[str, int] = {}
    if args.start_file is not None:
        while not args.start_file.exists():
            time.sleep(0.005)
    _install_faults(args, calls)
    try:
        handle = materialize_payload(manifest, slabs.allocations, HostCopyBackend(threads=1), cache, mode="required")
    except ColdsnapError as exc:
        print(json.dumps({"ok": False, "error": type(exc).__name__, "message": str(exc), "calls": calls}), flush=True)
        return 1
    assert handle is not None and handle.result is not None
    print(json.dumps({"ok": True, "written": handle.result.written, "calls": calls}), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
