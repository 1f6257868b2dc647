#!/usr/bin/env python3
"""The strict read of a capsule, as a restore reads it at every start, against other checkouts' reads.

A restore reads its worker's capsule before anything else: the three pinned documents (both manifests
and ``target.json``) are read, checked against their pins in ``artifact.json`` (size and SHA-256),
strictly parsed and compared with each other
(:func:`coldsnap_core.artifact.capsules.read_worker_capsule`). This script captures the full
SmolLM2-135M (by default) engine-free, as ``tests/core`` does (``slabs.stage_checkpoint``, here with one
allocation per tensor like an engine's one storage per parameter, then
:func:`coldsnap_core.capture.worker.capture_worker`), or takes an existing artifact (``--artifact``: e.g.
the work folder ``benchmarks/vllm_load.py`` left, with a real vLLM capsule), and times that read in a
fresh interpreter per checkout: this checkout and each ``--baseline`` (another checkout of coldsnap, e.g.
a ``git worktree`` of an older commit), side by side in one run, in ``--rounds`` interleaved rounds so
that background load hits each alike. A checkout that has parsed-capsule records (before 0.1.0's codec)
is also timed reading from one. Prints the median and the fastest of all reads of each; nothing is
asserted. Usage::

    .venv/bin/python benchmarks/read_capsule.py [--baseline CHECKOUT ...] [--rounds 3] [--repetitions 100]
        [--checkpoint smollm2-full|smollm2-2layer | --artifact ARTIFACT_DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import CHECKPOINTS, REPO, checkpoint, machine_line

CHILD = """
import json, sys, time
from pathlib import Path
from coldsnap_core.artifact.capsules import read_descriptor, read_worker_capsule
artifact, repetitions = Path(sys.argv[1]), int(sys.argv[2])
entry = read_descriptor(artifact).workers[0]
try:  # a checkout with parsed-capsule records: also the read that takes the documents from one
    from coldsnap_core.artifact.parsed_capsules import ParsedCapsules
    variants = {"strict": {}, "record": {"parsed_capsules": ParsedCapsules(Path(sys.argv[3]))}}
except ImportError:
    variants = {"strict": {}}
times = {}
for name, options in variants.items():
    capsule = read_worker_capsule(artifact, entry, **options)  # untimed: imports, and a record written
    times[name] = []
    for _ in range(repetitions):
        started = time.perf_counter()
        read_worker_capsule(artifact, entry, **options)
        times[name].append(time.perf_counter() - started)
native = capsule.native
assert Path(read_worker_capsule.__code__.co_filename).is_relative_to(Path.cwd()), "another checkout's coldsnap_core"
shape = f"{len(native.allocations)} allocations, {len(native.model_extents) + len(native.residual_extents)} extents"
print(json.dumps({"times": times, "shape": shape}))
"""


def capture(checkpoint_name: str, work: Path) -> Path:
    """Capture ``checkpoint_name`` into ``work`` with this checkout's code; returns the artifact folder."""
    from slabs import checkpoint_files, stage_checkpoint

    from coldsnap_core.cache.payload_cache import PayloadCache
    from coldsnap_core.capture.worker import capture_worker
    from coldsnap_core.copy.host import HostCopyBackend
    from coldsnap_core.format.manifest import WorkerIdentity
    from coldsnap_core.format.safetensors_header import read_header
    from coldsnap_core.identity.model_identity import identify_checkpoint

    folder = checkpoint(checkpoint_name)
    slabs = stage_checkpoint(folder, slab_count=sum(len(read_header(f)) for f in checkpoint_files(folder)))
    capture_worker(
        allocation_map=slabs.allocation_map,
        allocations=slabs.allocations,
        model_ranges=slabs.model_ranges,
        worker=WorkerIdentity("worker", 0, 1, 0, 1),
        capture_point="portable",
        model=identify_checkpoint(checkpoint_files(folder), source=str(folder)),
        cache=PayloadCache(work / "state"),
        artifact_dir=work / "artifact",
        backend=HostCopyBackend(),
    )
    return work / "artifact"


def read_times(checkout: Path, artifact: Path, repetitions: int, records: Path) -> dict:
    """``{"times": {variant: [seconds, ...]}, "shape": ...}`` of ``checkout``'s ``coldsnap_core`` reading ``artifact``
    in a fresh interpreter (``records``: a folder for the parsed-capsule records of a checkout that has them)."""
    command = [sys.executable, "-c", CHILD, str(artifact), str(repetitions), str(records)]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    # cwd: ``python -c`` puts the working folder first on sys.path, ahead of PYTHONPATH
    run = subprocess.run(command, env=env, cwd=checkout, capture_output=True, text=True, check=False)
    if run.returncode != 0:
        raise SystemExit(f"{checkout}: the read failed:\n{run.stderr[-4000:]}")
    return json.loads(run.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, action="append", default=[], help="another coldsnap checkout to time")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repetitions", type=int, default=100, help="reads per checkout and round")
    parser.add_argument("--checkpoint", choices=sorted(CHECKPOINTS), default="smollm2-full")
    parser.add_argument("--artifact", type=Path, default=None, help="read this artifact instead of capturing one")
    args = parser.parse_args()
    print(f"machine: {machine_line()}")
    checkouts = [REPO, *(b.resolve() for b in args.baseline)]
    with tempfile.TemporaryDirectory(prefix="coldsnap-read-capsule-") as tmp:
        artifact = args.artifact.resolve() if args.artifact else capture(args.checkpoint, Path(tmp))
        times: dict[tuple[Path, str], list[float]] = {}
        shape = ""
        for _ in range(args.rounds):
            for i, checkout in enumerate(checkouts):
                figures = read_times(checkout, artifact, args.repetitions, Path(tmp) / f"records-{i}")
                shape = figures["shape"]
                for variant, seconds in figures["times"].items():
                    times.setdefault((checkout, variant), []).extend(seconds)
    print(f"artifact {artifact}: {shape}; {args.rounds} rounds of {args.repetitions} reads per checkout")
    for (checkout, variant), seconds in times.items():
        what = "strict read" if variant == "strict" else "from a parsed-capsule record"
        print(f"  {checkout}: {what:29s} median {statistics.median(seconds) * 1e3:6.2f} ms, fastest {min(seconds) * 1e3:6.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
