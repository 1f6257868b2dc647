#!/usr/bin/env python3
"""SGLang weight loading: coldsnap restore against SGLang's load from the checkpoint, side by side.

Every engine is a fresh real SGLang 0.5.23 CPU engine process (``tests/sglang/sglang_run.py``, the SGLang
virtual environment of ``scripts/setup-sglang-venv.sh``: ``$COLDSNAP_SGLANG_VENV``, else ``.venv-sglang``),
on the same checkpoint in the same script run, with the page cache warm (the files each engine reads are
read once right before it starts). Runs are interleaved so that background load hits every variant alike;
medians and every run are printed.

Variants:

* ``safetensors``: SGLang's own ``--load-format safetensors`` (the reference);
* ``checkpoint``: ``--load-format coldsnap`` with a state root but no artifact: SGLang's
  ``DefaultModelLoader.load_weights_and_postprocess`` on the checkpoint, timed by the coldsnap loader the
  way it times a restore (what a restore replaces);
* ``coldsnap restore``: ``--load-format coldsnap``, ``COLDSNAP_RESTORE=native``: identity, layout and
  target checks, the pack's validation record, the residual's SHA-256, the copy, then SGLang's
  post-processing. Its weights (SGLang's weights checker) and greedy tokens must equal the reference's.

Two figures per engine: SGLang's own ``Load weight end. elapsed=`` (``ModelRunner.load_model``
in ``sglang/srt/model_executor/model_runner.py``: building the model, loading its weights,
post-processing; two decimals) and, for the two coldsnap variants, the loader's own wall time of
``load_weights_and_postprocess`` (the ``seconds`` of its line in ``<state-root>/load-outcomes.jsonl``,
``docs/format.md`` §10.3). Next to them: the machine's rates measured in the same run on the
checkpoint's bytes (:func:`_common.physical_limits`: memcpy, page cache read, disk read, SHA-256,
write + fsync) and the time the checkpoint's bytes take at memcpy and page cache read rates.

Usage: ``python benchmarks/sglang_load.py [--layers N | --checkpoint DIR] [--repetitions R] [--workdir DIR]``
(default: the full SmolLM2-135M, 3 repetitions). Needs about 5 GB of memory per engine tree.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "sglang"))
sys.path.insert(0, str(REPO / "tools"))

from _common import machine_line, physical_limits, warm_page_cache  # noqa: E402
from sglang_support import SGLangResult, coldsnap_env, run_sglang  # noqa: E402
from smollm2_fixture import ensure_fixture  # noqa: E402


def _last_outcome(state: Path) -> dict:
    lines = (state / "load-outcomes.jsonl").read_text().splitlines()
    return json.loads(lines[-1])


def _engine_seconds(result: SGLangResult, name: str) -> float:
    if not result.started or len(result.load_weight_seconds) != 1:
        raise SystemExit(f"{name}: engine failed (exit {result.returncode}):\n{result.log[-4000:]}")
    return result.load_weight_seconds[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=None, help="SmolLM2 cut to N layers (default: full, 30 layers)")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None, help="kept when given, else a temporary folder removed at the end")
    parser.add_argument("--checkpoint", type=Path, default=None, help="a llama checkpoint folder instead of SmolLM2")
    args = parser.parse_args()
    model = args.checkpoint.resolve() if args.checkpoint else ensure_fixture(layers=args.layers)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="coldsnap-sglang-load-"))
    artifact, state, plain_state = work / "artifact", work / "state", work / "state-checkpoint"
    checkpoint_files = sorted(model.glob("*.safetensors"))
    checkpoint_bytes = sum(f.stat().st_size for f in checkpoint_files)
    print(f"model {model.name}, {checkpoint_bytes / 1e6:.1f} MB of safetensors; work {work}")
    print(f"machine: {machine_line()}")
    state.mkdir(parents=True, exist_ok=True)
    limits = physical_limits(checkpoint_files, state)
    print(
        "machine rates (GB/s, measured now, on the checkpoint's bytes): " + ", ".join(f"{k} {v:.2f}" for k, v in limits.items())
    )

    def payload_files() -> list[Path]:
        return sorted((state / "model-payloads" / "sha256").glob("*.pack")) + sorted(artifact.glob("workers/*/weights.blob"))

    def warm(paths: list[Path]) -> None:
        for path in paths:
            warm_page_cache(path)

    try:
        warm(checkpoint_files)
        capture = run_sglang(
            work, "capture", model, "coldsnap", env=coldsnap_env(artifact, state, COLDSNAP_EXPORT_MODEL_PAYLOAD="1")
        )
        _engine_seconds(capture, "capture")
        engine_s: dict[str, list[float]] = {"safetensors": [], "checkpoint": [], "coldsnap restore": []}
        loader_s: dict[str, list[float]] = {"checkpoint": [], "coldsnap restore": []}
        for i in range(args.repetitions):
            warm(checkpoint_files)
            plain = run_sglang(work, f"plain-{i}", model, "safetensors")
            engine_s["safetensors"].append(_engine_seconds(plain, "safetensors"))
            warm(checkpoint_files)
            env = {"COLDSNAP_STATE_ROOT": str(plain_state)}
            checkpoint = run_sglang(work, f"checkpoint-{i}", model, "coldsnap", env=env, checksums=False)
            engine_s["checkpoint"].append(_engine_seconds(checkpoint, "checkpoint"))
            outcome = _last_outcome(plain_state)
            if outcome["outcome"] != "checkpoint":
                raise SystemExit(f"checkpoint: the loader's outcome is {outcome}")
            loader_s["checkpoint"].append(outcome["seconds"])
            warm(payload_files() + checkpoint_files)
            restore = run_sglang(
                work, f"restore-{i}", model, "coldsnap", env=coldsnap_env(artifact, state, COLDSNAP_RESTORE="native")
            )
            engine_s["coldsnap restore"].append(_engine_seconds(restore, "restore"))
            outcome = _last_outcome(state)
            if outcome["outcome"] != "restored":
                raise SystemExit(f"restore: the loader's outcome is {outcome}")
            loader_s["coldsnap restore"].append(outcome["seconds"])
            if restore.checksums != plain.checksums or restore.output_ids != plain.output_ids:
                raise SystemExit("restore did not reproduce SGLang's safetensors load (weights checker or greedy tokens)")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)

    n = args.repetitions
    print(f"\nSGLang 'Load weight end. elapsed=' (build + load + post-process), page cache warm, median of {n} fresh engines")
    reference = statistics.median(engine_s["safetensors"])
    for name, values in engine_s.items():
        value = statistics.median(values)
        print(f"  {name:<17} {value:7.2f} s   x{value / reference:5.2f}   runs: {', '.join(f'{v:.2f}' for v in values)}")
    print(f"\ncoldsnap loader's load_weights_and_postprocess wall time (load-outcomes.jsonl), median of {n}")
    checkpoint_s = statistics.median(loader_s["checkpoint"])
    for name, values in loader_s.items():
        value = statistics.median(values)
        print(
            f"  {name:<17} {value:7.3f} s   x{value / checkpoint_s:5.2f}   {checkpoint_bytes / value / 1e9:6.2f} GB/s"
            f"   runs: {', '.join(f'{v:.3f}' for v in values)}"
        )
    restore_s = statistics.median(loader_s["coldsnap restore"])
    print(
        f"\nrestore / checkpoint load_weights = {restore_s / checkpoint_s:.2f};"
        f" restore / SGLang load_model (safetensors) = {statistics.median(engine_s['coldsnap restore']) / reference:.2f}"
    )
    print(
        f"physical limits on the same {checkpoint_bytes / 1e6:.1f} MB: memcpy {limits['memcpy']:.2f} GB/s"
        f" ({checkpoint_bytes / limits['memcpy'] / 1e9:.3f} s), page cache read {limits['page cache read']:.2f} GB/s"
        f" ({checkpoint_bytes / limits['page cache read'] / 1e9:.3f} s), disk read {limits['disk read']:.2f} GB/s,"
        f" sha256 {limits['sha256']:.2f} GB/s, fresh page faults {limits['fresh page faults']:.2f} GB/s"
    )
    print(f"machine after the runs: {machine_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
