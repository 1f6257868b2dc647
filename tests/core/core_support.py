"""Helpers of the coldsnap_core tests: capture real slabs into a state root and artifact folder, copy
captures for corruption tests, rewrite manifests, and run the real CLI."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.capture.payload import ModelRange
from coldsnap_core.capture.worker import CaptureResult, capture_worker
from coldsnap_core.copy.host import HostCopyBackend
from coldsnap_core.format.allocation import AllocationMap, LiveAllocation
from coldsnap_core.format.manifest import (
    NATIVE_MANIFEST_FILENAME,
    RECOVERY_MANIFEST_FILENAME,
    CapturePoint,
    CheckpointFile,
    ModelIdentity,
    NativeManifest,
    WorkerIdentity,
)

REPO = Path(__file__).resolve().parents[2]
WORKER = WorkerIdentity("worker", 0, 1, 0, 1)
SYNTHETIC_MODEL = ModelIdentity("synthetic", None, (CheckpointFile("model.safetensors", 1, "0" * 64),))


@dataclass(frozen=True)
class Captured:
    """One worker's capture on disk: ``<root>/state`` (the cache) and ``<root>/artifact``."""

    root: Path
    result: CaptureResult

    @property
    def state_root(self) -> Path:
        return self.root / "state"

    @property
    def artifact_dir(self) -> Path:
        return self.root / "artifact"

    @property
    def cache(self) -> PayloadCache:
        return PayloadCache(self.state_root)

    @property
    def capsule_dir(self) -> Path:
        return self.artifact_dir / "workers" / WORKER.capsule_name

    @property
    def manifest_path(self) -> Path:
        return self.capsule_dir / NATIVE_MANIFEST_FILENAME

    @property
    def recovery_path(self) -> Path:
        return self.capsule_dir / RECOVERY_MANIFEST_FILENAME

    @property
    def manifest(self) -> NativeManifest:
        return NativeManifest.read(self.manifest_path)

    @property
    def blob_path(self) -> Path:
        return self.capsule_dir / "weights.blob"

    @property
    def pack_path(self) -> Path:
        return self.cache.object_path(self.manifest.pack.sha256)


def capture(
    root: Path,
    allocation_map: AllocationMap,
    allocations: list[LiveAllocation],
    model_ranges: tuple[ModelRange, ...] | list[ModelRange],
    *,
    model: ModelIdentity = SYNTHETIC_MODEL,
    backend: HostCopyBackend | None = None,
    capture_point: CapturePoint = "portable",
    worker: WorkerIdentity = WORKER,
) -> Captured:
    """Run the real capture into ``root/state`` and ``root/artifact``."""
    result = capture_worker(
        allocation_map=allocation_map,
        allocations=allocations,
        model_ranges=model_ranges,
        worker=worker,
        capture_point=capture_point,
        model=model,
        cache=PayloadCache(root / "state"),
        artifact_dir=root / "artifact",
        backend=backend or HostCopyBackend(),
    )
    return Captured(root, result)


def copy_capture(source: Captured, root: Path, *, copy_pack: bool = True) -> Captured:
    """An independent copy whose files a test may corrupt.

    With ``copy_pack=False`` the pack is hard-linked instead of copied (same inode, so its validation
    record stays valid): for tests that change manifests or the blob but never the pack's bytes.
    """

    def copy(src: str, dst: str) -> None:
        if not copy_pack and src.endswith(".pack"):
            os.link(src, dst)
        else:
            shutil.copy2(src, dst)

    shutil.copytree(source.root, root, symlinks=True, copy_function=copy)
    return Captured(root, source.result)


def live_allocations(arrays: tuple[np.ndarray, ...] | list[np.ndarray]) -> list[LiveAllocation]:
    return [LiveAllocation(i, int(a.ctypes.data), a.nbytes) for i, a in enumerate(arrays)]


def edit_json(path: Path, edit: Callable[[dict], object]) -> None:
    """Rewrite a JSON document in place after ``edit(document)`` mutated it."""
    doc = json.loads(path.read_text())
    edit(doc)
    os.chmod(path, 0o644)
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def repin(c: Captured) -> None:
    """Make ``artifact.json`` pin every capsule's current manifests (and the residual blob its native
    manifest names): what an editor who rewrites the descriptor along with the capsule would do. Tests
    of the rules behind the pins use it after editing a manifest."""

    def edit(doc: dict) -> None:
        for entry in doc["workers"]:
            capsule = c.artifact_dir / entry["capsule"]
            native_path = capsule / NATIVE_MANIFEST_FILENAME
            residual = None
            with contextlib.suppress(ValueError, OSError, KeyError, TypeError):
                residual = json.loads(native_path.read_bytes())["residual"]
            pins = []
            for pin in entry["capsule_files"]:
                path = capsule / pin["name"]
                if pin["name"].endswith(".json"):
                    if path.is_file():
                        data = path.read_bytes()
                        pin = {**pin, "size_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                elif isinstance(residual, dict) and {"file", "size_bytes", "sha256"} <= set(residual):
                    pin = {"name": residual["file"], "size_bytes": residual["size_bytes"], "sha256": residual["sha256"]}
                pins.append(pin)
            entry["capsule_files"] = sorted(pins, key=lambda p: p["name"])

    edit_json(c.artifact_dir / "artifact.json", edit)


def flip_byte(path: Path, offset: int, *, keep_mtime: bool = False) -> None:
    """XOR one byte of a file with 0xFF (optionally restoring the mtime, as ``touch -d`` would)."""
    st = os.stat(path)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(offset)
        value = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([value ^ 0xFF]))
    os.chmod(path, st.st_mode & 0o777)
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def run_cli(*args: str | os.PathLike[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the real ``coldsnap`` command line in this process: :func:`coldsnap_core.cli.main.main`, what the
    console script and ``python -m coldsnap_core.cli.main`` call, with its stdout and stderr captured and
    ``env`` added to the environment for the call (restored after). Returns what :func:`run_cli_process`
    returns: the exit code (argparse's ``--help``, ``--version`` and usage errors included), stdout, stderr.

    In process because a fresh interpreter costs about 0.3 s of CPU per command and these tests run about a
    hundred; an exception the CLI does not turn into an exit code propagates (the test fails with its
    traceback). Tests whose regression would hang or exhaust this process (a named pipe, a huge document)
    use :func:`run_cli_process`."""
    from coldsnap_core.cli.main import main

    stdout, stderr = io.StringIO(), io.StringIO()
    saved = dict(os.environ)
    os.environ.update({"HF_HUB_OFFLINE": "1", **(env or {})})
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                code = main([str(arg) for arg in args])
            except SystemExit as exc:  # argparse exits: --help and --version (0), usage errors (4)
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(["coldsnap", *map(str, args)], code, stdout.getvalue(), stderr.getvalue())


def run_cli_process(*args: str | os.PathLike[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the real ``coldsnap`` command line as its own process (``python -m coldsnap_core.cli.main``, at
    most 300 s)."""
    return subprocess.run(
        [sys.executable, "-m", "coldsnap_core.cli.main", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
        cwd=REPO,
        check=False,
    )
