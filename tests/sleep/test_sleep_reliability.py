"""Sleep capsules as operators run engines: containers sharing one state root, engines killed while asleep.

Real processes (``sleep_child.py``) with real SmolLM2 bytes in the fake CuMem allocator, real PID
namespaces (``unshare --pid --fork --mount-proc``) where the machine allows them, real ``flock``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from sleep_fakes import FakeCuMemAllocator, load_checkpoint, load_state

from coldsnap_core.copy.host import HostCopyBackend
from coldsnap_core.format.manifest import ModelIdentity
from coldsnap_vllm.sleep import ColdsnapSleepBackend

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CHILD = HERE / "sleep_child.py"


def _child(checkpoint: Path, state_root: Path, sync_dir: Path, role: str, *, namespace: bool) -> list[str]:
    command = [sys.executable, str(CHILD), str(checkpoint), str(state_root), str(sync_dir), role]
    return (["unshare", "--pid", "--fork", "--mount-proc", *command]) if namespace else command


def _report(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=180)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, f"child printed no report; stderr:\n{err}"
    return json.loads(lines[-1])


def _pid_namespaces_available() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", "echo $$"], capture_output=True, text=True)
    return probe.returncode == 0 and probe.stdout.strip() == "1"


def _backend(allocator: FakeCuMemAllocator, state) -> ColdsnapSleepBackend:
    copy = HostCopyBackend(threads=1)
    return ColdsnapSleepBackend(allocator=allocator, backend_factory=lambda device: copy, load_state=lambda: state)


@pytest.mark.slow  # about 11 s: sleeping processes in two PID namespaces
@pytest.mark.skipif(not _pid_namespaces_available(), reason="unshare --pid needs root or user namespaces here")
def test_sleep_capsules_collide_across_pid_namespaces(smollm2_2layer: Path, tmp_path: Path) -> None:
    """Two engines in two PID namespaces (both PID 1) share one state root: the first sleeps, the
    second sleeps, wakes and exits, then the first wakes with every weights byte intact. Fails if a
    sleep capsule is named by the pid alone (the second sleep replaces the first one's residual blob
    and its exit deletes the folder: the first can never wake, rule object-present)."""
    state_root, sync = tmp_path / "state", tmp_path / "sync"
    sync.mkdir()
    first = subprocess.Popen(
        _child(smollm2_2layer, state_root, sync, "first", namespace=True),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    second = subprocess.Popen(
        _child(smollm2_2layer, state_root, sync, "second", namespace=True),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    second_report, first_report = _report(second), _report(first)
    assert first_report["pid"] == second_report["pid"] == 1  # the collision the test is about
    assert second_report["ok"], second_report
    assert first_report["ok"], first_report
    assert first_report["capsule"] != second_report["capsule"]
    assert not os.path.exists(first_report["capsule"]) and not os.path.exists(second_report["capsule"])


def test_sleep_capsules_of_two_backends_sharing_a_state_root_do_not_collide(
    smollm2_2layer: Path, smollm2_identity: ModelIdentity, tmp_path: Path
) -> None:
    """Two backends of the same worker identity and the same pid (two engines, one state root): the
    second one's sleep and close leave the first one's capsule alone, and the first wakes byte for
    byte. Fails if the capsule is not unique to its backend instance (the pid is not enough)."""
    allocators = [FakeCuMemAllocator(), FakeCuMemAllocator()]
    try:
        models = [load_checkpoint(a, smollm2_2layer) for a in allocators]
        states = [load_state(m, smollm2_identity, tmp_path) for m in models]
        before = allocators[0].digests("weights")
        first, second = (_backend(a, s) for a, s in zip(allocators, states, strict=True))
        first.suspend(1)
        blob = first.capture.blob_path
        blob_bytes = blob.read_bytes()
        second.suspend(1)
        assert second.capture.capsule_dir != first.capture.capsule_dir
        second.resume(None)
        second.close()
        assert blob.read_bytes() == blob_bytes
        first.resume(None)
        assert allocators[0].digests("weights") == before
        first.close()
        assert not first.capture.capsule_dir.exists()
    finally:
        for a in allocators:
            a.close()


def _cache_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "coldsnap_core.cli.main", "cache", *args], capture_output=True, text=True, cwd=REPO
    )


@pytest.mark.slow  # about 17 s: a sleeping process killed and its capsule collected by the CLI
def test_sleep_capsule_of_an_engine_killed_while_asleep_is_listed_and_collected(
    smollm2_2layer: Path, smollm2_identity: ModelIdentity, tmp_path: Path
) -> None:
    """An engine SIGKILLed while asleep leaves its sleep capsule: ``cache ls`` lists it with its owner
    gone, ``cache gc`` removes it (at once: its lock is free) and keeps the capsule of an engine that is
    still asleep, and the next sleep capture on the state root removes such debris too. Fails if
    ``state/sleep`` is invisible to ``cache ls`` or kept forever by ``cache gc``."""
    state_root, sync = tmp_path / "state", tmp_path / "sync"
    sync.mkdir()
    allocator = FakeCuMemAllocator()
    try:
        model = load_checkpoint(allocator, smollm2_2layer)
        live = _backend(allocator, load_state(model, smollm2_identity, tmp_path))
        live.suspend(1)
        live_capsule = live.capture.capsule_dir
        assert live_capsule.parent == state_root / "sleep"
        for round_ in ("gc", "next-writer"):
            holder = subprocess.Popen(
                _child(smollm2_2layer, state_root, sync, "hold", namespace=False),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=REPO,
            )
            line = holder.stdout.readline()
            report = json.loads(line)
            dead = Path(report["capsule"])
            assert dead.is_dir() and dead != live_capsule
            os.kill(holder.pid, signal.SIGKILL)
            holder.communicate(timeout=60)
            (sync / "hold-asleep").unlink(missing_ok=True)

            listing = _cache_cli("ls", "--json", "--state-root", str(state_root))
            assert listing.returncode == 0, listing.stderr
            capsules = {c["path"]: c["owner"] for c in json.loads(listing.stdout)["sleep_capsules"]}
            assert capsules == {str(dead): "gone", str(live_capsule): "alive"}
            if round_ == "gc":
                gc = _cache_cli("gc", "--state-root", str(state_root))
                assert gc.returncode == 0, gc.stderr
                assert str(dead) in gc.stdout
            else:  # the next level-1 sleep on this state root is the next writer
                live.resume(None)
                live.suspend(1)
            assert not dead.exists()
            assert live.capture.capsule_dir.is_dir()
        assert sorted(p.name for p in (state_root / "sleep").iterdir() if not p.name.endswith(".lock")) == [
            live.capture.capsule_dir.name
        ]
        live.resume(None)
        live.close()
    finally:
        allocator.close()
