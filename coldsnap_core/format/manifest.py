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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from coldsnap_core.digests import pack_relpath
from coldsnap_core.format._strict import Fields, dump_document, parse_document, read_document
from coldsnap_core.format.allocation import AllocationMap
from coldsnap_core.format.content_ref import ContentRef
from coldsnap_core.format.extents import ModelExtent, ResidualExtent

NATIVE_MANIFEST_KIND = "coldsnap.native-manifest"
RECOVERY_MANIFEST_KIND = "coldsnap.recovery-manifest"
NATIVE_MANIFEST_FILENAME = "native-manifest.json"
RECOVERY_MANIFEST_FILENAME = "recovery-manifest.json"
RESIDUAL_FILENAME = "weights.blob"

CapturePoint = Literal["portable", "native"]
_CAPTURE_POINTS = ("portable", "native")
_ROLE_RE = re.compile(r"[a-z][a-z0-9_]*")
_FILENAME_RE = re.compile(r"(?!\.\.?$)[A-Za-z0-9._-]+")
CAPSULE_FILENAME_RE = _FILENAME_RE
"""A file name inside a capsule folder: ``[A-Za-z0-9._-]+``, not ``.`` or ``..``."""
CAPSULE_NAME_RE = re.compile(
    r"(?P<role>[a-z][a-z0-9_]*)-(?P<rank>[0-9]+)-of-(?P<world_size>[0-9]+)"
    r"(?:-dp-(?P<data_parallel_rank>[0-9]+)-of-(?P<data_parallel_size>[0-9]+))?"
)
"""A capsule folder name (:attr:`WorkerIdentity.capsule_name`, ``docs/format.md`` §4.3):
``<role>-<rank>-of-<world_size>``, with ``-dp-<data_parallel_rank>-of-<data_parallel_size>`` appended
for a data parallel replica (size > 1)."""


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    """Which execution worker a capsule belongs to (``docs/format.md`` §4.3).

    Attributes:
        role: ``worker`` for a vLLM/SGLang model worker (``driver`` and others are reserved).
        rank: rank of the worker within its data parallel replica (``torch.distributed`` rank of
            the tensor x pipeline parallel world; 0 when not distributed).
        world_size: number of workers of one replica (tensor parallel x pipeline parallel).
        tensor_parallel_rank: the worker's tensor parallel rank.
        tensor_parallel_size: the tensor parallel size.
        data_parallel_rank: which data parallel replica the worker serves (0 without data parallel).
        data_parallel_size: the number of data parallel replicas (1 without data parallel). Written
            to the documents only when greater than 1, so an artifact without data parallel has the
            same bytes it had before these fields existed.
    """

    role: str
    rank: int
    world_size: int
    tensor_parallel_rank: int
    tensor_parallel_size: int
    data_parallel_rank: int = 0
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        if not _ROLE_RE.fullmatch(self.role):
            raise ValueError(f"worker role {self.role!r} must match {_ROLE_RE.pattern}")
        if not (
            0 <= self.rank < self.world_size
            and 0 <= self.tensor_parallel_rank < self.tensor_parallel_size
            and 0 <= self.data_parallel_rank < self.data_parallel_size
        ):
            raise ValueError(f"inconsistent worker identity {self}")

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

    def to_json(self) -> dict[str, object]:
        doc: dict[str, object] = {
            "role": self.role,
            "rank": self.rank,
            "world_size": self.world_size,
            "tensor_parallel_rank": self.tensor_parallel_rank,
            "tensor_parallel_size": self.tensor_parallel_size,
        }
        if self.data_parallel_size > 1:
            doc["data_parallel_rank"] = self.data_parallel_rank
            doc["data_parallel_size"] = self.data_parallel_size
        return doc

    @classmethod
    def from_fields(cls, f: Fields) -> WorkerIdentity:
        role = f.str("role", pattern=_ROLE_RE)
        rank = f.int("rank")
        world_size = f.int("world_size", minimum=1)
        tp_rank = f.int("tensor_parallel_rank")
        tp_size = f.int("tensor_parallel_size", minimum=1)
        dp_rank, dp_size = 0, 1
        if f.has("data_parallel_rank") or f.has("data_parallel_size"):
            # Both or neither; a size of 1 is written by omitting both (one spelling per identity).
            dp_rank = f.int("data_parallel_rank")
            dp_size = f.int("data_parallel_size", minimum=2)
        f.done()
        if rank >= world_size or tp_rank >= tp_size or dp_rank >= dp_size:
            raise f.error(
                f"rank {rank}/{world_size}, tensor parallel rank {tp_rank}/{tp_size}, data parallel rank {dp_rank}/{dp_size}"
                " are out of range"
            )
        return cls(role, rank, world_size, tp_rank, tp_size, dp_rank, dp_size)


