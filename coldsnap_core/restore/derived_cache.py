"""The placement of a derived-cache seed before the engine compiles (``docs/format.md`` §17.4; the documents:
:mod:`coldsnap_core.artifact.derived_cache`)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import secrets
import tarfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from coldsnap_core._io import fsync_fd, write_all
from coldsnap_core.artifact.derived_cache import (
    SEED_ARCHIVE_FILENAME,
    SeedDocument,
    SeedQualification,
    archive_members,
    read_seed,
    verified_archive,
)
from coldsnap_core.errors import CapsulePinMismatchError, ColdsnapError, UnsafePathError
from coldsnap_core.format.descriptor import SEED_FILENAMES, CapsuleFile

logger = logging.getLogger(__name__)

MAX_REASON_CHARS = 2000
"""The longest skip reason logged for an unexpected error."""

__all__ = ["MAX_REASON_CHARS", "SeedPlacement", "place_seed"]


@dataclass(frozen=True, slots=True)
class SeedPlacement:
    """What :func:`place_seed` did (``used``, ``skipped`` for ``reason``, ``absent``); files written, already there; bytes."""

    status: Literal["used", "skipped", "absent"]
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
    """Verify the seed of the capsule at ``capsule_dir`` and place its files under ``roots`` (``docs/format.md`` §17.4):
    each member to ``roots[<root>]/<path>``, never over a file already there. With ``only`` (a member path prefix)
    just those members are placed, compared on the qualification's ``fields`` alone, and nothing is read when all are
    there. Never raises: a failure is ``skipped`` with the reason, one INFO line on ``log`` (files placed stay)."""
    pins = {p.name: p for p in capsule_files if p.name in SEED_FILENAMES}
    if not pins:
        return SeedPlacement("absent")
    try:
        document = read_seed(capsule_dir, pins)
        differences = document.qualification.differences(current, fields)
        if differences:
            raise _Unqualified("captured for another target or configuration (" + "; ".join(differences) + ")")
        selected = [m for m in document.members if only is None or m.name.startswith(only)]
        if only is not None and not selected:
            return SeedPlacement("absent")
        size = sum(m.size_bytes for m in selected)
        if only is not None and all(os.path.lexists(_member_target(m.name, roots)) for m in selected):
            return SeedPlacement("used", None, 0, len(selected), size)
        with verified_archive(capsule_dir / SEED_ARCHIVE_FILENAME, pins[SEED_ARCHIVE_FILENAME]) as archive:
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


def _place_members(
    archive, archive_path: Path, document: SeedDocument, roots: Mapping[str, Path], only: str | None = None
) -> tuple[int, int]:
    placed = present = 0
    with tarfile.open(fileobj=archive, mode="r:") as tar:
        for info, member in archive_members(tar, document, archive_path):
            if only is not None and not member.name.startswith(only):
                continue
            root_name, _, relative = member.name.partition("/")
            target = _member_target(member.name, roots)
            if os.path.lexists(target):
                present += 1
                continue
            extracted = tar.extractfile(info)
            assert extracted is not None
            data = extracted.read()
            if hashlib.sha256(data).hexdigest() != member.sha256:
                raise CapsulePinMismatchError(f"archive member {info.name} does not match its SHA-256", file=archive_path)
            placed += _install(roots[root_name], relative, data)
    return placed, present


def _install(root: Path, relative: str, data: bytes) -> int:
    """Write ``data`` to ``root/relative`` unless something is there (1 if written, else 0); the folders below
    ``root`` are opened ``O_NOFOLLOW``, each relative to the one above, so a swapped-in link cannot lead out of it.

    Raises:
        UnsafePathError: a symbolic link or a file where a folder below ``root`` belongs.
        OSError / InsufficientSpaceError / CacheError: a folder cannot be made or the file written.
    """
    *folders, name = relative.split("/")
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for depth, part in enumerate(folders, 1):
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, dir_fd=fd)
            try:
                below = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    where = root.joinpath(*folders[:depth])
                    raise UnsafePathError("refusing a symbolic link or file in the compile cache", file=where) from exc
                raise
            os.close(fd)
            fd = below
        return _link_new(fd, name, data, file=root / relative)
    finally:
        os.close(fd)


def _link_new(folder_fd: int, name: str, data: bytes, *, file: Path) -> int:
    """Create ``name`` in the folder ``folder_fd`` by a temporary file and a hard link, never over an entry (1 if created)."""
    temp = f".{name}.{secrets.token_hex(8)}.partial"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=folder_fd)
    try:
        try:
            write_all(fd, data, file=file)
            fsync_fd(fd, file=file)
        finally:
            os.close(fd)
        try:
            os.link(temp, name, src_dir_fd=folder_fd, dst_dir_fd=folder_fd, follow_symlinks=False)
        except FileExistsError:
            return 0
        os.fsync(folder_fd)
        return 1
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp, dir_fd=folder_fd)
