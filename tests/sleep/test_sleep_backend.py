"""The ``coldsnap`` sleep backend end to end on CPU: real SmolLM2 bytes in a fake CuMem allocator
with vLLM's contract (segments at fixed addresses, released and re-mapped with garbage), the host
copy backend, and fault injection."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import re
from pathlib import Path

import pytest
from sleep_fakes import FakeCuMemAllocator, LoadedModel, digest_at, load_state

from coldsnap_core.copy.base import SourceName
from coldsnap_core.copy.host import HostCopyBackend
from coldsnap_core.errors import ConfigurationError, CopyBackendError, ObserverError, WakeError
from coldsnap_core.format.manifest import NATIVE_MANIFEST_FILENAME, ModelIdentity, NativeManifest
from coldsnap_core.load_policy import ModelWrite as ObservedModelWrite
from coldsnap_vllm.sleep import ColdsnapSleepBackend
from coldsnap_vllm.state import WorkerLoadState

SMOLLM2_2LAYER_PACK_SHA256 = "b5a02a03cd57b72df32f33a3822006fb012818690d609dfca6a8e0265a05d407"
"""Golden: the canonical pack of the 2-layer SmolLM2 fixture's 20 tensors (equal to the portable
capture's pack of the same checkpoint, see test_sleep_capture.py)."""


class FailingCopy(HostCopyBackend):
    """The host copy backend, failing once on one op (fault injection).

    Args:
        source: ``pack`` or ``blob``.
        extent_index: the op's extent index.
    """

    def __init__(self, source: SourceName, extent_index: int) -> None:
        super().__init__(threads=1)
        self.target = (source, extent_index)
        self.fired = False

    def fill(self, ops, sources, allocations, *, verify_extents):  # type: ignore[override]
        for i, op in enumerate(ops):
            if not self.fired and (op.source, op.extent_index) == self.target:
                self.fired = True
                super().fill(ops[:i], sources, allocations, verify_extents=verify_extents)
                raise CopyBackendError(
                    f"copying {op.source} extent {op.extent_index} failed: injected I/O error",
                    file=sources[op.source],
                    allocation=op.allocation_index,
                    offset_bytes=op.offset_bytes,
                )
        super().fill(ops, sources, allocations, verify_extents=verify_extents)


def make_backend(
    state: WorkerLoadState | None, allocator: FakeCuMemAllocator, copy: HostCopyBackend | None = None
) -> ColdsnapSleepBackend:
    copy = copy or HostCopyBackend()
    return ColdsnapSleepBackend(allocator=allocator, backend_factory=lambda device: copy, load_state=lambda: state)


@pytest.fixture
def state(loaded: LoadedModel, smollm2_identity: ModelIdentity, tmp_path: Path) -> WorkerLoadState:
    return load_state(loaded, smollm2_identity, tmp_path)


def test_level1_cycle_restores_every_segment_byte_for_byte(
    loaded: LoadedModel, allocator: FakeCuMemAllocator, state: WorkerLoadState
) -> None:
    """suspend(1) + resume() restores every weights segment (tensors, buffers, slack) at the same
    address; the runtime tag comes back from vLLM's host backup, kv_cache is discarded. Fails if
    any byte class is lost (residual), if weights are backed up to host memory, or if the capture
    point, addresses or pack digest change."""
    before = allocator.digests("weights")
    runtime = allocator.digests("runtime")
    backend = make_backend(state, allocator)
    assert backend.state() == "RUNNING"

    backend.suspend(1)

    assert backend.state() == "SUSPENDED"
    assert allocator.calls == [("sleep", ("runtime", "cudagraph"))]
    weights = [allocator.pointer_to_data[a] for a in allocator.addresses("weights")]
    assert all(d.is_asleep and d.cpu_backup_tensor is None for d in weights)
    assert allocator.pointer_to_data[allocator.addresses("runtime")[0]].cpu_backup_tensor is not None
    capture = backend.capture
    assert capture is not None
    assert capture.capsule_dir.parent == state.state_root / "sleep"
    assert re.fullmatch(rf"worker-0-of-1-pid{os.getpid()}-[0-9a-f]{{16}}", capture.capsule_dir.name)
    assert (state.state_root / "sleep" / f"{capture.capsule_dir.name}.lock").is_file()
    on_disk = NativeManifest.read(capture.capsule_dir / NATIVE_MANIFEST_FILENAME)
    assert on_disk == capture.manifest
    assert on_disk.capture_point == "native"
    assert [a.address for a in on_disk.allocations.allocations] == allocator.addresses("weights")
    assert {a.tag for a in on_disk.allocations.allocations} == {"weights"}
    assert on_disk.pack.sha256 == SMOLLM2_2LAYER_PACK_SHA256
    assert len(on_disk.model_extents) == len(loaded.writes) == 20
    assert capture.pack_written and not capture.rewritten

    backend.resume(None)

    assert backend.state() == "RUNNING"
    assert allocator.digests("weights") == before
    assert allocator.digests("runtime") == runtime
    assert backend.last_report is not None
    assert backend.last_report.model_bytes == sum(w.size_bytes for w in loaded.writes)
    assert backend.last_report.model_bytes + backend.last_report.residual_bytes == sum(
        allocator.pointer_to_data[a].handle[1] for a in allocator.addresses("weights")
    )


