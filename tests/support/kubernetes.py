"""The Kubernetes recipes of ``examples/kubernetes/`` as the tests run them: each container's command and environment
read from the YAML and run on this machine as a process, as the kubelet would start it.

What a run changes, and nothing else (examples/kubernetes/README.md, "Tested"):

* volumes: each volume is a host folder, an ``emptyDir`` one per pod, a ``hostPath`` one per node (the same folder
  for every pod placed on that node), a ``persistentVolumeClaim`` one per claim (the test fills it); a running
  container's are linked at ``<root>/fs/<mountPath>``, and a command word or an environment value naming a mount path
  names that link (the same string in every pod: vLLM keys its compile cache on the model's path);
* ``overrides``: the values of variables the manifests define (the store, its REF, the port);
* ``secrets``: the content of the Secrets that ``envFrom`` names (the store's endpoint and credentials);
* the user: a ``chown UID:GID`` of the pod's ``runAsUser:runAsGroup`` gives the folder to the test's own user.

The environment of this machine (``PATH`` first with this interpreter's folder, so ``coldsnap`` and ``vllm`` are
this checkout's) is underneath, less every ``COLDSNAP_*`` variable, as an image's environment would be.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

RECIPES = Path(__file__).resolve().parents[2] / "examples" / "kubernetes"
_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def manifests() -> dict[str, list[dict]]:
    """Every YAML file of the recipes folder and the objects it holds, by file name (a fresh copy: callers edit it)."""
    return copy.deepcopy(_read(RECIPES))


@functools.cache
def _read(folder: Path) -> dict[str, list[dict]]:
    return {p.name: [d for d in yaml.safe_load_all(p.read_text(encoding="utf-8")) if d] for p in sorted(folder.glob("*.yaml"))}


def objects() -> Iterator[dict]:
    for docs in manifests().values():
        yield from docs


def find(kind: str, name: str | None = None) -> dict:
    """The one object of ``kind`` (and ``name``) in the recipes."""
    (found,) = [o for o in objects() if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    return found


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def containers(workload: dict) -> list[dict]:
    """The pod's init containers, then its containers, in the order the kubelet starts them."""
    spec = pod_spec(workload)
    return [*spec.get("initContainers", []), *spec["containers"]]


def container(workload: dict, name: str) -> dict:
    """The container (or init container) ``name`` of ``workload``."""
    (found,) = [c for c in containers(workload) if c["name"] == name]
    return found


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of a command word or an ``env`` value: ``$(VAR)`` becomes VAR's value when the container
    defines VAR (else it stays as written), ``$$`` becomes ``$``."""

    def one(match: re.Match) -> str:
        name = match.group(1)
        return "$" if name is None else env.get(name, match.group(0))

    return _REFERENCE.sub(one, text)


def references(text: str) -> set[str]:
    """The variables ``text`` refers to with ``$(VAR)``."""
    return {m.group(1) for m in _REFERENCE.finditer(text) if m.group(1)}


def container_env(container: dict, secrets: dict[str, dict[str, str]] | None = None) -> dict[str, str]:
    """The variables the kubelet gives ``container``: each ``envFrom`` source in order (a ConfigMap of the recipes;
    a Secret from ``secrets``, its manifest's placeholders otherwise), then ``env`` (each value expanded against what
    precedes it)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(find("ConfigMap", source["configMapRef"]["name"])["data"])
        else:
            name = source["secretRef"]["name"]
            env.update(secrets[name] if secrets is not None and name in secrets else find("Secret", name)["stringData"])
    for item in container.get("env", []):
        env[item["name"]] = expand(item["value"], env)
    return env


