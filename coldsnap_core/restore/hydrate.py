"""Two-source hydration: fill live allocations from the shared pack and the worker's residual blob. Every check but
``verify_extents``' runs before the first byte is written (``docs/format.md`` §7, "Order of checks", the ``hydrate``
entries); a padding or extent that disagrees on an admitted pack is judged by verifying the pack in full. If the copy
fails the allocations hold a mixture and must not be reported restored."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from coldsnap_core.cache.pack_use import hold_pack
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.cache.records import identity, read_trusted_record
from coldsnap_core.copy.base import CopyBackend, CopyOp
from coldsnap_core.errors import (
    CacheError,
    ColdsnapError,
    CopyBackendError,
    ExtentDigestMismatchError,
    IntegrityError,
    ManifestError,
    NonZeroPaddingError,
)
from coldsnap_core.format.allocation import AllocationMap, LiveAllocation
from coldsnap_core.format.manifest import NativeManifest
from coldsnap_core.format.pack_layout import PackLayout
from coldsnap_core.format.verify import (
    check_live_layout,
    check_manifest,
    check_pack_padding,
    extent_owner_map,
    pinned_file,
    verify_blob_file,
    verify_pack_file,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HydrationReport:
    """What a hydration did: bytes copied from the pack (each destination counted) and the blob; seconds of checks and copy."""

    model_bytes: int
    residual_bytes: int
    check_seconds: float
    copy_seconds: float


def plan_hydration(manifest: NativeManifest) -> list[CopyOp]:
    """The copy plan: model extents in pack order, then residual extents in blob order."""
    ops = [
        CopyOp("pack", e.pack_offset_bytes, e.allocation_index, e.offset_bytes, e.size_bytes, e.sha256, i)
        for i, e in enumerate(manifest.model_extents)
    ]
    ops.sort(key=lambda op: (op.source_offset_bytes, op.allocation_index, op.offset_bytes))
    ops.extend(
        CopyOp("blob", e.blob_offset_bytes, e.allocation_index, e.offset_bytes, e.size_bytes, None, i)
        for i, e in enumerate(manifest.residual_extents)
    )
    return ops


def hydrate(
    manifest: NativeManifest,
    *,
    blob_path: Path,
    cache: PayloadCache,
    allocations: Sequence[LiveAllocation],
    backend: CopyBackend,
    live_layout: AllocationMap | None = None,
    verify_extents: bool = False,
    manifest_file: str | None = None,
) -> HydrationReport:
    """Verify everything, then fill ``allocations`` (``allocations[i].index == i``) from the pack and the blob.
    ``live_layout``: the live allocation map, to compare fingerprints (``None``: sizes only); ``verify_extents``: hash
    every model extent right after its bytes land; ``manifest_file``: the manifest's path, for error messages.

    Raises:
        ManifestError, IntegrityError, MissingObjectError, NotRegularFileError, FileAccessError: a check of
            ``docs/format.md`` §7 failed: nothing is written, but for an ``ExtentDigestMismatchError`` of
            ``verify_extents`` (partly written). A quarantine sets ``quarantined_to`` on the error.
        CopyBackendError: a read failed during the copy, or a copied extent changed on its way while the pack
            verifies in full (partly written).
    """
    started = time.perf_counter()
    layout = check_manifest(manifest, file=manifest_file)
    check_live_layout(
        manifest.allocations, live_layout, allocations, file=manifest_file, manifest_fingerprint=manifest.layout_fingerprint
    )
    with hold_pack(cache, manifest.pack.sha256):  # `coldsnap cache rm` and gc leave a pack a load holds
        return _verify_and_fill(
            manifest,
            layout,
            lambda: cache.admit(manifest.pack.sha256, manifest.pack.size_bytes),
            blob_path=blob_path,
            cache=cache,
            allocations=allocations,
            backend=backend,
            verify_extents=verify_extents,
            manifest_file=manifest_file,
            started=started,
        )


def hydrate_admitted(
    manifest: NativeManifest,
    pack_path: Path,
    layout: PackLayout,
    *,
    blob_path: Path,
    cache: PayloadCache,
    allocations: Sequence[LiveAllocation],
    backend: CopyBackend,
    verify_extents: bool = False,
    manifest_file: str | None = None,
    filled_seconds: float | None = None,
) -> HydrationReport:
    """:func:`hydrate` of a pack the caller admitted at ``pack_path``, after the manifest rules (``layout``) and the live
    layout were checked; raises as :func:`hydrate`. ``filled_seconds``: as :func:`_verify_and_fill` (a one-pass fetch)."""
    return _verify_and_fill(
        manifest,
        layout,
        lambda: pack_path,
        blob_path=blob_path,
        cache=cache,
        allocations=allocations,
        backend=backend,
        verify_extents=verify_extents,
        manifest_file=manifest_file,
        started=time.perf_counter(),
        filled_seconds=filled_seconds,
    )


def _reported(manifest: NativeManifest, check_seconds: float, copy_seconds: float, *, fetched: bool) -> HydrationReport:
    """The report of a finished hydration of ``manifest``, logged at INFO (``fetched``: in one pass with the fetch)."""
    report = HydrationReport(manifest.model_bytes, manifest.residual_bytes, check_seconds, copy_seconds)
    logger.info(
        "coldsnap: hydrated %s: %d bytes from pack %s%s, %d from the residual blob (checks %.3f s, %s %.3f s)",
        manifest.worker.capsule_name,
        report.model_bytes,
        manifest.pack.sha256[:12],
        " as it was fetched" if fetched else "",
        report.residual_bytes,
        report.check_seconds,
        "fetch and copy" if fetched else "copy",
        report.copy_seconds,
    )
    return report


def _verify_and_fill(
    manifest: NativeManifest,
    layout: PackLayout,
    admit: Callable[[], Path],
    *,
    blob_path: Path,
    cache: PayloadCache,
    allocations: Sequence[LiveAllocation],
    backend: CopyBackend,
    verify_extents: bool,
    manifest_file: str | None,
    started: float,
    filled_seconds: float | None = None,
) -> HydrationReport:
    """Verify the blob, take the admitted pack (``admit()``, with the blob open), check its padding unless the
    admission verified this inode against ``layout``, then copy; with ``filled_seconds`` the model extents are in
    place already and only the blob is copied. Raises as :func:`hydrate`."""
    # The blob and the pack are each opened once: what is verified below is what the backend copies,
    # through /proc/self/fd/<n>, even if another process renames other bytes onto either path meanwhile.
    with pinned_file(blob_path, "residual blob") as blob_opened:
        verify_blob_file(blob_path, manifest.residual, opened=blob_opened)
        if filled_seconds is not None:
            checked = time.perf_counter()
            residual = [op for op in plan_hydration(manifest) if op.source == "blob"]
            try:
                backend.fill(residual, {"blob": Path(blob_opened)}, allocations, verify_extents=False)
            except ColdsnapError as exc:
                exc.renaming_file({blob_opened: str(blob_path)})
                raise
            return _reported(manifest, checked - started, filled_seconds + time.perf_counter() - checked, fetched=True)
        pack_path = admit()
        with pinned_file(pack_path, "pack") as pack_opened:
            _require_admitted_inode(cache, manifest.pack.sha256, pack_path, pack_opened)
            try:
                if not cache.verified_against(manifest.pack.sha256, os.stat(pack_opened), layout):
                    check_pack_padding(Path(pack_opened), layout)
            except NonZeroPaddingError as exc:
                exc.renaming_file({pack_opened: str(pack_path)})
                _raise_judged(exc, cache, manifest, layout, pack_path, manifest_file)
            checked = time.perf_counter()
            sources = {"pack": Path(pack_opened), "blob": Path(blob_opened)}
            try:
                backend.fill(plan_hydration(manifest), sources, allocations, verify_extents=verify_extents)
            except ColdsnapError as exc:
                exc.renaming_file({pack_opened: str(pack_path), blob_opened: str(blob_path)})
                if not isinstance(exc, ExtentDigestMismatchError):
                    raise
                _raise_judged(exc, cache, manifest, layout, pack_path, manifest_file)
    return _reported(manifest, checked - started, time.perf_counter() - checked, fetched=False)


def _require_admitted_inode(cache: PayloadCache, digest: str, pack_path: Path, opened: str) -> None:
    """The pack open at ``opened`` must be the inode admission accepted (else ``CacheError``; nothing is copied)."""
    admitted = cache.admitted_identity(digest)
    if admitted is None:  # admitted by another cache object: its validation record must bind the open file
        read_trusted_record(cache, digest, os.stat(opened))
        return
    if identity(os.stat(opened)) != admitted:
        raise CacheError("the pack was replaced after it was admitted (another inode is at the path); not copied", file=pack_path)


def _raise_judged(
    found: IntegrityError,
    cache: PayloadCache,
    manifest: NativeManifest,
    layout: PackLayout,
    pack_path: Path,
    manifest_file: str | None,
) -> NoReturn:
    """After an admitted pack's padding or a copied extent disagreed (``found``): verify the pack in full and raise
    ``found`` (the pack is corrupt and quarantined, or it changed meanwhile) or the judged error chained to it."""
    digest = manifest.pack.sha256
    try:
        verify_pack_file(pack_path, manifest.pack, layout, extent_owner=extent_owner_map(manifest), manifest_file=manifest_file)
    except IntegrityError as corrupt:
        found.quarantined_to = cache.quarantine(digest, log=False)  # type: ignore[attr-defined]
        logger.info(
            "coldsnap: pack %s is corrupt although it was admitted (%s); quarantined as %s",
            digest,
            corrupt.detail,
            found.quarantined_to,  # type: ignore[attr-defined]
        )
        raise found from corrupt
    except ManifestError as wrong:
        raise wrong from found
    if isinstance(found, ExtentDigestMismatchError):
        raise CopyBackendError(
            f"{found.detail}; the pack verifies in full, so the bytes changed while they were copied or in the"
            " destination memory",
            file=found.file,
            allocation=found.allocation,
            offset_bytes=found.offset_bytes,
        ) from found
    raise found  # the padding read non-zero, the full read zero: the file changed in between; not restored
