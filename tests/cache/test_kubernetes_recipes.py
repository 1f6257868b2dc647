"""The Kubernetes recipes of ``examples/kubernetes/`` cannot rot, without an engine: every manifest is a valid
Kubernetes object (``kubernetes-validate``'s bundled schemas, strict: an unknown field fails), the manifests agree with
each other and with the CLI, and the containers that need no engine (publish, the DaemonSet's pre-stage, the
Deployment's pull) run as written against the stores the tests start. ``tests/vllm/test_vllm_kubernetes.py`` runs the
export and the engine containers on real vLLM."""

from __future__ import annotations

import copy
import shlex
from pathlib import Path

import kubernetes_validate
import pytest
from cache_support import capture

from coldsnap_core.cli.main import build_parser
from coldsnap_core.stores import artifact_ref, parse_store_spec
from tests.support.kubernetes import Cluster, container, container_env, containers, expand, find, manifests, pod_spec, references

VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
"""The oldest Kubernetes release whose schemas ``kubernetes-validate`` bundles that is still in wide use, and its
newest."""
WORKLOADS = ("Job", "Deployment", "DaemonSet")


def _workloads() -> list[dict]:
    return [find(kind) for kind in WORKLOADS]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_a_valid_kubernetes_object(version: str) -> None:
    """Each object of each YAML file validates against that release's schema, strictly (fails on a misspelled or
    misplaced field, a wrong type, a missing required field); the folder holds the ConfigMap, the Secret, the
    export Job, the Deployment and the DaemonSet."""
    kinds = []
    for name, docs in manifests().items():
        for doc in docs:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                pytest.fail(f"examples/kubernetes/{name}: {doc['kind']} {doc['metadata']['name']}: {error.message}")
            kinds.append(doc["kind"])
    assert sorted(kinds) == ["ConfigMap", "DaemonSet", "Deployment", "Job", "Secret"]


def test_the_validation_sees_a_misspelled_field() -> None:
    """The schema check itself: a container's ``volumeMount`` (for ``volumeMounts``) and a string ``containerPort``
    are refused (fails if the validation stopped being strict)."""
    deployment = copy.deepcopy(find("Deployment"))
    engine = pod_spec(deployment)["containers"][0]
    engine["volumeMount"] = engine.pop("volumeMounts")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[-1], strict=True)
    deployment = copy.deepcopy(find("Deployment"))
    pod_spec(deployment)["containers"][0]["ports"][0]["containerPort"] = "8000"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[-1], strict=True)


def test_every_reference_mount_and_command_resolves() -> None:
    """What the schema cannot see: every ``$(VAR)`` of a command or an ``env`` value is a variable of that container
    (Kubernetes leaves an unknown one as written), every ``volumeMounts`` entry names a volume of its pod, every
    ``envFrom`` names an object of the folder, and every ``coldsnap`` command parses with the real CLI parser (a
    renamed option fails here)."""
    problems = []
    for workload in _workloads():
        volumes = {v["name"] for v in pod_spec(workload).get("volumes", [])}
        for spec in containers(workload):
            where = f"{workload['kind']} {spec['name']}"
            for source in spec.get("envFrom", []):
                kind, ref = ("ConfigMap", source["configMapRef"]) if "configMapRef" in source else ("Secret", source["secretRef"])
                try:
                    find(kind, ref["name"])
                except ValueError:
                    problems.append(f"{where}: no {kind} {ref['name']}")
            env = {**find("ConfigMap")["data"], **find("Secret")["stringData"]}
            env.update({item["name"]: item["value"] for item in spec.get("env", [])})
            words = [*spec.get("command", []), *spec.get("args", [])]
            for text in [*words, *(item["value"] for item in spec.get("env", []))]:
                problems += [f"{where}: $({name}) is no variable of the container" for name in references(text) - set(env)]
            problems += [f"{where}: no volume {m['name']}" for m in spec.get("volumeMounts", []) if m["name"] not in volumes]
            if words[:1] == ["coldsnap"]:
                try:
                    build_parser().parse_args([expand(w, env) for w in words[1:]])
                except (SystemExit, Exception) as error:  # the parser raises its usage error
                    problems.append(f"{where}: coldsnap does not parse {shlex.join(words)}: {error}")
    assert problems == []


