"""``coldsnap cache ls`` and ``gc`` of the target-local overlays under a state root (``docs/format.md`` §15.3)."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from coldsnap_core.artifact.overlay import (
    OVERLAY_FILENAME,
    OVERLAYS_DIRNAME,
    OverlayDescriptor,
    overlay_lock_path,
    portable_descriptor_sha256,
    refuse_linked_folders,
)
from coldsnap_core.cache.records import read_private_record
from coldsnap_core.errors import ColdsnapError, MissingObjectError, UnsafePathError
from coldsnap_core.format.descriptor import DESCRIPTOR_FILENAME


@dataclass(frozen=True, slots=True)
class OverlayListing:
    """One overlay folder of the state root, for ``coldsnap cache ls`` and ``gc``; ``status``: ``current`` (its portable
    ``artifact.json`` has the bound SHA-256), ``stale`` (that descriptor is gone or changed), ``invalid`` (its
    ``overlay.json`` is not trusted; no ``descriptor``), ``unreadable`` (that descriptor cannot be read now) or
    ``foreign`` (another user's); ``gc`` keeps the last two."""

    path: Path
    status: Literal["current", "stale", "invalid", "unreadable", "foreign"]
    reason: str
    descriptor: OverlayDescriptor | None
    size_bytes: int


def list_overlays(state_root: Path) -> list[OverlayListing]:
    """Every overlay folder (``overlays/<artifact>/<target>/<capsule>``), by path; a linked ``overlays`` is an UnsafePathError."""
    top = state_root / OVERLAYS_DIRNAME
    try:
        st = os.lstat(top)
    except FileNotFoundError:
        return []
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError("refusing a symbolic link or file where the overlays folder belongs", file=top)
    overlays = sorted(p for p in top.glob("*/*/*") if not p.name.startswith("."))
    return [listing for path in overlays if (listing := _listing(state_root, path)) is not None]


def _listing(state_root: Path, path: Path) -> OverlayListing | None:
    """The listing of one overlay folder, or ``None`` where :func:`refuse_linked_folders` skips it."""
    size = _folder_size(path)
    try:
        if not refuse_linked_folders(state_root, path):
            return None
        if (uid := _other_owner(path)) is not None:
            reason = f"it belongs to uid {uid}, not {os.geteuid()}: only that user's coldsnap cache gc removes it"
            return OverlayListing(path, "foreign", reason, None, size)
        descriptor = read_private_record(path / OVERLAY_FILENAME, OverlayDescriptor)
    except (ColdsnapError, OSError) as exc:
        return OverlayListing(path, "invalid", str(exc), None, size)
    try:
        now = portable_descriptor_sha256(Path(descriptor.artifact_dir))
    except MissingObjectError as exc:
        return OverlayListing(path, "stale", f"its portable {DESCRIPTOR_FILENAME} is gone ({exc.detail})", descriptor, size)
    except ColdsnapError as exc:
        # Only a missing descriptor is gone: one that cannot be read now (EACCES, an NFS outage, EIO) may
        # still be there, and removing its overlay would wipe every overlay of a node on a transient error.
        return OverlayListing(path, "unreadable", f"its portable {DESCRIPTOR_FILENAME} cannot be read ({exc})", descriptor, size)
    if now != descriptor.portable_descriptor_sha256:
        return OverlayListing(path, "stale", f"its portable {DESCRIPTOR_FILENAME} changed", descriptor, size)
    return OverlayListing(path, "current", "bound to the portable artifact as it is", descriptor, size)


def gc_overlays(state_root: Path, *, dry_run: bool = False) -> tuple[list[OverlayListing], list[OverlayListing]]:
    """Remove every stale or invalid overlay folder (:func:`list_overlays`), then empty parent folders; return what
    was (or, with ``dry_run``, would be) removed, and the ``unreadable`` and ``foreign`` overlays kept."""
    listings = list_overlays(state_root)
    removed = [o for o in listings if o.status in ("stale", "invalid")]
    kept = [o for o in listings if o.status in ("unreadable", "foreign")]
    if dry_run:
        return removed, kept
    for o in removed:
        shutil.rmtree(o.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(overlay_lock_path(o.path))
        for parent in (o.path.parent, o.path.parent.parent):
            with contextlib.suppress(OSError):
                parent.rmdir()  # only when empty
    return removed, kept


def _folder_size(path: Path) -> int:
    """The bytes of the files in the overlay folder ``path`` (0 when it cannot be listed)."""
    try:
        return sum(f.lstat().st_size for f in path.iterdir()) if path.is_dir() and not path.is_symlink() else 0
    except OSError:  # another user's folder (mode 0700), or gone meanwhile
        return 0


def _other_owner(path: Path) -> int | None:
    """The uid of another user that owns the overlay folder ``path`` or its ``overlay.json``, else ``None``."""
    for p in (path, path / OVERLAY_FILENAME):
        with contextlib.suppress(OSError):
            if (uid := os.lstat(p).st_uid) != os.geteuid():
                return uid
    return None
