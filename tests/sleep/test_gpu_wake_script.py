"""benchmarks/gpu_wake.py: skips cleanly without a GPU, and its steps run end to end on host memory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from coldsnap_core.copy.cuda import cuda_unavailable_reason

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_wake.py"


@pytest.mark.skipif(cuda_unavailable_reason() is None, reason="a GPU is present: the script would measure instead of skipping")
def test_without_a_gpu_the_script_says_why_and_exits_0() -> None:
    """No GPU, cupy or cuda-python: one clear line, exit 0, nothing measured."""
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("gpu_wake: skipped: ")
    assert "nothing was measured" in result.stdout


@pytest.mark.slow  # about 20 s: the GPU wake script end to end in fresh interpreters
def test_simulated_run_checks_every_step_of_the_script(smollm2_2layer: Path, tmp_path: Path) -> None:
    """--simulate-on-cpu runs layout, capture, release/re-map, hydration, the pinned baselines and
    the sleep backend over mmap'd segments: every SHA-256 comparison reports equal and the sleep
    backend's pack is the capture's. Fails if the script's own logic is broken (the part a GPU run
    cannot afford to discover)."""
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--simulate-on-cpu",
            "--checkpoint",
            str(smollm2_2layer),
            "--repeat",
            "1",
            "--work",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "SIMULATED" in out
    assert "SHA-256 per allocation after wake and after pinned copy: 9/9 equal" in out
    assert "pack b5a02a03cd57b72d == the capture's; 0 writes residual; SHA-256 per allocation 9/9 equal" in out
    assert "ratio coldsnap wake / pinned copy (vLLM wake):" in out
    assert list(tmp_path.iterdir()) == []  # the work folder is removed
