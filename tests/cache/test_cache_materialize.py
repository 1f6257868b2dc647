"""Materialization after a recovery load: byte-identical packs, the three modes, failures and skips."""

from __future__ import annotations

import gc
import logging
import weakref
from pathlib import Path

import pytest
from cache_support import capture, flip_byte, sha256_of
from slabs import stage_checkpoint

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.cache.records import record_state
from coldsnap_core.capture.materialize import MaterializationHandle, materialize_payload
from coldsnap_core.copy.host import HostCopyBackend
from coldsnap_core.errors import AllocationSizeMismatchError, ConfigurationError, LayoutMismatchError, PackDigestMismatchError
from coldsnap_core.format.allocation import LiveAllocation
from coldsnap_core.settings import ColdsnapSettings

TINY_PACK_SHA256 = "8deec00a23db33cd96d64728a18b63bdbf0d87336a8b8199a7b9733767c577fa"
"""Golden digest of the tiny checkpoint's pack (seed 0, 2 slabs): changes if the writer or layout drifts."""


def recovery_load(checkpoint: Path, *, reverse: bool = False):
    """A fresh "recovery load": the checkpoint read again into new slabs (new addresses)."""
    return stage_checkpoint(checkpoint, slab_count=2, reverse=reverse)


def test_materialized_smollm2_pack_is_byte_identical_to_the_captured_pack(smollm2_2layer: Path, tmp_path: Path) -> None:
    """Real SmolLM2 (2 layers, bf16): capture writes a pack; a recovery load into fresh slabs and
    ``materialize_payload(required)`` into another state root writes the same bytes (file SHA-256
    and a byte-for-byte comparison). Catches a materializer that does not use the canonical writer
    or that reads the wrong destination ranges."""
    result = capture(smollm2_2layer, tmp_path / "artifact", tmp_path / "capture-root", slab_count=4)
    slabs = stage_checkpoint(smollm2_2layer, slab_count=4)
    cache = PayloadCache(tmp_path / "state")
    handle = materialize_payload(result.manifest, slabs.allocations, HostCopyBackend(), cache, mode="required")
    assert handle is not None and handle.result is not None and handle.result.written
    materialized = cache.object_path(result.manifest.pack.sha256)
    assert handle.result.path == materialized
    assert sha256_of(materialized) == result.manifest.pack.sha256
    assert materialized.read_bytes() == result.pack_path.read_bytes()
    assert record_state(cache, result.manifest.pack.sha256) == "trusted"


def test_golden_digest_of_the_tiny_pack(captured, tmp_path: Path) -> None:
    """The tiny checkpoint's pack has a fixed digest, captured or materialized."""
    assert captured.pack.sha256 == TINY_PACK_SHA256
    cache = PayloadCache(tmp_path / "state")
    slabs = recovery_load(captured.checkpoint)  # held: the live allocations are raw addresses into its memory
    materialize_payload(captured.manifest, slabs.allocations, HostCopyBackend(), cache, mode="required")
    assert sha256_of(cache.object_path(TINY_PACK_SHA256)) == TINY_PACK_SHA256


def test_async_writes_in_the_background_and_releases_keepalive(captured, tmp_path: Path) -> None:
    """``async`` returns a handle at once; wait() finishes it; the object is admitted; the keepalive
    object is released afterwards (so the engine's memory is not pinned forever)."""
    slabs = recovery_load(captured.checkpoint)

    class Model:
        pass

    model = Model()
    ref = weakref.ref(model)
    cache = PayloadCache(tmp_path / "state")
    handle = materialize_payload(captured.manifest, slabs.allocations, HostCopyBackend(), cache, mode="async", keepalive=model)
    del model
    assert isinstance(handle, MaterializationHandle)
    assert handle.wait(60)
    assert handle.error is None and handle.result.written
    assert cache.admit(captured.pack.sha256) == handle.result.path
    handle._thread.join(10)
    gc.collect()
    assert ref() is None


def test_async_failure_is_logged_not_raised(captured, tmp_path: Path, caplog) -> None:
    """Resident bytes changed after loading: ``async`` does not raise into the caller; the handle
    holds PackDigestMismatchError, a WARNING is logged, nothing is eligible or left behind."""
    slabs = recovery_load(captured.checkpoint)
    extent = captured.manifest.model_extents[2]
    slabs.arrays[extent.allocation_index][extent.offset_bytes] ^= 0xFF
    cache = PayloadCache(tmp_path / "state")
    with caplog.at_level(logging.WARNING):
        handle = materialize_payload(
            captured.manifest, slabs.allocations, HostCopyBackend(), cache, mode="async", keepalive=slabs
        )
        assert handle.wait(60)
    assert isinstance(handle.error, PackDigestMismatchError)
    assert handle.result is None
    assert "background materialization" in caplog.text and captured.pack.sha256 in caplog.text
    assert cache.digests() == [] and cache.temporaries() == []


