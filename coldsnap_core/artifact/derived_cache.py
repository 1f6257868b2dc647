"""Derived-cache seeds: an engine's compile cache, captured into a capsule and placed before it compiles.

A start with compilation on spends most of its time compiling once the weights restore fast (vLLM on
CPU: inductor builds and loads a shared object per graph). A *seed* is what the engine's compile cache
held for one worker after its start compiled: the files themselves in one uncompressed tar archive
(``derived-cache.tar``), described by ``derived-cache.json`` (:class:`SeedDocument`: each file's path,
size and SHA-256, and the :class:`SeedQualification` it was captured under). Both are files of the
worker's capsule, pinned in ``artifact.json`` like its other files (``docs/format.md`` §17).

* :func:`attach_seed` writes a seed into a captured capsule and adds its two pins to the worker's
  ``artifact.json`` entry (the engine compiles after ``load_weights``, so this runs after the capture);
* :func:`place_seed` at restore: the pins, then the qualification (the exact target, the CPU's
  instruction-set flags or the GPU's compute capability, the model configuration and compilation
  settings), then each file is written where the engine looks for it, never over a file already there.
  It never raises: a seed that is absent, unqualified or corrupt is skipped with the reason
  (:class:`SeedPlacement`), and the engine compiles as it would without one.

Engine-neutral: the engine plugin names the cache roots (``vllm-cache``: ``VLLM_CACHE_ROOT``;
``inductor-cache``: ``TORCHINDUCTOR_CACHE_DIR``), which files of them belong to the worker, and its
compilation digest.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import logging
import os
import re
import secrets
import stat
import tarfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec

from coldsnap_core._io import fsync_dir, fsync_fd, os_error, write_all
from coldsnap_core.artifact.capsules import _artifact_lock, _capsule_lock_path, descriptor_lock_path, replace_file_durably
from coldsnap_core.errors import (
    CapsulePinMismatchError,
    ColdsnapError,
    ManifestMismatchError,
    ManifestValueError,
    MissingObjectError,
    UnsafePathError,
)
from coldsnap_core.format._strict import Document, Record, Sha256, Text, matching, read_document_bytes
from coldsnap_core.format.content_ref import ContentRef
from coldsnap_core.format.descriptor import (
    DESCRIPTOR_FILENAME,
    SEED_FILENAMES,
    WORKERS_DIRNAME,
    ArtifactDescriptor,
    CapsuleFile,
)
from coldsnap_core.format.manifest import WorkerIdentity
from coldsnap_core.format.target import QUALIFYING_FIELDS, TargetIdentity

logger = logging.getLogger(__name__)

SEED_KIND = "coldsnap.derived-cache"
SEED_DOCUMENT_FILENAME, SEED_ARCHIVE_FILENAME = SEED_FILENAMES
MAX_REASON_CHARS = 2000
"""The longest skip reason logged for an unexpected error."""
MAX_SEED_DOCUMENT_BYTES = 16 * 2**20
CPUINFO = Path("/proc/cpuinfo")

ROOT_NAMES = ("vllm-cache", "inductor-cache")
"""The cache roots a seed's paths start with (``docs/format.md`` §17.1)."""
_MEMBER = r"(?:vllm-cache|inductor-cache)(?:/(?!\.\.?(?:/|\Z))[A-Za-z0-9._+=-]+)+"
_MEMBER_RE = re.compile(_MEMBER)
MemberPath = matching(_MEMBER)
"""A member path: a root name, then one or more components of safe characters, none ``.`` or ``..``."""

DerivedCacheStatus = Literal["used", "skipped", "absent"]

TARGET_QUALIFICATION_FIELDS = QUALIFYING_FIELDS
"""The qualification's fields that are the target identity's: the ones a residual qualifies on
(``docs/format.md`` §15.1, §17.2)."""


class SeedMember(ContentRef):
    """One file of a seed: ``name`` is ``<root>/<path below the root>`` (JSON key ``path``)."""

    name: MemberPath = msgspec.field(name="path")


