"""Acceptance sensitivities on the real SmolLM2 2-layer checkpoint.

Each test perturbs one thing (allocation order, addresses, one model byte, one residual byte, the
checkpoint's sharding, a tied weight written twice) and shows exactly which objects change.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from core_support import Captured, capture, live_allocations
from msgspec.structs import replace
from slabs import Slabs, allocate, stage_checkpoint

from coldsnap_core.copy.host import HostCopyBackend
from coldsnap_core.format.allocation import AllocationMap
from coldsnap_core.restore.hydrate import hydrate


def _extent_digests(captured: Captured) -> dict[str, str]:
    """tensor name -> SHA-256 of its model extent."""
    return {e.provenance.tensor_name: e.sha256 for e in captured.manifest.model_extents}


def test_reversed_allocation_order_and_other_slab_layout_keep_the_pack(
    smollm2_2layer: Path, captured_2layer: Captured, tmp_path: Path
) -> None:
    """Catches a pack whose bytes depend on allocation order or placement (e.g. written in map order):
    tensors laid out in reverse, over 3 slabs instead of 4, with 1000-byte gaps, give a different
    layout fingerprint and residual blob but the same pack, byte for byte."""
    other = stage_checkpoint(smollm2_2layer, slab_count=3, gap_bytes=1000, reverse=True)
    assert next(t.name for a in other.allocation_map.allocations for t in a.tensors) != "model.embed_tokens.weight"
    got = capture(tmp_path, other.allocation_map, other.allocations, other.model_ranges)
    base = captured_2layer.manifest
    assert got.manifest.pack == base.pack
    assert got.pack_path.read_bytes() == captured_2layer.pack_path.read_bytes()
    assert got.manifest.layout_fingerprint != base.layout_fingerprint
    assert got.manifest.residual.sha256 != base.residual.sha256
    assert len(got.manifest.allocations) == 3 and _extent_digests(got) == _extent_digests(captured_2layer)


def test_other_addresses_keep_the_pack(staged_2layer: Slabs, captured_2layer: Captured, tmp_path: Path) -> None:
    """Catches a pack or fingerprint that depends on virtual addresses: the same slabs copied to other
    memory, with the addresses recorded in the allocation map (as the native capture point does),
    give the same pack digest and layout fingerprint."""
    moved = tuple(a.copy() for a in staged_2layer.arrays)
    live = live_allocations(moved)
    assert [a.address for a in live] != [a.address for a in staged_2layer.allocations]
    with_addresses = AllocationMap(
        tuple(replace(a, address=la.address) for a, la in zip(staged_2layer.allocation_map.allocations, live, strict=True))
    )
    got = capture(tmp_path, with_addresses, live, staged_2layer.model_ranges, capture_point="native")
    assert got.manifest.pack == captured_2layer.manifest.pack
    assert got.manifest.layout_fingerprint == captured_2layer.manifest.layout_fingerprint
    assert [a.address for a in got.manifest.allocations.allocations] == [a.address for a in live]


def test_one_flipped_model_byte_changes_the_pack_and_only_that_extent(
    smollm2_2layer: Path, captured_2layer: Captured, tmp_path: Path
) -> None:
    """Catches an extent digest computed over the wrong range (or shared between extents) and a pack
    digest blind to content: flipping one byte inside one tensor changes the pack digest and exactly
    that tensor's extent SHA-256; the other 19 extents, the blob and the layout are unchanged."""
    slabs = stage_checkpoint(smollm2_2layer)
    target = next(r for r in slabs.model_ranges if r.provenance.tensor_name == "model.layers.1.mlp.down_proj.weight")
    slabs.arrays[target.allocation_index][target.offset_bytes + target.size_bytes // 2] ^= 0x01
    got = capture(tmp_path, slabs.allocation_map, slabs.allocations, slabs.model_ranges)
    base = captured_2layer.manifest
    assert got.manifest.pack.sha256 != base.pack.sha256
    before, after = _extent_digests(captured_2layer), _extent_digests(got)
    assert {name for name in before if before[name] != after[name]} == {"model.layers.1.mlp.down_proj.weight"}
    assert got.manifest.residual == base.residual
    assert got.manifest.layout_fingerprint == base.layout_fingerprint


def test_one_flipped_residual_byte_changes_only_the_blob(smollm2_2layer: Path, captured_2layer: Captured, tmp_path: Path) -> None:
    """Catches residual bytes leaking into the pack (a pack that would not be shareable across targets):
    flipping one non-checkpoint byte between two tensors leaves the pack and every extent digest
    unchanged and changes the blob in exactly that byte."""
    slabs = stage_checkpoint(smollm2_2layer)
    gap = captured_2layer.manifest.residual_extents[5]
    slabs.arrays[gap.allocation_index][gap.offset_bytes + 3] ^= 0xFF
    got = capture(tmp_path, slabs.allocation_map, slabs.allocations, slabs.model_ranges)
    base = captured_2layer.manifest
    assert got.manifest.pack == base.pack
    assert got.pack_path.read_bytes() == captured_2layer.pack_path.read_bytes()
    assert got.manifest.model_extents == base.model_extents
    assert got.manifest.residual.sha256 != base.residual.sha256
    old, new = (
        np.frombuffer(captured_2layer.blob_path.read_bytes(), np.uint8),
        np.frombuffer(got.blob_path.read_bytes(), np.uint8),
    )
    assert np.flatnonzero(old != new).tolist() == [gap.blob_offset_bytes + 3]


@pytest.mark.parametrize("verify_extents", [False, True])
def test_capture_then_hydrate_into_fresh_slabs_reproduces_every_byte(
    staged_2layer: Slabs, captured_2layer: Captured, verify_extents: bool
) -> None:
    """Catches any byte lost between capture and hydration (model or residual, any slab): fresh
    zero-filled slabs hydrated from the pack and blob have the same (shape, dtype, sha256) fingerprint
    for every tensor and are equal to the staged slabs byte for byte."""
    fresh = allocate(staged_2layer.allocation_map)
    report = hydrate(
        captured_2layer.manifest,
        blob_path=captured_2layer.blob_path,
        cache=captured_2layer.cache,
        allocations=live_allocations(fresh),
        backend=HostCopyBackend(),
        live_layout=staged_2layer.allocation_map,
        verify_extents=verify_extents,
    )
    hydrated = Slabs(staged_2layer.allocation_map, fresh, staged_2layer.model_ranges)
    assert hydrated.fingerprints() == staged_2layer.fingerprints()
    assert len(hydrated.fingerprints()) == 20
    for got, want in zip(fresh, staged_2layer.arrays, strict=True):
        assert np.array_equal(got, want)
    assert report.model_bytes + report.residual_bytes == staged_2layer.allocation_map.total_bytes


def test_fingerprint_sees_a_dtype_reinterpretation(staged_2layer: Slabs) -> None:
    """Catches a fingerprint that hashes values instead of bytes or ignores the dtype: the same bytes
    declared float16 instead of bfloat16 change the fingerprint."""
    allocation = staged_2layer.allocation_map.allocations[1]
    relabelled = replace(allocation, tensors=(replace(allocation.tensors[0], dtype="float16"), *allocation.tensors[1:]))
    allocations = list(staged_2layer.allocation_map.allocations)
    allocations[1] = relabelled
    other = Slabs(AllocationMap(tuple(allocations)), staged_2layer.arrays, staged_2layer.model_ranges)
    name = allocation.tensors[0].name
    assert other.fingerprints()[name][2] == staged_2layer.fingerprints()[name][2]
    assert other.fingerprints()[name] != staged_2layer.fingerprints()[name]
    assert other.allocation_map.layout_fingerprint() != staged_2layer.allocation_map.layout_fingerprint()


def test_sharded_checkpoint_gives_the_same_pack(smollm2_2layer_3shards: Path, captured_2layer: Captured, tmp_path: Path) -> None:
    """Catches a pack that depends on where the bytes came from (file, header offsets) rather than on
    the bytes: the same weights split over 3 safetensors files give the same pack digest, and the
    provenance names the three files."""
    slabs = stage_checkpoint(smollm2_2layer_3shards)
    got = capture(tmp_path, slabs.allocation_map, slabs.allocations, slabs.model_ranges)
    assert got.manifest.pack == captured_2layer.manifest.pack
    assert len({e.provenance.checkpoint_file for e in got.manifest.model_extents}) == 3


def test_tied_weight_written_twice_is_stored_once(smollm2_2layer_untied: Path, captured_2layer: Captured, tmp_path: Path) -> None:
    """Catches a dedup regression on real data: the untied checkpoint's explicit lm_head.weight is a
    copy of the embedding, so it adds a model extent but not a byte to the pack (same digest)."""
    slabs = stage_checkpoint(smollm2_2layer_untied)
    got = capture(tmp_path, slabs.allocation_map, slabs.allocations, slabs.model_ranges)
    extents = {e.provenance.tensor_name: e for e in got.manifest.model_extents}
    assert len(extents) == len(captured_2layer.manifest.model_extents) + 1
    head, embed = extents["lm_head.weight"], extents["model.embed_tokens.weight"]
    assert (head.sha256, head.pack_offset_bytes) == (embed.sha256, embed.pack_offset_bytes)
    assert head.allocation_index != embed.allocation_index or head.offset_bytes != embed.offset_bytes
    assert got.manifest.pack == captured_2layer.manifest.pack
    assert hashlib.sha256(got.pack_path.read_bytes()).hexdigest() == got.manifest.pack.sha256
