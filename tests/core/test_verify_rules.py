"""Every verification rule, produced on a real SmolLM2 capture and caught by hydration before a byte
is written (gap, overlap, size change, digest/path mismatch, non-zero
padding, truncated pack, truncated blob, unknown version, ... each its own error).

Each case corrupts one thing in a copy of the capture, hydrates into zero-filled slabs, and checks
the exception class, its rule, that its message names the file, allocation and offset where they
apply, and that the destinations are still all zero.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from core_support import Captured, copy_capture, edit_json, flip_byte, live_allocations
from slabs import Slabs, allocate, stage_checkpoint

from coldsnap_core import errors
from coldsnap_core.cache.records import write_record
from coldsnap_core.copy.host import HostCopyBackend
from coldsnap_core.digests import pack_relpath
from coldsnap_core.format.manifest import NativeManifest
from coldsnap_core.format.verify import check_manifest
from coldsnap_core.restore.hydrate import hydrate


@dataclass
class Setup:
    """What a case hands to hydrate (defaults: the copy's own files and fresh slabs)."""

    captured: Captured
    slabs: Slabs
    arrays: list[np.ndarray] = field(default_factory=list)
    live_layout: Any = "default"
    verify_extents: bool = False


def _edit_manifest(edit: Callable[[dict], object]) -> Callable[[Setup], None]:
    return lambda s: edit_json(s.captured.manifest_path, edit)


def _swap_model_extents(doc: dict) -> None:
    doc["model_extents"][0], doc["model_extents"][1] = doc["model_extents"][1], doc["model_extents"][0]


def _swap_pack_offsets(doc: dict) -> None:
    a, b = doc["model_extents"][0], doc["model_extents"][1]
    assert a["pack_offset_bytes"] != b["pack_offset_bytes"]
    a["pack_offset_bytes"], b["pack_offset_bytes"] = b["pack_offset_bytes"], a["pack_offset_bytes"]


def _grow_live_allocation(s: Setup) -> None:
    s.arrays[2] = np.zeros(s.arrays[2].nbytes + 1, dtype=np.uint8)
    s.live_layout = None  # sizes only, as at the native capture point


def _drop_live_allocation(s: Setup) -> None:
    s.arrays.pop()
    s.live_layout = None


def _nonzero_padding_renamed(s: Setup) -> None:
    """A pack with a non-zero padding byte whose digest and path were recomputed to match it: the
    object is intact (it hashes to its name), so the manifest that names it while its layout puts
    padding on that byte is what is wrong (``manifest-pack-padding``, exit 2; the object is kept)."""
    manifest = s.captured.manifest
    layout = check_manifest(manifest)
    start, _ = next(iter(layout.padding_ranges()))
    old = s.captured.pack_path
    flip_byte(old, start)
    digest = hashlib.sha256(old.read_bytes()).hexdigest()
    os.rename(old, s.captured.cache.object_path(digest))
    s.captured.cache.record_path(manifest.pack.sha256).unlink()

    def repoint(doc: dict) -> None:
        doc["pack"]["sha256"] = digest
        doc["pack"]["path"] = pack_relpath(digest)

    edit_json(s.captured.manifest_path, repoint)


def _truncate(path_of: Callable[[Captured], Path], by: int) -> Callable[[Setup], None]:
    def corrupt(s: Setup) -> None:
        path = path_of(s.captured)
        os.chmod(path, 0o644)
        os.truncate(path, path.stat().st_size - by)

    return corrupt


def _bit_rot_under_a_valid_record(s: Setup) -> None:
    """A model byte changes on the device after the object was verified (no inode field moves): the
    validation record still matches, so only per-extent verification can see it."""
    extent = s.captured.manifest.model_extents[3]
    flip_byte(s.captured.pack_path, extent.pack_offset_bytes + 100)
    write_record(s.captured.cache, s.captured.manifest.pack.sha256, os.stat(s.captured.pack_path))
    s.verify_extents = True


def _under_a_valid_record(s: Setup, offset: int) -> None:
    """A pack byte (here a padding byte) changes after the object was verified, under a record that
    still matches: the admitted pack's padding check finds it, a full re-check proves the file
    corrupt, and the object is quarantined."""
    flip_byte(s.captured.pack_path, offset)
    write_record(s.captured.cache, s.captured.manifest.pack.sha256, os.stat(s.captured.pack_path))


@dataclass(frozen=True)
class Case:
    id: str
    corrupt: Callable[[Setup], None]
    error: type[errors.ColdsnapError]
    names_allocation: bool
    copy_pack: bool = False
    words: str = ""
    before_copy: bool = True


CASES = [
    Case("gap", _edit_manifest(lambda d: d["residual_extents"].pop(1)), errors.CoverageGapError, True, words="neither map"),
    Case(
        "overlap",
        _edit_manifest(lambda d: d["residual_extents"][0].update(size_bytes=d["residual_extents"][0]["size_bytes"] + 1)),
        errors.ExtentOverlapError,
        True,
    ),
    Case(
        "extent-out-of-bounds",
        _edit_manifest(lambda d: d["residual_extents"][-1].update(size_bytes=d["residual_extents"][-1]["size_bytes"] + 1)),
        errors.ExtentBoundsError,
        True,
        words="beyond the allocation",
    ),
    Case(
        "extent-names-missing-allocation",
        _edit_manifest(lambda d: d["residual_extents"][-1].update(allocation_index=4)),
        errors.ExtentBoundsError,
        True,
        words="names allocation 4",
    ),
    Case("unsorted-extents", _edit_manifest(_swap_model_extents), errors.ExtentOrderError, True),
    Case("non-canonical-pack-offset", _edit_manifest(_swap_pack_offsets), errors.PackLayoutError, True, words="canonical"),
    Case(
        "non-canonical-pack-size",
        _edit_manifest(lambda d: d["pack"].update(size_bytes=d["pack"]["size_bytes"] + 4096)),
        errors.PackLayoutError,
        False,
    ),
    Case(
        "non-canonical-blob-offset",
        _edit_manifest(
            lambda d: d["residual_extents"][1].update(blob_offset_bytes=d["residual_extents"][1]["blob_offset_bytes"] + 1)
        ),
        errors.ResidualLayoutError,
        True,
    ),
    Case(
        "manifest-allocation-size-edited",
        _edit_manifest(lambda d: d["allocations"][1].update(size_bytes=d["allocations"][1]["size_bytes"] + 8)),
        errors.LayoutMismatchError,
        False,
        words="hashes to",
    ),
    Case(
        "pack-path-mismatch",
        _edit_manifest(lambda d: d["pack"].update(path=pack_relpath("0" * 64))),
        errors.PackPathMismatchError,
        False,
    ),
    Case("live-allocation-size-differs", _grow_live_allocation, errors.AllocationSizeMismatchError, True),
    Case("live-allocation-missing", _drop_live_allocation, errors.LayoutMismatchError, False, words="allocations"),
    Case("missing-pack", lambda s: s.captured.pack_path.unlink(), errors.MissingObjectError, False),
    Case("missing-blob", lambda s: s.captured.blob_path.unlink(), errors.MissingObjectError, False),
    Case("truncated-blob", _truncate(lambda c: c.blob_path, 1), errors.ResidualSizeMismatchError, False, words="truncated"),
    Case("blob-byte-flipped", lambda s: flip_byte(s.captured.blob_path, 7), errors.ResidualDigestMismatchError, False),
    Case("truncated-pack", _truncate(lambda c: c.pack_path, 4096), errors.PackSizeMismatchError, False, True, "truncated"),
    Case(
        "pack-byte-flipped",
        lambda s: flip_byte(s.captured.pack_path, s.captured.manifest.model_extents[0].pack_offset_bytes + 5),
        errors.PackDigestMismatchError,
        False,
        True,
    ),
    Case("non-zero-padding-renamed", _nonzero_padding_renamed, errors.ManifestPaddingError, False, True),
    Case(
        "non-zero-padding-under-a-valid-record",
        lambda s: _under_a_valid_record(s, next(iter(check_manifest(s.captured.manifest).padding_ranges()))[0]),
        errors.NonZeroPaddingError,
        False,
        True,
    ),
    Case("extent-digest-verify-extents", _bit_rot_under_a_valid_record, errors.ExtentDigestMismatchError, True, True, "", False),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_each_rule_stops_hydration_with_its_own_error(
    captured_2layer: Captured, staged_2layer: Slabs, tmp_path: Path, case: Case
) -> None:
    """Catches a rule that is no longer checked, checked after the copy, or reported with the wrong
    class or without its context: the corrupted capture raises exactly ``case.error`` (rule and exit
    code from its class), the message names the rule, the file and, for per-extent rules, the
    allocation and offset; and, for every rule checked before the copy, no destination byte changed."""
    captured = copy_capture(captured_2layer, tmp_path / "copy", copy_pack=case.copy_pack)
    setup = Setup(captured, staged_2layer, arrays=list(allocate(staged_2layer.allocation_map)))
    case.corrupt(setup)
    manifest = NativeManifest.read(captured.manifest_path)
    live_layout = staged_2layer.allocation_map if setup.live_layout == "default" else setup.live_layout
    with pytest.raises(errors.ColdsnapError) as info:
        hydrate(
            manifest,
            blob_path=captured.blob_path,
            cache=captured.cache,
            allocations=live_allocations(setup.arrays),
            backend=HostCopyBackend(),
            live_layout=live_layout,
            verify_extents=setup.verify_extents,
            manifest_file=str(captured.manifest_path),
        )
    error = info.value
    assert type(error) is case.error, error
    message = str(error)
    assert message.startswith(f"rule {case.error.rule} failed: ")
    assert error.file is not None and f"file={error.file}" in message
    assert Path(error.file).is_relative_to(tmp_path), "the file named is the copy's"
    assert case.words in message
    if case.names_allocation:
        assert error.allocation is not None and f"allocation={error.allocation}" in message
        assert error.offset_bytes is not None and f"offset_bytes={error.offset_bytes}" in message
    if case.before_copy:
        assert all(not a.any() for a in setup.arrays), "a check failed, yet bytes were written"


def test_live_layout_of_another_staging_is_refused_before_writing(captured_2layer: Captured, smollm2_2layer: Path) -> None:
    """Catches hydration into a model built differently (another gap size: same tensors, other
    offsets and sizes): LayoutMismatchError naming the first differing allocation, nothing written."""
    other = stage_checkpoint(smollm2_2layer, gap_bytes=256)
    arrays = allocate(other.allocation_map)
    with pytest.raises(errors.LayoutMismatchError) as info:
        hydrate(
            captured_2layer.manifest,
            blob_path=captured_2layer.blob_path,
            cache=captured_2layer.cache,
            allocations=live_allocations(arrays),
            backend=HostCopyBackend(),
            live_layout=other.allocation_map,
            manifest_file=str(captured_2layer.manifest_path),
        )
    assert "layout differs at allocation 0" in str(info.value)
    assert all(not a.any() for a in arrays)


def test_unknown_format_version_is_refused_before_hydration(captured_2layer: Captured, tmp_path: Path) -> None:
    """Catches a manifest of another format version being hydrated as if it were version 9."""
    captured = copy_capture(captured_2layer, tmp_path / "copy", copy_pack=False)
    edit_json(captured.manifest_path, lambda d: d.update(format_version=10))
    with pytest.raises(errors.UnsupportedFormatVersionError) as info:
        NativeManifest.read(captured.manifest_path)
    assert str(captured.manifest_path) in str(info.value) and "format_version 10" in str(info.value)


def test_bit_rot_is_invisible_without_extent_verification(
    captured_2layer: Captured, staged_2layer: Slabs, tmp_path: Path
) -> None:
    """Documents the limit that ``verify_extents`` closes (and catches it silently being always on or
    the record being bypassed): with a still-valid validation record, a flipped pack byte is restored
    as is unless extents are verified."""
    captured = copy_capture(captured_2layer, tmp_path / "copy")
    setup = Setup(captured, staged_2layer, arrays=list(allocate(staged_2layer.allocation_map)))
    _bit_rot_under_a_valid_record(setup)
    hydrate(
        captured.manifest,
        blob_path=captured.blob_path,
        cache=captured.cache,
        allocations=live_allocations(setup.arrays),
        backend=HostCopyBackend(),
        live_layout=staged_2layer.allocation_map,
        verify_extents=False,
    )
    differing = sum(int((a != b).sum()) for a, b in zip(setup.arrays, staged_2layer.arrays, strict=True))
    assert differing == 1


def test_corrupt_pack_is_quarantined_by_admission(captured_2layer: Captured, staged_2layer: Slabs, tmp_path: Path) -> None:
    """Catches a corrupt cached pack staying eligible after a failed hydration: it is moved out of
    its object path, so the next restore cannot pick it up."""
    captured = copy_capture(captured_2layer, tmp_path / "copy")
    flip_byte(captured.pack_path, 12345)
    with pytest.raises(errors.PackDigestMismatchError):
        hydrate(
            captured.manifest,
            blob_path=captured.blob_path,
            cache=captured.cache,
            allocations=live_allocations(allocate(staged_2layer.allocation_map)),
            backend=HostCopyBackend(),
        )
    assert not captured.pack_path.exists()


def test_exit_codes_of_the_error_classes() -> None:
    """Catches an error class moved to another exit-code family (docs/format.md, "Exit codes")."""
    expected = {
        0: [],
        1: ["PackSizeMismatchError", "PackDigestMismatchError", "PackPathMismatchError", "NonZeroPaddingError",
            "ExtentDigestMismatchError", "ResidualSizeMismatchError", "ResidualDigestMismatchError"],
        2: ["ManifestParseError", "ManifestSchemaError", "UnsupportedFormatVersionError", "ManifestValueError",
            "ExtentBoundsError", "ExtentOverlapError", "CoverageGapError", "PackLayoutError", "ResidualLayoutError",
            "ExtentOrderError", "LayoutMismatchError", "AllocationSizeMismatchError", "ManifestMismatchError"],
        3: ["MissingObjectError", "PayloadUnavailableError"],
        4: ["ArtifactError", "UnsafePathError", "CopyBackendError", "ObserverError", "InvalidDigestError"],
    }  # fmt: skip
    for code, names in expected.items():
        for name in names:
            assert getattr(errors, name).exit_code == code, name
    rules = [getattr(errors, name).rule for name in errors.__all__ if isinstance(getattr(errors, name), type)]
    assert len(rules) == len(set(rules)), "every error class has its own rule"


def test_manifest_json_round_trip_of_a_capture(captured_2layer: Captured) -> None:
    """Catches a written manifest that its own reader would refuse or read differently."""
    text = captured_2layer.manifest_path.read_bytes()
    assert NativeManifest.loads(text).dumps() == text
    assert json.loads(text)["format_version"] == 9


def test_the_one_size_check_names_the_state_and_the_file() -> None:
    """``errors.size_mismatch`` is the size check of the verifier, the cache and every store. Fails if
    equal sizes produce an error, or the message loses the sizes, the truncated/extended word, the
    caller's suffix or the file."""
    assert errors.size_mismatch(errors.PackSizeMismatchError, "stored pack", 8192, 8192, file="/p") is None
    short = errors.size_mismatch(errors.PackSizeMismatchError, "stored pack", 4096, 8192, file="/p")
    assert isinstance(short, errors.PackSizeMismatchError) and short.file == "/p"
    assert short.detail == "stored pack is 4096 bytes, expected 8192 (truncated)"
    long = errors.size_mismatch(errors.ResidualSizeMismatchError, "blob", 9, 8, file=None, suffix="; quarantined")
    assert (
        isinstance(long, errors.ResidualSizeMismatchError)
        and long.detail == "blob is 9 bytes, expected 8 (extended); quarantined"
    )