class SeedQualification(Record):
    """What a seed's compiled code depends on; a seed is placed only where every field is equal.

    Attributes:
        engine, engine_version, torch_version, torch_cuda_version, device_type, accelerator_model,
            nvidia_driver_version: the capsule's target identity's fields (``docs/format.md`` §15.1).
        cpu_isa_flags: on CPU, the instruction-set flags of ``/proc/cpuinfo`` (sorted; inductor's C++
            code is built for this machine's vector extensions); ``()`` elsewhere.
        compute_capability: on CUDA, ``major.minor`` of the device; else ``None``.
        model_config_sha256: the digest of the engine's effective model configuration.
        compilation_sha256: the engine's digest of its compilation settings (vLLM: the configuration
            hash and compile-relevant environment that name its cache folder).

    Raises:
        ManifestValueError: ``cpu_isa_flags`` is not sorted and unique.
    """

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
            engine=target.engine,
            engine_version=target.engine_version,
            torch_version=target.torch_version,
            torch_cuda_version=target.torch_cuda_version,
            device_type=target.device_type,
            accelerator_model=target.accelerator_model,
            nvidia_driver_version=target.nvidia_driver_version,
            cpu_isa_flags=tuple(sorted(set(cpu_isa_flags))),
            compute_capability=compute_capability,
            model_config_sha256=model_config_sha256,
            compilation_sha256=compilation_sha256,
        )

    def differences(self, current: SeedQualification, fields: Iterable[str] | None = None) -> list[str]:
        """Each differing field as ``name: captured X, here Y`` (flags: only those that differ); only
        ``fields`` when given (default: every field)."""
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
    """``derived-cache.json`` (``docs/format.md`` §17.2).

    Attributes:
        worker: the worker whose start compiled these files.
        qualification: what they were compiled for.
        archive: the pin of ``derived-cache.tar``.
        members: the archive's files, in archive order (sorted by path, unique, none inside another).

    Raises:
        ManifestValueError: the archive is not named ``derived-cache.tar``, or the members break their order rule.
    """

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

    @property
    def size_bytes(self) -> int:
        return sum(m.size_bytes for m in self.members)


def read_cpu_isa_flags(cpuinfo: Path = CPUINFO) -> tuple[str, ...]:
    """The ``flags`` of the first processor in ``cpuinfo`` (sorted), or ``()`` when there is none
    (not Linux x86; ARM's ``Features`` line is read the same way)."""
    try:
        text = cpuinfo.read_text(encoding="ascii", errors="replace")
    except OSError:
        return ()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return tuple(sorted(set(value.split())))
    return ()


# -- capture -----------------------------------------------------------------------------------------


def collect_files(
    roots: Mapping[str, Path], folders: Iterable[tuple[str, str]], *, since_ns: int | None = None
) -> list[tuple[str, Path]]:
    """The regular files to capture: every file below each ``(root name, folder below the root)`` of
    ``folders`` (with ``since_ns``: only those modified at or after it, in nanoseconds since the epoch),
    as ``(member path, file path)`` sorted by member path. Lock files (``*.lock``, a ``locks`` folder)
    and hidden temporaries (``.*``) are left out: they carry no compiled code. Symbolic links are not
    followed."""
    found: dict[str, Path] = {}
    for root_name, folder in folders:
        base = roots[root_name]
        start = base / folder
        if not start.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(start, followlinks=False):
            dirnames[:] = sorted(d for d in dirnames if d != "locks" and not d.startswith("."))
            for name in sorted(filenames):
                if name.startswith(".") or name.endswith(".lock") or name.endswith(".tmp"):
                    continue
                path = Path(dirpath) / name
                st = os.lstat(path)
                if not stat.S_ISREG(st.st_mode) or (since_ns is not None and st.st_mtime_ns < since_ns):
                    continue
                member = f"{root_name}/{path.relative_to(base).as_posix()}"
                if _MEMBER_RE.fullmatch(member):
                    found[member] = path
    return sorted(found.items())


