"""``vllm serve MODEL --load-format coldsnap`` restores and answers a completion (the CLI path).

This is the one test that goes through vLLM's own process layout: the API server, the engine core
process and the worker process each load the ``vllm.general_plugins`` entry point
(``coldsnap_vllm:register``), so it fails if the plugin is not installed as an entry point or does
not register in every process. The artifact comes from a capture in another process, and reaches the serving
node (a fresh state root) through an OCI registry started by the test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from engine_support import PROMPTS, coldsnap_env, copy_state, only_pack, serve_completion, serve_until_exit

from coldsnap_core.artifact.capsules import read_capsule
from tests.support.servers import scraped

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "cache"))  # the store servers of the cache tests

pytestmark = [pytest.mark.engine, pytest.mark.vllm]


def test_vllm_serve_restores_and_answers(vllm_two_layer: dict, smollm2_2layer: Path, tmp_path: Path) -> None:
    """The session's capture (``vllm_two_layer`` in ``tests/conftest.py``, another process), its pack published
    to an OCI registry (``coldsnap publish-native --repo oci://...``, Debian's ``docker-registry`` on 127.0.0.1); then, on a second node (a fresh state root that holds no pack),
    ``vllm serve --load-format coldsnap`` with ``COLDSNAP_PAYLOAD_REPO=oci://...`` and ``COLDSNAP_RESTORE=native``:
    the worker stages the pack from the registry by digest, restores from pack + residual (its log says so, with no
    fallback WARNING) and ``/v1/completions`` returns the same greedy text as the captured engine (a plain load);
    with ``PROMETHEUS_MULTIPROC_DIR`` set, vLLM's own ``/metrics`` shows the restore (outcome, seconds, stage seconds,
    bytes fetched and hydrated) beside vLLM's metrics. Fails if a load's metrics do not reach vLLM's multiprocess
    registry from the engine core process, or if staging is not counted."""
    from store_processes import Registry

    prompt = PROMPTS[0]  # "The capital of France is": the captured engine's first completion is the reference
    captured = vllm_two_layer["capture"]
    assert captured.error is None and captured.outcome["kind"] == "captured"
    shutil.copytree(vllm_two_layer["artifact"], tmp_path / "artifact", symlinks=True)
    copy_state(vllm_two_layer["state"], tmp_path / "state")

    registry = Registry(tmp_path / "registry")
    registry.start()
    try:
        repo = f"oci://{registry.registry}/models/smollm2"
        docker_config = {"DOCKER_CONFIG": str(tmp_path / "docker-config")}
        cli = [str(Path(sys.executable).with_name("coldsnap")), "publish-native", str(tmp_path / "artifact")]
        publish = subprocess.run(
            [*cli, "--repo", repo, "--state-root", str(tmp_path / "state")],
            capture_output=True,
            text=True,
            timeout=120,
            env={**_env_without_coldsnap(), **docker_config},
        )
        assert publish.returncode == 0, publish.stderr
        pack = only_pack(tmp_path / "state")
        assert f"uploaded {pack.name[:-5]}" in publish.stdout and f"manifest {repo}:artifact@sha256:" in publish.stdout

        node = coldsnap_env(tmp_path / "artifact", tmp_path / "node-2", COLDSNAP_PAYLOAD_REPO=repo, COLDSNAP_RESTORE="native")
        # One API server: vLLM collects its processes' samples only in its multiprocess mode (README "Metrics").
        (tmp_path / "prometheus").mkdir()
        node["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path / "prometheus")
        text, log_text, metrics = serve_completion(smollm2_2layer, tmp_path, "serve", {**node, **docker_config}, prompt=prompt)
    finally:
        registry.stop()
    assert text == captured.outputs[0]
    assert "coldsnap: restored worker-0-of-1 from pack" in log_text
    assert "could not restore" not in log_text
    assert only_pack(tmp_path / "node-2").read_bytes() == pack.read_bytes()  # staged from the registry, verified
    assert f"GET /v2/models/smollm2/blobs/sha256:{pack.name[:-5]}" in registry.log_text()
    # vLLM's own /metrics: the restore, its seconds, the stage from the registry and the bytes it fetched and
    # hydrated (the engine core process loaded the weights), beside vLLM's own metrics (the completion).
    vllm = {"engine": "vllm"}
    assert scraped(metrics, "coldsnap_load_total", **vllm, outcome="restored", rule="") == 1, metrics
    assert scraped(metrics, "coldsnap_load_seconds_count", **vllm, outcome="restored") == 1
    assert scraped(metrics, "coldsnap_load_seconds_sum", **vllm, outcome="restored") > 0
    assert scraped(metrics, "coldsnap_stage_seconds_count", **vllm) == 1
    assert scraped(metrics, "coldsnap_fetched_bytes_total", **vllm) == pack.stat().st_size
    native = read_capsule(tmp_path / "artifact" / "workers" / "worker-0-of-1").native
    assert scraped(metrics, "coldsnap_hydrated_bytes_total", **vllm) == native.model_bytes + native.residual_bytes
    assert scraped(metrics, "vllm:request_success_total") == 1


def test_vllm_serve_counts_a_fallback_on_its_metrics(vllm_two_layer: dict, smollm2_2layer: Path, tmp_path: Path) -> None:
    """``vllm serve`` under ``auto`` on a node whose state root holds no pack and that names no payload store: the
    worker falls back to the checkpoint with one WARNING (rule ``payload-available``), the completion equals the
    captured engine's, and vLLM's own ``/metrics`` (``PROMETHEUS_MULTIPROC_DIR``) counts one ``fell-back`` load with
    that rule and its seconds, nothing restored and nothing hydrated. Fails if a fallback does not reach vLLM's
    ``/metrics``, is counted as a restore or without its rule."""
    captured = vllm_two_layer["capture"]
    shutil.copytree(vllm_two_layer["artifact"], tmp_path / "artifact", symlinks=True)
    node = coldsnap_env(tmp_path / "artifact", tmp_path / "empty-node", COLDSNAP_MATERIALIZE="off")
    (tmp_path / "prometheus").mkdir()
    node["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path / "prometheus")
    text, log_text, metrics = serve_completion(smollm2_2layer, tmp_path, "serve-fallback", node, prompt=PROMPTS[0])
    assert text == captured.outputs[0]
    assert "could not restore worker-0-of-1" in log_text and "rule payload-available failed" in log_text, log_text[-4000:]
    vllm = {"engine": "vllm"}
    assert scraped(metrics, "coldsnap_load_total", **vllm, outcome="fell-back", rule="payload-available") == 1, metrics
    assert scraped(metrics, "coldsnap_load_total", **vllm) == 1  # no other outcome
    assert scraped(metrics, "coldsnap_load_seconds_count", **vllm, outcome="fell-back") == 1
    assert scraped(metrics, "coldsnap_load_seconds_sum", **vllm, outcome="fell-back") > 0
    assert scraped(metrics, "coldsnap_hydrated_bytes_total", **vllm) == 0


def test_vllm_serve_ends_a_native_refusal_with_its_coldsnap_line(
    vllm_two_layer: dict, smollm2_2layer: Path, tmp_path: Path
) -> None:
    """``vllm serve --dtype float32`` under ``native`` against the session's bf16 capture: the start fails (exit
    non-zero), and within the last 20 lines of its output (what ``kubectl logs --tail 20`` shows, after vLLM's
    worker traceback and "Engine core initialization failed") is the one ``coldsnap:`` refusal line, naming the rule,
    both dtypes and the remedy ``--dtype bfloat16``; the termination log
    (``COLDSNAP_TERMINATION_LOG``, here a file of the test) holds the same line. Fails if the refusal is only inside
    a traceback (the line no longer comes last), if it lacks the dtypes or the remedy, or if the termination log is
    not written."""
    shutil.copytree(vllm_two_layer["artifact"], tmp_path / "artifact", symlinks=True)
    copy_state(vllm_two_layer["state"], tmp_path / "state")
    termination = tmp_path / "termination-log"
    termination.touch()  # Kubernetes creates the file; coldsnap writes it only where it exists
    env = coldsnap_env(
        tmp_path / "artifact", tmp_path / "state", COLDSNAP_RESTORE="native", COLDSNAP_TERMINATION_LOG=str(termination)
    )
    returncode, output = serve_until_exit(smollm2_2layer, tmp_path, "serve-refused", env, extra_args=("--dtype", "float32"))
    assert returncode != 0
    tail = output.splitlines()[-20:]
    refusals = [line for line in tail if "coldsnap: vLLM start refused for worker-0-of-1" in line]
    assert refusals, "\n".join(tail)
    line = refusals[-1]
    assert "rule model-identity failed" in line and 'dtype: "float32" (engine) vs "bfloat16" (artifact)' in line, line
    assert line.count("; remedy: ") == 1 and "; remedy: start the engine with --dtype bfloat16" in line
    written = termination.read_text()
    assert written.startswith("coldsnap: vLLM start refused for worker-0-of-1") and written.strip() in line


def _env_without_coldsnap() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("COLDSNAP_")}