def test_second_sleep_and_second_wake_are_no_ops_for_the_weights(
    loaded: LoadedModel, allocator: FakeCuMemAllocator, state: WorkerLoadState
) -> None:
    """A second suspend keeps the capsule (same blob inode, nothing recaptured from released memory)
    and a second resume does not call the allocator or rewrite anything. Fails if a repeated sleep
    reads released segments (it would crash) or recaptures, or a repeated wake re-hydrates."""
    before = allocator.digests()
    backend = make_backend(state, allocator)
    backend.suspend(1)
    blob = backend.capture.blob_path
    inode = os.stat(blob).st_ino
    backend.suspend(1)
    assert os.stat(blob).st_ino == inode
    assert backend.state() == "SUSPENDED"
    backend.resume(None)
    report = backend.last_report
    calls = len(allocator.calls)
    backend.resume(None)
    assert len(allocator.calls) == calls
    assert backend.last_report is report
    assert backend.state() == "RUNNING"
    assert allocator.digests() == before


def test_copy_failure_at_extent_k_names_it_and_the_retry_succeeds(
    loaded: LoadedModel, allocator: FakeCuMemAllocator, state: WorkerLoadState
) -> None:
    """A copy failing at model extent 7 raises WakeError naming that extent, its allocation and
    offset; the backend is not RUNNING and keeps every segment marked; the next wake hydrates all of
    them. Fails if a failed wake reports awake, loses the pending set, or the retry skips segments."""
    before = allocator.digests()
    copy = FailingCopy("pack", 7)
    backend = make_backend(state, allocator, copy)
    backend.suspend(1)
    extent = backend.capture.manifest.model_extents[7]

    with pytest.raises(WakeError) as raised:
        backend.resume(None)

    message = str(raised.value)
    assert "pack extent 7" in message and "injected I/O error" in message and "the next wake starts over" in message
    assert raised.value.allocation == extent.allocation_index
    assert raised.value.offset_bytes == extent.offset_bytes
    assert backend.state() == "SUSPENDED"
    assert backend.needs_hydration == set(allocator.addresses("weights"))
    assert allocator.digests() != before  # the segments are mapped and hold garbage and partial copies

    backend.resume(None)

    assert backend.state() == "RUNNING"
    assert backend.needs_hydration == frozenset()
    assert allocator.digests() == before


def test_allocator_map_failure_is_a_wake_error_and_the_retry_succeeds(
    loaded: LoadedModel, allocator: FakeCuMemAllocator, state: WorkerLoadState
) -> None:
    """vLLM's create_and_map failing on the third weights segment gives WakeError; the segments the
    allocator mapped before the failure are remembered, and the next wake maps the rest and hydrates
    all. Fails if the backend records only still-asleep segments on the retry."""
    before = allocator.digests()
    backend = make_backend(state, allocator)
    backend.suspend(1)
    allocator.fail_map.add(allocator.addresses("weights")[2])
    with pytest.raises(WakeError, match="could not map the weights segments again"):
        backend.resume(None)
    assert backend.state() == "SUSPENDED"
    backend.resume(None)
    assert allocator.digests() == before