@dataclass(frozen=True, slots=True)
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

    NAME_KEY: ClassVar[str] = "path"
    KEYS: ClassVar[tuple[str, ...]] = ("sha256", "size_bytes", "path")

    @property
    def path(self) -> str:
        """The pack's path relative to a state root or store root (the JSON key ``path``)."""
        return self.name

    @classmethod
    def for_digest(cls, sha256: str, size_bytes: int) -> PackRef:
        return cls(pack_relpath(sha256), size_bytes, sha256)


@dataclass(frozen=True, slots=True)
class ResidualRef(ContentRef):
    """The worker's residual blob, stored in its capsule (JSON keys ``file``, ``sha256``, ``size_bytes``;
    a :class:`~coldsnap_core.format.content_ref.ContentRef` named by ``file``).

    Attributes:
        name: file name within the capsule folder (``weights.blob``; also :attr:`file`).
        size_bytes: size of the blob; equal to the sum of the residual extents' sizes.
        sha256: SHA-256 (lowercase hex) of the whole blob.
    """

    NAME_KEY: ClassVar[str] = "file"
    NAME_PATTERN: ClassVar[re.Pattern[str] | None] = _FILENAME_RE
    KEYS: ClassVar[tuple[str, ...]] = ("file", "sha256", "size_bytes")

    @property
    def file(self) -> str:
        """The blob's file name within the capsule folder (the JSON key ``file``)."""
        return self.name


@dataclass(frozen=True, slots=True)
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
    """

    fingerprint_sha256: str | None = None

    def to_json(self) -> dict[str, object]:
        return {**ContentRef.to_json(self), "fingerprint_sha256": self.fingerprint_sha256}

    @classmethod
    def _read_more(cls, f: Fields) -> dict[str, Any]:
        return {"fingerprint_sha256": f.opt_sha256("fingerprint_sha256")}

    def _check(self, f: Fields) -> None:
        problem = checkpoint_name_problem(self.name)
        if problem is not None:
            raise f.error(f"name {self.name!r} {problem}")


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


@dataclass(frozen=True, slots=True)
class ModelIdentity:
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
    """

    source: str
    revision: str | None
    files: tuple[CheckpointFile, ...]
    config_sha256: str | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "source": self.source,
            "revision": self.revision,
            "files": [c.to_json() for c in self.files],
            "config_sha256": self.config_sha256,
        }

    @classmethod
    def from_fields(cls, f: Fields) -> ModelIdentity:
        identity = cls(
            source=f.str("source"),
            revision=f.opt_str("revision"),
            files=f.list("files", CheckpointFile.from_fields),
            config_sha256=f.opt_sha256("config_sha256"),
        )
        f.done()
        if not identity.files:
            raise f.error("files is empty; a model identity names at least one checkpoint file")
        names = [c.name for c in identity.files]
        for i, (a, b) in enumerate(itertools.pairwise(names)):
            if a >= b:
                what = "repeats" if a == b else "is not sorted by name at"
                raise f.error(f"files {what} {b!r} (files[{i + 1}]); names are unique and sorted")
        return identity


