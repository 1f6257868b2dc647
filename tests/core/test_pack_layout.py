"""The canonical pack layout: golden bytes for fixed contents, sort order, 4096 alignment, zero padding,
deduplication, the end-of-file rule, the empty pack, and the verifier's streaming over chunk boundaries.

The synthetic slabs here exercise the edge cases a real checkpoint does not have: a zero-size
allocation, an allocation without any model extent, one content held by two destinations, a content
whose size is an exact multiple of 4096, and a 10-byte content.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from core_support import Captured, capture, live_allocations
from slabs import allocate

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.capture.payload import ModelRange, plan_manifest_payload
from coldsnap_core.copy.host import HostCopyBackend
from coldsnap_core.errors import ExtentDigestMismatchError, NonZeroPaddingError, PackDigestMismatchError
from coldsnap_core.format.allocation import Allocation, AllocationMap
from coldsnap_core.format.extents import ExtentProvenance
from coldsnap_core.format.pack_layout import PACK_ALIGNMENT_BYTES, PackEntry, PackLayout, align_up
from coldsnap_core.format.verify import check_manifest, extent_owner_map, verify_pack_file
from coldsnap_core.restore.hydrate import hydrate

EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"

# Contents: A (5000 bytes), B (10 bytes), D (4096 bytes, an exact multiple of the alignment); C == A.
CONTENT_A = bytes((i * 7 + 3) & 0xFF for i in range(5000))
CONTENT_B = b"0123456789"
CONTENT_D = bytes((i * 13 + 1) & 0xFF for i in range(4096))

GOLDEN_SYNTHETIC_PACK_SHA256 = "8a30d7408a115f2311689d5ba95beebbbbd604c335c7107d5dfe196cb6b2ec61"
"""Pinned digest of the synthetic pack (independently recomputed in the test, then compared to this)."""


def _provenance(name: str, size: int) -> ExtentProvenance:
    return ExtentProvenance("synthetic.safetensors", name, 0, size, size, size, False)


def synthetic_slabs() -> tuple[AllocationMap, list[np.ndarray], list[ModelRange]]:
    """Four allocations: 0 holds A and B with residual bytes around them, 1 is empty, 2 is all
    residual, 3 holds C (== A) and D back to back with no residual byte at all."""
    sizes = [10_000, 0, 3000, 9096]
    arrays = [np.full(n, 0x5A, dtype=np.uint8) for n in sizes]
    arrays[2][:] = np.arange(3000) % 251
    arrays[0][0:5000] = np.frombuffer(CONTENT_A, dtype=np.uint8)
    arrays[0][5100:5110] = np.frombuffer(CONTENT_B, dtype=np.uint8)
    arrays[3][0:5000] = np.frombuffer(CONTENT_A, dtype=np.uint8)
    arrays[3][5000:9096] = np.frombuffer(CONTENT_D, dtype=np.uint8)
    ranges = [
        ModelRange(0, 0, 5000, _provenance("a", 5000)),
        ModelRange(0, 5100, 10, _provenance("b", 10)),
        ModelRange(3, 0, 5000, _provenance("c", 5000)),
        ModelRange(3, 5000, 4096, _provenance("d", 4096)),
    ]
    allocation_map = AllocationMap(tuple(Allocation(i, n, "slab", None, ()) for i, n in enumerate(sizes)))
    return allocation_map, arrays, ranges


def expected_pack(contents: list[bytes]) -> bytes:
    """The documented layout, written independently of coldsnap: distinct contents sorted by
    (sha256 hex, size), each at the next multiple of 4096, zero padding, file rounded up to 4096."""
    out = bytearray()
    for content in sorted(set(contents), key=lambda c: (hashlib.sha256(c).hexdigest(), len(c))):
        out += content
        out += bytes(-len(out) % 4096)
    return bytes(out)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> tuple[Captured, list[np.ndarray]]:
    allocation_map, arrays, ranges = synthetic_slabs()
    return capture(tmp_path_factory.mktemp("synthetic"), allocation_map, live_allocations(arrays), ranges), arrays


def test_golden_layout_of_fixed_contents(synthetic) -> None:
    """Catches any change to the byte layout (order, alignment, padding, dedup, end of file): the pack
    equals an independent construction of the documented rules, byte for byte, and its digest is
    pinned."""
    captured, _ = synthetic
    data = captured.pack_path.read_bytes()
    assert data == expected_pack([CONTENT_A, CONTENT_B, CONTENT_A, CONTENT_D])
    assert len(data) == 4 * 4096  # A: 2 pages, B: 1 page, D: exactly 1 page, no page for C
    assert hashlib.sha256(data).hexdigest() == captured.manifest.pack.sha256 == GOLDEN_SYNTHETIC_PACK_SHA256


def test_identical_extents_are_stored_once_and_both_point_to_it(synthetic) -> None:
    """Catches a dedup regression: two destinations holding the same bytes (A in allocation 0 and C in
    allocation 3) get one stored copy, and both model extents carry its pack offset and digest."""
    captured, _ = synthetic
    extents = captured.manifest.model_extents
    a, c = extents[0], extents[2]
    assert (a.allocation_index, c.allocation_index) == (0, 3)
    assert a.sha256 == c.sha256 == hashlib.sha256(CONTENT_A).hexdigest()
    assert a.pack_offset_bytes == c.pack_offset_bytes
    assert len({e.pack_offset_bytes for e in extents}) == 3
    assert captured.pack_path.read_bytes()[a.pack_offset_bytes : a.pack_offset_bytes + 5000] == CONTENT_A


def test_extents_are_sorted_by_digest_and_aligned(synthetic) -> None:
    """Catches ordering by allocation or by first appearance instead of (sha256, size), and a missing
    4096 alignment: stored contents appear in digest order, each at a multiple of 4096."""
    captured, _ = synthetic
    stored = sorted({(e.pack_offset_bytes, e.sha256, e.size_bytes) for e in captured.manifest.model_extents})
    assert [(s, n) for _, s, n in stored] == sorted((s, n) for _, s, n in stored)
    assert all(offset % PACK_ALIGNMENT_BYTES == 0 for offset, _, _ in stored)
    assert stored[0][0] == 0


def test_residual_map_is_the_complement_in_map_order(synthetic) -> None:
    """Catches a residual map that misses bytes around model extents, invents extents in a zero-size
    allocation or in an allocation fully covered by model extents, or stores the blob out of order."""
    captured, arrays = synthetic
    residual = [
        (e.allocation_index, e.offset_bytes, e.size_bytes, e.blob_offset_bytes) for e in captured.manifest.residual_extents
    ]
    assert residual == [(0, 5000, 100, 0), (0, 5110, 4890, 100), (2, 0, 3000, 4990)]
    expected_blob = arrays[0][5000:5100].tobytes() + arrays[0][5110:].tobytes() + arrays[2].tobytes()
    assert captured.blob_path.read_bytes() == expected_blob
    assert captured.manifest.residual.size_bytes == len(expected_blob)


def test_synthetic_capture_hydrates_exactly(synthetic) -> None:
    """Catches a hydration that skips the second destination of a deduplicated content, an empty
    allocation, or an all-residual allocation."""
    captured, arrays = synthetic
    fresh = allocate(captured.manifest.allocations)
    hydrate(
        captured.manifest,
        blob_path=captured.blob_path,
        cache=captured.cache,
        allocations=live_allocations(fresh),
        backend=HostCopyBackend(threads=2, chunk_bytes=4096),
        verify_extents=True,
    )
    for got, want in zip(fresh, arrays, strict=True):
        assert np.array_equal(got, want)


def test_empty_pack_is_a_zero_byte_object(tmp_path) -> None:
    """Catches the end-of-file rule for no extents (a stray 4096-byte page) and a writer or cache that
    cannot handle an empty object: all bytes go to the blob, the pack is 0 bytes with the SHA-256 of
    nothing, and hydration restores everything from the blob."""
    arrays = [np.arange(5000, dtype=np.uint8), np.zeros(0, dtype=np.uint8)]
    allocation_map = AllocationMap((Allocation(0, 5000, "buffer", None, ()), Allocation(1, 0, "buffer", None, ())))
    captured = capture(tmp_path, allocation_map, live_allocations(arrays), [])
    manifest = captured.manifest
    assert (manifest.pack.sha256, manifest.pack.size_bytes) == (EMPTY_SHA256, 0)
    assert captured.pack_path.stat().st_size == 0
    assert [(e.offset_bytes, e.size_bytes) for e in manifest.residual_extents] == [(0, 5000)]
    fresh = allocate(allocation_map)
    hydrate(
        manifest,
        blob_path=captured.blob_path,
        cache=captured.cache,
        allocations=live_allocations(fresh),
        backend=HostCopyBackend(),
    )
    assert np.array_equal(fresh[0], arrays[0])


def test_plan_orders_by_digest_then_size_and_rounds_the_end() -> None:
    """Catches sorting by size first, by insertion order, or a pack size not rounded up to 4096 (the
    end-of-file rule); equal (sha256, size) pairs are one entry."""
    layout = PackLayout.plan([("b" * 64, 10), ("a" * 64, 4097), ("b" * 64, 5), ("a" * 64, 4097), ("0" * 64, 4096)])
    assert layout.entries == (
        PackEntry("0" * 64, 4096, 0),
        PackEntry("a" * 64, 4097, 4096),
        PackEntry("b" * 64, 5, 12288),
        PackEntry("b" * 64, 10, 16384),
    )
    assert layout.size_bytes == 20480
    assert list(layout.padding_ranges()) == [(8193, 4095), (12293, 4091), (16394, 4086)]
    assert PackLayout.plan([]) == PackLayout((), 0)
    assert [align_up(n) for n in (0, 1, 4095, 4096, 4097)] == [0, 4096, 4096, 4096, 8192]
    with pytest.raises(ValueError, match="never empty"):
        PackLayout.plan([("a" * 64, 0)])


@pytest.mark.parametrize("chunk_bytes", [3, 4095, 4096, 4097, 5000, 8192, 1 << 20])
def test_verifier_streams_across_chunk_boundaries(synthetic, chunk_bytes: int) -> None:
    """Catches off-by-one errors in the verifier's streaming: extents and padding runs that start, end
    or straddle chunk boundaries (chunks of 3 bytes up to larger than the pack) are hashed and checked
    exactly, so a valid pack passes at every chunk size."""
    captured, _ = synthetic
    layout = check_manifest(captured.manifest)
    seen = []
    verify_pack_file(captured.pack_path, captured.manifest.pack, layout, chunk_bytes=chunk_bytes, progress=seen.append)
    assert sum(seen) == captured.manifest.pack.size_bytes


def _corrupt_copy(captured: Captured, tmp_path, offset: int):
    data = bytearray(captured.pack_path.read_bytes())
    data[offset] ^= 0x01
    path = tmp_path / "corrupt.pack"
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("chunk_bytes", [3, 4096, 5003, 1 << 20])
@pytest.mark.parametrize("where", ["first-padding-byte", "last-padding-byte", "tail-padding-byte"])
def test_verifier_names_the_exact_non_zero_padding_byte(synthetic, tmp_path, chunk_bytes: int, where: str) -> None:
    """Catches padding left unchecked (hidden bytes in a pack whose digest was recomputed), and a wrong
    offset in the error, for padding bytes at run starts, run ends and the file's tail, at chunk
    sizes that put them on and off chunk boundaries."""
    captured, _ = synthetic
    layout = check_manifest(captured.manifest)
    runs = list(layout.padding_ranges())
    offset = {
        "first-padding-byte": runs[0][0],
        "last-padding-byte": runs[0][0] + runs[0][1] - 1,
        "tail-padding-byte": runs[-1][0] + runs[-1][1] - 1,
    }[where]
    path = _corrupt_copy(captured, tmp_path, offset)
    with pytest.raises(NonZeroPaddingError) as info:
        verify_pack_file(path, captured.manifest.pack, layout, chunk_bytes=chunk_bytes)
    assert info.value.offset_bytes == offset and f"pack offset {offset}" in str(info.value)
    assert info.value.rule == "pack-padding-zero" and str(path) in str(info.value)


@pytest.mark.parametrize("chunk_bytes", [3, 4096, 1 << 20])
def test_verifier_names_the_extent_whose_bytes_changed(synthetic, tmp_path, chunk_bytes: int) -> None:
    """Catches a verifier that only checks the whole-file digest (it would not say which destination
    is affected): a flipped byte inside the 5000-byte content (two pages, two destinations) raises
    ExtentDigestMismatchError naming the first destination holding it; without a layout the same file
    fails the whole-file digest."""
    captured, _ = synthetic
    manifest = captured.manifest
    layout = check_manifest(manifest)
    a = manifest.model_extents[0]
    path = _corrupt_copy(captured, tmp_path, a.pack_offset_bytes + 4500)
    with pytest.raises(ExtentDigestMismatchError) as info:
        verify_pack_file(path, manifest.pack, layout, chunk_bytes=chunk_bytes, extent_owner=extent_owner_map(manifest))
    assert (info.value.allocation, info.value.offset_bytes) == (0, 0)
    assert f"pack offset {a.pack_offset_bytes}" in str(info.value)
    with pytest.raises(PackDigestMismatchError):
        verify_pack_file(path, manifest.pack, chunk_bytes=chunk_bytes)


def test_pack_in_cache_is_named_by_its_digest(synthetic) -> None:
    """Catches a writer that names the object by anything but its content's SHA-256."""
    captured, _ = synthetic
    digest = hashlib.sha256(captured.pack_path.read_bytes()).hexdigest()
    assert captured.pack_path == PayloadCache(captured.state_root).object_path(digest)
    assert captured.manifest.pack.path == f"model-payloads/sha256/{digest}.pack"


def test_replanning_a_captured_manifest_gives_its_own_maps(synthetic) -> None:
    """Materialization re-plans the pack from a manifest (``plan_manifest_payload``) with the planner
    the capture used. Catches a divergence between the two (another locate rule, layout or residual
    map): the re-plan equals the captured manifest's layout and maps, and each content is read from
    the first destination holding it (A from allocation 0, not its duplicate C in allocation 3)."""
    captured, arrays = synthetic
    manifest = captured.manifest
    plan = plan_manifest_payload(manifest, live_allocations(arrays), HostCopyBackend())
    assert plan.layout == check_manifest(manifest)
    assert plan.model_extents == manifest.model_extents
    assert plan.residual_extents == manifest.residual_extents
    a = manifest.model_extents[0]
    allocation, offset_bytes = plan.locate[(a.sha256, a.size_bytes)]
    assert (allocation.index, offset_bytes) == (0, 0)
    assert len(plan.locate) == len(plan.layout.entries) == 3
