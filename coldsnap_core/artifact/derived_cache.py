"""Derived-cache seeds, an engine's compile cache files captured into a capsule (``docs/format.md`` §17): the
documents, reading a seed against its pins, and checking it without placing it (:func:`verify_seed`)."""

from __future__ import annotations

import bisect
import contextlib
import fnmatch
import hashlib
import os
import re
import tarfile
from collections.abc import Iterable
from pathlib import Path

import msgspec

from coldsnap_core._io import open_regular
from coldsnap_core.artifact.capsules import check_pin
from coldsnap_core.errors import CapsulePinMismatchError, ManifestValueError
from coldsnap_core.format._strict import Document, Record, Sha256, Text, matching, read_document_bytes
from coldsnap_core.format.content_ref import ContentRef
from coldsnap_core.format.descriptor import SEED_FILENAMES, CapsuleFile
from coldsnap_core.format.manifest import WorkerIdentity
from coldsnap_core.format.target import QUALIFYING_FIELDS, TargetIdentity

SEED_KIND = "coldsnap.derived-cache"
SEED_DOCUMENT_FILENAME, SEED_ARCHIVE_FILENAME = SEED_FILENAMES
MAX_SEED_DOCUMENT_BYTES = 16 * 2**20
CPUINFO = Path("/proc/cpuinfo")

_MEMBER = r"(?:vllm-cache|inductor-cache)(?:/(?!\.\.?(?:/|\Z))[A-Za-z0-9._+=-]+)+"
MEMBER_RE = re.compile(_MEMBER)
MemberPath = matching(_MEMBER)
"""A member path: a root name, then one or more components of safe characters, none ``.`` or ``..``."""

SHARED_FOLDERS = (
    "vllm-cache/modelinfos",
    "vllm-cache/torch_compile_cache",
    "vllm-cache/torch_compile_cache/torch_aot_compile",
    "inductor-cache/*",
)
"""Folders (``*``: any one component) every start's compile cache uses: a seed member there is malformed
(``docs/format.md`` §17.1; ``vllm/model_executor/models/registry.py``, ``vllm/compilation/backends.py``,
``vllm/compilation/caching.py``, ``torch/_inductor/codecache.py``)."""


class SeedMember(ContentRef):
    """One file of a seed: ``name`` is ``<root>/<path below the root>`` (JSON key ``path``)."""

    name: MemberPath = msgspec.field(name="path")


class SeedQualification(Record):
    """What a seed's compiled code depends on; a seed is placed only where every field is equal (``docs/format.md`` §17.2).
    ManifestValueError when ``cpu_isa_flags`` is not sorted and unique."""

    engine: Text
    engine_version: Text | None
    torch_version: Text
    torch_cuda_version: Text | None
    device_type: Text
    accelerator_model: Text | None
    nvidia_driver_version: Text | None
    cpu_isa_flags: tuple[str, ...]
    compute_capability: Text | None
    model_config_sha256: Sha256 | None
    compilation_sha256: Sha256

    def __post_init__(self) -> None:
        if list(self.cpu_isa_flags) != sorted(set(self.cpu_isa_flags)):
            raise ManifestValueError("cpu_isa_flags must be sorted and unique")

    @classmethod
    def for_target(
        cls,
        target: TargetIdentity,
        *,
        model_config_sha256: str | None,
        compilation_sha256: str,
        cpu_isa_flags: tuple[str, ...] | None = None,
        compute_capability: str | None = None,
    ) -> SeedQualification:
        """The qualification of ``target``; on CPU the flags default to :func:`cpu_isa_flags`."""
        if cpu_isa_flags is None:
            cpu_isa_flags = read_cpu_isa_flags() if target.device_type == "cpu" else ()
        return cls(
            **{name: getattr(target, name) for name in QUALIFYING_FIELDS},
            cpu_isa_flags=tuple(sorted(set(cpu_isa_flags))),
            compute_capability=compute_capability,
            model_config_sha256=model_config_sha256,
            compilation_sha256=compilation_sha256,
        )

    def differences(self, current: SeedQualification, fields: Iterable[str] | None = None) -> list[str]:
        """Each differing field (of ``fields``, default all) as ``name: captured X, here Y`` (flags: those that differ)."""
        out = []
        for name in self.__struct_fields__ if fields is None else fields:
            mine, theirs = getattr(self, name), getattr(current, name)
            if mine == theirs:
                continue
            if name == "cpu_isa_flags":
                only_there = sorted(set(mine) - set(theirs))
                only_here = sorted(set(theirs) - set(mine))
                out.append(f"cpu_isa_flags: captured with {only_there or 'none'} more, here {only_here or 'none'} more")
            else:
                out.append(f"{name}: captured {mine}, here {theirs}")
        return out


class SeedDocument(Document, tag=SEED_KIND):
    """``derived-cache.json`` (``docs/format.md`` §17.2); ManifestValueError when the archive is not named
    ``derived-cache.tar``, or the members break their order rule."""

    MAX_BYTES = MAX_SEED_DOCUMENT_BYTES

    worker: WorkerIdentity
    qualification: SeedQualification
    archive: CapsuleFile
    members: tuple[SeedMember, ...]

    def __post_init__(self) -> None:
        if self.archive.name != SEED_ARCHIVE_FILENAME:
            raise ManifestValueError(f"archive names {self.archive.name!r}; a seed's archive is {SEED_ARCHIVE_FILENAME}")
        paths = [m.name for m in self.members]
        if paths != sorted(set(paths)):
            raise ManifestValueError("members are not sorted by path, or a path repeats")
        for path in paths:  # every member is a file: none can be a folder holding another
            # paths are sorted: a path below ``path`` sorts first among those that start with ``path + "/"``
            below = bisect.bisect_left(paths, path + "/")
            if below < len(paths) and paths[below].startswith(path + "/"):
                raise ManifestValueError(f"member {paths[below]!r} lies inside member {path!r}, which is a file")
            if any(_occupies(path, folder) for folder in SHARED_FOLDERS):
                raise ManifestValueError(f"member {path!r} is a file where every start's compile cache keeps a folder")

    @property
    def size_bytes(self) -> int:
        return sum(m.size_bytes for m in self.members)


