"""Many nodes, one store: real ``coldsnap`` processes, one state root each, racing on each store kind.

A "node" is a child process with its own state root (``store_servers.node_command``); the nodes are
released together by a start file. The store is the same server for all of them (a folder, the local
Hub, moto, the OCI registry, fake-gcs-server or azurite, over HTTP).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cache_support import capture, eligible_objects, sha256_of, temporaries
from store_servers import REPO, node_command, run_nodes

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.stores import artifact_ref, parse_artifact_ref
from coldsnap_core.stores.publish import artifact_listing, publish_native
from coldsnap_core.stores.pull import pull_artifact

pytestmark = pytest.mark.slow


def test_four_nodes_stage_one_digest_at_once(any_store, captured_once, tmp_path) -> None:
    """Four nodes run ``coldsnap stage`` of the same artifact at the same moment: every node exits 0 with
    one verified object in its cache, nothing partial in any cache or in the store, and the store still
    holds exactly one object (a fetch never writes to the store). Fails if concurrent fetches share or
    corrupt a temporary, or a store fetch leaves partial state behind."""
    pack = captured_once.pack
    publish_native([captured_once.artifact_dir], any_store.store, PayloadCache(captured_once.capture_root))
    writes = any_store.writes(pack.sha256)
    nodes = [tmp_path / f"node-{i}" for i in range(4)]
    start = tmp_path / "start"
    commands = [
        node_command(start, "stage", str(captured_once.artifact_dir), "--repo", any_store.spec, "--state-root", str(node))
        for node in nodes
    ]
    results = run_nodes(commands, any_store.env, start)
    assert [rc for rc, _, _ in results] == [0, 0, 0, 0], [err[-2000:] for _, _, err in results]
    for node in nodes:
        objects = eligible_objects(node)
        assert list(objects) == [pack.sha256] and sha256_of(objects[pack.sha256]) == pack.sha256
        assert temporaries(node) == []
    assert any_store.objects() == [f"{pack.sha256}.pack"]
    assert any_store.writes(pack.sha256) == writes
    assert any_store.leftovers() == []


def test_two_nodes_publish_one_digest_at_once(any_store, tmp_path, tiny_checkpoint) -> None:
    """Two nodes, each with its own artifact (different layouts, the same pack digest) and state root,
    run ``publish-native`` at the same moment: both exit 0, the store holds one object at the digest's
    path. With a conditional create (folder: no-replace link; S3: ``If-None-Match: *``) the object is
    written once: one node reports ``uploaded``, the other ``present``, and S3 keeps a single object
    version. The Hub has no conditional create: both may commit, and the Hub keeps one LFS object for the
    SHA-256, and a registry one blob per digest. Fails if the loser of the race fails, or (folder, S3) overwrites the winner's object."""
    roots = [tmp_path / "root-a", tmp_path / "root-b"]
    a = capture(tiny_checkpoint, tmp_path / "a", roots[0])
    b = capture(tiny_checkpoint, tmp_path / "b", roots[1], reverse=True)
    assert a.manifest.pack == b.manifest.pack and a.manifest.layout_fingerprint != b.manifest.layout_fingerprint
    digest = a.manifest.pack.sha256
    start = tmp_path / "start"
    commands = [
        node_command(start, "publish-native", str(tmp_path / name), "--repo", any_store.spec, "--state-root", str(root))
        for name, root in zip(("a", "b"), roots, strict=True)
    ]
    results = run_nodes(commands, any_store.env, start)
    assert [rc for rc, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    actions = sorted(out.split()[0] for _, out, _ in results)
    assert any_store.objects() == [f"{digest}.pack"]
    assert any_store.leftovers() == []
    if any_store.kind in ("hf", "oci"):  # no conditional create; the Hub and a registry keep one object per digest
        assert set(actions) <= {"uploaded", "present"} and "uploaded" in actions
        assert 1 <= any_store.writes(digest) <= 2
    else:
        assert actions == ["present", "uploaded"]
        assert any_store.writes(digest) == 1


def _published_ref(any_store, captured_once) -> str:
    publish_native([captured_once.artifact_dir], any_store.store, PayloadCache(captured_once.capture_root), name="tiny")
    return artifact_ref(any_store.spec, any_store.store, "tiny")


def test_two_pulls_of_one_folder_at_once_give_one_artifact(any_store, captured_once, tmp_path) -> None:
    """Two ``coldsnap pull`` processes of one REF into one DIR (one state root) at the same moment: both exit 0, DIR
    is the artifact (every file as published), exactly one of them fetched the files (the other waited on the lock
    beside DIR and found it in place), no temporary is left and the pack is staged once. Fails if the pulls share a
    temporary, the second replaces the first's folder, or one fails on the other's rename."""
    ref = _published_ref(any_store, captured_once)
    dest, state, start = tmp_path / "node" / "artifact", tmp_path / "node" / "state", tmp_path / "start"
    commands = [node_command(start, "pull", ref, str(dest), "--state-root", str(state), "--json") for _ in range(2)]
    results = run_nodes(commands, any_store.env, start)
    assert [rc for rc, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    listing = artifact_listing(captured_once.artifact_dir, "tiny")
    assert sorted(json.loads(out)["fetched_files"] for _, out, _ in results) == [0, len(listing.files)]
    for file in listing.files:
        assert (dest / file.path).read_bytes() == (captured_once.artifact_dir / file.path).read_bytes()
    assert sorted(p.name for p in dest.parent.iterdir()) == [".artifact.lock", "artifact", "state"]
    assert list(eligible_objects(state)) == [captured_once.pack.sha256] and temporaries(state) == []


def _kill_when(proc: subprocess.Popen, ready, timeout_seconds: float = 60.0) -> bool:
    """SIGKILL ``proc`` as soon as ``ready()`` holds (polled every millisecond); ``False`` when it exited first."""
    deadline = time.monotonic() + timeout_seconds
    while proc.poll() is None and time.monotonic() < deadline:
        if ready():
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.001)
    proc.wait(timeout=timeout_seconds)
    return False


@pytest.mark.parametrize("any_store", ["folder", "s3"], indirect=True)
def test_a_killed_pull_never_leaves_an_accepted_artifact(any_store, captured_once, tmp_path) -> None:
    """``coldsnap pull`` processes killed (SIGKILL) at successive points: as the lock is taken, as the temporary
    folder appears, after each further file landed in it. After each kill DIR is absent, or complete with every file
    intact (a kill after the rename); never a folder a restore would read with a file missing or partial. The next
    pull removes what the killed ones left and writes the artifact. Fails if files are written at DIR directly, the
    rename happens before every file is checked, or a stale temporary is mistaken for the artifact."""
    ref = _published_ref(any_store, captured_once)
    store, name = parse_artifact_ref(ref)
    listing = artifact_listing(captured_once.artifact_dir, "tiny")
    dest, start = tmp_path / "artifact", tmp_path / "start"
    start.touch()  # node_command runs at once
    env = {**os.environ, **any_store.env}

    def temps() -> list[Path]:
        return list(tmp_path.glob(".artifact.pull-*"))

    def fetched() -> int:  # files landed so far, in a temporary or (a pull that wrote in place) at DIR
        return sum(p.is_file() for folder in [*temps(), dest] for p in folder.rglob("*"))

    points = [lambda: (tmp_path / ".artifact.lock").exists(), lambda: bool(temps())]
    points += [lambda n=n: fetched() >= n for n in range(1, len(listing.files) + 1)]
    killed_mid_pull = 0
    for ready in points:
        for leftover in [*temps(), tmp_path / ".artifact.lock"]:  # each kill point is judged on this pull's own files
            if leftover.is_dir():
                shutil.rmtree(leftover)
            else:
                leftover.unlink(missing_ok=True)
        cmd = node_command(start, "pull", ref, str(dest), "--state-root", str(tmp_path / "state"))
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=REPO)
        if not _kill_when(proc, ready):
            continue
        killed_mid_pull += 0 < fetched() < len(listing.files)
        if dest.exists():  # killed after the rename: DIR must be the whole artifact, every pin intact
            assert pull_artifact(store, name, dest).fetched_files == 0
            shutil.rmtree(dest)
    assert killed_mid_pull >= 1, "no kill landed while files were being fetched"
    assert pull_artifact(store, name, dest).fetched_files == len(listing.files)
    assert temps() == []
