"""benchmarks/gpu_wake.py on a GPU machine that has only torch, cupy and the CUDA driver bindings:
no vLLM, no SGLang, no network (so no SmolLM2 fixture), and either name of the driver module."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPT = BENCHMARKS / "gpu_wake.py"

# Runs the script with every import of vllm, sglang (and what only they pull in) refused.
WITHOUT_ENGINES = """
import runpy, sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("vllm", "sglang", "transformers", "gguf", "tokenizers"):
            raise ImportError(f"{name} is not installed on this machine")
sys.meta_path.insert(0, Refuse())
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    print("engines imported:", sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "sglang")))
"""


def test_runs_without_vllm_on_a_synthetic_checkpoint(tmp_path: Path) -> None:
    """Catches a hard vLLM (or SGLang) import on the GPU path and a script that needs the SmolLM2
    fixture: with both engines unimportable, ``--simulate-on-cpu --synthetic tiny`` writes the
    synthetic checkpoint, captures, wakes, runs the coldsnap sleep backend and finds every SHA-256
    equal, and no engine module was imported."""
    work = tmp_path / "work"
    work.mkdir()
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            WITHOUT_ENGINES,
            str(SCRIPT),
            "--simulate-on-cpu",
            "--synthetic",
            "tiny",
            "--repeat",
            "1",
            "--work",
            str(work),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "wrote the synthetic tiny checkpoint" in out
    assert "SHA-256 per allocation after wake and after pinned copy: 1/1 equal" in out
    assert "sleep backend: pack" in out and "SHA-256 per allocation 1/1 equal" in out
    assert "engines imported: []" in out
    assert [p.name for p in work.iterdir()] == ["coldsnap-gpu-wake-synthetic-tiny"]  # the run's own folder is removed


@pytest.mark.parametrize(
    ("present", "expected"),
    [(("cuda.bindings.driver",), "cuda.bindings.driver"), (("cuda.cuda",), "cuda.cuda"), ((), None)],
)
def test_driver_module_names(present: tuple[str, ...], expected: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches a script that knows only one name of the driver module: cuda-bindings (CUDA 13) has
    ``cuda.bindings.driver`` only, cuda-python < 12.6 has ``cuda.cuda`` only; with neither the
    environment check says what to install instead of raising."""
    sys.path.insert(0, str(BENCHMARKS))
    monkeypatch.setattr(sys, "path", list(sys.path))
    import gpu_wake

    for name in ("cuda", "cuda.bindings", "cuda.bindings.driver", "cuda.cuda"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    package = types.ModuleType("cuda")
    package.__path__ = []  # a namespace package without the real submodules
    monkeypatch.setitem(sys.modules, "cuda", package)
    if not present:
        monkeypatch.setitem(sys.modules, "cuda.bindings", None)
        monkeypatch.setitem(sys.modules, "cuda.cuda", None)
    for name in present:
        module = types.ModuleType(name)
        parent, _, leaf = name.rpartition(".")
        if parent != "cuda":
            bindings = types.ModuleType(parent)
            bindings.__path__ = []
            monkeypatch.setitem(sys.modules, parent, bindings)
            setattr(package, parent.split(".")[1], bindings)
            setattr(bindings, leaf, module)
        else:
            setattr(package, leaf, module)
            monkeypatch.setitem(sys.modules, "cuda.bindings", None)
        monkeypatch.setitem(sys.modules, name, module)
    driver = gpu_wake.import_cuda_driver()
    assert (driver.__name__ if driver is not None else None) == expected