def test_corrupt_blob_stops_the_wake_before_any_copy_then_the_repaired_blob_wakes(
    loaded: LoadedModel, allocator: FakeCuMemAllocator, state: WorkerLoadState
) -> None:
    """Hydration's checks run before a byte is copied: a flipped blob byte gives WakeError with rule
    residual-sha256 and the blob's path; restoring the byte lets the next wake succeed. Fails if the
    blob is not verified or a failed check leaves the backend RUNNING."""
    before = allocator.digests()
    backend = make_backend(state, allocator)
    backend.suspend(1)
    blob = backend.capture.blob_path
    original = blob.read_bytes()
    os.chmod(blob, 0o644)
    blob.write_bytes(bytes([original[0] ^ 1]) + original[1:])
    with pytest.raises(WakeError, match="rule residual-sha256 failed") as raised:
        backend.resume(None)
    assert raised.value.file == str(blob)
    assert backend.state() == "SUSPENDED"
    blob.write_bytes(original)
    backend.resume(None)
    assert allocator.digests() == before


def test_missing_pack_is_a_wake_error(loaded: LoadedModel, allocator: FakeCuMemAllocator, state: WorkerLoadState) -> None:
    """The pack removed from the node-local cache while asleep: WakeError with rule object-present.
    Fails if a wake proceeds without its pack."""
    backend = make_backend(state, allocator)
    backend.suspend(1)
    backend.capture.pack_path.unlink()
    with pytest.raises(WakeError, match="rule object-present failed"):
        backend.resume(None)
    assert backend.state() == "SUSPENDED"


def test_post_processing_rewrite_becomes_residual_and_the_wake_restores_it(
    loaded: LoadedModel, allocator: FakeCuMemAllocator, state: WorkerLoadState
) -> None:
    """Bytes rewritten after load_weights (in-place post-processing of part of a tensor) are not
    model bytes: that write's range is covered by residual extents, the pack no longer holds it
    (its digest changes), and the wake restores the rewritten bytes. Fails if a stale extent goes
    to the pack (the wake would restore checkpoint bytes instead of the post-processed ones)."""
    name = "model.layers.0.mlp.down_proj.weight"
    address, size = loaded.tensors[name]
    ctypes.memset(address + 1000, 0x3C, 5000)
    rewritten = digest_at(address, size)
    before = allocator.digests()
    backend = make_backend(state, allocator)

    backend.suspend(1)

    manifest = backend.capture.manifest
    assert [r.provenance.tensor_name for r in backend.capture.rewritten] == [name]
    segment = next(a for a in manifest.allocations.allocations if a.address <= address < a.address + a.size_bytes)
    offset = address - segment.address
    assert not any(
        e.allocation_index == segment.index and e.offset_bytes < offset + size and offset < e.end_bytes
        for e in manifest.model_extents
    )
    covered = sum(
        min(e.end_bytes, offset + size) - max(e.offset_bytes, offset)
        for e in manifest.residual_extents
        if e.allocation_index == segment.index and e.offset_bytes < offset + size and offset < e.end_bytes
    )
    assert covered == size
    assert manifest.pack.sha256 != SMOLLM2_2LAYER_PACK_SHA256

    backend.resume(None)

    assert digest_at(address, size) == rewritten
    assert allocator.digests() == before


def test_suspend_without_loader_state_releases_nothing(allocator: FakeCuMemAllocator, loaded: LoadedModel) -> None:
    """No coldsnap loader state in the process: ConfigurationError before anything is released.
    Fails if the backend sleeps without being able to wake."""
    backend = make_backend(None, allocator)
    with pytest.raises(ConfigurationError, match="--load-format coldsnap"):
        backend.suspend(1)
    assert allocator.calls == []
    assert backend.state() == "RUNNING"
    assert not any(d.is_asleep for d in allocator.pointer_to_data.values())


def test_write_straddling_a_segment_end_is_refused_before_release(
    loaded: LoadedModel, allocator: FakeCuMemAllocator, smollm2_identity: ModelIdentity, tmp_path: Path
) -> None:
    """An observed write running past its segment's end is an observer bug: ObserverError naming the
    segment and offset, and the model stays awake."""
    first = allocator.addresses("weights")[0]
    size = allocator.pointer_to_data[first].handle[1]
    bad = ObservedModelWrite(first + size - 256, 512, loaded.writes[0].provenance)
    writes = [w for w in loaded.writes if not (w.address < bad.address + 512 and bad.address < w.address + w.size_bytes)]
    backend = make_backend(load_state(loaded, smollm2_identity, tmp_path, writes=[*writes, bad]), allocator)
    with pytest.raises(ObserverError, match="beyond weights segment 0") as raised:
        backend.suspend(1)
    assert raised.value.allocation == 0 and raised.value.offset_bytes == size - 256
    assert allocator.calls == [] and backend.state() == "RUNNING"