@dataclass(frozen=True, slots=True)
class NativeManifest:
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
        allocations: the preserved allocations.
        model_extents: ranges filled from the pack, sorted by (allocation_index, offset_bytes).
        residual_extents: ranges filled from the blob, sorted by (allocation_index, offset_bytes).
    """

    capture_point: CapturePoint
    worker: WorkerIdentity
    layout_fingerprint: str
    pack: PackRef
    residual: ResidualRef
    allocations: AllocationMap
    model_extents: tuple[ModelExtent, ...]
    residual_extents: tuple[ResidualExtent, ...]

    @property
    def model_bytes(self) -> int:
        return sum(e.size_bytes for e in self.model_extents)

    @property
    def residual_bytes(self) -> int:
        return sum(e.size_bytes for e in self.residual_extents)

    def to_json(self) -> dict[str, object]:
        return {
            "format": NATIVE_MANIFEST_KIND,
            "format_version": 9,
            "capture_point": self.capture_point,
            "worker": self.worker.to_json(),
            "layout_fingerprint": self.layout_fingerprint,
            "pack": self.pack.to_json(),
            "residual": self.residual.to_json(),
            "allocations": self.allocations.to_json(),
            "model_extents": [e.to_json() for e in self.model_extents],
            "residual_extents": [e.to_json() for e in self.residual_extents],
        }

    def dumps(self) -> bytes:
        return dump_document(self.to_json())

    @classmethod
    def from_fields(cls, f: Fields) -> NativeManifest:
        f.header(NATIVE_MANIFEST_KIND)
        capture_point = f.str("capture_point")
        if capture_point not in _CAPTURE_POINTS:
            raise f.error(f"capture_point {capture_point!r} is not one of {_CAPTURE_POINTS}")
        manifest = cls(
            capture_point=capture_point,  # type: ignore[arg-type]
            worker=f.obj("worker", WorkerIdentity.from_fields),
            layout_fingerprint=f.sha256("layout_fingerprint"),
            pack=f.obj("pack", PackRef.from_fields),
            residual=f.obj("residual", ResidualRef.from_fields),
            allocations=AllocationMap.from_fields_list(f, "allocations"),
            model_extents=f.list("model_extents", ModelExtent.from_fields, fast=ModelExtent.from_plain),
            residual_extents=f.list("residual_extents", ResidualExtent.from_fields, fast=ResidualExtent.from_plain),
        )
        f.done()
        for allocation in manifest.allocations.allocations:
            if (allocation.address is None) == (capture_point == "native"):
                needs = "an integer address" if capture_point == "native" else "address null"
                raise f.error(
                    f"allocations[{allocation.index}].address is {allocation.address}; the {capture_point} capture point"
                    f" needs {needs} on every allocation"
                )
        return manifest

    @classmethod
    def loads(cls, text: str | bytes, *, file: str | None = None) -> NativeManifest:
        """Parse strictly; raises a :class:`~coldsnap_core.errors.ManifestError` subclass."""
        return parse_document(text, cls.from_fields, file=file)

    @classmethod
    def read(cls, path: str | Path) -> NativeManifest:
        """Read strictly; raises :class:`~coldsnap_core.errors.MissingObjectError` or a ManifestError."""
        return read_document(path, cls.from_fields)


@dataclass(frozen=True, slots=True)
class RecoveryManifest:
    """The residual map plus the pinned model identity used by the recovery-loader fallback.

    Attributes:
        worker: the worker this capsule belongs to.
        layout_fingerprint: fingerprint of ``allocations`` (equal to the native manifest's).
        model: the pinned checkpoint the recovery loader reads model bytes from.
        residual: this worker's residual blob (the same blob as the native manifest's).
        allocations: the preserved allocations.
        residual_extents: the same residual map as the native manifest's.
    """

    worker: WorkerIdentity
    layout_fingerprint: str
    model: ModelIdentity
    residual: ResidualRef
    allocations: AllocationMap
    residual_extents: tuple[ResidualExtent, ...]

    def to_json(self) -> dict[str, object]:
        return {
            "format": RECOVERY_MANIFEST_KIND,
            "format_version": 9,
            "worker": self.worker.to_json(),
            "layout_fingerprint": self.layout_fingerprint,
            "model": self.model.to_json(),
            "residual": self.residual.to_json(),
            "allocations": self.allocations.to_json(),
            "residual_extents": [e.to_json() for e in self.residual_extents],
        }

    def dumps(self) -> bytes:
        return dump_document(self.to_json())

    @classmethod
    def from_fields(cls, f: Fields, *, native: tuple[Mapping[str, Any], NativeManifest] | None = None) -> RecoveryManifest:
        """Strictly parse a recovery manifest.

        Args:
            f: the document.
            native: the same capsule's native manifest, as ``(its JSON object, its parsed form)``: an
                ``allocations`` or ``residual_extents`` field that is exactly the native one's JSON
                (:meth:`Fields.same_as`) takes the native's parsed, already checked value instead of
                being parsed a second time (the two must be equal anyway, ``docs/format.md`` §9).
        """
        f.header(RECOVERY_MANIFEST_KIND)
        native_raw, parsed = native if native is not None else ({}, None)
        worker = f.obj("worker", WorkerIdentity.from_fields)
        layout_fingerprint = f.sha256("layout_fingerprint")
        model = f.obj("model", ModelIdentity.from_fields)
        residual = f.obj("residual", ResidualRef.from_fields)
        if parsed is not None and f.same_as("allocations", native_raw.get("allocations")):
            allocations = parsed.allocations
        else:
            allocations = AllocationMap.from_fields_list(f, "allocations")
        if parsed is not None and f.same_as("residual_extents", native_raw.get("residual_extents")):
            residual_extents = parsed.residual_extents
        else:
            residual_extents = f.list("residual_extents", ResidualExtent.from_fields, fast=ResidualExtent.from_plain)
        manifest = cls(worker, layout_fingerprint, model, residual, allocations, residual_extents)
        f.done()
        return manifest

    @classmethod
    def loads(cls, text: str | bytes, *, file: str | None = None) -> RecoveryManifest:
        return parse_document(text, cls.from_fields, file=file)

    @classmethod
    def read(cls, path: str | Path) -> RecoveryManifest:
        return read_document(path, cls.from_fields)
