#!/usr/bin/env python3
"""Capture SmolLM2-135M through SGLang, restore it in a fresh engine, compare with a plain SGLang load.

Steps, each in its own fresh process running a real SGLang engine (sglang 0.5.23 on the CPU, from the
SGLang virtual environment that ``scripts/setup-sglang-venv.sh`` builds):

1. ``plain``: ``sgl.Engine(model, load_format="safetensors")``, SGLang's normal load: the reference.
2. ``capture``: ``load_format="coldsnap"`` with ``COLDSNAP_EXPORT_MODEL_PAYLOAD=1``: the loader reads the
   checkpoint under its write observer and writes the pack to ``<state>/model-payloads/sha256/<digest>.pack``
   and SGLang's residual blob and manifests to ``<artifact>/workers/worker-0-of-1/``.
3. ``restore``: ``load_format="coldsnap"`` with ``COLDSNAP_RESTORE=native``: the loader verifies and
   hydrates the weights from pack + residual instead of reading safetensors.

It prints the greedy generations side by side, SGLang's own weight-loading time of each phase
(``Load weight end. elapsed=``), and the pack path: the model bytes are the same in vLLM and SGLang, so it
is the digest ``examples/vllm_capture_restore.py`` prints for the same checkpoint. Exit status 1 if the
generations differ (the full model answers "Paris" to "The capital of France is").

Usage (``scripts/demo.sh --engine sglang`` runs it)::

    python examples/sglang_capture_restore.py --sglang-python VENV/bin/python [--workdir DIR] [--layers N]

This script runs with any Python that can build the SmolLM2 fixture (``tools/smollm2_fixture.py``); the
engines run with ``--sglang-python``, with ``tests/sglang/support`` on ``PYTHONPATH``: SGLang's CPU engine
imports a few ``sgl_kernel`` names, whose only PyPI build is a CUDA one, and that folder holds a small
stand-in for them (test support, never shipped). SGLang spawns its scheduler, hence the ``__main__`` guard.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["The capital of France is", "Once upon a time"]
MAX_TOKENS = 16
LOAD_WEIGHT_END = re.compile(r"Load weight end\. elapsed=([0-9.]+) s")


def run_phase(phase: str, model: str, workdir: Path) -> list[str]:
    """One SGLang engine in this process; return the greedy completions of :data:`PROMPTS`."""
    load_format = "safetensors"
    if phase != "plain":
        load_format = "coldsnap"
        os.environ["COLDSNAP_ARTIFACT_DIR"] = str(workdir / "artifact")
        os.environ["COLDSNAP_STATE_ROOT"] = str(workdir / "state")
        os.environ["COLDSNAP_EXPORT_MODEL_PAYLOAD" if phase == "capture" else "COLDSNAP_RESTORE"] = (
            "1" if phase == "capture" else "native"
        )
    import sglang as sgl

    engine = sgl.Engine(
        model_path=model,
        load_format=load_format,
        dtype="bfloat16",
        device="cpu",
        attention_backend="torch_native",
        max_total_tokens=2048,  # a capped KV cache (the default takes 13.9 GB on this model)
        context_length=256,
        mem_fraction_static=0.1,
        skip_server_warmup=True,
        disable_cuda_graph=True,
        random_seed=0,
        log_level="info",  # SGLang's "Load weight end. elapsed=" line and coldsnap's own lines
    )
    try:
        outputs = engine.generate(prompt=PROMPTS, sampling_params={"temperature": 0.0, "max_new_tokens": MAX_TOKENS})
    finally:
        engine.shutdown()
    return [o["text"] for o in outputs]


def spawn_phase(phase: str, model: Path, workdir: Path, python: str) -> tuple[list[str], float, list[float]]:
    """Run ``phase`` in a fresh SGLang process; return its completions, wall time and SGLang's weight-loading
    time (seconds)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COLDSNAP_", "VLLM_"))}
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO / "tests" / "sglang" / "support"), str(REPO)]),
        SGLANG_USE_CPU_ENGINE="1",
        HF_HUB_OFFLINE="1",
    )
    # SGLang leaves its ZMQ IPC files in the temporary folder: one per engine, removed after.
    with tempfile.TemporaryDirectory(prefix=f"sglang-{phase}-", dir=workdir) as tmp:
        env["TMPDIR"] = tmp
        started = time.perf_counter()
        proc = subprocess.run(
            [python, __file__, "--phase", phase, "--model", str(model), "--workdir", str(workdir)],
            env=env,
            capture_output=True,
            text=True,
        )
        seconds = time.perf_counter() - started
    log = proc.stdout + proc.stderr
    (workdir / f"{phase}.log").write_text(log)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("COLDSNAP_EXAMPLE_RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(log[-5000:])
        raise SystemExit(f"the {phase} engine failed (exit {proc.returncode}); log: {workdir / f'{phase}.log'}")
    for line in log.splitlines():
        if "coldsnap:" in line:
            print(f"  [{phase}] {line.split('coldsnap:', 1)[1].strip()}")
    return json.loads(lines[-1].split(" ", 1)[1]), seconds, [float(s) for s in LOAD_WEIGHT_END.findall(log)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sglang-python", default=os.environ.get("COLDSNAP_SGLANG_PYTHON"), help="the SGLang venv's python")
    parser.add_argument("--workdir", type=Path, default=REPO / "out" / "sglang-example")
    parser.add_argument("--layers", type=int, default=None, help="cut SmolLM2 to N layers (default: the full model)")
    parser.add_argument("--phase", choices=("plain", "capture", "restore"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    workdir = args.workdir.absolute()
    if args.phase:
        print("COLDSNAP_EXAMPLE_RESULT " + json.dumps(run_phase(args.phase, args.model, workdir)), flush=True)
        return 0
    if not args.sglang_python:
        parser.error("--sglang-python (or COLDSNAP_SGLANG_PYTHON) is required: scripts/setup-sglang-venv.sh builds the venv")

    sys.path.insert(0, str(REPO / "tools"))
    from smollm2_fixture import ensure_fixture

    model = ensure_fixture(layers=args.layers)
    workdir.mkdir(parents=True, exist_ok=True)
    for stale in ("artifact", "state"):
        if (workdir / stale).exists():
            shutil.rmtree(workdir / stale)
    print(f"model: {model}\nworkdir: {workdir}")
    results, load_seconds = {}, {}
    for phase in ("plain", "capture", "restore"):
        print(f"{phase}: starting a fresh SGLang engine ...", flush=True)
        results[phase], seconds, load_seconds[phase] = spawn_phase(phase, model, workdir, args.sglang_python)
        print(f"{phase}: done in {seconds:.1f} s", flush=True)

    pack = next((workdir / "state" / "model-payloads" / "sha256").glob("*.pack"))
    print(f"\npack: {pack} ({pack.stat().st_size} bytes)")
    print(
        "SGLang load_weights (its 'Load weight end. elapsed='): checkpoint {} s, coldsnap restore {} s\n".format(
            "/".join(f"{s:.2f}" for s in load_seconds["plain"]), "/".join(f"{s:.2f}" for s in load_seconds["restore"])
        )
    )
    width = max(len(p) for p in PROMPTS)
    print(f"{'prompt':<{width}} | {'safetensors load':<40} | coldsnap restore")
    for prompt, plain, restored in zip(PROMPTS, results["plain"], results["restore"], strict=True):
        print(f"{prompt:<{width}} | {plain!r:<40} | {restored!r}")
    if results["plain"] != results["restore"] or results["plain"] != results["capture"]:
        print("\nFAIL: the coldsnap generations differ from the safetensors load")
        return 1
    if args.layers is None and "Paris" not in results["restore"][0]:
        print("\nFAIL: the full model did not answer 'Paris'")
        return 1
    print("\nOK: identical greedy generations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
