"""Process-local sleep capsules under ``<state_root>/sleep/``: names, ownership locks, listing, removal
(``docs/format.md`` §6.2, "Sleep capsule": the owner's ``flock`` on ``<capsule name>.lock``, and what is debris)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from coldsnap_core._io import remove_tree
from coldsnap_core.cache.partials import lock_is_free, tree_size
from coldsnap_core.errors import CacheError, UnsafePathError
from coldsnap_core.format.manifest import CAPSULE_NAME_RE, WorkerIdentity

logger = logging.getLogger(__name__)

SLEEP_DIRNAME = "sleep"
"""Folder of the process-local sleep capsules under the state root."""

LOCK_SUFFIX = ".lock"

_CAPSULE_RE = re.compile(rf"(?P<capsule>{CAPSULE_NAME_RE.pattern}-pid[0-9]+(?:-[0-9a-f]{{16}})?)")
_STAGING_RE = re.compile(r"\.(?P<capsule>.+)\.[0-9a-f]{16}\.(?:partial|old)")

Owner = Literal["alive", "gone"]


def sleep_dir(state_root: Path) -> Path:
    """``<state_root>/sleep``."""
    return Path(state_root) / SLEEP_DIRNAME


def sleep_capsule_dir(state_root: Path, worker: WorkerIdentity) -> Path:
    """A fresh, unclaimed sleep capsule path (a sweep may remove it; a sleep backend uses a :class:`SleepCapsuleClaim`)."""
    return sleep_dir(state_root) / f"{worker.capsule_name}-pid{os.getpid()}-{secrets.token_hex(8)}"


def _lock_is_held(lock_path: Path) -> bool:
    """Whether some process holds ``flock`` on ``lock_path`` (``False`` when it is absent)."""
    try:
        return not lock_is_free(lock_path, fcntl.LOCK_SH)
    except FileNotFoundError:
        return False
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return False  # a link is no owner's lock file
        raise CacheError(f"cannot examine a sleep capsule lock: {exc.strerror or exc}", file=lock_path) from exc


class SleepCapsuleClaim:
    """This process's claim on one sleep capsule: a unique folder name and the ``flock`` that proves its owner alive.
    UnsafePathError when ``sleep/`` or the lock path is a link; CacheError when either cannot be created."""

    def __init__(self, state_root: Path, capsule_name: str) -> None:
        self.folder = sleep_dir(state_root)
        self.capsule_name = capsule_name
        self.name = f"{capsule_name}-pid{os.getpid()}-{secrets.token_hex(8)}"
        self.path = self.folder / self.name
        self.lock_path = self.folder / f"{self.name}{LOCK_SUFFIX}"
        try:
            self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            st = os.lstat(self.folder)
        except OSError as exc:
            raise CacheError(f"cannot create the sleep capsule folder: {exc.strerror or exc}", file=self.folder) from exc
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafePathError("refusing a symbolic link or non-folder as the sleep capsule folder", file=self.folder)
        # flock first, then rename: a sweeper never sees the lock file free while its owner lives
        staging = self.folder / f".{self.name}.lock-{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise CacheError(f"cannot create the sleep capsule lock: {exc.strerror or exc}", file=staging) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new name (O_EXCL): nobody else can hold it
            os.rename(staging, self.lock_path)
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(staging)
            raise CacheError(f"cannot create the sleep capsule lock: {exc.strerror or exc}", file=self.lock_path) from exc
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Remove the capsule folder, then the lock file, then drop the lock (idempotent)."""
        if self._fd is None:
            return
        remove_tree(self.path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.lock_path)
        os.close(self._fd)
        self._fd = None


@dataclass(frozen=True, slots=True)
class SleepCapsuleEntry:
    """One entry of ``sleep/`` (a capsule, or a capsule's hidden staging folder) and its owner's state."""

    path: Path
    owner: Owner
    size_bytes: int


def list_sleep_capsules(state_root: Path) -> list[SleepCapsuleEntry]:
    """Every capsule (and staging) folder under ``sleep/`` with its owner's state; UnsafePathError for a linked ``sleep/``."""
    folder = sleep_dir(state_root)
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return []
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError("refusing a symbolic link or non-folder as the sleep capsule folder", file=folder)
    entries = []
    for child in sorted(folder.iterdir()):
        if child.name.endswith(LOCK_SUFFIX):
            continue
        staging = _STAGING_RE.fullmatch(child.name)
        capsule = staging["capsule"] if staging else child.name
        if _CAPSULE_RE.fullmatch(capsule) is None:
            continue  # not ours: never touched
        alive = _lock_is_held(folder / f"{capsule}{LOCK_SUFFIX}")
        entries.append(SleepCapsuleEntry(child, "alive" if alive else "gone", tree_size(child)))
    return entries


def sweep_sleep_capsules(state_root: Path, *, dry_run: bool = False) -> list[SleepCapsuleEntry]:
    """Remove every sleep capsule (and staging folder) whose owner is gone, re-checked under its lock, and lock files
    nobody holds and no capsule uses. Returns the removed capsule entries; raises as :func:`list_sleep_capsules`."""
    folder = sleep_dir(state_root)
    removed = []
    for entry in list_sleep_capsules(state_root):
        if entry.owner != "gone":
            continue
        staging = _STAGING_RE.fullmatch(entry.path.name)
        lock_path = folder / f"{staging['capsule'] if staging else entry.path.name}{LOCK_SUFFIX}"
        if dry_run:
            removed.append(entry)
            continue
        with _held_if_free(lock_path) as free:
            if not free:
                continue
            remove_tree(entry.path)
        removed.append(entry)
    if not dry_run and os.path.isdir(folder):
        capsules = {p.name for p in folder.iterdir() if not p.name.endswith(LOCK_SUFFIX)}
        for lock_path in folder.glob(f"*{LOCK_SUFFIX}"):
            if lock_path.name[: -len(LOCK_SUFFIX)] in capsules:
                continue
            with _held_if_free(lock_path) as free:
                if free:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(lock_path)
    if removed:
        logger.info(
            "coldsnap: removed %d sleep capsule(s) whose process is gone: %s",
            len(removed),
            ", ".join(str(e.path) for e in removed),
        )
    return removed


@contextlib.contextmanager
def _held_if_free(lock_path: Path):
    """Hold ``flock`` on ``lock_path`` if nobody does; yields whether it is held (or absent: ``True``)."""
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        yield isinstance(exc, FileNotFoundError)
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