def test_level2_discards_weights_without_capture_or_hydration(
    loaded: LoadedModel, allocator: FakeCuMemAllocator, state: WorkerLoadState
) -> None:
    """Level 2 keeps vLLM's semantics: no capsule, weights released without backup, and the wake
    only re-maps them (the caller reloads). Fails if level 2 captures or hydrates."""
    backend = make_backend(state, allocator)
    backend.suspend(2)
    assert backend.capture is None
    assert not (state.state_root / "sleep").exists()
    assert allocator.calls == [("sleep", ("runtime", "cudagraph"))]
    backend.resume(None)
    assert backend.last_report is None
    assert backend.state() == "RUNNING"
    assert all(not d.is_asleep for d in allocator.pointer_to_data.values())


def test_partial_wake_defers_the_weights_until_they_are_woken(
    loaded: LoadedModel, allocator: FakeCuMemAllocator, state: WorkerLoadState
) -> None:
    """resume(["kv_cache"]) leaves the weights asleep (deferrable tag) and the backend SUSPENDED;
    resume(["weights"]) then hydrates them. Fails if a kv-only wake touches or reports the weights."""
    before = allocator.digests()
    backend = make_backend(state, allocator)
    backend.suspend(1)
    backend.resume(["kv_cache"])
    assert backend.last_report is None
    assert backend.state() == "SUSPENDED"
    assert all(allocator.pointer_to_data[a].is_asleep for a in allocator.addresses("weights"))
    backend.resume(["weights"])
    assert backend.state() == "RUNNING"
    assert allocator.digests() == before


def test_sleeping_after_a_failed_wake_keeps_the_capsule_and_the_next_wake_restores(
    loaded: LoadedModel, allocator: FakeCuMemAllocator, state: WorkerLoadState
) -> None:
    """After a failed wake the segments hold garbage; a sleep then must not capture them: the blob
    stays the one from the first sleep and the following wake restores the original bytes."""
    before = allocator.digests()
    backend = make_backend(state, allocator, FailingCopy("blob", 3))
    backend.suspend(1)
    blob_digest = backend.capture.manifest.residual.sha256
    with pytest.raises(WakeError, match="blob extent 3"):
        backend.resume(None)
    backend.suspend(1)
    assert backend.capture.manifest.residual.sha256 == blob_digest
    assert all(allocator.pointer_to_data[a].is_asleep for a in allocator.addresses("weights"))
    backend.resume(None)
    assert allocator.digests() == before