@dataclass
class Cluster:
    """Host folders standing for the cluster's nodes and pods, and the values the test puts in: ``overrides`` apply to
    the variables a container defines, ``secrets`` replace the Secrets' content."""

    root: Path
    overrides: dict[str, str] = field(default_factory=dict)
    secrets: dict[str, dict[str, str]] = field(default_factory=dict)

    def claim(self, name: str) -> Path:
        """The host folder of the PersistentVolumeClaim ``name`` (one for the whole cluster; the test fills it)."""
        return self.root / "claims" / name

    def mounts(self, workload: dict, container: dict, node: str) -> dict[str, Path]:
        """``container``'s mount paths and the host folder each stands for on ``node``."""
        volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
        found = {}
        for mount in container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            if "hostPath" in volume:
                host = self.root / "nodes" / node / volume["hostPath"]["path"].lstrip("/")
            elif "persistentVolumeClaim" in volume:
                host = self.claim(volume["persistentVolumeClaim"]["claimName"])
            else:
                assert "emptyDir" in volume, f"{mount['name']}: a volume kind the tests do not place"
                host = self.root / "pods" / workload["metadata"]["name"] / mount["name"]
            host.mkdir(parents=True, exist_ok=True)
            found[mount["mountPath"]] = host
        return found

    def path(self, workload: dict, name: str, manifest_path: str, node: str = "node-a") -> Path:
        """The host folder or file that ``manifest_path`` names in container ``name`` of ``workload`` on ``node``."""
        for mount, host in self.mounts(workload, container(workload, name), node).items():
            if manifest_path == mount or manifest_path.startswith(mount + "/"):
                return host / manifest_path[len(mount) :].lstrip("/")
        raise AssertionError(f"{name}: no volume holds {manifest_path}")

    def command(self, workload: dict, name: str, node: str = "node-a") -> tuple[list[str], dict[str, str]]:
        """The argv and the environment of container ``name`` of ``workload`` on ``node``, as this machine runs it:
        the container's volumes are linked at ``root/fs/<mountPath>`` (only its own, as in its mount namespace), so a
        path of the manifests is the same string in every pod, as on a node."""
        spec = container(workload, name)
        assert "command" in spec, f"{name}: runs its image's own entry point"
        mounts = self.mounts(workload, spec, node)
        view = self.root / "fs"
        shutil.rmtree(view, ignore_errors=True)  # removes the links, never what they point to
        for mount, host in mounts.items():
            assert not any(mount.startswith(other + "/") for other in mounts), f"{name}: {mount} is inside another mount"
            link = view / mount.lstrip("/")
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(host, target_is_directory=True)
        place = re.compile("|".join(rf"(?<![\w/.-]){re.escape(m)}(?=/|$)" for m in mounts))

        def local(text: str) -> str:  # the manifest's paths, not the values the test puts in
            return place.sub(lambda m: f"{view}{m.group(0)}", text) if mounts else text

        given = {k for values in self.secrets.values() for k in values}
        env = {k: v if k in given else local(v) for k, v in container_env(spec, self.secrets).items()}
        env.update({k: v for k, v in self.overrides.items() if k in env})
        words = [expand(local(w), env) for w in [*spec["command"], *spec.get("args", [])]]
        pod_user = pod_spec(workload)["securityContext"]
        owner = f"{pod_user['runAsUser']}:{pod_user['runAsGroup']}"
        if words[0] == "chown" and spec.get("securityContext", {}).get("runAsUser") == 0:
            words = [f"{os.getuid()}:{os.getgid()}" if w == owner else w for w in words]
        host = {k: v for k, v in os.environ.items() if not k.startswith("COLDSNAP_")}
        host["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{host.get('PATH', '')}"
        return words, {**host, **env}

    def run(self, workload: dict, name: str, node: str = "node-a", *, timeout_s: float = 600) -> subprocess.CompletedProcess:
        """Run container ``name`` to its end; fails the test, with its output, unless it exits 0."""
        argv, env = self.command(workload, name, node)
        cwd = self.root / "pods" / workload["metadata"]["name"]
        cwd.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
        assert done.returncode == 0, f"{name}: {argv} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
        return done
