"""The artifact descriptor (``artifact.json``): every worker of an artifact, its payload digest and the pins of its
capsule files, the artifact's root of trust (``docs/format.md`` §5); and a store's artifact reference (§12.9).
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec

from coldsnap_core.errors import ManifestValueError
from coldsnap_core.format._strict import MAX_DESCRIPTOR_BYTES, Count, Document, Record, Sha256, matching
from coldsnap_core.format.content_ref import ContentRef
from coldsnap_core.format.manifest import (
    CAPSULE_NAME_RE,
    NATIVE_MANIFEST_FILENAME,
    RECOVERY_MANIFEST_FILENAME,
    CapsuleFileName,
    ModelIdentity,
    PackRef,
    WorkerIdentity,
)
from coldsnap_core.format.target import TARGET_FILENAME

ARTIFACT_KIND = "coldsnap.artifact"
SEED_FILENAMES = ("derived-cache.json", "derived-cache.tar")
"""A derived-cache seed's two capsule files (``docs/format.md`` §17), pinned together or not at all."""
DESCRIPTOR_FILENAME = "artifact.json"
WORKERS_DIRNAME = "workers"
MODEL_DIRNAME = "model"
"""The artifact's folder of the model's non-weight files (``docs/format.md`` §5 ``model_files``)."""

CapsuleFolder = matching(rf"workers/{CAPSULE_NAME_RE.pattern}")


class CapsuleFile(ContentRef):
    """The pin of one capsule file (or model file) in ``artifact.json``, by its file name."""

    name: CapsuleFileName


def check_capsule_file_names(pins: tuple[CapsuleFile, ...]) -> None:
    """The pins of a capsule are its four files, and a seed's two or none, each once, sorted (``docs/format.md`` §5,
    §17); else ManifestValueError."""
    names = [p.name for p in pins]
    documents = {NATIVE_MANIFEST_FILENAME, RECOVERY_MANIFEST_FILENAME, TARGET_FILENAME}
    seed = [n for n in names if n in SEED_FILENAMES]
    core = [n for n in names if n not in SEED_FILENAMES]
    if len(core) != 4 or names != sorted(set(names)) or not documents <= set(core) or seed not in ([], sorted(SEED_FILENAMES)):
        raise ManifestValueError(
            f"capsule_files names {names}; expected the capsule's four files (both manifests, {TARGET_FILENAME} and"
            " the residual blob), and optionally a derived-cache seed's two, each once, sorted by name"
        )


class WorkerEntry(Record):
    """One worker of an artifact (``docs/format.md`` §5).

    Raises:
        ManifestValueError: ``capsule`` is not the worker's capsule folder, or the pins are not the capsule's files
            (:func:`check_capsule_file_names`).
    """

    worker: WorkerIdentity
    capsule: CapsuleFolder
    payload: PackRef
    capsule_files: tuple[CapsuleFile, ...]

    def __post_init__(self) -> None:
        if self.capsule != f"{WORKERS_DIRNAME}/{self.worker.capsule_name}":
            raise ManifestValueError(f"capsule {self.capsule!r} is not the worker's capsule folder")
        check_capsule_file_names(self.capsule_files)

    def pin(self, name: str) -> CapsuleFile | None:
        """The pin of the capsule file ``name``, or ``None``."""
        return next((p for p in self.capsule_files if p.name == name), None)


class ArtifactDescriptor(Document, tag=ARTIFACT_KIND):
    """``artifact.json`` (``docs/format.md`` §5); ``model_files`` is ``msgspec.UNSET`` (not written) when there is none.

    Raises:
        ManifestValueError: no worker, two entries of one worker, entries out of order, or of several worlds;
            ``model_files`` empty, unsorted or naming a file twice.
    """

    MAX_BYTES = MAX_DESCRIPTOR_BYTES

    model: ModelIdentity
    workers: tuple[WorkerEntry, ...]
    model_files: tuple[CapsuleFile, ...] | msgspec.UnsetType = msgspec.UNSET

    def __post_init__(self) -> None:
        if self.model_files is not msgspec.UNSET:
            names = [f.name for f in self.model_files]
            if not names or names != sorted(set(names)):
                raise ManifestValueError(
                    f"model_files names {names}; expected at least one file, each once, sorted by name (an artifact"
                    " without model files leaves the field out)"
                )
        if not self.workers:
            raise ManifestValueError("workers is empty; an artifact lists at least one captured worker")
        keys = [w.worker.sort_key for w in self.workers]
        if len(set(keys)) != len(keys):
            raise ManifestValueError("two worker entries have the same (role, data parallel rank, rank)")
        if keys != sorted(keys):
            raise ManifestValueError("worker entries are not sorted by (role, data parallel rank, rank)")
        worlds = sorted({w.worker.world for w in self.workers})
        if len(worlds) > 1:
            raise ManifestValueError(
                f"worker entries of several world sizes or data parallel sizes, (world size, data parallel size) {worlds};"
                " one artifact holds one world"
            )

    def with_worker(self, entry: WorkerEntry) -> ArtifactDescriptor:
        """A copy with ``entry`` added, replacing any entry of the same worker and dropping every entry of another
        world (world size or data parallel size)."""
        key = entry.worker.sort_key
        kept = [w for w in self.workers if w.worker.sort_key != key and w.worker.world == entry.worker.world]
        workers = sorted([*kept, entry], key=lambda w: w.worker.sort_key)
        return msgspec.structs.replace(self, workers=tuple(workers))

    @property
    def pinned_model_files(self) -> tuple[CapsuleFile, ...]:
        """:attr:`model_files`, empty when the field is absent."""
        return () if self.model_files is msgspec.UNSET else self.model_files

    def pinned_files(self) -> Iterator[tuple[str, ContentRef]]:
        """Every file ``artifact.json`` pins, as ``(path in the artifact folder, pin)``, in worker order, then the
        model files."""
        for entry in self.workers:
            for pin in entry.capsule_files:
                yield f"{entry.capsule}/{pin.name}", pin
        for pin in self.pinned_model_files:
            yield f"{MODEL_DIRNAME}/{pin.name}", pin

    def distinct_payloads(self) -> tuple[PackRef, ...]:
        """Each payload digest once, in digest order."""
        return tuple(sorted({w.payload.sha256: w.payload for w in self.workers}.values(), key=lambda p: p.sha256))


ARTIFACT_REF_KIND = "coldsnap.artifact-ref"


class ArtifactReference(Document, tag=ARTIFACT_REF_KIND):
    """``refs/<name>.json`` in a payload store: the SHA-256 and size of an ``artifact.json`` (``docs/format.md`` §12.9)."""

    MAX_BYTES = 4096

    artifact_sha256: Sha256
    size_bytes: Count