def test_required_failure_raises_and_keeps_nothing(captured, tmp_path: Path) -> None:
    slabs = recovery_load(captured.checkpoint)
    extent = captured.manifest.model_extents[0]
    slabs.arrays[extent.allocation_index][extent.offset_bytes + 1] ^= 0x01
    cache = PayloadCache(tmp_path / "state")
    with pytest.raises(PackDigestMismatchError, match="manifest expects"):
        materialize_payload(captured.manifest, slabs.allocations, HostCopyBackend(), cache, mode="required")
    assert cache.digests() == [] and cache.temporaries() == []


def test_residual_bytes_do_not_matter(captured, tmp_path: Path) -> None:
    """Only model extents go into the pack: changing a residual (gap) byte changes nothing."""
    slabs = recovery_load(captured.checkpoint)
    slabs.arrays[0][0] ^= 0xFF  # byte 0 of slab 0 is gap (residual) by construction
    cache = PayloadCache(tmp_path / "state")
    handle = materialize_payload(captured.manifest, slabs.allocations, HostCopyBackend(), cache, mode="required")
    assert handle.result.written


def test_off_does_nothing(captured, tmp_path: Path) -> None:
    cache = PayloadCache(tmp_path / "state")
    assert materialize_payload(captured.manifest, [], HostCopyBackend(), cache, mode="off") is None
    assert not cache.state_root.exists()


def test_existing_valid_object_is_kept(captured) -> None:
    """A valid object already in the cache: nothing is written (the record fast path)."""
    cache = PayloadCache(captured.capture_root)
    slabs = recovery_load(captured.checkpoint)
    handle = materialize_payload(captured.manifest, slabs.allocations, HostCopyBackend(), cache, mode="required")
    assert not handle.result.written and handle.result.path == captured.pack_path


def test_existing_corrupt_object_is_rewritten(captured) -> None:
    """A corrupt object in the cache is quarantined and rewritten from the resident bytes."""
    cache = PayloadCache(captured.capture_root)
    flip_byte(captured.pack_path, 4)
    slabs = recovery_load(captured.checkpoint)
    handle = materialize_payload(captured.manifest, slabs.allocations, HostCopyBackend(), cache, mode="required")
    assert handle.result.written
    assert sha256_of(captured.pack_path) == captured.pack.sha256
    assert len(cache.quarantined()) == 1


def test_live_layout_mismatch(captured, tmp_path: Path) -> None:
    """Allocations that do not match the manifest (count or size) are refused before any write."""
    slabs = recovery_load(captured.checkpoint)
    cache = PayloadCache(tmp_path / "state")
    with pytest.raises(LayoutMismatchError):
        materialize_payload(captured.manifest, slabs.allocations[:1], HostCopyBackend(), cache, mode="required")
    a = slabs.allocations[0]
    short = [LiveAllocation(a.index, a.address, a.size_bytes - 1), *slabs.allocations[1:]]
    with pytest.raises(AllocationSizeMismatchError):
        materialize_payload(captured.manifest, short, HostCopyBackend(), cache, mode="required")
    assert cache.digests() == []


def test_mode_parsing() -> None:
    """COLDSNAP_MATERIALIZE, parsed by the one settings object (as every other choice: trimmed,
    case-insensitive): async|required|off; unset or empty gives the engine's default; anything else
    is a ConfigurationError naming the variable (or extra-config key) and the allowed values."""

    def mode(environ: dict[str, str], default: str = "async", extra: dict[str, object] | None = None) -> str:
        return ColdsnapSettings.resolve(environ, extra, materialize_default=default)[0].materialize  # type: ignore[arg-type]

    assert mode({}) == "async"
    assert mode({"COLDSNAP_MATERIALIZE": ""}, "off") == "off"
    for value in ("async", "required", "off"):
        assert mode({"COLDSNAP_MATERIALIZE": value}) == value
        assert mode({"COLDSNAP_MATERIALIZE": f" {value.upper()} "}) == value
    for bad in ("sync", "1", "on"):
        with pytest.raises(ConfigurationError, match=r"COLDSNAP_MATERIALIZE.*async, required, off"):
            mode({"COLDSNAP_MATERIALIZE": bad})
    with pytest.raises(ConfigurationError, match="materialize"):
        mode({}, extra={"materialize": "later"})


def test_bad_mode_argument(captured, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError):
        materialize_payload(captured.manifest, [], HostCopyBackend(), PayloadCache(tmp_path / "s"), mode="sometimes")  # type: ignore[arg-type]
