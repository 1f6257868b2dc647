"""Worker manifests: the native manifest and the recovery manifest of one unit capsule.

A worker's *unit capsule* is a folder in the artifact (``workers/<capsule_name>/``) holding::

    weights.blob               residual bytes (ResidualRef)
    native-manifest.json       NativeManifest: allocation map + model map + residual map
    recovery-manifest.json     RecoveryManifest: residual map + pinned model identity

Source: ``docs/format.md`` §4, which gives every field.
"""

from __future__ import annotations

import itertools
import re
from typing import Annotated, Literal

import msgspec

from coldsnap_core.digests import pack_relpath
from coldsnap_core.errors import ManifestValueError
from coldsnap_core.format._strict import MAX_OFFSET_BYTES, Count, Document, Offset, Record, Sha256, Text, matching
from coldsnap_core.format.allocation import Allocation, AllocationMap
from coldsnap_core.format.content_ref import ContentRef
from coldsnap_core.format.extents import ModelExtent, ResidualExtent
from coldsnap_core.identity.config_digest import config_json_sha256

NATIVE_MANIFEST_KIND = "coldsnap.native-manifest"
RECOVERY_MANIFEST_KIND = "coldsnap.recovery-manifest"
NATIVE_MANIFEST_FILENAME = "native-manifest.json"
RECOVERY_MANIFEST_FILENAME = "recovery-manifest.json"
RESIDUAL_FILENAME = "weights.blob"

CapturePoint = Literal["portable", "native"]
Role = matching("[a-z][a-z0-9_]*")
CAPSULE_FILE_NAME_RE = re.compile(r"(?!\.\.?\Z)[A-Za-z0-9._-]+")
"""A file name inside a capsule folder (or the artifact's ``model/`` folder): ``[A-Za-z0-9._-]+``, not ``.`` or
``..``."""
CapsuleFileName = matching(CAPSULE_FILE_NAME_RE.pattern)
DataParallelSize = Annotated[int, msgspec.Meta(ge=2, le=MAX_OFFSET_BYTES)]
"""A data parallel size as written: at least 2 (a size of 1 is written by omitting both fields)."""
CAPSULE_NAME_RE = re.compile(
    r"(?P<role>[a-z][a-z0-9_]*)-(?P<rank>[0-9]+)-of-(?P<world_size>[0-9]+)"
    r"(?:-dp-(?P<data_parallel_rank>[0-9]+)-of-(?P<data_parallel_size>[0-9]+))?"
)
"""A capsule folder name (:attr:`WorkerIdentity.capsule_name`, ``docs/format.md`` §4.3):
``<role>-<rank>-of-<world_size>``, with ``-dp-<data_parallel_rank>-of-<data_parallel_size>`` appended
for a data parallel replica (size > 1)."""


class _NoDataParallel(int):
    """The data parallel rank of a worker without data parallel: 0, and omitted from the documents."""

    def __repr__(self) -> str:
        return "0"


_NO_DATA_PARALLEL = _NoDataParallel(0)


class WorkerIdentity(Record, omit_defaults=True):
    """Which execution worker a capsule belongs to (``docs/format.md`` §4.3).

    Attributes:
        role: ``worker`` for a vLLM/SGLang model worker (``driver`` and others are reserved).
        rank: rank of the worker within its data parallel replica (``torch.distributed`` rank of
            the tensor x pipeline parallel world; 0 when not distributed).
        world_size: number of workers of one replica (tensor parallel x pipeline parallel).
        tensor_parallel_rank: the worker's tensor parallel rank.
        tensor_parallel_size: the tensor parallel size.
        data_parallel_rank: which data parallel replica the worker serves (0 without data parallel).
        data_parallel_size: the number of data parallel replicas (1 without data parallel). Both are
            written to the documents only when this is greater than 1 (then both, rank 0 included), so an
            artifact without data parallel has the same bytes it had before these fields existed.

    Raises:
        ManifestValueError: a rank is not below its size.
    """

    role: Role
    rank: Offset
    world_size: Count
    tensor_parallel_rank: Offset
    tensor_parallel_size: Count
    # msgspec omits a field whose value *is* its default: the rank 0 of a worker without data parallel is
    # this one object (set below), so the rank 0 of data parallel replica 0 (any other 0) is still written.
    data_parallel_rank: Offset = _NO_DATA_PARALLEL
    data_parallel_size: DataParallelSize = 1

    def __post_init__(self) -> None:
        if self.data_parallel_size == 1 and self.data_parallel_rank == 0:
            msgspec.structs.force_setattr(self, "data_parallel_rank", _NO_DATA_PARALLEL)
        elif self.data_parallel_rank is _NO_DATA_PARALLEL:  # a size without a rank: written with rank 0, so read as absent
            msgspec.structs.force_setattr(self, "data_parallel_rank", 0)
        if not (
            self.rank < self.world_size
            and self.tensor_parallel_rank < self.tensor_parallel_size
            and self.data_parallel_rank < self.data_parallel_size
        ):
            raise ManifestValueError(
                f"rank {self.rank}/{self.world_size}, tensor parallel rank {self.tensor_parallel_rank}/"
                f"{self.tensor_parallel_size}, data parallel rank {self.data_parallel_rank}/{self.data_parallel_size}"
                " are out of range"
            )

    @property
    def capsule_name(self) -> str:
        """The capsule folder name: ``<role>-<rank>-of-<world_size>`` (``worker-0-of-2``) without data
        parallel, ``<role>-<rank>-of-<world_size>-dp-<data_parallel_rank>-of-<data_parallel_size>``
        (``worker-0-of-1-dp-1-of-2``) for a replica of a data parallel deployment."""
        name = f"{self.role}-{self.rank}-of-{self.world_size}"
        if self.data_parallel_size > 1:
            name += f"-dp-{self.data_parallel_rank}-of-{self.data_parallel_size}"
        return name

    @property
    def world(self) -> tuple[int, int]:
        """``(world_size, data_parallel_size)``: the workers of one artifact all share it."""
        return (self.world_size, self.data_parallel_size)

    @property
    def sort_key(self) -> tuple[str, int, int]:
        """``(role, data_parallel_rank, rank)``: the order and uniqueness key of ``artifact.json``'s workers."""
        return (self.role, self.data_parallel_rank, self.rank)

    def describe(self) -> str:
        """``tensor parallel rank T of N`` (and ``, data parallel rank D of M`` when M > 1), for messages."""
        text = f"tensor parallel rank {self.tensor_parallel_rank} of {self.tensor_parallel_size}"
        if self.data_parallel_size > 1:
            text += f", data parallel rank {self.data_parallel_rank} of {self.data_parallel_size}"
        return text


