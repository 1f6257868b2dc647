"""Publication (``coldsnap publish-native``): upload each distinct pack of artifacts once (``docs/format.md`` §12.4).

Each distinct digest, in digest order, is skipped when the store holds it (``has(verify=True)``), else verified in
full locally (a corrupt one is quarantined and stops publication) and uploaded. Then each artifact's own files go
beside the packs, and last its name (§12.9). ``dry_run`` checks sizes only: it hashes, uploads and records nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from coldsnap_core._io import file_size, refuse_symlink
from coldsnap_core.artifact.capsules import check_pinned_file, read_capsule, read_descriptor, read_descriptor_bytes
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.errors import (
    ArtifactError,
    ConfigurationError,
    IntegrityError,
    MissingObjectError,
    PackSizeMismatchError,
    size_mismatch,
)
from coldsnap_core.format._strict import FORMAT_VERSION
from coldsnap_core.format.content_ref import ContentRef
from coldsnap_core.format.descriptor import DESCRIPTOR_FILENAME
from coldsnap_core.format.manifest import NativeManifest, PackRef
from coldsnap_core.format.verify import check_manifest, extent_owner_map, verify_pack_file
from coldsnap_core.stores.base import (
    ArtifactListing,
    ListedFile,
    ListedPack,
    PayloadStore,
    PublishedArtifact,
    artifact_name,
    artifact_object,
    check_artifact_name,
)

logger = logging.getLogger(__name__)

PublishAction = Literal["uploaded", "present", "would-upload"]
ProgressFactory = Callable[[str, int], Callable[[int], object]]
"""``(description, total_bytes) -> progress callback``; the CLI passes tqdm bars."""


@dataclass(frozen=True, slots=True)
class PayloadToPublish:
    """One distinct payload, a native manifest naming it and the ``<artifact folder>:<capsule name>`` of its workers."""

    pack: PackRef
    manifest: NativeManifest
    owners: tuple[str, ...]
    manifest_file: str | None = None


@dataclass(frozen=True, slots=True)
class PublishedPayload:
    """What publication did with one payload (``present``: already in the store; ``would-upload``: a dry run)."""

    pack: PackRef
    action: PublishAction
    owners: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PublishedFile:
    """What publication did with one file of the artifact named ``artifact``."""

    artifact: str
    file: ListedFile
    action: PublishAction


def collect_payloads(artifact_dirs: Sequence[Path]) -> list[PayloadToPublish]:
    """The distinct payloads named by the workers of ``artifact_dirs``, in digest order; ``MissingObjectError``,
    ``ManifestError`` for a bad document, ``ArtifactError`` when capsules and ``artifact.json`` disagree on a pack."""
    found: dict[str, tuple[PackRef, NativeManifest, list[str], str]] = {}
    for artifact_dir in artifact_dirs:
        artifact_dir = Path(artifact_dir)
        descriptor = read_descriptor(artifact_dir)
        for entry in descriptor.workers:
            capsule = read_capsule(artifact_dir / entry.capsule)
            if capsule.native.pack != entry.payload:
                raise ArtifactError(
                    f"artifact.json names pack {entry.payload.sha256}, the capsule's native manifest {capsule.native.pack.sha256}",
                    file=capsule.native_manifest_path,
                )
            check_manifest(capsule.native, file=str(capsule.native_manifest_path))
            owner = f"{artifact_dir}:{entry.worker.capsule_name}"
            digest = entry.payload.sha256
            first = found.setdefault(digest, (entry.payload, capsule.native, [], str(capsule.native_manifest_path)))
            if first[0].size_bytes != entry.payload.size_bytes:
                raise ArtifactError(
                    f"pack {digest} is {entry.payload.size_bytes} bytes here and {first[0].size_bytes} bytes in {first[2][0]}",
                    file=capsule.native_manifest_path,
                )
            first[2].append(owner)
    return [
        PayloadToPublish(pack, manifest, tuple(owners), manifest_file)
        for _, (pack, manifest, owners, manifest_file) in sorted(found.items())
    ]


def publish_native(
    artifact_dirs: Sequence[Path],
    store: PayloadStore,
    cache: PayloadCache,
    *,
    name: str | None = None,
    dry_run: bool = False,
    progress: ProgressFactory | None = None,
    on_payload: Callable[[PublishedPayload], object] | None = None,
    on_file: Callable[[PublishedFile], object] | None = None,
    on_artifact: Callable[[str], object] | None = None,
) -> list[PublishedPayload]:
    """Upload each distinct payload of ``artifact_dirs`` to ``store`` once, then each artifact's files and its name
    (``name``: one artifact only; default: each folder's name); returns one entry per payload, in digest order.

    Raises:
        MissingObjectError: a local object or a pinned file to upload is absent.
        IntegrityError: a local object does not verify (it is quarantined; nothing more is uploaded).
        CapsulePinMismatchError: a file of an artifact does not match its pin (nothing more is uploaded).
        ManifestExtentDigestError / ManifestPaddingError: the manifest's extents or layout are wrong (the object is
            kept; nothing more is uploaded).
        StoreError: the store failed.
        UnsafePathError: a symbolic link at a local object path.
        ManifestError, ArtifactError: as :func:`collect_payloads`.
        ConfigurationError: ``name`` with several artifacts or not an artifact name, or the store's index would refuse
            an artifact's record (before any upload, and in a dry run).
    """
    if name is not None and len(artifact_dirs) != 1:
        raise ConfigurationError(f"one name names one artifact: {name!r} was given for {len(artifact_dirs)} artifacts")
    payloads = collect_payloads(artifact_dirs)
    listings = [artifact_listing(Path(d), name) for d in artifact_dirs]
    for listing in listings:
        store.check_artifact(listing)
    results = []
    for item in payloads:
        published = PublishedPayload(item.pack, _publish_payload(item, store, cache, dry_run, progress), item.owners)
        logger.info("coldsnap: %s %s (%d bytes) -> %s", published.action, item.pack.sha256, item.pack.size_bytes, store.name)
        if on_payload is not None:
            on_payload(published)
        results.append(published)
    for artifact_dir, listing in zip(artifact_dirs, listings, strict=True):
        for file in listing.files:
            done = PublishedFile(listing.name, file, _publish_file(Path(artifact_dir), listing, file, store, dry_run))
            if on_file is not None:
                on_file(done)
        if not dry_run:
            reference = store.publish_artifact(listing)  # the name last: everything it names is in the store
            if on_artifact is not None:
                on_artifact(reference)
    return results


def _publish_payload(
    item: PayloadToPublish, store: PayloadStore, cache: PayloadCache, dry_run: bool, progress: ProgressFactory | None
) -> PublishAction:
    """Publish one payload (the module docstring)."""
    pack = item.pack
    if store.has(pack.sha256, pack.size_bytes, verify=not dry_run):
        return "present"
    path = cache.object_path(pack.sha256)
    st = refuse_symlink(path)
    if st is None:
        raise MissingObjectError(
            f"pack is not in the node-local cache, so it cannot be published (named by {', '.join(item.owners)})",
            file=path,
        )
    if dry_run:
        if mismatch := size_mismatch(PackSizeMismatchError, "local pack", st.st_size, pack.size_bytes, file=path):
            raise mismatch
        return "would-upload"
    layout = check_manifest(item.manifest, file=item.manifest_file)
    callback = progress(f"verify {pack.sha256[:12]}", pack.size_bytes) if progress else None
    try:
        verify_pack_file(
            path, pack, layout, progress=callback, extent_owner=extent_owner_map(item.manifest), manifest_file=item.manifest_file
        )
    except IntegrityError:  # a ManifestError (the manifest is wrong, the pack intact) keeps the pack
        cache.quarantine(pack.sha256)
        raise
    upload_progress = progress(f"upload {pack.sha256[:12]}", pack.size_bytes) if progress else None
    created = store.upload(path, pack.sha256, pack.size_bytes, progress=upload_progress)
    return "present" if created is False else "uploaded"


def _publish_file(
    artifact_dir: Path, listing: ArtifactListing, file: ListedFile, store: PayloadStore, dry_run: bool
) -> PublishAction:
    """One file of an artifact: present in the store, else checked against its pin and uploaded."""
    obj = artifact_object(listing.artifact.sha256, file.path, file.sha256)
    if store.has(obj, file.size_bytes, verify=not dry_run):
        return "present"
    local = artifact_dir / file.path
    if dry_run:
        size_bytes = file_size(local)
        if size_bytes is None:
            raise MissingObjectError(f"{DESCRIPTOR_FILENAME} pins this file and it does not exist", file=local)
        if mismatch := size_mismatch(PackSizeMismatchError, "local file", size_bytes, file.size_bytes, file=local):
            raise mismatch
        return "would-upload"
    pin = ContentRef(file.path, file.size_bytes, file.sha256)
    # the bytes sent are the pinned ones: a file changed since artifact.json was read is refused, naming it
    check_pinned_file(local, pin, pinned_by=f"{artifact_dir / DESCRIPTOR_FILENAME} (read for this publication)")
    created = store.upload(local, obj, file.size_bytes)
    return "present" if created is False else "uploaded"


def artifact_listing(artifact_dir: Path, name: str | None = None) -> ArtifactListing:
    """What a store's artifact index records of ``artifact_dir`` (named ``name``, else after the folder); raises
    ``ConfigurationError`` for a bad ``name``, else as :func:`~coldsnap_core.artifact.capsules.read_descriptor_bytes`."""
    descriptor, artifact_sha256 = read_descriptor_bytes(artifact_dir)
    model = descriptor.model
    identity = json.dumps(model.to_json(), sort_keys=True, separators=(",", ":")).encode()
    annotations = [("model.source", model.source), ("model.sha256", hashlib.sha256(identity).hexdigest())]
    if model.revision is not None:
        annotations.append(("model.revision", model.revision))
    if model.config_sha256 is not None:
        annotations.append(("model.config-sha256", model.config_sha256))
    workers: dict[str, tuple[PackRef, list[str]]] = {}
    for entry in descriptor.workers:
        workers.setdefault(entry.payload.sha256, (entry.payload, []))[1].append(entry.worker.capsule_name)
    packs = tuple(ListedPack(pack.sha256, pack.size_bytes, tuple(names)) for _, (pack, names) in sorted(workers.items()))
    artifact = PublishedArtifact(artifact_sha256, os.path.getsize(artifact_dir / DESCRIPTOR_FILENAME))
    files = [ListedFile(DESCRIPTOR_FILENAME, artifact.sha256, artifact.size_bytes)]
    files += [ListedFile(path, pin.sha256, pin.size_bytes) for path, pin in descriptor.pinned_files()]
    folder_name = Path(artifact_dir).resolve().name
    label = check_artifact_name(name) if name is not None else artifact_name(folder_name)
    return ArtifactListing(label, FORMAT_VERSION, tuple(sorted(annotations)), packs, artifact, tuple(files))
