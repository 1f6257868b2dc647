"""The Kubernetes recipes of ``examples/kubernetes/`` on real vLLM: every container of the export Job, the pre-stage
DaemonSet and the Deployment runs its command and environment as the YAML writes them (``tests/support/kubernetes.py``:
only the volumes' host folders, the port and the store's endpoint are put in), against S3 on moto with the
ConfigMap's own bucket, prefix and REF. The schema and the engine-free containers against more stores:
``tests/cache/test_kubernetes_recipes.py``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from engine_support import http_status

from tests.support.kubernetes import Cluster, find, pod_spec
from tests.support.servers import free_port, stop_server

pytestmark = [pytest.mark.engine, pytest.mark.vllm]
READY_TIMEOUT_S = 900


def test_export_job_prestage_daemonset_and_deployment_serve_on_real_vllm(
    smollm2_2layer: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fleet flow as the recipes run it, with compilation on as written: the Job's ``export`` container (``coldsnap
    export -- vllm serve``) exits 0 and its ``publish`` container prints the ConfigMap's ``ARTIFACT_REF``; on a node,
    the DaemonSet's containers pre-stage the pack into the node's state root; the Deployment's ``pull`` there writes
    the artifact, no weight file, into the pod's volume and fetches no pack again; its ``vllm`` container becomes ready
    on the readiness probe's path and port and answers a completion for the served name, restored with the checkpoint
    absent and the export's compile cache used. Fails if a recipe's command, variable, volume, REF, probe or option
    stopped working with this vLLM and coldsnap."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "cache"))  # the store servers of the cache tests
    import boto3
    from store_processes import MotoProcess
    from store_servers import S3_ENV

    for name, value in {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
        monkeypatch.setenv(name, value)  # this machine's (a CPU node without the Hub), not the recipes'
    job, deployment, daemonset = find("Job"), find("Deployment"), find("DaemonSet")
    config = find("ConfigMap")["data"]
    moto = MotoProcess(tmp_path / "moto")
    moto.start()
    try:
        credentials = {**S3_ENV, "AWS_ENDPOINT_URL": moto.url}
        boto3.client("s3", endpoint_url=moto.url, **_boto_keys(credentials)).create_bucket(
            Bucket=config["COLDSNAP_PAYLOAD_REPO"].removeprefix("s3://").split("/")[0]
        )
        cluster = Cluster(tmp_path / "cluster", {"PORT": str(free_port())}, {"coldsnap-store": credentials})
        (claim,) = [v["persistentVolumeClaim"]["claimName"] for v in pod_spec(job)["volumes"] if "persistentVolumeClaim" in v]
        shutil.copytree(smollm2_2layer, cluster.claim(claim))  # the checkpoint's volume
        cluster.run(job, "export", timeout_s=1500)
        assert f"ref {config['ARTIFACT_REF']}" in cluster.run(job, "publish").stdout.splitlines()
        for name in ("own-node-cache", "prestage"):
            cluster.run(daemonset, name)
        state = cluster.path(daemonset, "prestage", config["COLDSNAP_STATE_ROOT"])
        (pack,) = (state / "model-payloads" / "sha256").glob("*.pack")
        inode = pack.stat().st_ino
        for name in ("own-node-cache", "pull"):
            cluster.run(deployment, name)
        assert pack.stat().st_ino == inode, "the Deployment's pull fetched the pack the DaemonSet staged"
        text = _serve(cluster, deployment)
    finally:
        moto.stop()
    pod = cluster.root / "pods" / deployment["metadata"]["name"]
    assert [p for p in pod.rglob("*") if p.suffix in (".safetensors", ".bin", ".pt")] == []
    assert text.strip(), text
    lines = [json.loads(line) for line in (state / "load-outcomes.jsonl").read_text().splitlines()]
    restored = [line for line in lines if line["outcome"] == "restored"]
    assert len(restored) == 1 and restored[0].get("checkpoint") == "absent", lines
    assert restored[0].get("derived_cache") == "used", restored[0].get("derived_cache_reason")


def _boto_keys(env: dict[str, str]) -> dict[str, str]:
    return {
        "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
        "region_name": env["AWS_DEFAULT_REGION"],
    }


def _serve(cluster: Cluster, deployment: dict) -> str:
    """Start the Deployment's ``vllm`` container, wait for its readiness probe, return the greedy completion of one
    prompt for the served model name, stop it."""
    argv, env = cluster.command(deployment, "vllm")
    (engine,) = pod_spec(deployment)["containers"]
    probe = engine["readinessProbe"]["httpGet"]
    assert probe["port"] == engine["ports"][0]["name"]
    base = f"http://127.0.0.1:{env['PORT']}"
    log = cluster.root / "vllm.log"
    with open(log, "w") as out:
        server = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=cluster.root)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while http_status(base + probe["path"]) != 200:
            assert server.poll() is None, f"{argv} exited with {server.returncode}:\n{log.read_text()[-6000:]}"
            assert time.monotonic() < deadline, f"not ready:\n{log.read_text()[-6000:]}"
            time.sleep(1)
        model = argv[argv.index("--served-model-name") + 1]
        body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
        request = urllib.request.Request(
            base + "/v1/completions", data=body.encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())["choices"][0]["text"]
    finally:
        stop_server(server)