def _write_archive(path: Path, files: list[tuple[str, Path]]) -> tuple[CapsuleFile, tuple[SeedMember, ...]]:
    """Write ``files`` into a new uncompressed tar at ``path`` (ustar/pax, owner and times zeroed so the
    archive depends only on the bytes) and return its pin and the members' pins."""
    members = []
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for member_path, source in files:
            data = source.read_bytes()
            info = tarfile.TarInfo(member_path)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, _BytesReader(data))
            members.append(SeedMember(member_path, len(data), hashlib.sha256(data).hexdigest()))
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fsync_fd(fd, file=path)
    finally:
        os.close(fd)
    return CapsuleFile(SEED_ARCHIVE_FILENAME, path.stat().st_size, digest.hexdigest()), tuple(members)


class _BytesReader:
    def __init__(self, data: bytes) -> None:
        self._data, self._offset = data, 0

    def read(self, size: int = -1) -> bytes:
        end = len(self._data) if size < 0 else self._offset + size
        chunk = self._data[self._offset : end]
        self._offset += len(chunk)
        return chunk


def attach_seed(
    artifact_dir: Path,
    worker: WorkerIdentity,
    pack_sha256: str,
    qualification: SeedQualification,
    files: list[tuple[str, Path]],
) -> SeedDocument | None:
    """Write a seed of ``files`` (:func:`collect_files`) into ``worker``'s capsule and pin it in ``artifact.json``.

    The capsule must still be the one this process captured (its entry names pack ``pack_sha256``);
    under the capsule's lock both files are written (temporary name, fsync, rename), then under the
    descriptor's lock the entry's ``capsule_files`` gets their two pins (replacing an older seed's). A
    crash in between leaves unpinned files that restore ignores and the next capture replaces.

    Returns:
        The seed document, or ``None`` when ``files`` is empty (nothing was compiled).

    Raises:
        MissingObjectError: the artifact has no entry for ``worker``.
        ManifestMismatchError: the entry names another pack (the capsule was replaced meanwhile).
        UnsafePathError, FileAccessError, InsufficientSpaceError: writing failed.
    """
    if not files:
        return None
    capsule_dir = artifact_dir / WORKERS_DIRNAME / worker.capsule_name
    descriptor_path = artifact_dir / DESCRIPTOR_FILENAME
    with _artifact_lock(_capsule_lock_path(artifact_dir / WORKERS_DIRNAME, worker.capsule_name)):
        _require_entry(ArtifactDescriptor.read(descriptor_path), worker, pack_sha256, descriptor_path)
        document, pins = write_seed_files(capsule_dir, worker, qualification, files)
        with _artifact_lock(descriptor_lock_path(artifact_dir)):
            descriptor = ArtifactDescriptor.read(descriptor_path)
            entry = _require_entry(descriptor, worker, pack_sha256, descriptor_path)
            entry = msgspec.structs.replace(entry, capsule_files=with_seed_pins(entry.capsule_files, pins))
            replace_file_durably(descriptor_path, descriptor.with_worker(entry).dumps())
    log_captured(capsule_dir.name, document)
    return document


def write_seed_files(
    folder: Path, worker: WorkerIdentity, qualification: SeedQualification, files: list[tuple[str, Path]]
) -> tuple[SeedDocument, tuple[CapsuleFile, CapsuleFile]]:
    """Write ``derived-cache.tar`` and ``derived-cache.json`` of ``files`` into ``folder`` (each by a
    temporary name, fsync and rename; the caller holds the folder's lock) and return the document and
    the two pins, sorted by name.

    Raises:
        UnsafePathError, FileAccessError, InsufficientSpaceError: writing failed.
    """
    temp = folder / f".{SEED_ARCHIVE_FILENAME}.{secrets.token_hex(8)}.partial"
    try:
        archive, members = _write_archive(temp, files)
        document = SeedDocument(worker, qualification, archive, members)
        os.rename(temp, folder / SEED_ARCHIVE_FILENAME)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
    data = document.dumps()
    replace_file_durably(folder / SEED_DOCUMENT_FILENAME, data)
    return document, (CapsuleFile(SEED_DOCUMENT_FILENAME, len(data), hashlib.sha256(data).hexdigest()), archive)


