"""``vllm serve MODEL --load-format coldsnap`` restores and answers a completion (the CLI path).

This is the one test that goes through vLLM's own process layout: the API server, the engine core
process and the worker process each load the ``vllm.general_plugins`` entry point
(``coldsnap_vllm:register``), so it fails if the plugin is not installed as an entry point or does
not register in every process. The artifact comes from a capture in another process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from engine_support import coldsnap_env, run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STARTUP_TIMEOUT_SECONDS = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


def test_vllm_serve_restores_and_answers(smollm2_2layer: Path, tmp_path: Path) -> None:
    """Capture in one process, then ``vllm serve --load-format coldsnap`` with ``COLDSNAP_RESTORE=native``:
    the worker restores from pack + residual (its log says so, with no fallback WARNING) and
    ``/v1/completions`` returns the same greedy text as the captured engine."""
    prompt = "The capital of France is"
    env = coldsnap_env(tmp_path / "artifact", tmp_path / "state")
    captured = run_engine(
        tmp_path, "capture", smollm2_2layer, "coldsnap", env={**env, "COLDSNAP_EXPORT_MODEL_PAYLOAD": "1"}, prompts=[prompt]
    )
    assert captured.error is None and captured.outcome["kind"] == "captured"

    port = _free_port()
    server_env = {k: v for k, v in os.environ.items() if not k.startswith("COLDSNAP_")}
    server_env.update(env, COLDSNAP_RESTORE="native", HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    vllm_cli = Path(sys.executable).with_name("vllm")
    command = [
        str(vllm_cli),
        "serve",
        str(smollm2_2layer),
        "--load-format",
        "coldsnap",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    command += ["--dtype", "bfloat16", "--max-model-len", "256", "--max-num-seqs", "4", "--enforce-eager", "--seed", "0"]
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, env=server_env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
        while _get(f"http://127.0.0.1:{port}/health") != 200:
            assert server.poll() is None, f"vllm serve exited with {server.returncode}:\n{log_path.read_text()[-5000:]}"
            assert time.monotonic() < deadline, "vllm serve did not become healthy"
            time.sleep(1)
        body = json.dumps({"model": str(smollm2_2layer), "prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    log_text = log_path.read_text()
    assert answer["choices"][0]["text"] == captured.outputs[0]
    assert "coldsnap: restored worker-0-of-1 from pack" in log_text
    assert "could not restore" not in log_text