class PackRef(ContentRef):
    """The worker's model payload: a content-addressed ``model-weights.pack`` (JSON keys ``sha256``,
    ``size_bytes``, ``path``; a :class:`~coldsnap_core.format.content_ref.ContentRef` named by ``path``).

    Attributes:
        name: ``model-payloads/sha256/<sha256>.pack``, relative to a state root or store root (also
            :attr:`path`). Always derived from ``sha256``; a manifest whose path disagrees is refused
            before anything is read (:mod:`coldsnap_core.restore.staging`).
        size_bytes: size of the pack file; a multiple of 4096 (0 for an empty pack).
        sha256: SHA-256 (lowercase hex) of the whole pack file, padding included.
    """

    name: Text = msgspec.field(name="path")

    @property
    def path(self) -> str:
        """The pack's path relative to a state root or store root (the JSON key ``path``)."""
        return self.name

    @classmethod
    def for_digest(cls, sha256: str, size_bytes: int) -> PackRef:
        return cls(pack_relpath(sha256), size_bytes, sha256)


class ResidualRef(ContentRef):
    """The worker's residual blob, stored in its capsule (JSON keys ``file``, ``sha256``, ``size_bytes``;
    a :class:`~coldsnap_core.format.content_ref.ContentRef` named by ``file``).

    Attributes:
        name: file name within the capsule folder (``weights.blob``; also :attr:`file`).
        size_bytes: size of the blob; equal to the sum of the residual extents' sizes.
        sha256: SHA-256 (lowercase hex) of the whole blob.
    """

    name: CapsuleFileName = msgspec.field(name="file")

    @property
    def file(self) -> str:
        """The blob's file name within the capsule folder (the JSON key ``file``)."""
        return self.name


class CheckpointFile(ContentRef):
    """One pinned checkpoint file of the recovery model identity (a
    :class:`~coldsnap_core.format.content_ref.ContentRef` with a fingerprint).

    Attributes:
        name: file name relative to the checkpoint folder (``model-00001-of-00003.safetensors``).
        size_bytes: the file's size.
        sha256: SHA-256 (lowercase hex) of the whole file.
        fingerprint_sha256: the file's content fingerprint (``docs/format.md`` §10.2: SHA-256 over its
            size, its safetensors header and 16 sampled 128 KiB blocks), or ``None`` (JSON ``null``)
            when the capture did not compute one (restore then accepts the file on name and size).

    Raises:
        ManifestValueError: the name is not relative to the checkpoint folder (:func:`checkpoint_name_problem`).
    """

    fingerprint_sha256: Sha256 | None = None

    def __post_init__(self) -> None:
        problem = checkpoint_name_problem(self.name)
        if problem is not None:
            raise ManifestValueError(f"name {self.name!r} {problem}")


def checkpoint_name_problem(name: str) -> str | None:
    """Why ``name`` is not a checkpoint file name relative to its folder, or ``None`` if it is one.

    A name is ``/``-separated components, none empty, ``.`` or ``..``; no leading ``/``, no
    backslash and no NUL (so ``folder / name`` never leaves the folder on any reader).
    """
    if "\\" in name or "\x00" in name:
        return "contains a backslash or NUL"
    if name.startswith("/"):
        return "is an absolute path"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return "has an empty, '.' or '..' component"
    return None