def with_seed_pins(capsule_files: Iterable[CapsuleFile], pins: Iterable[CapsuleFile]) -> tuple[CapsuleFile, ...]:
    """``capsule_files`` without any seed pin, plus ``pins``, sorted by name."""
    kept = [p for p in capsule_files if p.name not in SEED_FILENAMES]
    return tuple(sorted([*kept, *pins], key=lambda p: p.name))


def log_captured(capsule_name: str, document: SeedDocument, where: str = "") -> None:
    """The one INFO line of a captured seed (``where``: e.g. `` into the target-local overlay``)."""
    logger.info(
        "coldsnap: %s: derived-cache seed captured%s: %d files, %d bytes (archive %s)",
        capsule_name,
        where,
        len(document.members),
        document.size_bytes,
        document.archive.sha256[:12],
    )


def _require_entry(descriptor: ArtifactDescriptor, worker: WorkerIdentity, pack_sha256: str, file: Path):
    entry = next((e for e in descriptor.workers if e.worker == worker), None)
    if entry is None:
        raise MissingObjectError(f"the artifact lists no capsule for {worker.capsule_name} to attach a seed to", file=file)
    if entry.payload.sha256 != pack_sha256:
        raise ManifestMismatchError(
            f"{worker.capsule_name} now names pack {entry.payload.sha256}, this capture wrote {pack_sha256}: the capsule"
            " was replaced meanwhile; its seed is not attached",
            file=file,
        )
    return entry


# -- restore -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SeedPlacement:
    """What :func:`place_seed` did.

    Attributes:
        status: ``used`` (verified, qualified and placed where the engine looks), ``skipped``
            (present but not placed: :attr:`reason`), ``absent`` (the capsule has none).
        reason: why it was skipped, in words; ``None`` otherwise.
        placed_files: files written.
        present_files: files already there (never overwritten).
        size_bytes: the seed's bytes.
    """

    status: DerivedCacheStatus
    reason: str | None = None
    placed_files: int = 0
    present_files: int = 0
    size_bytes: int = 0


def place_seed(
    capsule_dir: Path,
    capsule_files: Iterable[CapsuleFile],
    current: SeedQualification,
    roots: Mapping[str, Path],
    *,
    log: logging.Logger = logger,
    only: str | None = None,
    fields: tuple[str, ...] | None = None,
    what: str = "derived-cache seed",
) -> SeedPlacement:
    """Verify the seed of the capsule at ``capsule_dir`` and place its files under ``roots``.

    In order: both seed files pinned in ``capsule_files`` (else ``absent``); the document's bytes and
    the archive's match their pins (size and SHA-256) and the document parses; its qualification equals
    ``current`` field by field; then each member is read from the archive, checked against its size and
    SHA-256, and written to ``roots[<root>]/<path>`` by a temporary file and a hard link, so a file
    already there is never replaced (nor is one another process writes meanwhile).

    With ``only`` (a member path prefix, e.g. ``vllm-cache/modelinfos/``) just those members are placed,
    compared on the qualification's ``fields`` alone (those an early placement can know, ``docs/format.md``
    §17.4); the other members are still checked by the archive's SHA-256. When every such member is
    already there, nothing more is read (``used``, all present). ``what`` names the placement in the log.

    Never raises: anything else is ``skipped`` with the reason, logged as one INFO line on ``log``.
    Files placed before a member failed its check stay (each was verified); the engine compiles
    what is missing.
    """
    pins = {p.name: p for p in capsule_files if p.name in SEED_FILENAMES}
    if not pins:
        return SeedPlacement("absent")
    try:
        document = _read_seed(capsule_dir, pins)
        differences = document.qualification.differences(current, fields)
        if differences:
            raise _Unqualified("captured for another target or configuration (" + "; ".join(differences) + ")")
        selected = [m for m in document.members if only is None or m.name.startswith(only)]
        if only is not None and not selected:
            return SeedPlacement("absent")
        size = sum(m.size_bytes for m in selected)
        if only is not None and all(os.path.lexists(_member_target(m.name, roots)) for m in selected):
            return SeedPlacement("used", None, 0, len(selected), size)
        with _verified_archive(capsule_dir / SEED_ARCHIVE_FILENAME, pins[SEED_ARCHIVE_FILENAME]) as archive:
            placed, present = _place_members(archive, capsule_dir / SEED_ARCHIVE_FILENAME, document, roots, only)
    except Exception as exc:  # the contract: a seed never fails a start (docs/format.md §17)
        reason = exc.detail if isinstance(exc, ColdsnapError) else f"{type(exc).__name__}: {exc}"[:MAX_REASON_CHARS]
        if isinstance(exc, ColdsnapError) and exc.file is not None:
            reason = f"{reason} ({exc.file})"
        log.info("coldsnap: %s: %s skipped: %r", capsule_dir.name, what, reason)  # %r: one line, escaped
        return SeedPlacement("skipped", reason)
    log.info(
        "coldsnap: %s: %s placed: %d files written, %d already present (%d bytes)",
        capsule_dir.name,
        what,
        placed,
        present,
        size,
    )
    return SeedPlacement("used", None, placed, present, size)