def test_the_recipes_agree_with_each_other() -> None:
    """The export serves with the Deployment's command, model path included (vLLM keys its compile cache on the
    model's name and options: the export's would not qualify); every pod runs as one user and the root ``chown``
    gives the node's folder to that user; the DaemonSet pre-stages the node group and hostPath the Deployment uses;
    the state root lies on that volume; the readiness probe asks the port vLLM listens on; the ConfigMap's REF is
    what ``publish-native`` prints for its store and name."""
    job, deployment, daemonset = _workloads()
    export = container(job, "export")
    engine = pod_spec(deployment)["containers"][0]
    served = export["command"][export["command"].index("--") + 1 :]
    assert served == engine["command"] and "coldsnap" in served
    users = {(pod_spec(w)["securityContext"]["runAsUser"], pod_spec(w)["securityContext"]["runAsGroup"]) for w in _workloads()}
    assert len(users) == 1
    ((user, group),) = users
    for workload in (deployment, daemonset):
        (owner,) = [c for c in containers(workload) if c.get("securityContext", {}).get("runAsUser") == 0]
        assert owner["command"][:2] == ["chown", f"{user}:{group}"], owner["command"]
        (cache,) = [v for v in pod_spec(workload)["volumes"] if "hostPath" in v]
        assert owner["command"][2] == cache["hostPath"]["path"]
    assert pod_spec(deployment)["nodeSelector"] == pod_spec(daemonset)["nodeSelector"]
    assert [v for v in pod_spec(deployment)["volumes"] if "hostPath" in v] == pod_spec(daemonset)["volumes"]
    config = find("ConfigMap")["data"]
    assert config["COLDSNAP_STATE_ROOT"].startswith(pod_spec(daemonset)["volumes"][0]["hostPath"]["path"] + "/")
    (port,) = engine["ports"]
    assert engine["readinessProbe"]["httpGet"]["port"] == port["name"]
    assert {e["name"]: e["value"] for e in engine["env"]}["PORT"] == str(port["containerPort"])
    repo = config["COLDSNAP_PAYLOAD_REPO"]
    assert config["ARTIFACT_REF"] == artifact_ref(repo, parse_store_spec(repo), config["ARTIFACT_NAME"])


@pytest.mark.parametrize("kind", ["folder", "s3", "oci"])
def test_publish_prestage_and_pull_run_as_written(
    kind: str, tiny_checkpoint: Path, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine-free containers, their commands and environments read from the YAML, against a folder store, S3 on
    moto and an OCI registry: the Job's ``publish`` container publishes a capture found where its ``export``
    container writes it and prints the REF the ConfigMap's rule gives; on one node the DaemonSet's containers give
    the node's folder to the user and pull the artifact and its pack into the state root; the Deployment's ``pull``
    on that node writes the artifact into the pod's volume and finds the pack staged (the same file, not fetched
    again). Fails if a command, a variable, a mount path or the REF of the recipes stopped working."""
    from store_servers import store_under_test

    store = store_under_test(kind, request, tmp_path, monkeypatch)
    job, deployment, daemonset = _workloads()
    config = find("ConfigMap")["data"]
    ref = artifact_ref(store.spec, store.store, config["ARTIFACT_NAME"])
    cluster = Cluster(
        tmp_path / "cluster", {"COLDSNAP_PAYLOAD_REPO": store.spec, "ARTIFACT_REF": ref}, {"coldsnap-store": store.env}
    )
    export_env = container_env(container(job, "export"))
    artifact, state = (cluster.path(job, "export", export_env[v]) for v in ("COLDSNAP_ARTIFACT_DIR", "COLDSNAP_STATE_ROOT"))
    capture(tiny_checkpoint, artifact, state)
    published = cluster.run(job, "publish").stdout.splitlines()
    assert f"ref {ref}" in published, published
    for name in ("own-node-cache", "prestage"):
        cluster.run(daemonset, name)
    (pack,) = (cluster.path(daemonset, "prestage", config["COLDSNAP_STATE_ROOT"]) / "model-payloads" / "sha256").glob("*.pack")
    inode = pack.stat().st_ino
    for name in ("own-node-cache", "pull"):
        cluster.run(deployment, name)
    assert pack.stat().st_ino == inode
    assert (cluster.path(deployment, "pull", container(deployment, "pull")["command"][-1]) / "artifact.json").is_file()