class ModelIdentity(Record):
    """The pinned model: what restore compares with the model the engine is loading, and what the
    recovery loader falls back to.

    Attributes:
        source: Hugging Face repository id, or the local checkpoint folder's real path
            (``os.path.realpath``; informational for a local folder: restore compares its content).
        revision: the repository revision (commit), or ``None`` for a local folder.
        files: every checkpoint file with its size and SHA-256, sorted by name, at least one, names
            unique and relative to the checkpoint folder.
        config_sha256: SHA-256 (lowercase hex) of the engine's effective model configuration
            (:func:`coldsnap_core.identity.config_digest.model_config_sha256`: the Hugging Face config after
            overrides, the dtype and the quantization method), or ``None`` when the capture ran
            without an engine. It covers what changes buffer values but not shapes (a rotary base,
            a rope scaling), which the layout fingerprint cannot see.
        config: the canonical configuration JSON whose digest is ``config_sha256``
            (:func:`coldsnap_core.identity.config_digest.canonical_model_config`), so a restore names the keys that
            differ with both values; absent (:data:`msgspec.UNSET`, not written) in an artifact captured before it
            was recorded or without an engine.

    Raises:
        ManifestValueError: ``files`` is empty, unsorted or names a file twice; ``config`` is not ASCII or its digest
            is not ``config_sha256``.
    """

    source: Text
    revision: Text | None
    files: tuple[CheckpointFile, ...]
    config_sha256: Sha256 | None = None
    config: Text | msgspec.UnsetType = msgspec.UNSET

    def __post_init__(self) -> None:
        if not self.files:
            raise ManifestValueError("files is empty; a model identity names at least one checkpoint file")
        if self.config is not msgspec.UNSET and (
            not self.config.isascii() or config_json_sha256(self.config) != self.config_sha256
        ):
            raise ManifestValueError("config is not the canonical configuration whose digest is config_sha256")
        for i, (a, b) in enumerate(itertools.pairwise(c.name for c in self.files)):
            if a >= b:
                what = "repeats" if a == b else "is not sorted by name at"
                raise ManifestValueError(f"files {what} {b!r} (files[{i + 1}]); names are unique and sorted")


class NativeManifest(Document, tag=NATIVE_MANIFEST_KIND):
    """The allocation map plus the independent model and residual extent maps of one worker.

    It binds every pack offset and blob offset to an allocation byte range (and, at the native
    capture point, to the captured virtual address of the allocation).

    Attributes:
        capture_point: ``portable`` (parameter storages at the end of ``load_weights``) or
            ``native`` (CuMem "weights" segments at the first level-1 sleep).
        worker: the worker this capsule belongs to.
        layout_fingerprint: :meth:`AllocationMap.layout_fingerprint` of ``allocations``.
        pack: the shared model payload.
        residual: this worker's residual blob.
        allocations: the preserved allocations (an :class:`AllocationMap`; read as a tuple).
        model_extents: ranges filled from the pack, sorted by (allocation_index, offset_bytes).
        residual_extents: ranges filled from the blob, sorted by (allocation_index, offset_bytes).

    Raises:
        ManifestValueError: an allocation's index is not its position, or an address does not fit the capture point
            (``native``: every allocation has one; ``portable``: none has).
    """

    capture_point: CapturePoint
    worker: WorkerIdentity
    layout_fingerprint: Sha256
    pack: PackRef
    residual: ResidualRef
    allocations: tuple[Allocation, ...]
    model_extents: tuple[ModelExtent, ...]
    residual_extents: tuple[ResidualExtent, ...]

    def __post_init__(self) -> None:
        _hold_as_map(self)
        for allocation in self.allocations:
            if (allocation.address is None) == (self.capture_point == "native"):
                needs = "an integer address" if self.capture_point == "native" else "address null"
                raise ManifestValueError(
                    f"allocations[{allocation.index}].address is {allocation.address}; the {self.capture_point} capture"
                    f" point needs {needs} on every allocation"
                )

    @property
    def model_bytes(self) -> int:
        return sum(e.size_bytes for e in self.model_extents)

    @property
    def residual_bytes(self) -> int:
        return sum(e.size_bytes for e in self.residual_extents)


class RecoveryManifest(Document, tag=RECOVERY_MANIFEST_KIND):
    """The residual map plus the pinned model identity used by the recovery-loader fallback.

    Attributes:
        worker: the worker this capsule belongs to.
        layout_fingerprint: fingerprint of ``allocations`` (equal to the native manifest's).
        model: the pinned checkpoint the recovery loader reads model bytes from.
        residual: this worker's residual blob (the same blob as the native manifest's).
        allocations: the preserved allocations (an :class:`AllocationMap`; read as a tuple).
        residual_extents: the same residual map as the native manifest's.
    """

    worker: WorkerIdentity
    layout_fingerprint: Sha256
    model: ModelIdentity
    residual: ResidualRef
    allocations: tuple[Allocation, ...]
    residual_extents: tuple[ResidualExtent, ...]

    def __post_init__(self) -> None:
        _hold_as_map(self)


def _hold_as_map(manifest: NativeManifest | RecoveryManifest) -> None:
    """Hold a manifest's ``allocations`` (a tuple as read) as an :class:`AllocationMap`, which checks the indices."""
    if type(manifest.allocations) is not AllocationMap:
        msgspec.structs.force_setattr(manifest, "allocations", AllocationMap(manifest.allocations))
