"""Who is wrong when a pack and a manifest disagree: the pack's file SHA-256 decides.

A pack is content addressed. If its bytes hash to its name it is intact, and a manifest whose extent
digests or layout do not describe it is the manifest's fault (exit code 2): the pack must not be
quarantined, because every other artifact naming that digest shares it. Only a pack whose file
SHA-256 differs from its name is corrupt (exit code 1, quarantined). Each test works on real packs,
manifests and files and names the regression it catches.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from cache_support import capture, flip_byte, hydrate_captured, sha256_of

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.cache.records import record_state, write_record
from coldsnap_core.cli.main import main
from coldsnap_core.copy.host import HostCopyBackend, host_view
from coldsnap_core.errors import (
    CopyBackendError,
    ExtentDigestMismatchError,
    ManifestExtentDigestError,
    ManifestPaddingError,
    NonZeroPaddingError,
)
from coldsnap_core.format.manifest import NATIVE_MANIFEST_FILENAME, NativeManifest
from coldsnap_core.format.pack_layout import PackEntry, PackLayout
from coldsnap_core.format.verify import check_manifest, verify_pack_file
from coldsnap_core.stores.local import LocalFolderStore
from coldsnap_core.stores.publish import publish_native

CAPSULE = Path("workers") / "worker-0-of-1"


def _repin(artifact_dir: Path, name: str, data: bytes) -> None:
    """Keep ``artifact.json`` consistent with an edited capsule file, if it pins one (an object with
    ``name``, ``size_bytes`` and ``sha256`` for ``name``), so the edited manifest is what gets judged."""
    path = artifact_dir / "artifact.json"
    doc = json.loads(path.read_text())

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if node.get("name") == name and {"size_bytes", "sha256"} <= node.keys():
                node["size_bytes"], node["sha256"] = len(data), hashlib.sha256(data).hexdigest()
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(doc)
    os.chmod(path, 0o644)
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def misrecord_one_extent_digest(artifact_dir: Path) -> int:
    """Change the last hex digit of the SHA-256 of one model extent whose content no other extent
    holds (so the canonical layout still holds, as in the QA report); return its index."""
    path = artifact_dir / CAPSULE / NATIVE_MANIFEST_FILENAME
    doc = json.loads(path.read_text())
    extents = doc["model_extents"]
    counts: dict[str, int] = {}
    for extent in extents:
        counts[extent["sha256"]] = counts.get(extent["sha256"], 0) + 1
    index = next(i for i, e in enumerate(extents) if counts[e["sha256"]] == 1)
    digest = extents[index]["sha256"]
    extents[index]["sha256"] = digest[:-1] + ("0" if digest[-1] != "0" else "1")
    data = (json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()
    os.chmod(path, 0o644)
    path.write_bytes(data)
    _repin(artifact_dir, NATIVE_MANIFEST_FILENAME, data)
    check_manifest(NativeManifest.read(path))  # the canonical layout still holds
    return index


# --- the verifier -------------------------------------------------------------------------------------


def test_wrong_extent_digest_in_manifest_is_a_manifest_error(captured) -> None:
    """The pack hashes to its name but the manifest misrecords one extent's SHA-256:
    ManifestExtentDigestError (rule manifest-extent-sha256, exit 2) naming the manifest and the
    destination, where the verifier said ``extent-sha256`` (exit 1, "the pack is corrupt")."""
    misrecord_one_extent_digest(captured.artifact_dir)
    manifest_path = captured.artifact_dir / CAPSULE / NATIVE_MANIFEST_FILENAME
    manifest = NativeManifest.read(manifest_path)
    layout = check_manifest(manifest)
    with pytest.raises(ManifestExtentDigestError) as info:
        verify_pack_file(captured.pack_path, manifest.pack, layout, manifest_file=manifest_path)
    assert info.value.exit_code == 2 and info.value.rule == "manifest-extent-sha256"
    assert info.value.file == str(manifest_path) and "intact" in info.value.detail


def test_corrupt_pack_still_reports_the_extent(captured) -> None:
    """The other side of the same rule: a flipped byte inside an extent changes the file SHA-256, so
    it is still ExtentDigestMismatchError (exit 1) naming the extent (a regression that blames every
    extent mismatch on the manifest would let corrupt packs through as exit 2 and never quarantine)."""
    manifest = captured.manifest
    extent = manifest.model_extents[0]
    flip_byte(captured.pack_path, extent.pack_offset_bytes + 7)
    with pytest.raises(ExtentDigestMismatchError) as info:
        verify_pack_file(captured.pack_path, manifest.pack, check_manifest(manifest))
    assert info.value.exit_code == 1


def test_layout_with_padding_on_data_is_a_manifest_error(captured) -> None:
    """A layout that puts padding on a pack's non-zero data byte while the pack hashes to its name:
    ManifestPaddingError (exit 2), where the verifier said ``pack-padding-zero`` (exit 1)."""
    manifest = captured.manifest
    layout = check_manifest(manifest)
    data = captured.pack_path.read_bytes()
    entry = next(e for e in layout.entries if data[e.end_bytes - 1] != 0 and e.size_bytes > 1)
    shortened = PackEntry(
        hashlib.sha256(data[entry.offset_bytes : entry.end_bytes - 1]).hexdigest(), entry.size_bytes - 1, entry.offset_bytes
    )
    wrong = PackLayout(tuple(shortened if e == entry else e for e in layout.entries), layout.size_bytes)
    with pytest.raises(ManifestPaddingError) as info:
        verify_pack_file(captured.pack_path, manifest.pack, wrong)
    assert info.value.offset_bytes == entry.end_bytes - 1 and info.value.exit_code == 2
    flip_byte(captured.pack_path, 3)  # now the file is corrupt too: the object is blamed again
    with pytest.raises(NonZeroPaddingError):
        verify_pack_file(captured.pack_path, manifest.pack, wrong)


# --- admission, publication, the CLI: the shared pack is not quarantined ----------------------------------


def test_admission_with_a_wrong_manifest_keeps_the_pack(captured) -> None:
    """Admission with the manifest's layout of an unrecorded pack: ManifestExtentDigestError, and the
    pack stays at its path for every other artifact (it was quarantined)."""
    misrecord_one_extent_digest(captured.artifact_dir)
    manifest = NativeManifest.read(captured.artifact_dir / CAPSULE / NATIVE_MANIFEST_FILENAME)
    cache = PayloadCache(captured.capture_root)
    cache.record_path(captured.pack.sha256).unlink()
    with pytest.raises(ManifestExtentDigestError):
        cache.admit(captured.pack.sha256, captured.pack.size_bytes, layout=check_manifest(manifest))
    assert cache.quarantined() == []
    assert cache.admit(captured.pack.sha256, captured.pack.size_bytes) == captured.pack_path


def test_publish_with_a_wrong_manifest_exits_2_and_keeps_the_pack(captured, tmp_path: Path, tiny_checkpoint: Path) -> None:
    """``publish-native`` of an artifact whose manifest misrecords an extent digest: exit 2, nothing
    uploaded, and the pack that another artifact shares stays in the cache (it was quarantined with
    exit 1, and the other artifact lost its pack)."""
    other = tmp_path / "other"
    capture(tiny_checkpoint, other, captured.capture_root, reverse=True)
    misrecord_one_extent_digest(captured.artifact_dir)
    store = tmp_path / "store"
    args = ["publish-native", captured.artifact_dir, "--repo", store, "--state-root", captured.capture_root]
    assert main([str(a) for a in args]) == 2
    cache = PayloadCache(captured.capture_root)
    assert cache.quarantined() == [] and cache.digests() == [captured.pack.sha256]
    assert not (store / "model-payloads" / "sha256").exists()
    assert [r.action for r in publish_native([other], LocalFolderStore(store), cache)] == ["uploaded"]


def test_cli_verify_wrong_manifest_extent_digest_exits_2(captured, capsys) -> None:
    """``coldsnap verify`` on the QA case: exit 2 with rule manifest-extent-sha256 (was exit 1 with
    extent-sha256)."""
    misrecord_one_extent_digest(captured.artifact_dir)
    assert main(["verify", str(captured.artifact_dir), "--state-root", str(captured.capture_root)]) == 2
    assert "rule manifest-extent-sha256 failed" in capsys.readouterr().err


# --- hydration with verify_extents on an admitted pack --------------------------------------------------------


def test_hydration_blames_a_wrong_manifest_and_keeps_the_pack(captured) -> None:
    """``hydrate(verify_extents=True)`` with a trusted pack and a manifest that misrecords an extent
    digest: the copied bytes mismatch, the pack is re-verified, found intact, and
    ManifestExtentDigestError is raised; the pack and its record stay (a regression that quarantines
    on any extent mismatch removes a valid shared pack here)."""
    misrecord_one_extent_digest(captured.artifact_dir)
    cache = PayloadCache(captured.capture_root)
    with pytest.raises(ManifestExtentDigestError) as info:
        hydrate_captured(captured, cache, verify_extents=True, name_manifest=True)
    assert info.value.file == str(captured.artifact_dir / CAPSULE / "native-manifest.json")
    assert cache.quarantined() == [] and record_state(cache, captured.pack.sha256) == "trusted"


def test_hydration_quarantines_a_pack_corrupted_under_its_record(captured) -> None:
    """The record's documented limit (an edit re-bound by a forged record): ``verify_extents``
    catches it, the re-verification proves the file corrupt, the pack is quarantined
    (``quarantined_to``) and ExtentDigestMismatchError names the destination."""
    cache = PayloadCache(captured.capture_root)
    extent = captured.manifest.model_extents[0]
    flip_byte(captured.pack_path, extent.pack_offset_bytes + 5)
    write_record(cache, captured.pack.sha256, os.lstat(captured.pack_path))
    with pytest.raises(ExtentDigestMismatchError) as info:
        hydrate_captured(captured, cache, verify_extents=True)
    assert info.value.allocation is not None
    assert info.value.quarantined_to is not None and info.value.quarantined_to.exists()
    assert cache.digests() == []


def test_hydration_quarantines_padding_corrupted_under_its_record(captured) -> None:
    """A non-zero padding byte under a forged record: the padding check fails, the full re-check
    proves the file corrupt, NonZeroPaddingError with the pack quarantined."""
    cache = PayloadCache(captured.capture_root)
    layout = check_manifest(captured.manifest)
    start, _ = next(iter(layout.padding_ranges()))
    flip_byte(captured.pack_path, start)
    write_record(cache, captured.pack.sha256, os.lstat(captured.pack_path))
    with pytest.raises(NonZeroPaddingError) as info:
        hydrate_captured(captured, cache)
    assert info.value.quarantined_to is not None
    assert cache.digests() == []


class BitRotBackend(HostCopyBackend):
    """The host backend on memory that loses a bit after the copy: it copies for real, flips one
    byte of the first model extent's destination (what a failing DIMM or device would do, which no
    test can cause for real), then hashes every model extent's destination as ``verify_extents``
    requires."""

    def fill(self, ops, sources, allocations, *, verify_extents: bool) -> None:
        super().fill(ops, sources, allocations, verify_extents=False)
        first = next(op for op in ops if op.sha256 is not None)
        view = host_view(allocations[first.allocation_index].address + first.offset_bytes, first.size_bytes)
        view[0] ^= 0x01
        for op in ops:
            if op.sha256 is None:
                continue
            view = host_view(allocations[op.allocation_index].address + op.offset_bytes, op.size_bytes)
            if hashlib.sha256(view).hexdigest() != op.sha256:
                raise ExtentDigestMismatchError(
                    f"model extent {op.extent_index} does not match its SHA-256 after copying",
                    file=sources[op.source],
                    allocation=op.allocation_index,
                    offset_bytes=op.offset_bytes,
                )


def test_hydration_blames_the_copy_when_pack_and_manifest_agree(captured) -> None:
    """A destination changed after the copy while pack and manifest are both right: CopyBackendError
    (rule copy), and the valid pack is neither quarantined nor unrecorded (it was quarantined
    because the error named the pack)."""
    cache = PayloadCache(captured.capture_root)
    with pytest.raises(CopyBackendError, match="pack verifies in full"):
        hydrate_captured(captured, cache, backend=BitRotBackend(threads=1), verify_extents=True)
    assert cache.quarantined() == [] and sha256_of(captured.pack_path) == captured.pack.sha256
    assert record_state(cache, captured.pack.sha256) == "trusted"
