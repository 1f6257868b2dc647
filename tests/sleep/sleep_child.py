"""A sleep-mode "engine" in its own process, for the tests that need more than one (PID namespaces, kill -9).

It loads a real safetensors checkpoint into the fake CuMem allocator (:func:`sleep_fakes.load_checkpoint`),
publishes the loader's state and drives :class:`coldsnap_vllm.sleep.ColdsnapSleepBackend` with the host
copy backend. Usage::

    python sleep_child.py CHECKPOINT STATE_ROOT SYNC_DIR ROLE

``ROLE``:

* ``first``: sleep (level 1), create ``SYNC_DIR/first-asleep``, wait for ``SYNC_DIR/second-done``, wake,
  and report whether every weights byte came back;
* ``second``: wait for ``SYNC_DIR/first-asleep``, sleep, wake, close the backend (which removes its
  own capsule), create ``SYNC_DIR/second-done``;
* ``hold``: sleep, print the report, create ``SYNC_DIR/hold-asleep`` and stay asleep until killed.

The child prints one JSON line: ``{"ok": bool, "pid": ..., "capsule": ..., "error": ...}``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# vLLM's classes are not what these tests are about (the capsule folders are), and importing vLLM costs
# seconds of CPU per child: the fakes then use their same-shaped AllocationData stand-in.
sys.modules["vllm"] = None  # type: ignore[assignment]


def _wait_for(path: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.05)


def main() -> int:
    checkpoint, state_root, sync_dir, role = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    from sleep_fakes import FakeCuMemAllocator, load_checkpoint, load_state

    from coldsnap_core.copy.host import HostCopyBackend
    from coldsnap_core.identity.model_identity import identify_checkpoint
    from coldsnap_vllm.sleep import ColdsnapSleepBackend

    if role == "second":
        _wait_for(sync_dir / "first-asleep")
    allocator = FakeCuMemAllocator()
    model = load_checkpoint(allocator, checkpoint)
    identity = identify_checkpoint(sorted(checkpoint.glob("*.safetensors")), source=str(checkpoint))
    state = load_state(model, identity, sync_dir)
    state = dataclasses.replace(state, state_root=state_root, artifact_dir=None)
    copy = HostCopyBackend(threads=1)
    backend = ColdsnapSleepBackend(allocator=allocator, backend_factory=lambda device: copy, load_state=lambda: state)
    before = allocator.digests("weights")
    report: dict[str, object] = {"pid": os.getpid(), "role": role}
    try:
        backend.suspend(1)
        report["capsule"] = str(backend.capture.capsule_dir)
        if role == "hold":
            print(json.dumps({**report, "ok": True}), flush=True)
            (sync_dir / "hold-asleep").touch()
            while True:
                time.sleep(60)
        if role == "first":
            (sync_dir / "first-asleep").touch()
            _wait_for(sync_dir / "second-done")
        backend.resume(None)
        report["ok"] = allocator.digests("weights") == before
    except Exception as exc:  # reported, not raised: the parent asserts on the report
        report.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    finally:
        if role == "second":
            backend.close()
            (sync_dir / "second-done").touch()
    print(json.dumps(report), flush=True)
    backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