def _member_target(member: str, roots: Mapping[str, Path]) -> Path:
    root_name, _, relative = member.partition("/")
    return roots[root_name] / relative


class _Unqualified(Exception):
    """The seed does not qualify for this start (the message says why)."""


def _read_seed(capsule_dir: Path, pins: dict[str, CapsuleFile]) -> SeedDocument:
    missing = [name for name in SEED_FILENAMES if name not in pins]
    if missing:
        raise CapsulePinMismatchError(f"artifact.json pins one seed file without {missing[0]}", file=capsule_dir)
    document_path = capsule_dir / SEED_DOCUMENT_FILENAME
    document_pin = pins[SEED_DOCUMENT_FILENAME]
    data = read_document_bytes(document_path, max_bytes=MAX_SEED_DOCUMENT_BYTES)
    _check_digest(document_path, len(data), hashlib.sha256(data).hexdigest(), document_pin)
    document = SeedDocument.loads(data, file=str(document_path))
    archive_path = capsule_dir / SEED_ARCHIVE_FILENAME
    archive_pin = pins[SEED_ARCHIVE_FILENAME]
    if (archive_pin.size_bytes, archive_pin.sha256) != (document.archive.size_bytes, document.archive.sha256):
        raise CapsulePinMismatchError("artifact.json pins another archive than derived-cache.json names", file=archive_path)
    return document