def test_segment_size_change_while_asleep_is_a_wake_error(
    loaded: LoadedModel, allocator: FakeCuMemAllocator, state: WorkerLoadState
) -> None:
    """A captured segment whose size changed (a different allocator state) is refused by name before
    hydration. Fails if hydration writes into a segment of another size."""
    backend = make_backend(state, allocator)
    backend.suspend(1)
    address = allocator.addresses("weights")[1]
    data = allocator.pointer_to_data[address]
    data.handle = (data.handle[0], data.handle[1] // 2, data.handle[2], data.handle[3])
    with pytest.raises(WakeError, match=f"weights segment at {address:#x} is") as raised:
        backend.resume(None)
    assert raised.value.allocation == 1


def test_close_removes_the_sleep_capsule(loaded: LoadedModel, allocator: FakeCuMemAllocator, state: WorkerLoadState) -> None:
    """The sleep capsule is process-local: close() removes it. Fails if capsules accumulate."""
    backend = make_backend(state, allocator)
    backend.suspend(1)
    backend.resume(None)
    capsule = backend.capture.capsule_dir
    assert capsule.is_dir()
    backend.close()
    assert not capsule.exists()


def test_unsupported_level_is_refused(allocator: FakeCuMemAllocator) -> None:
    """Only levels 1 and 2 release memory; anything else is a ConfigurationError."""
    with pytest.raises(ConfigurationError, match="sleep level 3"):
        make_backend(None, allocator).suspend(3)


def test_discarding_the_weights_turns_the_next_wake_into_a_plain_remap(
    loaded: LoadedModel, allocator: FakeCuMemAllocator, state: WorkerLoadState
) -> None:
    """discard(("weights",)) after a level-1 capture means the caller will reload: the wake does not
    hydrate from the (now stale) capsule. Fails if stale bytes are written over a reload."""
    backend = make_backend(state, allocator)
    backend.suspend(1)
    backend.discard(("weights",))
    backend.resume(None)
    assert backend.last_report is None
    assert backend.state() == "RUNNING"


def test_state_is_resuming_while_hydrating(loaded: LoadedModel, allocator: FakeCuMemAllocator, state: WorkerLoadState) -> None:
    """state() says RESUMING while the segments are being filled, RUNNING only afterwards. Fails if
    the backend reports RUNNING before hydration finished."""
    seen = []

    class Watching(HostCopyBackend):
        def fill(self, ops, sources, allocations, *, verify_extents):  # type: ignore[override]
            seen.append(backend.state())
            super().fill(ops, sources, allocations, verify_extents=verify_extents)

    backend = make_backend(state, allocator, Watching())
    backend.suspend(1)
    backend.resume(None)
    assert seen == ["RESUMING"]
    assert backend.state() == "RUNNING"


def test_a_reloaded_model_with_another_state_root_replaces_the_old_capsule(
    loaded: LoadedModel, allocator: FakeCuMemAllocator, state: WorkerLoadState, tmp_path: Path
) -> None:
    """After a level-2 sleep and a reload, the loader may publish a new state (here another state
    root): the next level-1 capture goes there, the old capsule is removed, and the wake restores.
    Fails if capsules of earlier loads are left behind or the stale one is used."""
    current = [state]
    before = allocator.digests()
    backend = ColdsnapSleepBackend(
        allocator=allocator, backend_factory=lambda device: HostCopyBackend(), load_state=lambda: current[0]
    )
    backend.suspend(1)
    backend.resume(None)
    old = backend.capture.capsule_dir
    current[0] = dataclasses.replace(state, state_root=tmp_path / "elsewhere")
    backend.suspend(1)
    assert not old.exists()
    assert backend.capture.capsule_dir.parent.parent == tmp_path / "elsewhere"
    backend.resume(None)
    assert allocator.digests() == before
    backend.close()
    assert not backend.capture.capsule_dir.exists()


class RecordingCopy(HostCopyBackend):
    """The host copy backend, recording the ``verify_extents`` of every ``fill``."""

    def __init__(self) -> None:
        super().__init__(threads=1)
        self.verify_extents: list[bool] = []

    def fill(self, ops, sources, allocations, *, verify_extents):  # type: ignore[override]
        self.verify_extents.append(verify_extents)
        super().fill(ops, sources, allocations, verify_extents=verify_extents)


@pytest.mark.parametrize(("published", "explicit", "expected"), [(True, None, True), (False, None, False), (True, False, False)])
def test_the_wake_hashes_extents_as_the_loaders_resolved_setting_says(
    loaded: LoadedModel, allocator: FakeCuMemAllocator, state: WorkerLoadState, monkeypatch, published, explicit, expected
) -> None:
    """The wake's extent verification is the loader's resolved ``verify_extents`` (an extra-config key
    wins over ``COLDSNAP_VERIFY_EXTENTS``), published with its load state, never the backend's own read
    of the environment (here the variable says the opposite); an explicit constructor argument wins.
    Fails if the backend reads ``COLDSNAP_VERIFY_EXTENTS`` itself (the extra-config key was then ignored
    at wake)."""
    monkeypatch.setenv("COLDSNAP_VERIFY_EXTENTS", "0" if published else "1")
    copy = RecordingCopy()
    backend = ColdsnapSleepBackend(
        allocator=allocator,
        backend_factory=lambda device: copy,
        load_state=lambda: dataclasses.replace(state, verify_extents=published),
        verify_extents=explicit,
    )
    before = allocator.digests()
    backend.suspend(1)
    backend.resume(None)
    assert allocator.digests() == before
    assert copy.verify_extents and set(copy.verify_extents) == {expected}
    backend.close()