def _occupies(path: str, folder: str) -> bool:
    """Whether the member ``path`` is at ``folder`` (a :data:`SHARED_FOLDERS` pattern), component by component."""
    parts, pattern = path.split("/"), folder.split("/")
    return len(parts) == len(pattern) and all(map(fnmatch.fnmatchcase, parts, pattern))


def read_cpu_isa_flags(cpuinfo: Path = CPUINFO) -> tuple[str, ...]:
    """The ``flags`` (ARM: ``Features``) of the first processor in ``cpuinfo``, sorted; ``()`` when there is none."""
    try:
        text = cpuinfo.read_text(encoding="ascii", errors="replace")
    except OSError:
        return ()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return tuple(sorted(set(value.split())))
    return ()


def read_seed(capsule_dir: Path, pins: dict[str, CapsuleFile]) -> SeedDocument:
    missing = [name for name in SEED_FILENAMES if name not in pins]
    if missing:
        raise CapsulePinMismatchError(f"artifact.json pins one seed file without {missing[0]}", file=capsule_dir)
    document_path = capsule_dir / SEED_DOCUMENT_FILENAME
    data = read_document_bytes(document_path, max_bytes=MAX_SEED_DOCUMENT_BYTES)
    check_pin(document_path, len(data), hashlib.sha256(data).hexdigest(), pins[SEED_DOCUMENT_FILENAME])
    document = SeedDocument.loads(data, file=str(document_path))
    archive_path = capsule_dir / SEED_ARCHIVE_FILENAME
    archive_pin = pins[SEED_ARCHIVE_FILENAME]
    if (archive_pin.size_bytes, archive_pin.sha256) != (document.archive.size_bytes, document.archive.sha256):
        raise CapsulePinMismatchError("artifact.json pins another archive than derived-cache.json names", file=archive_path)
    return document


@contextlib.contextmanager
def verified_archive(path: Path, pin: CapsuleFile):
    """The seed archive opened once (no symbolic link followed, never blocking on a pipe, regular files only),
    hashed in full against ``pin``, and yielded at offset 0: the bytes read as a tar are the bytes hashed."""
    with open_regular(path, "seed archive") as (fd, _), os.fdopen(fd, "rb", closefd=False) as f:
        digest = hashlib.file_digest(f, "sha256")
        check_pin(path, f.tell(), digest.hexdigest(), pin)
        f.seek(0)
        yield f


def archive_members(tar: tarfile.TarFile, document: SeedDocument, archive_path: Path):
    """Yield ``(info, member)`` for each archive member once the whole list checks: exactly the listed names,
    each a plain regular file (no sparse member: its logical size is not bytes in the archive) of the listed
    size, and the listed sizes no more than the pinned archive holds, so reading a member is bounded."""
    expected = {m.name: m for m in document.members}
    infos = tar.getmembers()
    if sorted(i.name for i in infos) != sorted(expected) or len(infos) != len(expected):
        raise CapsulePinMismatchError("the archive's files are not the ones derived-cache.json lists", file=archive_path)
    if sum(m.size_bytes for m in document.members) > document.archive.size_bytes:
        raise CapsulePinMismatchError("the listed files are larger than the archive holds", file=archive_path)
    for info in infos:
        member = expected[info.name]
        if not info.isreg() or info.issparse() or info.size != member.size_bytes:
            raise CapsulePinMismatchError(f"archive member {info.name} is not the listed regular file", file=archive_path)
        yield info, member


def verify_seed(capsule_dir: Path, capsule_files: Iterable[CapsuleFile]) -> SeedDocument | None:
    """Check the seed of the capsule at ``capsule_dir`` without placing it (``coldsnap verify``): both files, the
    document and every archive member against their pins; the document, or ``None`` without a seed. Raises
    CapsulePinMismatchError (rule ``capsule-pin``), MissingObjectError, ManifestError or FileAccessError."""
    pins = {p.name: p for p in capsule_files if p.name in SEED_FILENAMES}
    if not pins:
        return None
    document = read_seed(capsule_dir, pins)
    archive_path = capsule_dir / SEED_ARCHIVE_FILENAME
    try:
        with (
            verified_archive(archive_path, pins[SEED_ARCHIVE_FILENAME]) as archive,
            tarfile.open(fileobj=archive, mode="r:") as tar,
        ):
            for info, member in archive_members(tar, document, archive_path):
                extracted = tar.extractfile(info)
                if extracted is None or hashlib.sha256(extracted.read()).hexdigest() != member.sha256:
                    raise CapsulePinMismatchError(f"archive member {info.name} does not match its SHA-256", file=archive_path)
    except (tarfile.TarError, ValueError) as exc:  # tarfile raises ValueError for malformed sparse headers
        raise CapsulePinMismatchError(f"the archive cannot be read as a tar: {exc}", file=archive_path) from exc
    return document


def compilation_digest(parts: Iterable[str]) -> str:
    """SHA-256 of the engine's compilation factors (strings, in the engine's order)."""
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()