@contextlib.contextmanager
def _verified_archive(path: Path, pin: CapsuleFile):
    """The seed archive opened once (no symbolic link followed, never blocking on a pipe, regular files only),
    hashed in full against ``pin``, and yielded at offset 0: the bytes read as a tar are the bytes hashed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise MissingObjectError("the seed archive does not exist", file=path) from exc
    except OSError as exc:
        raise os_error("the seed archive cannot be opened", exc, path) from exc
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafePathError("the seed archive is not a regular file", file=path)
        digest, size = hashlib.sha256(), 0
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
            size += len(chunk)
        _check_digest(path, size, digest.hexdigest(), pin)
        f.seek(0)
        yield f


def _members(tar: tarfile.TarFile, document: SeedDocument, archive_path: Path):
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


def _check_digest(path: Path, size_bytes: int, sha256: str, pin: CapsuleFile) -> None:
    if (size_bytes, sha256) != (pin.size_bytes, pin.sha256):
        raise CapsulePinMismatchError(
            f"{path.name} is {size_bytes} bytes with SHA-256 {sha256}; artifact.json pins {pin.size_bytes} bytes with"
            f" SHA-256 {pin.sha256}",
            file=path,
        )


def _place_members(
    archive, archive_path: Path, document: SeedDocument, roots: Mapping[str, Path], only: str | None = None
) -> tuple[int, int]:
    placed = present = 0
    with tarfile.open(fileobj=archive, mode="r:") as tar:
        for info, member in _members(tar, document, archive_path):
            if only is not None and not member.name.startswith(only):
                continue
            root_name = member.name.partition("/")[0]
            target = _member_target(member.name, roots)
            if os.path.lexists(target):
                present += 1
                continue
            extracted = tar.extractfile(info)
            assert extracted is not None
            data = extracted.read()
            if hashlib.sha256(data).hexdigest() != member.sha256:
                raise CapsulePinMismatchError(f"archive member {info.name} does not match its SHA-256", file=archive_path)
            placed += _install(target, data, roots[root_name])
    return placed, present


def _install(target: Path, data: bytes, root: Path) -> int:
    """Write ``data`` to ``target`` unless something is there (1 if written, else 0). Every folder on the
    way below ``root`` must be a real folder (no symbolic link leads the file elsewhere)."""
    parent = target.parent
    folder = root
    root.mkdir(parents=True, exist_ok=True)
    for part in parent.relative_to(root).parts:
        folder = folder / part
        if os.path.islink(folder):
            raise UnsafePathError("refusing a symbolic link in the compile cache", file=folder)
        with contextlib.suppress(FileExistsError):
            folder.mkdir()
    temp = parent / f".{target.name}.{secrets.token_hex(8)}.partial"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        try:
            write_all(fd, data, file=temp)
            fsync_fd(fd, file=temp)
        finally:
            os.close(fd)
        try:
            os.link(temp, target)  # fails if anything is there: never replaces an entry
        except FileExistsError:
            return 0
        fsync_dir(parent)
        return 1
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)


def verify_seed(capsule_dir: Path, capsule_files: Iterable[CapsuleFile]) -> SeedDocument | None:
    """Check the seed of the capsule at ``capsule_dir`` without placing it (``coldsnap verify``): both files
    match their pins, the document parses and names the pinned archive, and the archive holds exactly the
    listed regular files with their sizes and SHA-256. Returns the document, or ``None`` without a seed.

    Raises:
        CapsulePinMismatchError: a file does not match its pin, one seed file is pinned without the other,
            or the archive's files are not the listed ones (rule ``capsule-pin``).
        MissingObjectError, ManifestError, FileAccessError: a file is missing, malformed or unreadable.
    """
    pins = {p.name: p for p in capsule_files if p.name in SEED_FILENAMES}
    if not pins:
        return None
    document = _read_seed(capsule_dir, pins)
    archive_path = capsule_dir / SEED_ARCHIVE_FILENAME
    try:
        with (
            _verified_archive(archive_path, pins[SEED_ARCHIVE_FILENAME]) as archive,
            tarfile.open(fileobj=archive, mode="r:") as tar,
        ):
            for info, member in _members(tar, document, archive_path):
                extracted = tar.extractfile(info)
                if extracted is None or hashlib.sha256(extracted.read()).hexdigest() != member.sha256:
                    raise CapsulePinMismatchError(f"archive member {info.name} does not match its SHA-256", file=archive_path)
    except (tarfile.TarError, ValueError) as exc:  # tarfile raises ValueError for malformed sparse headers
        raise CapsulePinMismatchError(f"the archive cannot be read as a tar: {exc}", file=archive_path) from exc
    return document


def compilation_digest(parts: Iterable[str]) -> str:
    """SHA-256 of the engine's compilation factors (strings, in the engine's order), for
    :attr:`SeedQualification.compilation_sha256`."""
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


__all__ = [
    "ROOT_NAMES",
    "SEED_ARCHIVE_FILENAME",
    "SEED_DOCUMENT_FILENAME",
    "TARGET_QUALIFICATION_FIELDS",
    "SeedDocument",
    "SeedMember",
    "SeedPlacement",
    "SeedQualification",
    "attach_seed",
    "collect_files",
    "compilation_digest",
    "log_captured",
    "place_seed",
    "read_cpu_isa_flags",
    "verify_seed",
    "with_seed_pins",
    "write_seed_files",
]
