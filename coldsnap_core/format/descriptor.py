"""The artifact descriptor (``artifact.json``): every worker of an artifact and its payload digest.

An artifact folder looks like::

    artifact.json                      ArtifactDescriptor
    workers/worker-0-of-2/             unit capsule of rank 0 (see coldsnap_core.format.manifest)
    workers/worker-1-of-2/             unit capsule of rank 1
    workers/worker-0-of-1-dp-1-of-2/   (data parallel) the capsule of replica 1's rank 0

    model/                             the model's non-weight files (config.json, tokenizer files, ...), pinned in
                                       artifact.json's ``model_files``

The packs themselves are not in the artifact: each worker entry names its payload by digest, and
the object lives at ``<state-root>/model-payloads/sha256/<digest>.pack`` (or in a payload store).
Several workers may name the same digest; publication uploads it once (``docs/format.md`` §5 and §12).

``artifact.json`` is the root of trust of an artifact: each worker entry pins the SHA-256 and size
of every file of its capsule (both manifests and the residual blob), so a capsule edited in any
byte, even consistently with itself, is refused before it is used. It is distributed like any other
configuration; signing it is out of scope.
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
    """The pin of one file of a unit capsule, recorded in ``artifact.json`` (a
    :class:`~coldsnap_core.format.content_ref.ContentRef`; JSON keys ``name``, ``size_bytes``, ``sha256``).

    Attributes:
        name: the file name within the capsule folder (``native-manifest.json``,
            ``recovery-manifest.json``, ``target.json``, or the residual blob's ``residual.file``,
            ``weights.blob``).
        size_bytes: the file's size in bytes.
        sha256: SHA-256 (lowercase hex) of the whole file.
    """

    name: CapsuleFileName


def check_capsule_file_names(pins: tuple[CapsuleFile, ...]) -> None:
    """The pins of a capsule are its four files (both manifests, ``target.json`` and the residual
    blob), each once, sorted by name (``docs/format.md`` §5 and §15.3).

    Raises:
        ManifestValueError: any other list.
    """
    names = [p.name for p in pins]
    documents = {NATIVE_MANIFEST_FILENAME, RECOVERY_MANIFEST_FILENAME, TARGET_FILENAME}
    # a derived-cache seed (docs/format.md §17) adds its two files, both or neither
    seed = [n for n in names if n in SEED_FILENAMES]
    core = [n for n in names if n not in SEED_FILENAMES]
    if len(core) != 4 or names != sorted(set(names)) or not documents <= set(core) or seed not in ([], sorted(SEED_FILENAMES)):
        raise ManifestValueError(
            f"capsule_files names {names}; expected the capsule's four files (both manifests, {TARGET_FILENAME} and"
            " the residual blob), and optionally a derived-cache seed's two, each once, sorted by name"
        )


class WorkerEntry(Record):
    """One worker of an artifact.

    Attributes:
        worker: the worker's identity.
        capsule: the capsule folder, relative to the artifact folder (``workers/<capsule_name>``).
        payload: the worker's pack (digest, size, derived path).
        capsule_files: the pins of the capsule's four files, sorted by name: both manifests,
            ``target.json`` and the residual blob (its ``sha256`` and ``size_bytes`` equal the native
            manifest's ``residual``).

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
    """``artifact.json``: the model identity and the worker list, sorted by (role, data parallel rank, rank).

    Attributes:
        model: the pinned model identity shared by every worker.
        workers: one entry per worker that has captured, at least one.
        model_files: the pins of the model's non-weight files the capture copied to ``model/<name>`` (the engine's
            ``config.json``, tokenizer files, ...; ``docs/format.md`` §5), sorted by name; written only when there is
            at least one (``msgspec.UNSET``: absent, and the document's bytes are those of one without the field).

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
        """A copy with ``entry`` added, replacing any entry of the same worker (role, data parallel rank,
        rank) and dropping every entry of another world (world size or data parallel size: a capture of
        another world starts another world; the old world's capsules cannot be restored next to the
        new one's)."""
        key = entry.worker.sort_key
        kept = [w for w in self.workers if w.worker.sort_key != key and w.worker.world == entry.worker.world]
        workers = sorted([*kept, entry], key=lambda w: w.worker.sort_key)
        return msgspec.structs.replace(self, workers=tuple(workers))

    @property
    def pinned_model_files(self) -> tuple[CapsuleFile, ...]:
        """:attr:`model_files`, empty when the field is absent."""
        return () if self.model_files is msgspec.UNSET else self.model_files

    def pinned_files(self) -> Iterator[tuple[str, ContentRef]]:
        """Every file ``artifact.json`` pins, as ``(path in the artifact folder, pin)``: each worker's capsule files
        (``workers/<capsule>/<name>``), in worker order, then ``model/<name>``."""
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
    """``refs/<name>.json`` in a payload store: the artifact a name designates, written after every file it names
    (``docs/format.md`` §12.9).

    Attributes:
        artifact_sha256: the SHA-256 of the artifact's ``artifact.json``.
        size_bytes: the size of that ``artifact.json``.
    """

    MAX_BYTES = 4096

    artifact_sha256: Sha256
    size_bytes: Count
