"""Worker manifests: the native and the recovery manifest of one capsule (every field: ``docs/format.md`` §4)."""

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
"""A file name inside a capsule folder (or the artifact's ``model/`` folder)."""
CapsuleFileName = matching(CAPSULE_FILE_NAME_RE.pattern)
DataParallelSize = Annotated[int, msgspec.Meta(ge=2, le=MAX_OFFSET_BYTES)]
"""A data parallel size as written: at least 2 (a size of 1 is written by omitting both fields, §4.3)."""
CAPSULE_NAME_RE = re.compile(
    r"(?P<role>[a-z][a-z0-9_]*)-(?P<rank>[0-9]+)-of-(?P<world_size>[0-9]+)"
    r"(?:-dp-(?P<data_parallel_rank>[0-9]+)-of-(?P<data_parallel_size>[0-9]+))?"
)
"""A capsule folder name (:attr:`WorkerIdentity.capsule_name`, ``docs/format.md`` §4.3)."""


class _NoDataParallel(int):
    """The data parallel rank of a worker without data parallel: 0, and omitted from the documents."""

    def __repr__(self) -> str:
        return "0"


_NO_DATA_PARALLEL = _NoDataParallel(0)


class WorkerIdentity(Record, omit_defaults=True):
    """Which execution worker a capsule belongs to (``docs/format.md`` §4.3).

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
        """The capsule folder name (``worker-0-of-2``, ``worker-0-of-1-dp-1-of-2``; ``docs/format.md`` §4.3)."""
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
    """The worker's model payload, named by ``path`` (``model-payloads/sha256/<sha256>.pack``, derived from ``sha256``)."""

    name: Text = msgspec.field(name="path")

    @property
    def path(self) -> str:
        """The pack's path relative to a state root or store root (the JSON key ``path``)."""
        return self.name

    @classmethod
    def for_digest(cls, sha256: str, size_bytes: int) -> PackRef:
        return cls(pack_relpath(sha256), size_bytes, sha256)


class ResidualRef(ContentRef):
    """The worker's residual blob, named by ``file`` within its capsule folder (``weights.blob``)."""

    name: CapsuleFileName = msgspec.field(name="file")

    @property
    def file(self) -> str:
        """The blob's file name within the capsule folder (the JSON key ``file``)."""
        return self.name


class CheckpointFile(ContentRef):
    """One pinned checkpoint file of the model identity, with its content fingerprint (``docs/format.md`` §10.2) or
    ``None`` (restore then accepts the file on name and size).

    Raises:
        ManifestValueError: the name is not relative to the checkpoint folder (``docs/format.md`` §4).
    """

    fingerprint_sha256: Sha256 | None = None

    def __post_init__(self) -> None:
        name = self.name
        if "\\" in name or "\x00" in name:
            raise ManifestValueError(f"name {name!r} contains a backslash or NUL")
        if name.startswith("/"):
            raise ManifestValueError(f"name {name!r} is an absolute path")
        if any(part in ("", ".", "..") for part in name.split("/")):
            raise ManifestValueError(f"name {name!r} has an empty, '.' or '..' component")


class ModelIdentity(Record):
    """The pinned model restore compares with the engine's and the recovery loader falls back to (``docs/format.md``
    §4.2 ``model``; ``config`` is :data:`msgspec.UNSET` when not recorded).

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
    """The allocation map plus the model and residual extent maps of one worker (``docs/format.md`` §4.1).

    Raises:
        ManifestValueError: an allocation's index is not its position, or an address does not fit the capture point.
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
    """The residual map plus the pinned model identity the recovery loader falls back to (``docs/format.md`` §4.2)."""

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
